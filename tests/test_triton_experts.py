"""The fused Triton experts kernels (`moetool.kernels`) under Triton's CPU interpreter, against the
dequantize reference: `quant.format.dequantize_parts` of the same pool, then the same math in fp32.

Tolerance: the kernels dequantize as `dequantize_parts` does, in fp32, and accumulate in fp32; the
one difference is the order of the sums (two GEMVs of up to a few thousand terms, then k weighted
terms), a few fp32 ulps of the largest partial sums. So |kernel - reference| <= RTOL * max |reference|
with RTOL = 1e-5 (~80 ulps: what a summation-order change can reach; a wrong code, group, slice
or slot is off by whole weights, >1e-2). bf16 outputs add one rounding: 2^-8 of each value.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from moetool.kernels import Act, Activation, SlotPool, activation_of, experts_forward, supported  # noqa: E402
from moetool.kernels import config as kconfig
from moetool.kernels import experts as kexperts  # noqa: E402
from moetool.kernels.activation import reference  # noqa: E402
from moetool.model import ExpertWeights, ProviderExperts, fused_expert, inspect_geometry, load_model  # noqa: E402
from moetool.model import load_reference  # noqa: E402
from moetool.quant import hqq  # noqa: E402
from moetool.quant.format import dequantize_parts, encode, make_layout, stack_views  # noqa: E402
from kernel_cases import RTOL, assert_close, random_ids, random_pool, reference_forward, with_ids  # noqa: E402
from tiny import save_tiny  # noqa: E402


def _import_interpreted():
    """The kernels module, its kernels decorated for Triton's CPU interpreter (TRITON_INTERPRET=1 while
    it is imported; the rest of the session keeps its own setting)."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from moetool.kernels import triton_experts
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
    return triton_experts


triton_experts = _import_interpreted()
pytestmark = pytest.mark.skipif(not kexperts._interpreted(), reason="moetool.kernels was imported before this "
                                "module, without TRITON_INTERPRET=1: its kernels cannot run on CPU tensors")


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter reads it when a kernel runs too


CUDA_CONFIG = kconfig.default_config(torch.device("cuda"))  # the GPU's tiles, run by the interpreter
# (gate_up rows, K tile, down rows, K tile, combine columns, warps): K tiles of 64 under groups of 128
# (a group spans tiles); the GPU's down tiles beside few gate_up programs (the interpreter's time).
SMALL_K = (128, 64, 32, 64, 256, 4)
MIXED = (128, 256, CUDA_CONFIG[2], CUDA_CONFIG[3], CUDA_CONFIG[4], 4)
SILU = Activation(Act.SILU, gated=True)


# (bits, group, hidden, width, T, k, config): every precision at groups 32/64/128 over widths that
# are not a multiple of the K tile (1408 = 5.5 x 256) or are under it (32), T and k over 1..8, the
# GPU's own tiles where the interpreter can afford them; then the demo model's experts (hidden 576,
# 32 wide, top-6).
CASES = [
    (16, 0, 128, 1408, 1, 4, ()), (16, 0, 128, 768, 2, 8, ()), (16, 0, 64, 32, 8, 3, CUDA_CONFIG),
    (8, 128, 128, 1408, 1, 1, SMALL_K), (8, 64, 128, 768, 3, 2, ()), (8, 32, 64, 32, 8, 8, ()),
    (4, 128, 128, 1408, 2, 3, ()), (4, 64, 128, 768, 1, 8, ()), (4, 32, 64, 32, 5, 5, CUDA_CONFIG),
    (2, 128, 128, 1408, 1, 2, MIXED), (2, 64, 128, 768, 4, 1, ()), (2, 32, 64, 32, 7, 3, CUDA_CONFIG),
    (16, 0, 576, 32, 1, 6, ()), (8, 32, 576, 32, 2, 6, ()), (4, 32, 576, 32, 1, 6, ()), (2, 32, 576, 32, 3, 6, ()),
]


@pytest.mark.parametrize("bits,group,hidden,width,T,k,config", CASES)
def test_kernel_matches_the_dequantize_reference(bits, group, hidden, width, T, k, config):
    gen = torch.Generator().manual_seed(bits * 1000 + width + T)
    pool = random_pool(bits, hidden, width, group, slots=k + 2, gen=gen)
    pool = with_ids(pool, random_ids(T, k, k + 2, gen))
    x, w = torch.randn(T, hidden, generator=gen), torch.rand(T, k, generator=gen)
    got = experts_forward(x, w, [pool], SILU, config)
    assert got.shape == (T, hidden) and got.dtype == torch.float32
    assert_close(got, reference_forward(x, w, [pool], SILU))


# Mode 1 (`kconfig.MODES`): the next K tile's codes read before this tile's math, each tile reduced
# as it is done. K tiles of 64: two groups of 32 a tile, a group of 128 over two tiles, the last tile
# partial (96, 160) or the only one (32); then the GPU's own tiles.
WIDE = (128, 64, 128, 64, 256, 4, 1)
MODE1_CASES = [
    (16, 0, 128, 160, 1, 4, WIDE), (8, 128, 128, 256, 2, 2, WIDE), (8, 32, 64, 32, 3, 8, WIDE),
    (4, 32, 192, 96, 4, 8, WIDE), (2, 32, 128, 160, 2, 3, WIDE), (2, 32, 576, 32, 1, 6, WIDE),
    (4, 64, 128, 768, 2, 4, (*CUDA_CONFIG[:6], 1)),
]


@pytest.mark.parametrize("bits,group,hidden,width,T,k,config", MODE1_CASES)
def test_the_prefetching_mode_matches_the_dequantize_reference(bits, group, hidden, width, T, k, config):
    test_kernel_matches_the_dequantize_reference(bits, group, hidden, width, T, k, config)


# Mode 2: three tiles ahead, so K of one tile (32) or fewer tiles than the ring (96, 160) read only
# masked tiles ahead; the same cases as mode 1's.
@pytest.mark.parametrize("bits,group,hidden,width,T,k,config", MODE1_CASES)
def test_the_ring_mode_matches_the_dequantize_reference(bits, group, hidden, width, T, k, config):
    test_kernel_matches_the_dequantize_reference(bits, group, hidden, width, T, k, (*config[:6], 2))


# Mode 3 (`triton_words._gemv_words`): packed codes as 32-bit words, each code a float 0.5 + code *
# 2^(P-24) (P = 15..22) whose sums carry the 0.5 for every weight until a chunk's sum of x takes it
# off: up to ~2^(23-P) / code of the fp32 precision of a product goes to that offset, so its
# tolerance is 1e-4 of the largest output (measured 0.6-2.7e-5 on these cases), 40x under one bf16
# rounding; a wrong code, slice, group or row is off by whole weights (>1e-2). 16-bit pools take
# mode 1's loop in the same launch.
RTOL_WORDS = 1e-4
WORDS = (128, 64, 128, 64, 256, 4, 3)
WORDS_GPU = (32, 256, 32, 256, 1024, 2, 3)  # a config the tuner tries: 64-column chunks, 2 warps


@pytest.mark.parametrize("bits,group,hidden,width,T,k,config",
                         [(*c[:6], WORDS) for c in MODE1_CASES] + [(4, 64, 128, 768, 2, 4, WORDS_GPU),
                                                                   (2, 128, 256, 1408, 1, 3, WORDS_GPU),
                                                                   (8, 64, 128, 256, 2, 2, WORDS_GPU)])
def test_the_word_mode_matches_the_dequantize_reference(bits, group, hidden, width, T, k, config):
    gen = torch.Generator().manual_seed(bits * 1000 + width + T)
    pool = with_ids(random_pool(bits, hidden, width, group, slots=k + 2, gen=gen), random_ids(T, k, k + 2, gen))
    x, w = torch.randn(T, hidden, generator=gen), torch.rand(T, k, generator=gen)
    assert_close(experts_forward(x, w, [pool], SILU, config), reference_forward(x, w, [pool], SILU), RTOL_WORDS)


@pytest.mark.parametrize("spec", [SILU, Activation(Act.GELU, gated=False)], ids=lambda s: f"{s.kind.name}-{s.gated}")
def test_the_word_mode_takes_every_precision_biases_and_ungated_experts_in_one_call(spec):
    """bf16 (mode 1's loop), INT8 (gate and up in byte rows of their own), INT4 and INT2 ([gate; up]
    sharing bytes) in one launch with biases, skipped pairs, and an ungated block whose rows are
    every slice of a byte row."""
    gen = torch.Generator().manual_seed(6)
    T, k, hidden, width = 3, 5, 64, 96
    pools = [random_pool(b, hidden, width, 32, slots=4, gen=gen, bias=True, gated=spec.gated) for b in (16, 8, 4, 2)]
    which = torch.randint(-1, 4, (T, k), generator=gen)
    ids = torch.randint(0, 4, (4, T, k), generator=gen, dtype=torch.int32)
    ids = torch.where(which.unsqueeze(0) == torch.arange(4).view(4, 1, 1), ids, -1)
    pools = [with_ids(p, i) for p, i in zip(pools, ids)]
    x, w = torch.randn(T, hidden, generator=gen), torch.rand(T, k, generator=gen)
    assert_close(experts_forward(x, w, pools, spec, WORDS), reference_forward(x, w, pools, spec), RTOL_WORDS)


def test_the_word_mode_leaves_what_it_cannot_read_as_words_to_mode_1():
    """Interleaved gate_up rows (gpt_oss), a pool whose slots are off 4-byte boundaries, and groups of
    17 columns (no 16-column chunk) all run, through mode 1's loop, to the same result."""
    gen = torch.Generator().manual_seed(7)
    pool = with_ids(random_pool(4, 64, 96, 32, slots=4, gen=gen, bias=True), random_ids(3, 4, 4, gen))
    x, w = 8 * torch.randn(3, 64, generator=gen), torch.rand(3, 4, generator=gen)
    assert_close(experts_forward(x, w, [pool], GPT_OSS, WORDS), reference_forward(x, w, [pool], GPT_OSS))
    wide = torch.zeros(pool.data.shape[0], pool.data.shape[1] + 1, dtype=torch.uint8)
    wide[:, 1:] = pool.data
    shifted = SlotPool(wide[:, 1:], pool.layout, pool.ids)  # rows one byte off alignment
    assert shifted.data.data_ptr() % 4 and kexperts._aligned_mode(3, [shifted.data]) == 1
    assert_close(experts_forward(x, w, [shifted], SILU, WORDS), reference_forward(x, w, [pool], SILU))
    odd = with_ids(random_pool(2, 68, 34, 17, slots=4, gen=gen), random_ids(3, 4, 4, gen))
    assert kexperts.kernel_meta(kexperts.layout_ints(odd.layout), 68, True, False, 64, 64, 3)[26] == 0
    x = torch.randn(3, 68, generator=gen)
    assert_close(experts_forward(x, w, [odd], SILU, WORDS), reference_forward(x, w, [odd], SILU))


def test_the_word_mode_keeps_x_and_h_in_quads_only_where_every_pool_reads_them_as_words():
    """x (and h, where the first kernel writes it) go in quads (column 4w + b at b K/4 + w, so a
    thread's x for four words is four 16-byte loads) only where every pool of the launch reads that
    projection as words: a bf16 pool beside, interleaved gate_up rows (gpt_oss: gate_up in mode 1's
    loop, down as words) and the block's own activation between the launches (h as stored) each
    leave one or both as stored, and every case gives the reference's result."""
    gen = torch.Generator().manual_seed(12)
    T, k, hidden, width = 2, 3, 64, 96
    x, w = torch.randn(T, hidden, generator=gen), torch.rand(T, k, generator=gen)
    low = with_ids(random_pool(4, hidden, width, 32, slots=4, gen=gen, bias=True), random_ids(T, k, 4, gen))
    bf16 = with_ids(random_pool(16, hidden, width, 0, slots=4, gen=gen, bias=True), random_ids(T, k, 4, gen))
    own = Activation(Act.NONE, gated=True, fn=lambda h: F.silu(h[..., :width]) * h[..., width:])
    cases = [([low], SILU, (True, True)), ([bf16, low], SILU, (False, False)), ([low], GPT_OSS, (False, True)),
             ([low], own, (True, False))]
    for pools, spec, want in cases:
        layouts = [v for p in pools for v in kexperts.layout_ints(p.layout)]
        metas = kexperts._metas(layouts, hidden, spec.gated, spec.interleaved, WORDS[1], WORDS[3], 3)
        assert kexperts.quads(metas, int(spec.kind)) == want, (spec.kind, len(pools))
        assert_close(experts_forward(x, w, pools, spec, WORDS), reference_forward(x, w, pools, spec), RTOL_WORDS)
    q = kexperts._in_quads(torch.arange(8.0).view(1, 8))
    assert q.tolist() == [[0.0, 4.0, 1.0, 5.0, 2.0, 6.0, 3.0, 7.0]]


def test_a_kernel_config_is_six_tiles_and_a_known_mode():
    assert kconfig.checked_config([16, 256, 16, 256, 1024, 4])[-1] == 0  # mode 0 unless named
    for bad in ([16, 256, 16, 256, 1024, 4, 4], [16, 256, 16, 256], [16, 200, 16, 256, 1024, 4],
                [16, 256, 16, 256, 1024, 3], [16, 256, 16, 256, 1024, 4.0], [0, 256, 16, 256, 1024, 4]):
        with pytest.raises(ValueError, match="MODE"):
            kconfig.checked_config(bad)


def test_per_channel_int8_and_bf16_activations():
    """INT8 with one group per row (its group is the whole 1408-column input) under bf16 hidden rows:
    the output is bf16, one rounding away from the fp32 reference on the same bf16 inputs."""
    gen = torch.Generator().manual_seed(1)
    pool = random_pool(8, 128, 1408, 0, slots=3, gen=gen, per_channel=True)
    pool = with_ids(pool, torch.tensor([[2, 0]], dtype=torch.int32))
    x, w = torch.randn(1, 128, generator=gen).bfloat16(), torch.rand(1, 2, generator=gen).bfloat16()
    got = experts_forward(x, w, [pool], SILU)
    want = reference_forward(x.float(), w.float(), [pool], SILU)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).abs() <= 2 ** -8 * want.abs() + RTOL * want.abs().max()).all()


class CountLaunches:
    """Counts the launches of the module's kernels (and runs them): `kernel[grid](...)` goes through it."""

    def __init__(self, monkeypatch):
        self.n = 0
        for name in ("gate_up_kernel", "down_kernel", "combine_kernel"):
            monkeypatch.setattr(triton_experts, name, self._wrap(getattr(triton_experts, name)))

    def _wrap(self, kernel):
        counter = self

        class Counted:
            def __getitem__(self, grid):
                counter.n += 1
                return kernel[grid]
        return Counted()


def test_every_precision_in_one_call_in_three_launches(monkeypatch):
    """bf16, INT8, INT4 and INT2 pools in one call, each (token, slot) at one precision or skipped,
    one pair present in two pools (it counts twice, as the contract says): three launches in all."""
    gen = torch.Generator().manual_seed(2)
    T, k, hidden, width = 4, 6, 64, 96
    pools = [random_pool(b, hidden, width, 32, slots=5, gen=gen, bias=True) for b in (16, 8, 4, 2)]
    which = torch.randint(-1, 4, (T, k), generator=gen)  # the precision of each pair, -1: skipped
    ids = torch.randint(0, 5, (4, T, k), generator=gen, dtype=torch.int32)
    ids = torch.where(which.unsqueeze(0) == torch.arange(4).view(4, 1, 1), ids, -1)
    ids[1, 0, 0], ids[2, 0, 0] = 3, 1  # pair (0, 0) at INT8 and at INT4
    pools = [with_ids(p, i) for p, i in zip(pools, ids)]
    x, w = torch.randn(T, hidden, generator=gen), torch.rand(T, k, generator=gen)
    launches = CountLaunches(monkeypatch)
    got = experts_forward(x, w, pools, SILU)
    assert launches.n == 3
    assert_close(got, reference_forward(x, w, pools, SILU))
    assert_close(experts_forward(x, w, pools, SILU, WIDE), got)  # mode 1: every precision in one launch too


def test_a_layer_with_no_slot_anywhere_adds_nothing():
    gen = torch.Generator().manual_seed(3)
    pools = [with_ids(random_pool(b, 64, 32, 32, slots=2, gen=gen), torch.full((2, 3), -1, dtype=torch.int32))
             for b in (16, 4)]
    got = experts_forward(torch.randn(2, 64, generator=gen), torch.rand(2, 3, generator=gen), pools, SILU)
    assert torch.equal(got, torch.zeros(2, 64))


GPT_OSS = Activation(Act.CLAMPED_SWIGLU, gated=True, interleaved=True, alpha=1.702, limit=7.0)


@pytest.mark.parametrize("bits,hidden,width,group", [(16, 64, 96, 0), (8, 64, 96, 32), (4, 64, 96, 32),
                                                     (2, 64, 96, 32), (2, 68, 34, 17)])
def test_biased_clamped_interleaved_experts(bits, hidden, width, group):
    """gpt_oss's experts: [gate, up] rows interleaved, biases on both projections, SwiGLU clamped
    at its limit (the random biases put values past the clamp). Width 34 at INT2: a byte's four
    rows are two neurons' gate and up in one program but not four neurons'; groups of 17 columns."""
    gen = torch.Generator().manual_seed(4 + bits)
    pool = random_pool(bits, hidden, width, group, slots=4, gen=gen, bias=True)
    pool = with_ids(pool, random_ids(3, 4, 4, gen))
    x, w = 8 * torch.randn(3, hidden, generator=gen), torch.rand(3, 4, generator=gen)
    got = experts_forward(x, w, [pool], GPT_OSS)
    want = reference_forward(x, w, [pool], GPT_OSS)
    assert_close(got, want)
    unclamped = Activation(Act.CLAMPED_SWIGLU, gated=True, interleaved=True, alpha=1.702, limit=1e9)
    assert (reference_forward(x, w, [pool], unclamped) - want).abs().max() > 100 * RTOL * want.abs().max()


@pytest.mark.parametrize("spec", [Activation(Act.GELU, gated=True), Activation(Act.GELU_TANH, gated=True),
                                  Activation(Act.RELU, gated=True), Activation(Act.SILU, gated=False),
                                  Activation(Act.GELU, gated=False)], ids=lambda s: f"{s.kind.name}-{s.gated}")
@pytest.mark.parametrize("bits", [16, 2])
def test_every_epilogue_activation(spec, bits):
    gen = torch.Generator().manual_seed(5)
    pool = random_pool(bits, 64, 64, 32, slots=3, gen=gen, bias=True, gated=spec.gated)
    pool = with_ids(pool, random_ids(2, 3, 3, gen))
    x, w = torch.randn(2, 64, generator=gen), torch.rand(2, 3, generator=gen)
    assert_close(experts_forward(x, w, [pool], spec), reference_forward(x, w, [pool], spec))


def test_an_unknown_activation_runs_between_two_launches(monkeypatch):
    """Act.NONE: the kernel writes gate_up's raw rows, the block's own function runs, then down."""
    def softplus_gate(h):  # a gate the kernel has no epilogue for
        gate, up = h.chunk(2, dim=-1)
        return F.softplus(gate) * up

    spec = Activation(Act.NONE, gated=True, fn=softplus_gate)
    gen = torch.Generator().manual_seed(6)
    pools = [with_ids(random_pool(b, 64, 48, 16, slots=3, gen=gen, bias=True), random_ids(2, 2, 3, gen))
             for b in (16, 4)]
    x, w = torch.randn(2, 64, generator=gen), torch.rand(2, 2, generator=gen)
    launches = CountLaunches(monkeypatch)
    got = experts_forward(x, w, pools, spec)
    assert launches.n == 3
    assert_close(got, reference_forward(x, w, pools, spec))
    pools = [with_ids(random_pool(b, 64, 48, 16, slots=3, gen=gen, bias=True), random_ids(2, 2, 3, gen))
             for b in (8, 4, 2)]  # mode 3 stores raw rows from byte rows: INT8's own, INT4's and INT2's shared
    assert_close(experts_forward(x, w, pools, spec, WORDS), reference_forward(x, w, pools, spec), RTOL_WORDS)


# ---- the model's own activation ----------------------------------------------------------------

@pytest.mark.parametrize("arch,kind,interleaved", [("qwen2_moe", Act.SILU, False), ("gpt_oss", Act.CLAMPED_SWIGLU, True),
                                                   ("minimax_m3_vl_text", Act.CLAMPED_SWIGLU, False)])
def test_activation_is_read_off_the_block(tmp_path, arch, kind, interleaved):
    lm = load_model(save_tiny(arch, tmp_path / arch))
    experts = lm.model.get_submodule(lm.geometry.layers[0].path).experts
    spec = activation_of(experts)
    assert (spec.kind, spec.interleaved) == (kind, interleaved)
    h = 20 * torch.randn(5, 2 * lm.geometry.layers[0].intermediate_size)
    assert_close(reference(spec, h), experts.activation(h).float())


def test_a_look_alike_activation_falls_back_to_the_blocks_own(tmp_path):
    """An act_fn of a known class whose forward differs: recognised by name, refused by the probe."""
    from transformers.activations import SiLUActivation

    class ShiftedSiLU(SiLUActivation):
        def forward(self, x):
            return F.silu(x) + 0.5

    lm = load_model(save_tiny("qwen2_moe", tmp_path / "q"))
    experts = lm.model.get_submodule(lm.geometry.layers[0].path).experts
    experts.impl.act_fn = ShiftedSiLU()
    spec = activation_of(experts)
    assert spec.kind == Act.NONE and spec.fn is not None
    h = torch.randn(3, 32)
    assert torch.equal(spec.fn(h), experts.activation(h))


# ---- whole layers of tiny real models --------------------------------------------------------------

def layer_pools(experts: torch.nn.Module, g, bits: int, group: int = 16) -> tuple[SlotPool, list[ExpertWeights]]:
    """A pool holding every expert of transformers' experts module `experts` (slot = expert id) at
    `bits` and groups of `group` columns, and the weights it holds (dequantized for low bits). Also
    test_kernels_archs.py's, at each architecture's own group."""
    fused = {n: p.detach() for n, p in experts.named_parameters()}
    weights = [fused_expert(fused, g, e) for e in range(g.num_experts)]
    gate_up, down = weights[0].gate_up.shape, weights[0].down.shape
    layout = make_layout(bits, gate_up, down, has_bias=g.has_bias, group_size=group)
    blobs = torch.stack([encode(layout, w, None if bits == 16 else hqq.quantize_expert(w, bits, group, optimize=False))
                         for w in weights])
    stack = dequantize_parts(stack_views(blobs, layout), layout, torch.float32)
    held = [ExpertWeights(stack.gate_up[e], stack.down[e], *(None if b is None else b[e] for b in
                                                             (stack.gate_up_bias, stack.down_bias)))
            for e in range(g.num_experts)]
    return SlotPool(blobs, layout, torch.empty(0, dtype=torch.int32)), held


def set_weights(experts: torch.nn.Module, g, held: list[ExpertWeights]) -> None:
    """Put `held` into transformers' fused experts parameters (transposed for gpt_oss)."""
    with torch.no_grad():
        for e, w in enumerate(held):
            gate_up, down = (w.gate_up.t(), w.down.t()) if g.transposed else (w.gate_up, w.down)
            getattr(experts, "gate_up_proj" if g.gated else "up_proj")[e].copy_(gate_up)
            experts.down_proj[e].copy_(down)


class KernelExperts(torch.nn.Module):
    """A MoE block's experts through the kernel: all of a layer's experts in one pool, slot = expert."""

    def __init__(self, pool: SlotPool, spec: Activation, config: tuple = ()):
        super().__init__()
        self.pool, self.spec, self.config = pool, spec, config

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return experts_forward(hidden_states, top_k_weights, [with_ids(self.pool, top_k_index.int())], self.spec,
                               self.config)


def spec_of(experts: torch.nn.Module, g) -> Activation:
    return activation_of(ProviderExperts(copy.deepcopy(experts), g, provider=None))


@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("bits", [16, 4, 2])
def test_a_tiny_models_layer_matches_its_own_experts(tmp_path, arch, bits):
    """Layer 0's experts of a tiny checkpoint saved in bf16 (so the bf16 blobs hold its weights
    exactly), through the kernel, against transformers' own experts module in fp32: with its own
    weights at bf16, with the dequantized weights put into it at 4 and 2 bits."""
    model = load_reference(save_tiny(arch, tmp_path / arch, dtype=torch.bfloat16), experts_impl="eager")
    g = inspect_geometry(model).layers[0]
    experts = model.get_submodule(g.path).experts
    spec = spec_of(experts, g)
    assert spec.kind != Act.NONE
    pool, held = layer_pools(experts, g, bits)
    set_weights(experts, g, held)
    gen = torch.Generator().manual_seed(7)
    T = 5
    idx = torch.stack([torch.randperm(g.num_experts, generator=gen)[:g.top_k] for _ in range(T)])  # [T, k]
    w = torch.softmax(torch.randn(T, g.top_k, generator=gen), -1)
    x = 4 * torch.randn(T, g.hidden_size, generator=gen)
    with torch.no_grad():
        want = experts(x, idx, w)
    assert_close(experts_forward(x, w, [with_ids(pool, idx.int())], spec), want)


@pytest.mark.slow
@pytest.mark.parametrize("arch,low,config", [("qwen2_moe", 4, ()), ("gpt_oss", 2, ()), ("qwen2_moe", 2, WORDS),
                                             ("qwen2_moe", 4, WORDS)])
def test_a_tiny_model_through_the_kernel(tmp_path, arch, low, config):
    """Every MoE layer through the kernel: at bf16 the same greedy tokens as transformers (logits
    within 1e-4 of the largest); at 4 or 2 bits the perplexity of a short text within 0.5% of the
    model with the dequantized weights put in (the issue's bar; the gap measured is fp32 rounding).
    Mode 3 too (`WORDS`; its 16-bit pass runs mode 1's loop)."""
    path = save_tiny(arch, tmp_path / arch, dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(8))
    for bits in (16, low):
        model = load_reference(path, experts_impl="eager")
        geometry = inspect_geometry(model)
        kernels = {}
        for g in geometry.layers:
            experts = model.get_submodule(g.path).experts
            pool, held = layer_pools(experts, g, bits)
            set_weights(experts, g, held)
            kernels[g.path] = KernelExperts(pool, spec_of(experts, g), config)
        with torch.no_grad():
            want_logits = model(ids).logits
            want_tokens = model.generate(ids[:, :8], max_new_tokens=6, do_sample=False) if bits == 16 else None
            for p, k in kernels.items():
                model.get_submodule(p).experts = k
            got_logits = model(ids).logits
            got_tokens = model.generate(ids[:, :8], max_new_tokens=6, do_sample=False) if bits == 16 else None
        assert_close(got_logits, want_logits, rtol=1e-4)
        if bits == 16:
            assert torch.equal(got_tokens, want_tokens)
        nll = [F.cross_entropy(lg[0, :-1], ids[0, 1:]).item() for lg in (got_logits, want_logits)]
        assert abs(torch.tensor(nll[0] - nll[1]).exp().item() - 1) < 0.005, nll


# ---- the engine's hook (CUDA only; forced on here, on a CPU under the interpreter) ------------------

@pytest.mark.parametrize("policy,settings,budget", [("static", {"bits": "4"}, "100%"), ("dymoe", {}, "40%")])
def test_the_engines_low_bit_experts_through_the_kernels(tiny_ckpt, bundle, monkeypatch, policy, settings, budget):
    """The engine's `_gemm` hook, which CUDA turns on for the low-bit precisions: resident INT4
    (static), and DyMoE's 4/2 mix with loads and evictions at 40%; prefill logits and greedy
    decode tokens as the engine's own dequantize path gives them, the kernels really launched."""
    from moetool.engine import build_engine
    from moetool.engine.store import HostStore
    from moetool.quant.bundle import Bundle

    ids = torch.tensor([[5, 17, 33, 2, 9, 100, 45, 7]])
    results = []
    for triton in (False, True):
        lm = load_model(str(tiny_ckpt("qwen2_moe")))
        store = HostStore.from_bundle(Bundle.open(bundle, model=lm.fingerprint), torch.float32)
        engine, _ = build_engine(lm, store, policy, settings=settings, budget=budget, kernels=False)
        assert engine.triton_layers == {}  # off the GPU, never on by itself
        if triton:
            engine.triton_layers = {(g.index, b): activation_of(lm.model.get_submodule(g.path).experts)
                                    for g in lm.geometry.layers for b in (4, 2)}
            launches = CountLaunches(monkeypatch)
        with torch.no_grad():
            logits = lm.model(ids).logits
            tokens = lm.model.generate(ids, max_new_tokens=4, do_sample=False)
        results.append((logits, tokens))
        engine.close()
    assert launches.n >= 3 * 4 * len(lm.geometry.layers)  # prefill and each decode step's layers at least
    assert_close(results[1][0], results[0][0])
    assert torch.equal(results[1][1], results[0][1])


@pytest.mark.parametrize("policy,settings,budget", [("static", {"bits": "4"}, "100%"), ("lru", {}, "25%"),
                                                     ("dymoe", {"config": "4/2"}, "40%")])
def test_the_captured_step_through_the_kernels(tiny_ckpt, bundle, monkeypatch, policy, settings, budget):
    """The captured decode step's experts as CUDA runs them (forced on here): every precision's pool
    and the missed rows read from host memory, in one kernel call a layer; the greedy tokens of the
    step's gather path (the CPU's), with the kernels really launched inside the compiled step."""
    from moetool.engine import build_engine
    from moetool.engine.decode import DecodeProgram
    from moetool.engine.store import HostStore
    from moetool.quant.bundle import Bundle

    ids = torch.tensor([[5, 17, 33, 2, 9, 100, 45, 7]])
    tokens = []
    for kernels in (False, True):
        lm = load_model(str(tiny_ckpt("qwen2_moe")))
        store = HostStore.from_bundle(Bundle.open(bundle, model=lm.fingerprint), torch.float32)
        engine, _ = build_engine(lm, store, policy, settings=settings, budget=budget, captured=True, max_tokens=24)
        program = DecodeProgram(engine, max_tokens=24, backend="eager", kernels=kernels)
        assert bool(program.layers.kernel_acts) == kernels
        if kernels:  # counted once built (the count wraps the kernels, which `supported` checks)
            launches = CountLaunches(monkeypatch)
        tokens.append(program.generate(ids, 5))
    assert launches.n == 3 * 4 * len(lm.geometry.layers)  # 4 captured steps, 3 launches a layer
    assert tokens[0] == tokens[1]


# ---- compile, the ops, refusals --------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_compile_of_a_decode_step(backend):
    """torch.compile(fullgraph=True) of a function that takes routed slot ids and runs the layer:
    the ops trace as two graph nodes (fake shapes), a known activation and the block-function
    fallback alike, and the compiled function computes what the eager one does."""
    import torch._dynamo

    gen = torch.Generator().manual_seed(9)
    pools = [random_pool(b, 64, 32, 32, slots=4, gen=gen, bias=True) for b in (16, 4)]
    fallback = Activation(Act.NONE, gated=True, interleaved=True, fn=lambda h: reference(GPT_OSS, h))

    def step(x, w, ids16, ids4, spec):
        out = experts_forward(x, w, [with_ids(pools[0], ids16), with_ids(pools[1], ids4)], spec)
        return out + x  # the residual, so the graph holds ops around the custom ones

    x, w = torch.randn(2, 64, generator=gen), torch.rand(2, 3, generator=gen)
    ids = random_ids(2, 3, 4, gen)
    ids16, ids4 = torch.where(ids % 2 == 0, ids, -1), torch.where(ids % 2 == 1, ids, -1)
    for spec in (GPT_OSS, fallback) if backend == "aot_eager" else (fallback,):  # inductor: the C++ build is slow
        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True, backend=backend)
        assert_close(compiled(x, w, ids16, ids4, spec), step(x, w, ids16, ids4, spec))


def test_the_ops_pass_torch_librarys_checks():
    """Schema, fake (meta) implementation and dispatch of both ops, as torch.library.opcheck tests them."""
    gen = torch.Generator().manual_seed(10)
    pool = with_ids(random_pool(4, 64, 32, 32, slots=3, gen=gen), random_ids(2, 2, 3, gen))
    x, w = torch.randn(2, 64, generator=gen), torch.rand(2, 2, generator=gen)
    layouts = list(kexperts.layout_ints(pool.layout))
    args = (x, [pool.data], [pool.ids], layouts, 2, int(Act.SILU), True, False, 0.0, 0.0, [])
    torch.library.opcheck(torch.ops.moetool.experts_gate_up.default, args)
    h = torch.ops.moetool.experts_gate_up(*args)
    torch.library.opcheck(torch.ops.moetool.experts_down.default,
                          (h, w, [pool.data], [pool.ids], layouts, 64, torch.float32, [], int(Act.SILU)))


def test_what_the_kernels_refuse():
    gen = torch.Generator().manual_seed(11)
    layout = random_pool(4, 64, 32, 32, slots=1, gen=gen).layout
    assert supported(layout, SILU, "cpu") is None
    assert "CUDA" in supported(layout, SILU, "meta")
    axis0 = make_layout(4, (64, 64), (64, 32), has_bias=False, group_size=32, axis=0)
    assert "axis 0" in supported(axis0, SILU, "cpu")
    with pytest.raises(ValueError, match="axis 0"):  # asked or not: refused, never read as axis 1
        experts_forward(torch.randn(1, 64), torch.rand(1, 2),
                        [SlotPool(torch.zeros(1, axis0.nbytes, dtype=torch.uint8), axis0,
                                  torch.zeros(1, 2, dtype=torch.int32))], SILU)
    odd_rows = make_layout(2, (34, 64), (64, 34), has_bias=False, group_size=2)  # 34 rows, 4 codes a byte
    assert "byte slices" in supported(odd_rows, Activation(Act.SILU, gated=False), "cpu")
    assert "down projection" in supported(layout, Activation(Act.SILU, gated=False), "cpu")
    assert "own function" in supported(layout, Activation(Act.NONE, gated=True), "cpu")
    pool = with_ids(random_pool(4, 64, 32, 32, slots=1, gen=gen), torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="int32"):
        experts_forward(torch.randn(1, 64), torch.rand(1, 2), [pool], SILU)


# ---- the benchmark script, without a GPU -----------------------------------------------------------

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench_kernels.py"


def _bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, **(env or {})}  # compiled unless named
    return subprocess.run([sys.executable, str(BENCH), *args], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_kernels_compile_for_an_h100():
    """What the interpreter cannot check: Triton's compiler takes the kernels, with the arguments of
    a call that mixes every precision, down to an sm_90 binary (no driver or GPU involved)."""
    run = _bench("--compile-only", "90", "--shapes", "qwen1.5-moe-a2.7b")
    assert run.returncode == 0, run.stderr[-2000:]
    for kernel in ("gate_up_kernel", "down_kernel", "combine_kernel"):
        assert f"{kernel}" in run.stdout and "sm_90" in run.stdout


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_machine_code_reading_counts_loads_conversions_and_tiles_moved_between_layouts():
    """`machine_traffic` on hand-written SASS and TTGIR: opcodes counted whatever their predicate or
    modifiers; a convert_layout of a many-row, many-column tile counts, x's one-row tile and a tile
    of scales (one column) do not; a loop is a branch back, and its body what lies between."""
    sass = """
        /*0040*/                   LDG.E.128 R4, desc[UR6][R2.64] ;
        /*0050*/              @P0 LDG.E.U16 R8, desc[UR6][R10.64] ;
        /*0060*/                   I2FP.F32.U32 R9, R9 ;
        /*0070*/             @!P1 I2F.U16 R12, R12 ;
        /*0080*/                   STS.128 [R0], R4 ;
        /*0090*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00a0*/                   LDS.64 R6, [R1] ;
        /*00b0*/                   FFMA R3, R4, R5, R3 ;
        /*00c0*/              @!P0 BRA 0x40 ;
        /*00d0*/                   EXIT ;
        /*00e0*/                   BRA 0xe0;
    """
    ttgir = """
        %a = ttg.convert_layout %raw_n_103 : tensor<16x4x64xi8, #blocked2> -> tensor<16x4x64xi8, #blocked>
        %b = ttg.convert_layout %xk_80 : tensor<1x4x64xf32, #blocked1> -> tensor<1x4x64xf32, #blocked>
        %c = ttg.convert_layout %acc : tensor<16x8x1xf32, #blocked4> -> tensor<16x8x1xf32, #blocked1>
    """
    traffic = _bench_module().machine_traffic(sass, ttgir)
    # One loop: the branch back from 0xc0 to 0x40 (its body is 0x40..0xc0, nine instructions); the
    # branch to itself at the end (the trap after EXIT) is not a loop.
    assert traffic == dict(sass_ops=11, global_loads=2, shared_ops=2, barriers=1, int_to_float=2, tile_shuffles=1,
                           loops=1, loop_ops=9)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_the_compiled_kernels_keep_their_tiles_in_place_and_make_floats_of_codes_without_conversions(tmp_path, group):
    """The kernels compiled for an sm_90 (no GPU) at the default tiles, every precision alone and
    DyMoE's 4,2 in one launch, each loop mode, HQQ groups of 32, 64 and 128, read in their machine
    code: no weight tile goes through shared memory to change layout, a low-bit kernel converts no
    more ints to floats than the bf16 one (its codes become floats by bit operations) and issues at
    most twice its global loads, and nothing spills. Before, every low-bit kernel converted one int a
    weight (65 I2F in an INT4 gate_up program), and modes 1 and 2 moved every codes tile into x's
    layout through shared memory (Triton 3.6: 71 global loads and 97 shared-memory instructions in
    an INT4 gate_up program of mode 1, against 14 and 20 now)."""
    run = _bench("--compile-only", "90", "--shapes", "qwen1.5-moe-a2.7b", "--compile-sets", "16", "8", "4", "2",
                 "4,2", "--group", str(group), "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads((tmp_path / "compile_only.json").read_text())
    assert {(r["kernel"], tuple(r["bits"]), r["mode"]) for r in rows} == {
        (k, b, m) for k in ("gate_up_kernel", "down_kernel", "combine_kernel")
        for b in ((16,), (8,), (4,), (2,), (4, 2)) for m in kconfig.MODES}
    bf16 = {(r["kernel"], r["mode"]): r for r in rows if r["bits"] == [16]}
    for r in rows:
        assert r["group"] == group
        what = f"{r['kernel']} bits {r['bits']} mode {r['mode']}: {r}"
        ref = bf16[r["kernel"], r["mode"]]
        assert r["tile_shuffles"] == 0 and r["spilled_bytes"] == 0, what
        assert r["int_to_float"] <= ref["int_to_float"], what
        # (mode 3 read x as four strided tiles, a scalar load each: 97 in an INT4 gate_up program; in
        # quads, 65, with bf16's 66)
        assert r["global_loads"] <= 2 * len(r["bits"]) * ref["global_loads"], what


def test_the_word_mode_costs_well_under_the_instructions_a_weight_of_mode_1(tmp_path):
    """Issue 42's diagnosis: at batch 1 the low-bit kernels are bound by the instructions a weight
    costs (7.4-9 a thread in modes 0-2's K loops, INT4 and INT2, sm_90). Mode 3's loops, compiled at
    a config the tuner tries, cost at most 4.6 (measured 3.1-4.3 on Triton 3.6 and 3.9) and at most
    3/4 of mode 1's at the same config (measured 0.46-0.55 on 3.6, the GPU image's, 0.58-0.70 on 3.9),
    gate_up and down, INT4, INT2 and DyMoE's 4,2."""
    run = _bench("--compile-only", "90", "--shapes", "qwen1.5-moe-a2.7b", "--compile-sets", "4", "2", "4,2",
                 "--modes", "1", "3", "--config", ",".join(map(str, WORDS_GPU[:6])), "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {(r["kernel"], tuple(r["bits"]), r["mode"]): r for r in json.loads((tmp_path / "compile_only.json").read_text())}
    for kernel in ("gate_up_kernel", "down_kernel"):
        for bits in ((4,), (2,), (4, 2)):
            words, lanes = rows[kernel, bits, 3], rows[kernel, bits, 1]
            what = f"{kernel} {bits}: mode 3 {words['loop_ops_per_weight']}, mode 1 {lanes['loop_ops_per_weight']}"
            assert words["spilled_bytes"] == 0 and words["loop_ops_per_weight"] <= 4.6, what
            assert words["loop_ops_per_weight"] <= 0.75 * lanes["loop_ops_per_weight"], what


@pytest.mark.slow
def test_the_benchmark_writes_its_rows_on_a_cpu(tmp_path):
    run = _bench("--shapes", "qwen3-30b-a3b", "--bits", "16", "2", "--sets", "1", "--repeats", "1", "--cpu-slots", "8",
                 "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "need CUDA to be timed" in run.stderr
    rows = json.loads((tmp_path / "bench_kernels.json").read_text())
    assert [(r["bits"], r["path"]) for r in rows] == [(16, "dequant-gemm-eager"), (2, "dequant-gemm-eager")]
    for r in rows:
        assert r["shape"] == "qwen3-30b-a3b" and r["device"].startswith("cpu") and r["us_per_expert"] > 0
        assert r["gbps"] == pytest.approx(r["expert_bytes"] / (r["us_per_expert"] * 1e3))
    assert rows[0]["ratio_to_bf16"] == 1.0 and rows[1]["ratio_to_bf16"] == pytest.approx(
        rows[1]["us_per_expert"] / rows[0]["us_per_expert"])


def test_the_tuner_writes_configs_the_kernels_read_each_checked_against_the_reference(tmp_path):
    """`bench_kernels.py --tune` under the interpreter (a check of the search, its times are the
    interpreter's): a configs file `moetool.kernels.experts` loads, for this shape and precision set,
    whose chosen config passed the reference check; off CUDA and the interpreter, one sentence, exit 2."""
    run = _bench("--tune", "--shapes", "tiny", "--tune-sets", "4,2", "--tune-seconds", "8", "--repeats", "1",
                 "--config", "32,64,32,64,256,4", "--out", str(tmp_path), env={"TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    (path,) = tmp_path.glob("kernel-configs-*.json")
    kconfig.load_tuned.cache_clear()
    device, table = kconfig.load_tuned(str(path))
    best = table["128x64"]["4,2"]
    (job,) = json.loads(path.read_text())["measured"]
    assert job["default"] == [32, 64, 32, 64, 256, 4, 0] and len(job["tried"]) >= 2  # the default, then others
    chosen = next(t for t in job["tried"] if tuple(t["config"]) == best)
    assert chosen["max_rel_err"] <= 1e-2 and "refused" not in chosen
    assert all(("us_per_expert" in t) != ("refused" in t) for t in job["tried"])
    assert chosen["us_per_expert"] <= job["default_us"]
    refused = _bench("--tune", "--shapes", "tiny", "--out", str(tmp_path / "no"))
    assert refused.returncode == 2 and "on CUDA" in refused.stderr and not (tmp_path / "no").exists()


@pytest.mark.parametrize("arch,bits", [("qwen2_moe", 4), ("gpt_oss", 2), ("qwen2_moe", 16)])
def test_the_call_profile_timing_times_on_cuda_computes_the_layers_experts(tmp_path, arch, bits):
    """`profile --what timing` times the kernels' call on CUDA (`profile.timing.path_call`): run here
    by the interpreter, it returns sum_i w_i expert_i(x) over the top-k copies of the profiled expert
    (the model's own activation, gpt_oss's biases and clamp), as the engine adds a layer's experts."""
    from moetool.profile import _timing_blobs
    from moetool.profile.timing import path_call
    from moetool.quant.format import dequantize

    lm = load_model(save_tiny(arch, tmp_path / arch))
    blob, layout = _timing_blobs(lm, None)[bits]
    g = lm.geometry.layers[0]
    module = lm.model.get_submodule(g.path).experts
    act = activation_of(module)
    assert kexperts.supported(layout, act, "cpu") is None
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(1, g.hidden_size, generator=gen), torch.softmax(torch.randn(1, g.top_k, generator=gen), -1)
    call, dequant_s, _ = path_call("triton", module, act, blob, layout, bits, x, weight)
    want = weight.sum() * module.expert_forward(x, dequantize(blob, layout, torch.float32))  # k copies of one expert
    assert_close(call(), want)
    assert dequant_s == 0.0  # the kernels read the codes as stored

"""Per-channel INT8 experts through torch's int8 weight-only CPU kernel: the quantize option that
stores them, the in-place conversion of a blob (zero point folded into an offset times the sum of
the inputs), the kernel against the dequantized weights, and the engine path against the
dequantize path, under bf16 and fp32 compute.

Stated tolerance: the kernel takes bf16 scales and bf16 activations (fp32 ones rounded), so against
the dequantized reference outputs agree within 2% of their largest magnitude (as the int4 kernel's,
tests/test_int4_kernel.py); perplexity within 0.5%.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from moetool.cli import app
from moetool.engine import build_engine
from moetool.engine.store import HostStore
from moetool.model import load_model
from moetool.quant import hqq, int8_kernel
from moetool.quant.bundle import Bundle
from moetool.quant.format import ALIGN, Bits, dequantize, encode, make_layout
from moetool.quant.quantize import QuantizeConfig, quantize
from tiny import save_tiny
from helpers import KERNEL_IDS as IDS
from helpers import close as _close
from helpers import gaussian_expert

CPU, BF16, FP32 = torch.device("cpu"), torch.bfloat16, torch.float32


def _per_channel_blob(has_bias: bool, seed: int = 1):
    w = gaussian_expert(rows=64, hidden=128, bias=has_bias, seed=seed)
    w.gate_up[3] += 5.0  # a row far off centre: its zero point, hence its offset, is large
    layout = make_layout(Bits.INT8, w.gate_up.shape, w.down.shape, has_bias, group_size=32, int8_per_channel=True)
    q = {p.name: hqq.quantize_weight(getattr(w, p.name), Bits.INT8, p.group_size, optimize=False)
         for p in layout.projections}
    pool = torch.zeros(2, layout.nbytes + ALIGN, dtype=torch.uint8)  # a slot inside a pool, as the engine has
    blob = pool[1, :layout.nbytes]
    encode(layout, w, q, out=blob)
    return layout, pool, blob


@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("has_bias", [False, True])
def test_converted_blob_through_the_kernel_equals_the_dequantized_expert(dtype, has_bias):
    layout, pool, blob = _per_channel_blob(has_bias)
    assert layout.per_channel and [p.group_size for p in layout.projections] == [128, 64]
    assert int8_kernel.unsupported(layout, CPU, dtype) is None
    ref = dequantize(blob.clone(), layout, dtype)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0)).to(dtype)
    act = lambda h: F.silu(h[:, :64]) * h[:, 64:]  # noqa: E731
    want = F.linear(act(F.linear(x, ref.gate_up, ref.gate_up_bias)), ref.down, ref.down_bias)
    int8_kernel.convert_(blob, layout)
    assert pool[0].count_nonzero() == 0  # nothing written outside the blob
    got = int8_kernel.expert_forward(x, int8_kernel.kernel_weights(blob, layout), act)
    _close(got, want)
    # Several tokens: the converted experts decoded for a grouped GEMM give the same weights.
    w = int8_kernel.kernel_weights(blob, layout)
    for (codes, scale, offset), name in zip((w.gate_up, w.down), ("gate_up", "down")):
        decoded = int8_kernel.decode(codes[None], scale[None], offset[None], FP32)[0]
        _close(decoded, getattr(ref, name), share=0.01)


def test_a_dead_neurons_zero_rows_give_zero_through_the_kernel_as_through_the_dequantize_path():
    """A neuron whose gate and up rows are all zero (pruned, padded): hqq gives such a row the scale 1.0 and
    zero 0, and the kernel's s (x . (q - 128)) + c sum(x) cancelled to 0 through a bf16 product of 128 |sum(x)|,
    leaving 0.25 |sum(x)|: tokens changed on the CPU kernel and not on the eager path. A row of one code is
    now its constant alone (0 here), exactly."""
    w = gaussian_expert(rows=64, hidden=128, bias=False, seed=3)
    w.gate_up[2].zero_()
    w.gate_up[34].zero_()  # its up row too
    w.gate_up[7].fill_(0.25)  # a constant row
    layout = make_layout(Bits.INT8, w.gate_up.shape, w.down.shape, False, group_size=32, int8_per_channel=True)
    q = {p.name: hqq.quantize_weight(getattr(w, p.name), Bits.INT8, p.group_size, optimize=False)
         for p in layout.projections}
    blob = encode(layout, w, q)
    ref = dequantize(blob.clone(), layout, FP32)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(0)).abs() + 1  # sum(x) large: the worst case
    int8_kernel.convert_(blob, layout)
    w8 = int8_kernel.kernel_weights(blob, layout)
    got = int8_kernel.linear(x.to(BF16), *w8.gate_up)  # [1, 64] fp32
    assert got[0, 2] == 0 and got[0, 34] == 0  # exactly: it had been ~0.25 |sum(x)| = 50
    assert got[0, 7] == pytest.approx(float(ref.gate_up[7] @ x.to(BF16).float()[0]), rel=1e-3)
    _close(got, x.to(BF16).float() @ ref.gate_up.T)


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_one_token_through_the_fused_call_equals_the_weighted_sum_of_each_expert(dtype):
    blobs = [_per_channel_blob(False, seed=s)[1:] for s in range(3)]
    layout = _per_channel_blob(False)[0]
    weights = []
    for _, blob in blobs:
        int8_kernel.convert_(blob, layout)
        weights.append(int8_kernel.kernel_weights(blob, layout))
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(2)).to(dtype)
    route = torch.tensor([0.5, 0.3, 0.2], dtype=dtype)
    act = lambda h: F.silu(h[..., :64]) * h[..., 64:]  # noqa: E731
    want = sum(r * int8_kernel.expert_forward(x, w, act) for r, w in zip(route.float(), weights))
    stacked = [tuple(torch.stack([getattr(w, proj)[i] for w in weights]) for i in range(3)) for proj in ("gate_up", "down")]
    got = int8_kernel.fused_forward(x, *stacked, route, act)
    _close(got, want, share=0.01)


def test_what_the_int8_kernel_cannot_run_is_named():
    shapes = ((128, 64), (64, 64))
    ok = make_layout(Bits.INT8, *shapes, False, int8_per_channel=True)
    assert int8_kernel.unsupported(ok, CPU, BF16) is None and int8_kernel.unsupported(ok, CPU, FP32) is None
    assert "--int8-per-channel" in int8_kernel.unsupported(make_layout(Bits.INT8, *shapes, False, 32), CPU, BF16)
    assert "float16" in int8_kernel.unsupported(ok, CPU, torch.float16)
    assert "CPU" in int8_kernel.unsupported(ok, torch.device("cuda"), BF16)
    assert "not INT8" in int8_kernel.unsupported(make_layout(Bits.INT4, *shapes, False, 32), CPU, BF16)


@pytest.fixture(scope="module")
def int8_model(tmp_path_factory):
    """A tiny qwen2_moe and its bf16 bundle with per-channel INT8 (and grouped INT4) experts."""
    tmp = tmp_path_factory.mktemp("int8k")
    path = save_tiny("qwen2_moe", tmp / "m", moe_intermediate_size=32)
    quantize(QuantizeConfig(model=str(path), out=tmp / "b", bits=(16, 8, 4), group_size=32, dtype="bfloat16",
                            int8_per_channel=True))
    return path, tmp / "b"


def test_quantize_stores_per_channel_int8_and_records_it(int8_model):
    path, bundle = int8_model
    opened = Bundle.open(bundle, verify="full")  # layouts re-validated against make_layout
    assert opened.manifest.settings["int8_per_channel"] is True
    assert {layout.bits: layout.per_channel for layout in opened.manifest.layouts.values()} == \
        {16: False, 8: True, 4: False}
    store = HostStore.from_bundle(opened, BF16)
    for layer in load_model(path).geometry.layers:
        assert store.layout(layer.index, 8).per_channel and not store.layout(layer.index, 4).per_channel


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_engine_int8_kernel_matches_the_dequantize_path(int8_model, dtype, monkeypatch):
    """Static INT8 over the per-channel bundle: the prompt's experts decoded from the kernel's layout
    for grouped GEMMs, each decode step's through the kernel together (`fused_forward`); the same results
    as the dequantize path within the stated tolerance, perplexity within 0.5%, same device bytes."""
    path, bundle = int8_model
    seen = {"decode": 0, "fused": 0}
    decode, fused = int8_kernel.decode, int8_kernel.fused_forward
    monkeypatch.setattr(int8_kernel, "decode", lambda *a: seen.__setitem__("decode", seen["decode"] + 1) or decode(*a))
    monkeypatch.setattr(int8_kernel, "fused_forward",
                        lambda *a: seen.__setitem__("fused", seen["fused"] + 1) or fused(*a))
    runs = {}
    for kernels in (True, False):
        lm = load_model(path, dtype=dtype)
        store = HostStore.from_bundle(Bundle.open(bundle, model=lm.fingerprint), dtype)
        engine, plan = build_engine(lm, store, "static", settings={"bits": "8"}, budget="100%", batch=2,
                                    kernels=kernels)
        with torch.no_grad():
            logits = lm.model(IDS).logits.float()
            lm.model.generate(IDS[:1], max_new_tokens=4, do_sample=False)  # decode steps: one token a layer
        runs[kernels] = (logits, None, engine, plan)
    every = frozenset(g.index for g in runs[True][2].layers)
    assert runs[True][2].kernel_layers[8] == every and not runs[False][2].kernel_layers
    assert runs[True][2].stats.summary()["kernel_layers"]["8"] == len(every)
    assert seen["decode"] > 0 and seen["fused"] > 0  # both paths of the kernel ran
    got, want = runs[True][0], runs[False][0]
    _close(got, want)
    ppl = [math.exp(F.cross_entropy(x[:, :-1].reshape(-1, x.shape[-1]), IDS[:, 1:].reshape(-1)).item())
           for x in (got, want)]
    assert abs(ppl[0] - ppl[1]) <= 0.005 * ppl[1]
    s, p = runs[True][2].stats.summary(), runs[False][2].stats.summary()
    assert s["precision_mix"].get("8", 0) > 0
    assert s["peak_device_bytes"] == p["peak_device_bytes"] <= runs[True][3].total_bytes


def test_a_grouped_int8_bundle_keeps_dequantizing(tmp_path):
    """Groups narrower than a row have no per-row form (where a group is a whole row, it is one)."""
    path = save_tiny("qwen2_moe", tmp_path / "m", moe_intermediate_size=64)
    quantize(QuantizeConfig(model=str(path), out=tmp_path / "b", bits=(16, 8), group_size=32, dtype="bfloat16"))
    lm = load_model(path, dtype=BF16)
    store = HostStore.from_bundle(Bundle.open(tmp_path / "b", model=lm.fingerprint), BF16)
    engine, _ = build_engine(lm, store, "static", settings={"bits": "8"}, budget="100%")
    assert 8 not in engine.kernel_layers


@pytest.mark.parametrize("args,says", [
    (["--bits", "4,2"], "add 8 to --bits"),
    (["--method", "gptq"], "quantized by hqq"),
])
def test_per_channel_int8_refuses_what_it_cannot_do_in_one_sentence(tiny_ckpt, tmp_path, args, says):
    result = CliRunner().invoke(app, ["quantize", str(tiny_ckpt("qwen2_moe")), "--int8-per-channel",
                                      "--out", str(tmp_path / "b"), *args])
    assert result.exit_code == 1, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in result.output
    assert not (tmp_path / "b").exists()


def test_quantize_command_stores_per_channel_int8(tiny_ckpt, tmp_path):
    result = CliRunner().invoke(app, ["quantize", str(tiny_ckpt("qwen2_moe")), "--bits", "8,4", "--int8-per-channel",
                                      "--no-hqq-optimize", "--out", str(tmp_path / "b"), "--json"])
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.stdout)
    assert manifest["settings"]["int8_per_channel"] is True
    for layout in manifest["layouts"].values():
        groups = [(p["group_size"], p["shape"][1]) for p in layout["projections"]]
        assert all(g == width for g, width in groups) == (layout["bits"] == 8), groups


def test_a_row_whose_kernel_offset_overflows_float16_is_refused_at_quantize():
    """A row of weights near 7e4 (past float16's 65504) decodes finite through hqq's fp16 scale and zero, so
    quantize stored it; but the kernel's row offset c = s (128 - z) is ~7e4 in float16, infinity, and every
    output of the expert on the CPU kernel was inf or NaN where the dequantizing path's was finite."""
    from moetool.errors import MoetoolError
    from moetool.model import ExpertWeights
    from moetool.quant.quantize import _refuse_overflow

    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(64, 64, generator=gen) * 0.02
    gate_up[5] = 70000 + torch.rand(64, generator=gen) * 300
    w = ExpertWeights(gate_up=gate_up, down=torch.randn(64, 32, generator=gen) * 0.02)
    layout = make_layout(8, gate_up.shape, w.down.shape, False, 64, int8_per_channel=True)
    q = {p.name: hqq.quantize_weight(getattr(w, p.name), 8, p.group_size, 1, "cpu", False) for p in layout.projections}
    blob = encode(layout, w, q)
    approx = dequantize(blob, layout)
    assert bool(torch.isfinite(approx.gate_up).all())  # the decoded weights are finite: only the offset overflows
    with pytest.raises(MoetoolError, match=r"expert 3 of layer 1 cannot be stored at 8 bits per channel: its gate_up "
                                           r"projection holds weights of magnitude 7\.0.e\+04, past float16's range"):
        _refuse_overflow(w, approx, layout, 1, 3, blob)
    gate_up[5] = torch.randn(64, generator=gen) * 0.02  # an ordinary row: stored
    q = {p.name: hqq.quantize_weight(getattr(w, p.name), 8, p.group_size, 1, "cpu", False) for p in layout.projections}
    blob = encode(layout, w, q)
    _refuse_overflow(w, dequantize(blob, layout), layout, 1, 3, blob)

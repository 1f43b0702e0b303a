"""INT4 experts through torch's packed-int4 CPU kernel: the in-place conversion of a bundle blob, the
kernel's result against the dequantized weights, and the engine path against the dequantize path.

Stated tolerance: the kernel keeps scale and zero point in bf16 and accumulates in its own order, so
against the dequantized reference (bf16) outputs agree within 2% of their largest magnitude; the
measured gap is about one bf16 rounding step (~0.5%).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from moetool.engine import build_engine
from moetool.engine.store import HostStore
from moetool.model import load_model
from moetool.quant import hqq, int4_kernel
from moetool.quant.bundle import Bundle
from moetool.quant.format import ALIGN, Bits, dequantize, encode, make_layout
from moetool.quant.quantize import QuantizeConfig, quantize
from tiny import save_tiny
from test_quant_format import gaussian_expert

IDS = torch.tensor([[5, 17, 33, 2, 9, 100, 45, 7], [1, 2, 3, 4, 5, 6, 7, 8]])
CPU, BF16 = torch.device("cpu"), torch.bfloat16


def _close(got: torch.Tensor, want: torch.Tensor, share: float = 0.02) -> None:
    got, want = got.float(), want.float()
    assert (got - want).abs().max() <= share * want.abs().max(), f"max diff {(got - want).abs().max():.4g}"


@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("group", [32, 64])
def test_converted_blob_through_the_kernel_equals_the_dequantized_expert(has_bias, group):
    w = gaussian_expert(rows=64, hidden=128, bias=has_bias, seed=1)
    layout = make_layout(Bits.INT4, w.gate_up.shape, w.down.shape, has_bias, group_size=group)
    assert int4_kernel.unsupported(layout, CPU, BF16) is None
    pool = torch.zeros(2, layout.nbytes + ALIGN, dtype=torch.uint8)  # a slot inside a pool, as the engine has
    blob = pool[1, :layout.nbytes]
    encode(layout, w, hqq.quantize_expert(w, Bits.INT4, group, optimize=False), out=blob)
    ref = dequantize(blob.clone(), layout, BF16)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0)).to(BF16)
    act = lambda h: F.silu(h[:, :64]) * h[:, 64:]  # noqa: E731
    want = F.linear(act(F.linear(x, ref.gate_up, ref.gate_up_bias)), ref.down, ref.down_bias)
    int4_kernel.convert_(blob, layout)
    assert pool[0].count_nonzero() == 0  # nothing written outside the blob
    got = int4_kernel.expert_forward(x, int4_kernel.kernel_weights(blob, layout), act)
    _close(got, want)


def test_what_the_kernel_cannot_run_is_named():
    shapes = ((64, 128), (128, 32))
    ok = make_layout(Bits.INT4, *shapes, False, group_size=32)
    assert "bf16" in int4_kernel.unsupported(ok, CPU, torch.float32)
    assert "CPU" in int4_kernel.unsupported(ok, torch.device("cuda"), BF16)
    assert "group size 16" in int4_kernel.unsupported(make_layout(Bits.INT4, *shapes, False, group_size=16), CPU, BF16)
    assert "multiple of 16" in int4_kernel.unsupported(make_layout(Bits.INT4, (40, 128), (128, 64), False, 32), CPU, BF16)
    assert "not hqq INT4" in int4_kernel.unsupported(make_layout(Bits.INT2, *shapes, False, group_size=32), CPU, BF16)


@pytest.fixture(scope="module")
def kernel_model(tmp_path_factory):
    """A tiny qwen2_moe whose experts fit the kernel (32-wide: groups of 32), and its bf16 INT4 bundle."""
    tmp = tmp_path_factory.mktemp("int4k")
    path = save_tiny("qwen2_moe", tmp / "m", moe_intermediate_size=32)
    quantize(QuantizeConfig(model=str(path), out=tmp / "b", bits=(16, 4, 2), group_size=32, dtype="bfloat16"))
    return path, tmp / "b"


def _logits(path, bundle, policy, budget, **kw):
    lm = load_model(path, dtype=BF16)
    store = HostStore.from_bundle(Bundle.open(bundle, model=lm.fingerprint), BF16)
    engine, plan = build_engine(lm, store, policy, settings={"bits": "4"} if policy == "static" else {},
                                budget=budget, clock="sim", batch=2, **kw)
    with torch.no_grad():
        return lm.model(IDS).logits.float(), engine, plan


@pytest.mark.parametrize("policy,budget", [("static", "100%"), ("dymoe", "40%")])
def test_engine_int4_kernel_matches_the_dequantize_path(kernel_model, policy, budget):
    """Resident INT4 slots, and (dymoe 4/2 at 40%) demand loads, evictions and staged copies, each
    converted as it lands: same results within the stated tolerance, same perplexity within 0.5%,
    same device bytes."""
    path, bundle = kernel_model
    got, engine, plan = _logits(path, bundle, policy, budget)
    want, plain, _ = _logits(path, bundle, policy, budget, int4_kernel=False)
    assert engine.int4_kernel_layers == frozenset(g.index for g in engine.layers) and not plain.int4_kernel_layers
    assert engine.stats.summary()["int4_kernel_layers"] == len(engine.layers)
    _close(got, want)
    ppl = [math.exp(F.cross_entropy(x[:, :-1].reshape(-1, x.shape[-1]), IDS[:, 1:].reshape(-1)).item())
           for x in (got, want)]
    assert abs(ppl[0] - ppl[1]) <= 0.005 * ppl[1]
    s, p = engine.stats.summary(), plain.stats.summary()
    assert s["precision_mix"].get("4", 0) > 0  # INT4 experts really ran
    if policy == "dymoe":
        assert s["hit_rate"] < 1  # and some were loaded (converted) during the forward
    assert s["peak_device_bytes"] == p["peak_device_bytes"] <= plan.total_bytes
    assert s["bytes_h2d"] == p["bytes_h2d"]


def test_eager_and_fp32_engines_keep_dequantizing(kernel_model):
    path, bundle = kernel_model
    _, eager, _ = _logits(path, bundle, "static", "100%", experts_impl="eager")
    assert not eager.int4_kernel_layers
    lm = load_model(path)  # fp32 compute: the kernel's slow path, not used
    engine, _ = build_engine(lm, HostStore.from_bundle(Bundle.open(bundle, model=lm.fingerprint), torch.float32),
                             "static", settings={"bits": "4"}, budget="100%", clock="sim")
    assert not engine.int4_kernel_layers


def test_biases_and_a_custom_gate_go_through_the_kernel_path(tmp_path):
    """gpt_oss: expert biases, transposed checkpoint tensors, its clamped interleaved gate."""
    path = save_tiny("gpt_oss", tmp_path / "m", intermediate_size=32)
    quantize(QuantizeConfig(model=str(path), out=tmp_path / "b", bits=(16, 4), group_size=32, dtype="bfloat16"))
    got, engine, _ = _logits(path, tmp_path / "b", "static", "100%")
    want, _, _ = _logits(path, tmp_path / "b", "static", "100%", int4_kernel=False)
    assert engine.int4_kernel_layers == frozenset(g.index for g in engine.layers)
    _close(got, want)

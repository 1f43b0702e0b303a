"""INT4 and INT2 experts through torch's packed-int4 CPU kernel: the in-place conversion of a bundle
blob, the kernel's result against the dequantized weights, and the engine path against the
dequantize path, under bf16 and fp32 compute.

Stated tolerance: the kernel keeps scale and zero point in bf16, takes bf16 activations (fp32 ones
rounded) and accumulates in its own order, so against the dequantized reference outputs agree within
2% of their largest magnitude; the measured gap is about one or two bf16 rounding steps (~0.5-1%).
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
from moetool.quant.format import ALIGN, Bits, dequantize, encode, make_layout, unpack_2bit_u8, views
from moetool.quant.quantize import QuantizeConfig, quantize
from helpers import KERNEL_IDS as IDS
from helpers import close as _close
from helpers import gaussian_expert
from tiny import save_tiny

CPU, BF16, FP32 = torch.device("cpu"), torch.bfloat16, torch.float32


@pytest.mark.parametrize("bits", [Bits.INT4, Bits.INT2])
@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("has_bias,group", [(False, 32), (True, 64)])
def test_converted_blob_through_the_kernel_equals_the_dequantized_expert(bits, dtype, has_bias, group):
    w = gaussian_expert(rows=64, hidden=128, bias=has_bias, seed=1)
    layout = make_layout(bits, w.gate_up.shape, w.down.shape, has_bias, group_size=group)
    assert int4_kernel.unsupported(layout, CPU, dtype) is None
    pool = torch.zeros(2, layout.nbytes + ALIGN, dtype=torch.uint8)  # a slot inside a pool, as the engine has
    blob = pool[1, :layout.nbytes]
    encode(layout, w, hqq.quantize_expert(w, bits, group, optimize=False), out=blob)
    ref = dequantize(blob.clone(), layout, dtype)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0)).to(dtype)
    act = lambda h: F.silu(h[:, :64]) * h[:, 64:]  # noqa: E731
    want = F.linear(act(F.linear(x, ref.gate_up, ref.gate_up_bias)), ref.down, ref.down_bias)
    int4_kernel.convert_(blob, layout)
    assert pool[0].count_nonzero() == 0  # nothing written outside the blob
    got = int4_kernel.expert_forward(x, int4_kernel.kernel_weights(blob, layout), act)
    _close(got, want)


@pytest.mark.parametrize("shape", [(64, 128), (128, 96), (576, 32)])
def test_int2_codes_expand_to_the_kernels_own_packing(shape):
    """The reordered INT2 bytes, expanded, are byte for byte what the conversion op makes of the codes
    (raised by INT2_BASE): the packed order read off the op (`_pack_order`) is the op's."""
    n, k = shape
    w = gaussian_expert(rows=n // 2, hidden=k, bias=False, seed=2)  # gate_up [n, k]
    layout = make_layout(Bits.INT2, w.gate_up.shape, w.down.shape, False, group_size=32)
    blob = torch.zeros(layout.nbytes, dtype=torch.uint8)
    encode(layout, w, hqq.quantize_expert(w, Bits.INT2, 32, optimize=False), out=blob)
    proj = layout.projections[0]
    codes = torch.empty(proj.grouped_shape(), dtype=torch.uint8)
    unpack_2bit_u8(views(blob, layout)["gate_up.q"], codes)
    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.view(n, k).to(torch.int32) + int4_kernel.INT2_BASE, 8)
    int4_kernel.convert_(blob, layout)
    got = int4_kernel.kernel_weights(blob, layout)
    assert got.int2 and got.gate_up[0].shape == (n, k // 4)  # still INT2's bytes in the slot
    assert torch.equal(int4_kernel.expand(got.gate_up[0]), want.view(n, k // 2))


def test_what_the_kernel_cannot_run_is_named():
    shapes = ((64, 128), (128, 32))
    ok = make_layout(Bits.INT4, *shapes, False, group_size=32)
    assert int4_kernel.unsupported(ok, CPU, FP32) is None and int4_kernel.unsupported(ok, CPU, BF16) is None
    assert "float16" in int4_kernel.unsupported(ok, CPU, torch.float16)
    assert "CPU" in int4_kernel.unsupported(ok, torch.device("cuda"), BF16)
    assert "group size 16" in int4_kernel.unsupported(make_layout(Bits.INT4, *shapes, False, group_size=16), CPU, BF16)
    assert "multiple of 16" in int4_kernel.unsupported(make_layout(Bits.INT4, (40, 128), (128, 64), False, 32), CPU, BF16)
    assert int4_kernel.unsupported(make_layout(Bits.INT2, *shapes, False, group_size=32), CPU, BF16) is None
    assert "not hqq INT4 or INT2" in int4_kernel.unsupported(make_layout(Bits.INT8, *shapes, False, group_size=32), CPU, BF16)


@pytest.fixture(scope="module")
def kernel_model(tmp_path_factory):
    """A tiny qwen2_moe whose experts fit the kernel (32-wide: groups of 32), and its bf16 INT4/INT2 bundle."""
    tmp = tmp_path_factory.mktemp("int4k")
    path = save_tiny("qwen2_moe", tmp / "m", moe_intermediate_size=32)
    quantize(QuantizeConfig(model=str(path), out=tmp / "b", bits=(16, 4, 2), group_size=32, dtype="bfloat16"))
    return path, tmp / "b"


@pytest.fixture(scope="module")
def wide_kernel_model(tmp_path_factory):
    """As `kernel_model`, with every projection's rows a multiple of 128 (hidden 128, experts 64 wide):
    the kernel packs rows in blocks whose size depends on the CPU (64 with AVX-512, smaller on AVX2),
    and experts fuse only where each projection fills whole blocks (`int4_kernel.fusable`)."""
    tmp = tmp_path_factory.mktemp("int4w")
    path = save_tiny("qwen2_moe", tmp / "m", hidden_size=128, moe_intermediate_size=64)
    quantize(QuantizeConfig(model=str(path), out=tmp / "b", bits=(16, 4, 2), group_size=32, dtype="bfloat16"))
    return path, tmp / "b"


def _logits(path, bundle, policy, budget, dtype=BF16, settings=None, **kw):
    lm = load_model(path, dtype=dtype)
    store = HostStore.from_bundle(Bundle.open(bundle, model=lm.fingerprint), dtype)
    settings = settings if settings is not None else {"bits": "4"} if policy == "static" else {}
    engine, plan = build_engine(lm, store, policy, settings=settings, budget=budget, clock="sim", batch=2, **kw)
    with torch.no_grad():
        return lm.model(IDS).logits.float(), engine, plan


@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("policy,settings,budget", [("static", {"bits": "4"}, "100%"), ("static", {"bits": "2"}, "100%"),
                                                    ("dymoe", {}, "40%")])
def test_engine_int4_kernel_matches_the_dequantize_path(kernel_model, dtype, policy, settings, budget, monkeypatch):
    """Resident INT4 and INT2 slots, and (dymoe 4/2 at 40%) demand loads, evictions and staged copies,
    each converted as it lands, under bf16 and fp32 compute: same results within the stated
    tolerance, same perplexity within 0.5%, same device bytes. Several tokens a layer: the pool's
    converted experts are decoded from the kernel's layout for grouped GEMMs."""
    path, bundle = kernel_model
    decoded = []
    decode = int4_kernel.decode
    monkeypatch.setattr(int4_kernel, "decode", lambda *a, **k: decoded.append(a[0].shape[0]) or decode(*a, **k))
    got, engine, plan = _logits(path, bundle, policy, budget, dtype, settings)
    assert decoded  # the prefill's kernel experts went through grouped GEMMs
    want, plain, _ = _logits(path, bundle, policy, budget, dtype, settings, kernels=False)
    every = frozenset(g.index for g in engine.layers)
    assert engine.kernel_layers == {4: every, 2: every} and not plain.kernel_layers
    assert engine.stats.summary()["kernel_layers"] == {"4": len(every), "2": len(every)}
    _close(got, want)
    ppl = [math.exp(F.cross_entropy(x[:, :-1].reshape(-1, x.shape[-1]), IDS[:, 1:].reshape(-1)).item())
           for x in (got, want)]
    assert abs(ppl[0] - ppl[1]) <= 0.005 * ppl[1]
    s, p = engine.stats.summary(), plain.stats.summary()
    for bits in ({"4"} if settings.get("bits") == "4" else {"2"} if settings else {"4", "2"}):
        assert s["precision_mix"].get(bits, 0) > 0  # experts at these bits really ran
    if policy == "dymoe":
        assert s["hit_rate"] < 1  # and some were loaded (converted) during the forward
    assert s["peak_device_bytes"] == p["peak_device_bytes"] <= plan.total_bytes
    assert s["bytes_h2d"] == p["bytes_h2d"]


def test_the_eager_path_keeps_dequantizing(kernel_model):
    path, bundle = kernel_model
    _, eager, _ = _logits(path, bundle, "static", "100%", experts_impl="eager")
    assert not eager.kernel_layers


def test_biases_and_a_custom_gate_go_through_the_kernel_path(tmp_path):
    """gpt_oss: expert biases, transposed checkpoint tensors, its clamped interleaved gate. Its
    expert biases made large (a fresh model's are zeros), so losing them anywhere, single-token
    kernel calls or the prompt's decoded experts, fails the tolerance."""
    from transformers import AutoModelForCausalLM

    path = save_tiny("gpt_oss", tmp_path / "m", intermediate_size=32)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        biases = [p for n, p in model.named_parameters() if ".experts." in n and n.endswith("bias")]
        assert biases
        for p in biases:
            p.normal_(0, 1.0, generator=torch.Generator().manual_seed(p.numel()))
    model.save_pretrained(path)
    quantize(QuantizeConfig(model=str(path), out=tmp_path / "b", bits=(16, 4), group_size=32, dtype="bfloat16"))
    got, engine, _ = _logits(path, tmp_path / "b", "static", "100%")
    want, _, _ = _logits(path, tmp_path / "b", "static", "100%", kernels=False)
    assert engine.kernel_layers[4] == frozenset(g.index for g in engine.layers)
    _close(got, want)


@pytest.mark.parametrize("bits", [Bits.INT4, Bits.INT2])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_one_token_through_stacked_experts_equals_the_weighted_sum_of_each(bits, dtype):
    """fused_forward (gate_up stacked along rows, down along input columns, one kernel call each)
    against each expert through the kernel alone, weighted and summed."""
    n, gen = 5, torch.Generator().manual_seed(3)
    experts = [gaussian_expert(rows=64, hidden=128, bias=False, seed=10 + i) for i in range(n)]
    layout = make_layout(bits, experts[0].gate_up.shape, experts[0].down.shape, False, group_size=32)
    assert int4_kernel.fusable(layout, n)
    pool = torch.zeros(n + 1, layout.nbytes, dtype=torch.uint8)
    for i, w in enumerate(experts):
        encode(layout, w, hqq.quantize_expert(w, bits, 32, optimize=False), out=pool[i + 1])
        int4_kernel.convert_(pool[i + 1], layout)
    slots = [4, 1, 3, 2, 5]  # pool order is not expert order
    x = torch.randn(1, 128, generator=gen).to(dtype)
    weight = torch.rand(n, generator=gen).to(dtype)
    act = lambda h: F.silu(h[:, :64]) * h[:, 64:]  # noqa: E731
    want = sum(weight[i].float() * int4_kernel.expert_forward(x, int4_kernel.kernel_weights(pool[s], layout), act).float()
               for i, s in enumerate(slots))
    per = []
    for proj in layout.projections:
        n_out, k = proj.shape
        q, sc = layout.part(f"{proj.name}.q"), layout.part(f"{proj.name}.scale")
        codes = torch.stack([pool[s, q.offset:q.offset + q.nbytes] for s in slots]).view(n, n_out, -1)
        sz = torch.stack([pool[s, sc.offset:sc.offset + 2 * sc.nbytes] for s in slots])
        per.append((int4_kernel.expand(codes) if bits == Bits.INT2 else codes, 32,
                    sz.view(torch.bfloat16).view(n, k // 32, n_out, 2)))
    got = int4_kernel.fused_forward(x, per[0], per[1], weight, act)
    _close(got, want)


@pytest.mark.parametrize("shape", [(64, 128), (128, 96), (576, 32), (96, 256), (48, 64), (192, 64), (80, 32)])
def test_the_block_form_read_pass_by_pass_is_the_one_in_the_ops_full_pack_order(shape):
    """block_rows reads the block form off the op four bits of row and column index at a time, holding
    no index tensors; the op's full pack order (`_pack_order`, every weight's index) shows the same."""
    n, k = shape
    lo, hi = int4_kernel._pack_order(n, k)
    want = None
    for b in (16, 32, 64, 128):
        if n % b:
            continue
        blk, col, j = torch.arange(n // b).view(-1, 1, 1), torch.arange(k).view(1, -1, 1), torch.arange(b // 2)
        if torch.equal(lo, ((blk * b + j) * k + col).reshape(-1)) and \
                torch.equal(hi, ((blk * b + j + b // 2) * k + col).reshape(-1)):
            want = b
            break
    assert int4_kernel.block_rows(n, k) == want


def test_what_does_not_stack_is_named():
    shapes = ((64, 128), (128, 32))
    assert int4_kernel.block_rows(64, 128) is not None  # the kernel's packing on this CPU is in block form
    assert not int4_kernel.fusable(make_layout(Bits.INT4, *shapes, True, group_size=32), 4)  # biases: per expert


def test_decode_steps_run_each_layers_kernel_experts_in_one_call(wide_kernel_model, monkeypatch):
    """Greedy decode, batch 1 (one token a step): every MoE layer's INT4 and INT2 experts (dymoe 4/2)
    go through fused_forward, and each step's logits match the dequantize path within the stated
    tolerance."""
    path, bundle = wide_kernel_model
    calls = []
    fused = int4_kernel.fused_forward
    monkeypatch.setattr(int4_kernel, "fused_forward", lambda *a: calls.append(a[1][0].shape[0]) or fused(*a))
    runs = []
    for kernel in (True, False):
        lm = load_model(path, dtype=FP32)
        store = HostStore.from_bundle(Bundle.open(bundle, model=lm.fingerprint), FP32)
        engine, _ = build_engine(lm, store, "dymoe", budget="100%", clock="sim", kernels=kernel)
        with torch.no_grad():
            out = lm.model.generate(IDS[:1], max_new_tokens=4, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True)
        runs.append((out, engine))
    (got, engine), (want, _) = runs
    layers = len(engine.layers)
    assert engine.fused_layers == engine.kernel_layers
    assert len(calls) >= 3 * layers  # the 3 decode steps after the prompt, every layer at least once
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.logits, want.logits):
        _close(g, w)


@pytest.mark.parametrize("bits", [Bits.INT4, Bits.INT2])
@pytest.mark.parametrize("blocked", [True, False])
def test_decoding_the_kernel_layout_gives_the_dequantized_weights(bits, blocked, monkeypatch):
    """int4_kernel.decode (several tokens' path) on converted blobs against hqq's dequantize: equal
    up to the bf16 rounding of scale and zero point (within 1% of the largest weight), by the block
    form's reshapes and by the scatter kept for any other packing."""
    if not blocked:
        monkeypatch.setattr(int4_kernel, "block_rows", lambda n, k: None)
    experts = [gaussian_expert(rows=64, hidden=128, bias=False, seed=20 + i) for i in range(3)]
    layout = make_layout(bits, experts[0].gate_up.shape, experts[0].down.shape, False, group_size=32)
    pool = torch.zeros(3, layout.nbytes, dtype=torch.uint8)
    want = []
    for i, w in enumerate(experts):
        encode(layout, w, hqq.quantize_expert(w, bits, 32, optimize=False), out=pool[i])
        want.append(dequantize(pool[i].clone(), layout, FP32))
        int4_kernel.convert_(pool[i], layout)
    for proj in layout.projections:
        n_out, k = proj.shape
        q, sc = layout.part(f"{proj.name}.q"), layout.part(f"{proj.name}.scale")
        codes = pool[:, q.offset:q.offset + q.nbytes].reshape(3, n_out, -1)
        sz = pool[:, sc.offset:sc.offset + 2 * sc.nbytes].contiguous().view(torch.bfloat16).view(3, k // 32, n_out, 2)
        if bits == Bits.INT2:  # from its 2-bit codes as they lie, and expanded first: the same weights
            got = int4_kernel.decode(codes, 32, sz, FP32, int2=True)
            assert torch.equal(got, int4_kernel.decode(int4_kernel.expand(codes), 32, sz, FP32))
        else:
            got = int4_kernel.decode(codes, 32, sz, FP32)
        for i in range(3):
            _close(got[i], getattr(want[i], proj.name), share=0.01)

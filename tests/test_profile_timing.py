"""`profile --what timing` times each precision's expert on the path the engine runs it on for a
decode token on this device (`profile.timing.expert_path`), and the call it times computes the
layer's experts: a profile that timed another path would calibrate the sim clock to a cost no run
pays (the dequantize path's INT4 expert took 24x the fused kernel's time on an H200).

Tolerance for the CPU kernels' calls: the low-bit kernels' stated 2% of the largest magnitude
(tests/test_int4_kernel.py), against the dequantized weights in fp32."""

import pytest
import torch

from moetool.engine import build_engine
from moetool.engine.store import HostStore
from moetool.errors import MoetoolError
from moetool.kernels import activation_of
from moetool.model import load_model
from moetool.profile import _timing_blobs
from moetool.profile.timing import PATHS, expert_path, expert_timings, path_call
from moetool.quant.bundle import Bundle
from moetool.quant.format import dequantize
from moetool.quant.quantize import QuantizeConfig, quantize
from helpers import close
from tiny import save_tiny

BF16, FP32 = torch.bfloat16, torch.float32


# Experts every CPU kernel takes (rows multiples of 128, groups of 32, per-channel INT8): qwen2_moe's
# run fused over the top-k, gpt_oss's (biased, clamped) one expert a call.
MODELS = {"qwen2_moe": dict(hidden_size=128, moe_intermediate_size=64),
          "gpt_oss": dict(hidden_size=128, intermediate_size=64)}


@pytest.fixture(scope="module", params=list(MODELS))
def kernel_bundle(tmp_path_factory, request):
    """A tiny model and its 16/8/4/2-bit bundle."""
    tmp = tmp_path_factory.mktemp("timing")
    path = save_tiny(request.param, tmp / "m", **MODELS[request.param])
    quantize(QuantizeConfig(model=str(path), out=tmp / "b", bits=(16, 8, 4, 2), group_size=32, dtype="bfloat16",
                            int8_per_channel=True))
    return path, tmp / "b"


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_each_precision_is_timed_on_the_path_the_engine_takes(kernel_bundle, dtype):
    path, bundle = kernel_bundle
    lm = load_model(path, dtype=dtype)
    b = Bundle.open(bundle, model=lm.fingerprint)
    timings = {e.bits: e for e in expert_timings(lm, _timing_blobs(lm, b))}
    engine, _ = build_engine(lm, HostStore.from_bundle(b, dtype), "resident", budget="100%")
    layer = lm.geometry.layers[0].index
    for bits, e in timings.items():
        if layer in engine.kernel_layers.get(bits, ()):
            want = ("int8-cpu" if bits == 8 else "int4-cpu") + ("-fused" if layer in engine.fused_layers[bits] else "")
        else:
            want = "grouped"
        assert e.path == want, f"{bits}-bit expert timed on {e.path}, the engine runs {want}"
        assert e.path in PATHS and e.compute_s > 0
        assert (e.dequant_s > 0) == (e.path == "grouped") and (e.convert_s > 0) == (e.path != "grouped")
    assert all(timings[b].path.startswith(("int8-cpu", "int4-cpu")) for b in (8, 4, 2))  # the kernels were timed


@pytest.mark.parametrize("bits", [16, 8, 4, 2])
def test_the_timed_call_computes_the_layers_experts(kernel_bundle, bits):
    """Each path's call returns sum_i w_i expert_i(x) over the top-k copies, as the engine adds a
    layer's experts, and leaves the profiled blob as it was."""
    path, bundle = kernel_bundle
    lm = load_model(path, dtype=BF16)
    blob, layout = _timing_blobs(lm, Bundle.open(bundle, model=lm.fingerprint))[bits]
    g = lm.geometry.layers[0]
    module = lm.model.get_submodule(g.path).experts
    act = activation_of(module)
    route = expert_path(layout, act, bits, g.top_k, torch.device("cpu"), BF16, captured=True)
    x = torch.randn(1, g.hidden_size, generator=torch.Generator().manual_seed(0)).to(BF16)
    weight = torch.softmax(torch.randn(1, g.top_k, generator=torch.Generator().manual_seed(1)), -1).to(BF16)
    before = blob.clone()
    call, _, _ = path_call(route, module, act, blob, layout, bits, x, weight)
    got = call()
    assert torch.equal(blob, before)
    w = dequantize(blob, layout, FP32)
    want = weight.float().sum() * module.expert_forward(x.float(), w)  # k copies of one expert
    assert got.shape == (1, g.hidden_size) and got.dtype == BF16
    close(got, want)


def test_on_cuda_the_kernels_take_low_bits_and_the_captured_steps_reference_precision(kernel_bundle):
    """The path on a CUDA device (asked of the predicates only: no device needed): the Triton kernels
    for INT8/INT4/INT2 on either decode path, for bf16 where the captured step runs (it reads every
    precision through them), grouped GEMMs for bf16 on the host path."""
    path, bundle = kernel_bundle
    lm = load_model(path, dtype=BF16)
    blobs = _timing_blobs(lm, Bundle.open(bundle, model=lm.fingerprint))
    g = lm.geometry.layers[0]
    act = activation_of(lm.model.get_submodule(g.path).experts)
    cuda = torch.device("cuda")
    for bits, (_, layout) in blobs.items():
        for captured in (True, False):
            want = "grouped" if bits == 16 and not captured else "triton"
            assert expert_path(layout, act, bits, g.top_k, cuda, BF16, captured) == want


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_c_cpu_times_the_reference_expert_decoded_and_run_on_the_host_in_the_runs_dtype(kernel_bundle, dtype,
                                                                                         monkeypatch):
    """SMoE's C_CPU as the engine's CPU-assisted experts pay it: the reference blob decoded on the host
    in the compute dtype (bf16 on a GPU run), then the block's MLP, and that expert's own output."""
    from moetool.profile.timing import c_cpu

    path, bundle = kernel_bundle
    lm = load_model(path, dtype=dtype)
    blobs = _timing_blobs(lm, Bundle.open(bundle, model=lm.fingerprint))
    module = lm.model.get_submodule(lm.geometry.layers[0].path).experts
    seen, forward = [], module.expert_forward

    def spy(x, w):
        y = forward(x, w)
        seen.append((x.dtype, w.gate_up.dtype, w.gate_up.device.type, x, y))
        return y

    monkeypatch.setattr(module, "expert_forward", spy)
    assert c_cpu(lm, blobs) > 0
    assert {s[:3] for s in seen} == {(dtype, dtype, "cpu")}
    blob, layout = blobs[16]
    x, y = seen[-1][3:]
    assert torch.equal(y, forward(x, dequantize(blob, layout, dtype)))  # the reference-precision expert itself


def test_the_captured_steps_dense_time_is_measured_and_the_sim_clock_charges_it_there(kernel_bundle, tmp_path):
    """`captured_dense`: the captured step with every expert resident less its experts' timed cost,
    per MoE layer; written to the hardware profile as t_dense_captured_s, which the simulated clock
    charges each layer of a captured step (and t_dense_s on the host path): two profiles that differ
    only there give captured steps that differ by layers x the difference, host steps that do not."""
    import json

    from moetool.engine import measured_on
    from moetool.engine.decode import DecodeProgram
    from moetool.engine.store import HostStore
    from moetool.profile.timing import TimingProfile, captured_dense, hw_profile

    path, bundle = kernel_bundle
    lm = load_model(path, dtype=FP32)
    b = Bundle.open(bundle, model=lm.fingerprint)
    store = HostStore.from_bundle(b, FP32)
    ids = torch.arange(8).view(1, -1)
    timings = expert_timings(lm, _timing_blobs(lm, b))
    dense, note = captured_dense(lm, store, ids, 3, {e.bits: e.compute_s for e in timings}, backend="eager")
    assert dense is not None and dense >= 0 and "static at 2 bits" in note
    t = TimingProfile(device="cpu", dtype="float32", steps=3, layers=(), experts=timings, c_cpu_s=1e-4,
                      h2d_gbps=None, t_dense_s=1e-3, t_dense_captured_s=dense, captured_note=note)
    hw = hw_profile(t, "rtx3090", "measured", model=measured_on(lm))
    assert hw["t_dense_captured_s"] == dense and note in hw["sources"]["t_dense_captured_s"]
    step = {}
    for name, value in (("low", 1e-4), ("high", 6e-4)):
        (tmp_path / f"{name}.json").write_text(json.dumps({**hw, "t_dense_captured_s": value}))
        for captured in (True, False):
            lm = load_model(path, dtype=FP32)
            engine, _ = build_engine(lm, HostStore.from_bundle(b, FP32), "resident", budget="100%", clock="sim",
                                     hw=str(tmp_path / f"{name}.json"), captured=captured, max_tokens=16)
            with torch.no_grad():
                if captured:
                    DecodeProgram(engine, max_tokens=16, backend="eager").generate(ids, 4)
                else:
                    lm.model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
            step[name, captured] = [x.seconds for x in engine.stats.steps if x.phase == "decode"]
    layers = len(lm.geometry.layers)
    for low, high in zip(step["low", True], step["high", True]):
        assert high - low == pytest.approx(layers * 5e-4)
    assert step["low", False] == step["high", False]


@pytest.mark.parametrize("arch", ["granitemoehybrid", "qwen3_next"])
def test_a_layers_time_outside_its_moe_block_is_its_mixers_whatever_it_is(tmp_path, arch):
    """Only `self_attn` was timed: a hybrid's Mamba layers hold `self_attn = None` (a traceback), and
    linear-attention layers timed 0, so the dense time and Fate's window left their mixers out."""
    from moetool.profile.timing import layer_timings

    lm = load_model(save_tiny(arch, tmp_path / arch))
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    timings = layer_timings(lm, ids, steps=2)
    assert [t.layer for t in timings] == [g.index for g in lm.geometry.layers]
    assert all(t.t_attn > 0 and t.t_moe > 0 for t in timings)


def test_timing_decodes_inside_the_models_positions(tmp_path):
    """The timing part prefilled 32 tokens and decoded 10 more whatever the model's context: on a model
    of 16 positions it fed position 40 where every other stage refuses. Its prompt is cut to fit, and
    a context with no room for its decode steps is refused in one sentence."""
    from moetool.profile import ProfileConfig, profile

    seen = []
    path = save_tiny("qwen3_moe", tmp_path / "q16", max_position_embeddings=16)
    lm_cls = load_model(path).model.model.rotary_emb.__class__
    real = lm_cls.forward
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lm_cls, "forward", lambda self, x, position_ids, *a, **k: seen.append(int(position_ids.max()))
                   or real(self, x, position_ids, *a, **k))
        got = profile(ProfileConfig(model=str(path), data=("heldout",), seqs_per_data=1, seq_len=8, what=("timing",)))
    assert got.timing is not None and 8 <= max(seen) < 16  # a prompt cut to 6 tokens, and its decode steps after it
    with pytest.raises(MoetoolError, match=r"--what timing decodes 10 tokens after its prompt, and .* context of 10 "):
        profile(ProfileConfig(model=str(save_tiny("qwen3_moe", tmp_path / "q10", max_position_embeddings=10)),
                              data=("heldout",), seqs_per_data=1, seq_len=8, what=("timing",)))

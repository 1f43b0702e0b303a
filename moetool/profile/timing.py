"""Timings on this machine: per layer t_attn, t_gate, t_moe in decode; per precision the load, dequant
and compute time of one expert; C_CPU (SMoE); host-to-device bandwidth (CUDA only).

An expert is timed on the path the engine runs it on for a decode token on this device
(`expert_path`): the fused Triton kernels on CUDA (inside a CUDA graph, as the captured step
replays them), torch's INT4/INT8 CPU kernels where they take the layout, else dequantize then one
grouped GEMM. A profile that timed another path would calibrate the sim clock to a cost no run pays
(on an H200 a dequantized INT4 expert takes 24x the kernel's time, docs/benchmarks.md).

`hw_profile` turns them into a hardware profile JSON for `moetool run --clock sim --hw FILE`: the
measured `t_dense_s`, `t_expert_s` and `c_cpu_s` (and `h2d_gbps` on CUDA) over a shipped preset's
throughputs, each field's origin written in `sources`.

    t = measure_timing(lm, blobs, ids, steps=8)
    json.dumps(hw_profile(t, base="rtx3090", name="demo-cpu", model=measured_on(lm)))
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from moetool.engine.clock import load_hw
from moetool.inference import with_cache
from moetool.model import LoadedModel
from moetool.profile_artifact import ExpertTiming, LayerTiming, TimingProfile

REPEATS = 15
H2D_BYTES = 64 << 20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, repeats: int = REPEATS) -> float:
    """Median seconds of `fn` over `repeats` runs after one warm-up."""
    fn()
    out = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


@torch.no_grad()
def layer_timings(lm: LoadedModel, ids: torch.Tensor, steps: int) -> tuple[LayerTiming, ...]:
    """Medians over `steps` greedy decode steps (after a prefill of `ids` and one untimed step)."""
    device = next(lm.model.parameters()).device
    starts: dict[tuple[str, int], float] = {}
    samples: dict[tuple[str, int], list[float]] = {}
    recording = [False]
    hooks = []

    def around(module: torch.nn.Module, kind: str, layer: int) -> None:
        def pre(*_):
            if recording[0]:
                _sync(device)
                starts[kind, layer] = time.perf_counter()

        def post(*_):
            if recording[0]:
                _sync(device)
                samples.setdefault((kind, layer), []).append(time.perf_counter() - starts[kind, layer])

        hooks.append(module.register_forward_pre_hook(pre))
        hooks.append(module.register_forward_hook(post))

    for g in lm.geometry.layers:
        block = lm.model.get_submodule(g.path)
        # The decoder layer whole: its time outside the MoE block is its mixer's, whatever it is (self-attention,
        # Mamba, linear attention; a `self_attn` of None on a hybrid's Mamba layers), with its norms.
        around(lm.model.get_submodule(g.path.rsplit(".", 1)[0]), "layer", g.index)
        around(block.get_submodule(g.router), "gate", g.index)
        around(block, "moe", g.index)
        around(block.experts, "experts", g.index)
    try:
        # The same prefill and steps twice, timed the second time: kernels that plan per shape (cuDNN
        # graphs, cuBLAS heuristics) meet every sequence length in the first pass, as a long run would.
        for timed_pass in (False, True):
            out = lm.model(input_ids=ids.to(device), use_cache=True)
            for step in range(steps + 1):
                recording[0] = timed_pass and step > 0  # the first decode step warms caches and allocators
                nxt = out.logits[:, -1:].argmax(-1)
                out = lm.model(input_ids=nxt, use_cache=True, **with_cache(lm.model, out.past_key_values))
    finally:
        for h in hooks:
            h.remove()

    def med(kind: str, layer: int) -> float:
        return statistics.median(samples.get((kind, layer), [0.0]))

    return tuple(LayerTiming(layer=g.index, t_attn=max(0.0, med("layer", g.index) - med("moe", g.index)),
                             t_gate=med("gate", g.index),
                             t_moe=med("moe", g.index), t_experts=med("experts", g.index))
                 for g in lm.geometry.layers)


# The engine's paths for one decode token's experts at one precision (`expert_path`).
PATHS = {
    "triton": "the fused Triton experts kernels, codes read as stored, timed in a CUDA graph",
    "int4-cpu-fused": "torch's packed-int4 CPU kernel, the top-k experts in one call a projection",
    "int4-cpu": "torch's packed-int4 CPU kernel, one expert a call",
    "int8-cpu-fused": "torch's int8 weight-only CPU kernel, gate_up of the top-k in one call",
    "int8-cpu": "torch's int8 weight-only CPU kernel, one expert a call",
    "grouped": "dequantized (bf16: read as stored), one grouped GEMM a projection over the top-k",
}


def expert_path(layout: Any, activation: Any, bits: int, top_k: int, device: torch.device, dtype: torch.dtype,
                captured: bool) -> str:
    """The path (`PATHS`) the engine takes for one decode token's experts of `layout` at `bits` on
    `device`, from the same predicates it asks at build time: the Triton kernels on CUDA where they
    take the layout (low bits on either decode path; the reference precision too when `captured`,
    the step `--decode auto` takes there, engine/decode.py), torch's CPU kernels where they take it
    (`quant.kernels.layers_on_kernel`, fused over the top-k where `fusable`), else grouped GEMMs."""
    from moetool.quant import int4_kernel, int8_kernel
    from moetool.quant.kernels import MODULES

    if device.type == "cuda" and (bits != 16 or captured):
        from moetool.kernels import supported

        if supported(layout, activation, device) is None:
            return "triton"
    module = MODULES.get(bits)
    if module is not None and module.unsupported(layout, device, dtype) is None:
        name = "int4-cpu" if module is int4_kernel else "int8-cpu"
        fused = int4_kernel.fusable(layout, top_k) if module is int4_kernel else int8_kernel.fusable(layout)
        return f"{name}-fused" if fused else name
    return "grouped"


@torch.no_grad()
def expert_timings(lm: LoadedModel, blobs: dict[int, tuple[torch.Tensor, Any]]) -> tuple[ExpertTiming, ...]:
    """Per precision: copy `blob` to the device, then one token through the layer's top-k copies of
    it on the engine's path for this device (`expert_path`), per expert.

    `blobs` maps bits -> (host uint8 blob, quant.format.Layout) of one expert of the first MoE layer.
    """
    from moetool.engine.decode import VERIFIED_MODEL_TYPES
    from moetool.kernels import activation_of

    p = next(lm.model.parameters())
    device, dtype = p.device, p.dtype
    g = lm.geometry.layers[0]
    module = lm.model.get_submodule(g.path).experts
    activation = activation_of(module)
    captured = lm.fingerprint.model_type in VERIFIED_MODEL_TYPES
    x = torch.randn(1, g.hidden_size, device=device, dtype=dtype)  # [1, H]
    weight = torch.full((1, g.top_k), 1.0 / g.top_k, device=device, dtype=dtype)  # [1, k] routing weights
    out = []
    for bits, (blob, layout) in sorted(blobs.items(), reverse=True):
        src = blob.pin_memory() if device.type == "cuda" else blob
        dst = torch.empty_like(src, device=device)
        load = timed(lambda: dst.copy_(src, non_blocking=True), device)
        path = expert_path(layout, activation, int(bits), g.top_k, device, dtype, captured)
        call, deq, convert = path_call(path, module, activation, dst, layout, int(bits), x, weight)
        per_call = graph_timed(call, device) if path == "triton" else timed(call, device)
        out.append(ExpertTiming(bits=int(bits), nbytes=int(blob.numel()), load_s=load, dequant_s=deq,
                                compute_s=per_call / g.top_k, path=path, convert_s=convert))
    return tuple(out)


def path_call(path: str, module: torch.nn.Module, activation: Any, blob: torch.Tensor, layout: Any, bits: int,
              x: torch.Tensor, weight: torch.Tensor) -> tuple[Callable[[], torch.Tensor], float, float]:
    """(call, dequant seconds, convert seconds) for one token `x` [1, H] through k = weight.shape[1]
    copies of the expert `blob` (on the device) on `path`. The call returns the weighted sum over
    the k experts [1, H] in x's dtype, as the engine's layer adds it; the copies sit in a pool of k
    slots, as the residency holds experts. `blob` is left as it was."""
    from moetool.quant.format import dequantize_into, empty_weights
    from moetool.quant.kernels import MODULES

    k, device, dtype = weight.shape[1], blob.device, x.dtype
    pool = blob.unsqueeze(0).repeat(k, 1) if path != "grouped" else None  # [k, blob bytes]: k slots
    if path == "triton":
        from moetool.kernels import SlotPool, experts_forward

        slots = SlotPool(pool, layout, torch.arange(k, dtype=torch.int32, device=device).view(1, k))
        return (lambda: experts_forward(x, weight, [slots], activation)), 0.0, 0.0
    if path != "grouped":
        kernel = MODULES[bits]
        convert = timed(lambda: kernel.convert_(blob.clone(), layout), device, repeats=3)
        for row in pool:
            kernel.convert_(row, layout)  # as a blob lands in a CPU pool slot (engine/loads.py)
        ws = [kernel.kernel_weights(row, layout) for row in pool]
        if path.endswith("-fused"):
            gate_up, down = (_stacked([getattr(w, name) for w in ws], bits) for name in ("gate_up", "down"))
            flat = weight.view(-1)
            return (lambda: kernel.fused_forward(x, gate_up, down, flat, module.activation).to(dtype)), 0.0, convert

        def per_expert() -> torch.Tensor:
            return sum(w_i * kernel.expert_forward(x, w, module.activation).to(dtype)
                       for w_i, w in zip(weight.view(-1), ws))
        return per_expert, 0.0, convert
    from moetool.engine.groups import grouped_mlp
    from moetool.quant.format import ExpertStack

    w = empty_weights(layout, dtype, device)
    deq = timed(lambda: dequantize_into(blob, layout, w), device)
    stack = ExpertStack(*(None if t is None else t.unsqueeze(0).expand(k, *t.shape).contiguous()
                          for t in (w.gate_up, w.down, w.gate_up_bias, w.down_bias)))
    rows = x.expand(k, -1).contiguous()  # [k, H]: one row per expert, as the engine gathers a token's
    offs = torch.arange(1, k + 1, dtype=torch.int32, device=device)
    return (lambda: (grouped_mlp(module, rows, stack, offs, [1] * k) * weight.view(k, 1)).sum(0, keepdim=True)), \
        deq, 0.0


def _stacked(per_expert: list[tuple], bits: int) -> tuple:
    """One projection's kernel tensors of k converted experts, stacked as the engine's pool views
    hand them to `fused_forward` (`engine.weights.PoolWeights.kernel_stack`, `int8_stack`)."""
    from moetool.quant import int4_kernel

    if bits == 8:
        codes, scale, offset = zip(*per_expert)
        return torch.stack(codes), torch.stack(scale), torch.stack(offset)
    codes, group, sz = zip(*per_expert)
    stacked = torch.stack(codes)
    return (int4_kernel.expand(stacked) if bits == 2 else stacked), group[0], torch.stack(sz)


def graph_timed(fn: Callable[[], Any], device: torch.device, repeats: int = REPEATS) -> float:
    """Median seconds of `fn` replayed from one CUDA graph (what the captured decode step pays: no
    launch from the host), after an eager warm-up that compiles its kernels; `timed` off CUDA."""
    if device.type != "cuda":
        return timed(fn, device, repeats)
    fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timed(graph.replay, device, repeats)


@torch.no_grad()
def c_cpu(lm: LoadedModel, blobs: dict[int, tuple[torch.Tensor, Any]]) -> float:
    """SMoE's C_CPU: one token through one expert on the host, as the engine's CPU-assisted experts
    run it (`engine.runtime._compute_on_host`): the reference-precision blob decoded on the host in
    the run's compute dtype (bf16 on a GPU run: a host without native bf16 pays for it), then the
    block's own MLP. `blobs` as `expert_timings` takes them."""
    from moetool.quant.format import dequantize_into, empty_weights

    g = lm.geometry.layers[0]
    module = lm.model.get_submodule(g.path).experts
    dtype, cpu = next(lm.model.parameters()).dtype, torch.device("cpu")
    blob, layout = blobs[max(blobs)]
    blob = blob.to(cpu)
    w = empty_weights(layout, dtype, cpu)
    x = torch.randn(1, g.hidden_size, dtype=dtype)  # [1, H]; the activation holds no weights, so it runs on the host too
    return timed(lambda: module.expert_forward(x, dequantize_into(blob, layout, w)), cpu)


def h2d_bandwidth(device: torch.device) -> float | None:
    """Pinned host -> device copy bandwidth in GB/s (10^9 bytes), None off CUDA."""
    if device.type != "cuda":
        return None
    src = torch.empty(H2D_BYTES, dtype=torch.uint8).pin_memory()
    dst = torch.empty(H2D_BYTES, dtype=torch.uint8, device=device)
    return H2D_BYTES / timed(lambda: dst.copy_(src, non_blocking=True), device, repeats=10) / 1e9


def measure_timing(lm: LoadedModel, blobs: dict[int, tuple[torch.Tensor, Any]], ids: torch.Tensor,
                   steps: int = 8, store: Any = None, backend: str | None = None) -> TimingProfile:
    """The timings of `lm` on its device. With `store` (the run's HostStore), also the captured
    step's dense time (`captured_dense`), last: it installs an engine in `lm`."""
    p = next(lm.model.parameters())
    layers = layer_timings(lm, ids, steps)
    # t_moe is the whole MoE block, router included: its time beyond the routed experts is the router and
    # the shared experts (adding t_gate as well charged every layer's router twice)
    t_dense = sum(t.t_attn + max(0.0, t.t_moe - t.t_experts) for t in layers) / max(1, len(layers))
    experts = expert_timings(lm, blobs)
    t = TimingProfile(device=str(p.device), dtype=str(p.dtype).replace("torch.", ""), steps=steps,
                      layers=layers, experts=experts, c_cpu_s=c_cpu(lm, blobs),
                      h2d_gbps=h2d_bandwidth(p.device), t_dense_s=t_dense)
    if store is not None:
        dense, note = captured_dense(lm, store, ids, steps, {e.bits: e.compute_s for e in experts}, backend)
        t = replace(t, t_dense_captured_s=dense, captured_note=note)
    return t


def captured_dense(lm: LoadedModel, store: Any, ids: torch.Tensor, steps: int, t_expert: dict[int, float],
                   backend: str | None = None) -> tuple[float | None, str]:
    """(seconds, how) of one MoE layer's non-expert work inside the captured decode step: the median
    captured step with every expert resident (the store's lowest precision, the likeliest to fit the
    device; `resident` at the reference one) less each layer's top-k experts at their timed cost
    (`t_expert`, the kernels' time in a CUDA graph), per MoE layer. (None, why) where the step
    cannot be built here (the experts do not fit the device, the model does not capture)."""
    from moetool.engine import build_engine
    from moetool.engine.decode import DecodeProgram
    from moetool.errors import MoetoolError

    bits = min(store.bits)
    policy, settings = ("resident", {}) if bits == 16 else ("static", {"bits": str(bits)})
    device = next(lm.model.parameters()).device
    max_tokens = ids.shape[1] + steps + 2
    engine = None
    try:
        engine, _ = build_engine(lm, store, policy, settings=settings, budget="100%", device=device,
                                 max_tokens=max_tokens, captured=True)
        program = DecodeProgram(engine, max_tokens=max_tokens, backend=backend, unverified_ok=True)
        program.generate(ids, steps + 2)
    except MoetoolError as e:
        return None, f"not measured: {e}"
    finally:
        if engine is not None:
            engine.close()
    decode = [x.seconds for x in engine.stats.steps if x.phase == "decode"][1:]  # the first after the prefill warms
    g = lm.geometry.layers[0]
    n = len(lm.geometry.layers)
    step = statistics.median(decode)
    dense = max(0.0, (step - n * g.top_k * t_expert[bits]) / n)
    return dense, (f"{policy} at {bits} bits, every expert resident: median captured step {step * 1e3:.3f} ms "
                   f"less {n} x {g.top_k} experts at {t_expert[bits] * 1e6:.1f} us, per MoE layer")


def hw_profile(t: TimingProfile, base: str, name: str, model: dict[str, Any]) -> dict[str, Any]:
    """A hardware profile JSON: `base`'s throughputs, overridden by what `t` measured on `model`
    (`engine.measured_on`: a run of another model is charged estimates, not these times, and so is any
    model for a measured profile that names none, as those written before the key was)."""
    _, raw = load_hw(base)
    # Not `devices`: a measured profile is one model on one machine, not the preset a device is matched to.
    data = {k: v for k, v in raw.items() if k not in ("t_dense_s", "t_expert_s", "c_cpu_s", "devices")}
    sources = dict(raw.get("sources", {}))
    where = f"measured by moetool profile --what timing on {t.device} ({t.dtype})"
    # t_expert_s keyed by bits as text: this is the profile's JSON form (load_hw reads the keys as ints).
    data.update(name=name, description=f"{raw.get('description', base)}; per-layer and per-expert times {where}",
                t_dense_s=t.t_dense_s, t_expert_s={str(e.bits): e.dequant_s + e.compute_s for e in t.experts},
                c_cpu_s=t.c_cpu_s)
    data.pop("t_dense_captured_s", None)
    if t.t_dense_captured_s is not None:
        data["t_dense_captured_s"] = t.t_dense_captured_s
        sources["t_dense_captured_s"] = f"{where}: {t.captured_note}"
    elif t.captured_note:
        sources["t_dense_captured_s"] = f"{where}: {t.captured_note} (the captured step is charged t_dense_s)"
    sources.update(t_dense_s=f"{where}: mean over MoE layers of t_attn + the MoE block's time beyond its routed "
                             "experts (router, shared experts), "
                             "one decode token",
                   t_expert_s=f"{where}: one token through one expert (its share of the top-k), per precision, "
                              "on the engine's path there: " + ", ".join(f"{e.bits}-bit {e.path}" for e in t.experts),
                   c_cpu_s=f"{where}: one reference-precision expert on one token on the host CPU, decoded "
                           f"and computed in {t.dtype} as the engine's CPU-assisted experts run")
    if t.h2d_gbps is not None:
        data["h2d_gbps"] = t.h2d_gbps
        sources["h2d_gbps"] = f"{where}: pinned {H2D_BYTES >> 20} MiB copies, median"
    else:
        sources["h2d_gbps"] = f"from preset '{base}' (no CUDA device to measure here): {sources.get('h2d_gbps', '')}"
    data["sources"] = sources
    data["base"] = base
    data["model"] = model
    return data

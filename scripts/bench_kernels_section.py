"""The `kernels` section of scripts/bench_engine.py (kept apart: that script would pass 500 lines).

One MoE layer's expert math for k experts and one token on a CPU: the compute-dtype weights in one
grouped GEMM per projection, the bundle's INT4 (and INT2) blobs decoded for the k at once then the
same GEMMs, torch's packed-int4 CPU kernel once per expert and projection, and the engine's own
kernel path (the k experts in one kernel call per projection); in fp32 and in bf16. Run through
bench_engine.py (`--skip` every other section to run it alone).
"""

from __future__ import annotations

import statistics
import time

import torch

import moetool.engine.runtime as runtime
from moetool.engine.store import HostStore
from moetool.quant import int4_kernel
from moetool.quant.format import ExpertStack, stack_views


def _median_us(fn, n: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _int4pack(w: torch.Tensor):
    """(packed, group, scales_and_zeros) of `w` [N, K] in torch's CPU int4 layout, or None with the reason:
    asymmetric 4-bit codes per group of the largest of 128/64/32 inputs dividing K."""
    n, k = w.shape
    group = next((g for g in (128, 64, 32) if k % g == 0), None)
    if group is None:
        return None, f"input width {k} has no group of 32, 64 or 128"
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = ((wg - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    # The kernel computes (q - 8) * scale + zero: the group minimum is zero - 8 * scale.
    sz = torch.stack([scale[..., 0], (lo + 8 * scale)[..., 0]], -1).transpose(0, 1).contiguous()  # [K/g, N, 2]
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8)
    except RuntimeError as exc:
        return None, str(exc).splitlines()[0]
    return (packed, group, sz.to(w.dtype)), None


def _fused_case(store: HostStore, layer: int, bits: int, k: int, x: torch.Tensor, act):
    """k experts' blobs at `bits` converted as the engine converts them in its slots, run as the
    engine runs them for one token (`int4_kernel.fused_forward` on a `kernel_stack`-like gather);
    None where the kernel does not take the layout."""
    layout = store.layout(layer, bits)
    if int4_kernel.unsupported(layout, torch.device("cpu"), x.dtype) or not int4_kernel.fusable(layout, k):
        return None
    pool = torch.stack([store.host(layer, e, bits) for e in range(k)]).clone()
    for row in pool:
        int4_kernel.convert_(row, layout)
    views = []
    for proj in layout.projections:
        (n, kk), q, sz = proj.shape, layout.part(f"{proj.name}.q"), layout.part(f"{proj.name}.scale")
        views.append((pool[:, q.offset:q.offset + q.nbytes].view(k, n, -1), proj.group_size,
                      pool[:, sz.offset:sz.offset + 2 * sz.nbytes].view(torch.bfloat16).view(k, kk // proj.group_size, n, 2)))
    at, weight = torch.arange(k), torch.full((k,), 1.0 / k, dtype=x.dtype)

    def run():
        per = [(int4_kernel.expand(c.index_select(0, at)) if bits == 2 else c.index_select(0, at), grp,
                sz.index_select(0, at)) for c, grp, sz in views]
        return int4_kernel.fused_forward(x, per[0], per[1], weight, act)
    return run


def section_kernels(b) -> dict:  # b: bench_engine.Bench
    if b.device.type != "cpu":
        print("\n== kernels: CPU only (torch's CUDA int4 kernel takes another packing)")
        return {}
    if 4 not in b.bundle.manifest.bits:
        print("\n== kernels: skipped, the bundle has no INT4")
        return {}
    lm, _ = b.engine("resident", "grouped_mm", store="checkpoint")  # its experts module: the model's activation
    g = lm.geometry.layers[0]
    k, module = g.top_k, lm.model.get_submodule(g.path).experts
    group = b.bundle.manifest.group_size
    print(f"\n== kernels: layer {g.index}'s expert math, {k} experts x 1 token, median of 200 calls "
          f"(the bundle's INT4 group size: {group}; torch's kernel takes 32, 64, 128 or 256)")
    results = {"bundle_group_size": group}
    for dtype in (torch.float32, torch.bfloat16):  # torch's CPU int4 kernel has a fast path for bf16 only
        store = HostStore.from_bundle(b.bundle, dtype)
        blobs = torch.stack([store.host(g.index, e, 4) for e in range(k)])  # k experts' INT4 blobs
        x = torch.randn(k, g.hidden_size, dtype=dtype)  # one token per expert
        offs, counts = torch.arange(1, k + 1, dtype=torch.int32), [1] * k
        dequant = lambda blobs: store.decode_stack(stack_views(blobs, store.layout(g.index, 4)), g.index, 4)  # noqa: E731
        deq = dequant(blobs)
        # The same GEMMs on weights already in `dtype` (decoded once, outside the timer): a resident expert.
        full = ExpertStack(deq.gate_up.contiguous(), deq.down.contiguous())
        out = {"resident grouped": _median_us(lambda: runtime.grouped_mlp(module, x, full, offs, counts)),
               "int4 dequantize_stack + grouped": _median_us(
                   lambda: runtime.grouped_mlp(module, x, dequant(blobs), offs, counts))}
        # Speed only: the kernel's packing of the decoded weights at its own group size (not the bundle's).
        packs, why = {}, {}
        for name in ("gate_up", "down"):
            per = [_int4pack(getattr(deq, name)[e]) for e in range(k)]
            packs[name] = [p for p, _ in per] if per[0][0] is not None else None
            why[name] = per[0][1]

        def kernel(x=x, blobs=blobs, dequant=dequant, packs=packs):
            for e in range(k):
                h = x[e:e + 1]
                for name in ("gate_up", "down"):
                    if packs[name] is not None:
                        p, grp, sz = packs[name][e]
                        h = torch.ops.aten._weight_int4pack_mm_for_cpu(h, p, grp, sz)
                    else:
                        h = h @ getattr(dequant(blobs[e:e + 1]), name)[0].T
                    if name == "gate_up":
                        h = module.impl._apply_gate(h) if g.gated else module.impl.act_fn(h)
        out["int4 kernel per expert"] = _median_us(kernel)
        for bits in (4, 2):  # the engine's own path: the bundle's blobs converted, one call per projection
            if bits in b.bundle.manifest.bits:
                fused = _fused_case(store, g.index, bits, k, x[:1], module.activation)
                if fused is not None:
                    out[f"int{bits} kernel, k experts in one call per projection"] = _median_us(fused)
        if 2 in b.bundle.manifest.bits:
            blobs2 = torch.stack([store.host(g.index, e, 2) for e in range(k)])
            out["int2 dequantize_stack + grouped"] = _median_us(lambda: runtime.grouped_mlp(
                module, x, store.decode_stack(stack_views(blobs2, store.layout(g.index, 2)), g.index, 2), offs, counts))
        tag = str(dtype).removeprefix("torch.")
        for name, reason in why.items():
            if reason:
                print(f"  {tag}: {name} has no int4 kernel ({reason}); decoded per expert instead")
        for name, us in out.items():
            print(f"  {tag:<9} {name:<34} {us:9.1f} us")
        for name, us in list(out.items())[1:]:
            print(f"ratio {name} / resident grouped ({tag}) = {us / out['resident grouped']:.2f}x")
        results[tag] = {"us": out, "no_kernel": {n: r for n, r in why.items() if r}}
    return results

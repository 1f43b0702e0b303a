"""Which of torch's low-bit CPU kernels runs a layer's experts at each stored precision.

INT4 and INT2 go through the packed-int4 matmul (`quant.int4_kernel`), per-channel INT8 through the
int8 weight-only matmul (`quant.int8_kernel`). Each module has the same calls: `unsupported(layout,
device, dtype)` (why not, or None), `convert_(blob, layout)` (in place, once, as a blob lands in a
CPU pool slot), `kernel_weights(blob, layout)` (views of a converted blob) and
`expert_forward(x, weights, act)`, and for a single token's experts `fused_forward(x, gate_up,
down, weight, act)`. The engine asks `layers_on_kernel` once, at build time.

    on, fused = layers_on_kernel(store, geometry.layers, torch.device("cpu"), torch.bfloat16)
    kernels.MODULES[bits].convert_(blob, store.layout(layer, bits))
"""

from __future__ import annotations

import torch

from moetool.quant import int4_kernel, int8_kernel

MODULES = {8: int8_kernel, 4: int4_kernel, 2: int4_kernel}


def layers_on_kernel(store, layers, device: torch.device,
                     dtype: torch.dtype) -> tuple[dict[int, frozenset[int]], dict[int, frozenset[int]]]:
    """For a store's INT8, INT4 and INT2 experts: bits -> the MoE layers (`layers`, geometry entries)
    whose layout a kernel takes on `device` in `dtype`, and bits -> those of them whose experts also
    run together for one token (`fusable` of each kernel module). A single token's call stacks at
    most the layer's top-k experts, so that is what is asked: nothing here scales with the model's
    expert count."""
    on, fused = {}, {}
    for bits, module in MODULES.items():
        if bits not in store.bits:
            continue
        ok = [g for g in layers if module.unsupported(store.layout(g.index, bits), device, dtype) is None]
        if ok:
            on[bits] = frozenset(g.index for g in ok)
            fused[bits] = frozenset(g.index for g in ok if (
                int4_kernel.fusable(store.layout(g.index, bits), g.top_k) if module is int4_kernel
                else int8_kernel.fusable(store.layout(g.index, bits))))
    return on, fused

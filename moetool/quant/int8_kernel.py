"""INT8 experts through torch's int8 weight-only CPU matmul (`aten._weight_int8pack_mm`, what
torchao's int8 weight-only quantization runs), without dequantizing the weights.

The kernel computes y = (x @ Q^T) * s for int8 Q [N, K] and one scale per output row s [N]. A
bundle's per-channel INT8 blob (`moetool quantize --int8-per-channel`: hqq codes 0..255, an fp16
scale and zero per row) fits it exactly, zero point and all: hqq's w = (q - z) * s with
q8 = q - 128 gives y_n = s_n (x . q8_n) + c_n * sum(x), c_n = s_n (128 - z_n). So the blob is
rewritten in place, once, when it lands in a CPU pool slot: codes to int8 (q - 128 is q ^ 0x80,
read as int8), the scale part to bf16 (the kernel takes scales in the activations' dtype), the zero
part to c (kept in fp16: c can be up to 128 scale steps, and bf16's 8 bits would round it by up
to a quarter of a step); the same bytes, so pools and the budget are unchanged. Grouped INT8 (the default
layout) has no such form: a scale per group is not a scale per row.

Measured (a one-off check on this 2-core CPU, 2 threads, one token): the kernel takes ~half the
time of a bf16 matmul of the same shape with bf16 activations, and ~5x a fp32 matmul with fp32
ones. Under fp32 compute the engine hands it the activations rounded to bf16, as for the int4
kernel (`quant.int4_kernel`), and takes the result back to fp32; the offset term is added in fp32.

    reason = unsupported(layout, torch.device("cpu"), torch.bfloat16)   # None: usable
    convert_(blob, layout)                                               # once, in place
    y = expert_forward(x, kernel_weights(blob, layout), act)             # x [n, H]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moetool.quant.format import Layout, views
from moetool.quant.int4_kernel import cpu_kernel_unsupported  # the CPU, dtype and op rules both kernels share



def unsupported(layout: Layout, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot run experts of this INT8 layout on `device` in `dtype`, or None."""
    reason = cpu_kernel_unsupported(device, dtype, "_weight_int8pack_mm", "int8 weight-only")
    if reason:
        return reason
    if layout.bits != 8:
        return f"the layout is {layout.bits}-bit, not INT8"
    if not layout.per_channel:
        return "its INT8 experts are stored in groups, not one scale per row (quantize with --int8-per-channel)"
    return None


@dataclass(frozen=True)
class Int8Weights:
    """A converted blob's tensors, as views of it: per projection (int8 codes [N, K], bf16 scales
    [N], fp16 offsets [N] multiplying the sum of the inputs), then the biases (None without)."""

    gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    down: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None


@torch.no_grad()
def convert_(blob: torch.Tensor, layout: Layout) -> None:
    """Rewrite one per-channel INT8 blob (uint8, on the CPU) from hqq's layout into the kernel's, in place."""
    v = views(blob, layout)
    for proj in layout.projections:
        codes = v[f"{proj.name}.q"]
        codes.bitwise_xor_(0x80)  # q - 128 in two's complement: read as int8 from here on
        scale = v[f"{proj.name}.scale"].float()  # [N, 1] fp16
        offset = scale * (128 - v[f"{proj.name}.zero"].float())
        # A row of one code (a dead neuron's zeros, a constant row: hqq gives a range of 0 the scale 1.0)
        # is its constant alone: the kernel's s * (x . q8) and c * sum(x) would cancel to it through a
        # bf16 product as large as 128 s |sum(x)|, leaving its rounding (0.25 |sum(x)| for a zero row).
        flat = codes.view(torch.int8)
        one = (flat == flat[:, :1]).all(dim=1, keepdim=True)  # [N, 1]
        if bool(one.any()):
            offset = torch.where(one, scale * flat[:, :1].float() + offset, offset)
            scale = torch.where(one, torch.zeros_like(scale), scale)
            flat.masked_fill_(one, 0)
        v[f"{proj.name}.scale"].view(torch.bfloat16).copy_(scale)
        v[f"{proj.name}.zero"].copy_(offset)  # fp16, see the module's docstring


def kernel_weights(blob: torch.Tensor, layout: Layout) -> Int8Weights:
    """Views of a converted blob for `expert_forward` (no copy: valid while the slot holds it)."""
    v = views(blob, layout)
    per = [(v[f"{p.name}.q"].view(torch.int8), v[f"{p.name}.scale"].view(torch.bfloat16).view(-1),
            v[f"{p.name}.zero"].view(-1)) for p in layout.projections]
    return Int8Weights(per[0], per[1], v.get("gate_up_bias"), v.get("down_bias"))


def linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """x [T, K] bf16 -> [T, N] fp32: the kernel's (x @ Q^T) * s plus the zero point's c * sum(x)."""
    y = torch.ops.aten._weight_int8pack_mm(x, codes, scale).float()
    return y.addmm_(x.float().sum(-1, keepdim=True), offset.float().unsqueeze(0))


def expert_forward(x: torch.Tensor, w: Int8Weights, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One expert on rows `x` [T, H]: down(act(gate_up(x))), biases added, in fp32 (the caller takes
    the result into its own dtype); the kernel sees bf16 activations."""
    h = linear(x.to(torch.bfloat16), *w.gate_up)
    if w.gate_up_bias is not None:
        h = h + w.gate_up_bias.float()
    y = linear(act(h.to(x.dtype)).to(torch.bfloat16), *w.down)
    if w.down_bias is not None:
        y = y + w.down_bias.float()
    return y


def fusable(layout: Layout) -> bool:
    """Whether a single token's experts of this layout run together (`fused_forward`): no biases."""
    return not any(p.name.endswith("bias") for p in layout.parts)


def fused_forward(x: torch.Tensor, gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                  down: tuple[torch.Tensor, torch.Tensor, torch.Tensor], weight: torch.Tensor,
                  act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """n experts on one token, summed with their routing weights: sum_i w_i down_i(act(gate_up_i(x))).

    x [1, H]; gate_up (codes [n, 2I, H] int8, scales and offsets [n, 2I]); down (codes [n, H, I],
    [n, H], [n, H]); weight [n]. Gate_up stacks the experts' rows: one kernel call. Down has a
    scale per output row and expert, so no stacking sums the experts: one call each, their
    offsets' terms in one matmul. Returns [1, H] fp32.
    """
    codes, scale, offset = gate_up
    n, rows, hidden = codes.shape
    xb = x.to(torch.bfloat16)
    h = torch.ops.aten._weight_int8pack_mm(xb, codes.reshape(n * rows, hidden), scale.reshape(-1)).float()
    h = h.view(n, rows).addcmul_(offset.float(), xb.float().sum())  # + c * sum(x)
    a = act(h.to(x.dtype)).float().mul_(weight.float().unsqueeze(1)).to(torch.bfloat16)  # [n, I], weighted
    codes, scale, offset = down
    y = a.float().sum(1).unsqueeze(0) @ offset.float()  # [1, H]: sum_i c_i * sum(a_i)
    for i in range(n):
        y += torch.ops.aten._weight_int8pack_mm(a[i:i + 1], codes[i], scale[i])
    return y


def decode(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Weights [n, N, K] in `dtype` from n converted experts' tensors for one projection (codes
    [n, N, K] int8, scales and offsets [n, N]): w = q8 * s + c, for one grouped GEMM over several tokens."""
    w = codes.float().mul_(scale.float().unsqueeze(-1)).add_(offset.float().unsqueeze(-1))
    return w.to(dtype)

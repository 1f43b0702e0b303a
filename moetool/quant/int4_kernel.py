"""INT4 experts through torch's packed-int4 CPU matmul (`aten._weight_int4pack_mm_for_cpu`, the
tinygemm layout torchao's int4 weight-only quantization uses), without dequantizing the weights.

A bundle's INT4 blob (hqq codes, fp16 scale and zero per group of input columns) is rewritten in
place, once, when it lands in a CPU pool slot: the codes become the kernel's packed layout (the same
N*K/2 bytes), and the scale and zero parts become the kernel's bf16 scale and zero point, each
[K/g, N] in the same 2 bytes per group. The kernel computes w = (q - 8) * s + zp; hqq's
w = (q - z) * s gives zp = (8 - z) * s. The blob keeps its size, so pools, staging buffers and the
budget are unchanged.

Measured (scripts/bench_engine.py, kernels section, 2-core CPU): the kernel's fast path takes bf16
activations; with fp32 ones it is ~10x slower than its bf16 path, slower than dequantizing. So the
engine uses it for bf16 compute on a CPU only, and only where its shape rules hold (output rows a
multiple of 16, groups of 32/64/128/256 input columns, hqq axis 1, scale and zero back to back).

    reason = unsupported(layout, torch.device("cpu"), torch.bfloat16)   # None: usable
    convert_(blob, layout)                                               # once, in place
    y = expert_forward(x, kernel_weights(blob, layout), act)             # x [n, H] bf16
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moetool.quant.format import PACKING_BY_NAME, Layout, views

GROUPS = (32, 64, 128, 256)  # the group sizes the kernel takes
_INNER_K_TILES = 8  # the packing's inner K tiles (what torchao's CPU int4 layout uses)


def unsupported(layout: Layout, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot run experts of this INT4 layout on `device` in `dtype`, or None if it can."""
    if device.type != "cpu":
        return "the packed-int4 kernel here is the CPU one"
    if dtype != torch.bfloat16:
        return "the kernel's fast path takes bf16 activations (fp32 is slower than dequantizing)"
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return "this torch has no packed-int4 CPU kernel"
    for proj in layout.projections:
        n, k = proj.shape
        if proj.packing != "4bit_u8" or proj.axis != 1:
            return f"the {proj.name} projection is not hqq INT4 grouped along its input columns"
        if proj.group_size not in GROUPS or k % proj.group_size:
            return f"the {proj.name} projection's group size {proj.group_size} is not one of {GROUPS}"
        if n % 16:
            return f"the {proj.name} projection has {n} output rows, not a multiple of 16"
        scale, zero = layout.part(f"{proj.name}.scale"), layout.part(f"{proj.name}.zero")
        if scale.offset + scale.nbytes != zero.offset:  # the kernel reads (scale, zero point) interleaved
            return f"the {proj.name} projection's scale and zero are not back to back in the blob"
    return None


@dataclass(frozen=True)
class KernelWeights:
    """A converted blob's tensors, as views of it: per projection (packed codes [N, K/2] uint8, group
    size, scales and zero points [K/g, N, 2] bf16), then the biases (None without)."""

    gate_up: tuple[torch.Tensor, int, torch.Tensor]
    down: tuple[torch.Tensor, int, torch.Tensor]
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None


def _scales_and_zeros(blob: torch.Tensor, layout: Layout, proj) -> torch.Tensor:
    n, k = proj.shape
    scale = layout.part(f"{proj.name}.scale")
    return blob[scale.offset:scale.offset + 2 * scale.nbytes].view(torch.bfloat16).view(k // proj.group_size, n, 2)


@torch.no_grad()
def convert_(blob: torch.Tensor, layout: Layout) -> None:
    """Rewrite one INT4 blob (uint8, on the CPU) from hqq's layout into the kernel's, in place."""
    v = views(blob, layout)
    for proj in layout.projections:
        n, k = proj.shape
        g = proj.group_size
        codes = torch.empty(proj.grouped_shape(), dtype=torch.uint8)  # [N*K/g, g]
        PACKING_BY_NAME[proj.packing].unpack(v[f"{proj.name}.q"], codes)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.view(n, k).to(torch.int32), _INNER_K_TILES)
        scale = v[f"{proj.name}.scale"].float().view(n, k // g)
        zero = v[f"{proj.name}.zero"].float().view(n, k // g)
        v[f"{proj.name}.q"].view(-1).copy_(packed.view(-1))  # N*K/2 bytes either way
        # hqq's (scale, zero) -> the kernel's interleaved (scale, zero point), over the same bytes.
        _scales_and_zeros(blob, layout, proj).copy_(torch.stack((scale.T, ((8 - zero) * scale).T), -1))


def kernel_weights(blob: torch.Tensor, layout: Layout) -> KernelWeights:
    """Views of a converted blob for `expert_forward` (no copy: they stay valid while the slot holds
    an expert of this layout, so a caller may keep them per slot)."""
    v = views(blob, layout)
    per = []
    for proj in layout.projections:
        n, k = proj.shape
        per.append((v[f"{proj.name}.q"].reshape(-1).view(n, k // 2), proj.group_size,
                    _scales_and_zeros(blob, layout, proj)))
    return KernelWeights(per[0], per[1], v.get("gate_up_bias"), v.get("down_bias"))


def expert_forward(x: torch.Tensor, w: KernelWeights, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One expert on rows `x` [T, H] (bf16): down(act(gate_up(x))), biases added."""
    h = torch.ops.aten._weight_int4pack_mm_for_cpu(x, *w.gate_up)  # [T, 2I]
    if w.gate_up_bias is not None:
        h = h + w.gate_up_bias
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(act(h), *w.down)  # [T, H]
    if w.down_bias is not None:
        y = y + w.down_bias
    return y

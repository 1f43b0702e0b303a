"""Random expert pools in the bundle's layout and the fp32 dequantize reference of the experts kernels'
contract, shared by the kernels' tests under Triton's interpreter (test_triton_experts.py) and on a
GPU (test_cuda.py). Imports no Triton: `moetool.kernels` decorates its kernels only when one runs."""

from __future__ import annotations

import torch

from moetool.kernels import Activation, SlotPool
from moetool.kernels.activation import reference
from moetool.model import ExpertWeights
from moetool.quant.format import QTensor, dequantize_parts, encode, make_layout, stack_views

RTOL = 1e-5  # see test_triton_experts.py's docstring: a summation-order change, ~80 fp32 ulps


def random_pool(bits: int, hidden: int, inter: int, group: int, slots: int, gen: torch.Generator, *,
                bias: bool = False, gated: bool = True, per_channel: bool = False) -> SlotPool:
    """A pool of `slots` random experts in the bundle's layout (random codes, scales and zeros:
    every code value and slice occurs), ids to be set by the caller."""
    rows = 2 * inter if gated else inter
    layout = make_layout(bits, (rows, hidden), (hidden, inter), has_bias=bias, group_size=group or 64,
                         int8_per_channel=per_channel)
    blobs = []
    for _ in range(slots):
        w = ExpertWeights(gate_up=torch.randn(rows, hidden, generator=gen) / hidden ** 0.5,
                          down=torch.randn(hidden, inter, generator=gen) / inter ** 0.5,
                          gate_up_bias=torch.randn(rows, generator=gen) if bias else None,
                          down_bias=torch.randn(hidden, generator=gen) if bias else None)
        q = None
        if bits != 16:
            q = {}
            for proj in layout.projections:
                g, gs = proj.grouped_shape()
                scale = (torch.rand(g, 1, generator=gen) + 0.5) / (gs ** 0.5 * (1 << bits))
                q[proj.name] = QTensor(torch.randint(0, 1 << bits, (g, gs), generator=gen, dtype=torch.uint8),
                                       scale, torch.rand(g, 1, generator=gen) * ((1 << bits) - 1))
        blobs.append(encode(layout, w, q))
    return SlotPool(torch.stack(blobs), layout, torch.empty(0, dtype=torch.int32))


def random_ids(T: int, k: int, slots: int, gen: torch.Generator, skip: float = 0.25) -> torch.Tensor:
    """[T, k] int32 slot ids, about `skip` of them -1 (never slot 0 of a token: each token runs one)."""
    ids = torch.randint(0, slots, (T, k), generator=gen, dtype=torch.int32)
    drop = torch.rand(T, k, generator=gen) < skip
    drop[:, 0] = False
    return ids.masked_fill(drop, -1)


def reference_forward(x: torch.Tensor, w: torch.Tensor, pools: list[SlotPool], spec: Activation) -> torch.Tensor:
    """The contract in fp32 from `dequantize_parts` of each whole pool: a loop, the plain math."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for p in pools:
        stack = dequantize_parts(stack_views(p.data, p.layout), p.layout, torch.float32)
        for t, j in (p.ids >= 0).nonzero().tolist():
            s = int(p.ids[t, j])
            h = stack.gate_up[s] @ x[t].float()
            if stack.gate_up_bias is not None:
                h = h + stack.gate_up_bias[s]
            y = stack.down[s] @ reference(spec, h[None])[0]
            if stack.down_bias is not None:
                y = y + stack.down_bias[s]
            out[t] += w[t, j].float() * y
    return out


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> None:
    scale = want.abs().max().item()
    err = (got.float() - want).abs().max().item()
    assert err <= rtol * scale + 1e-30, f"max error {err:.3g} against max |reference| {scale:.3g}"


def with_ids(pool: SlotPool, ids: torch.Tensor) -> SlotPool:
    return SlotPool(pool.data, pool.layout, ids.contiguous())

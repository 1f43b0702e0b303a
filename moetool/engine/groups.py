"""A layer's work once planned: its (token, slot) rows grouped by expert and precision, the grouped
expert MLP over them, and the combine that sums a token's k outputs as transformers does.

    groups = engine._group(plan, idx, num_experts, stats)       # [Group], slices of one Rows
    y = grouped_mlp(module, hidden[rows.tok], stack, offs, counts)
    out = Combine(hidden, weight, grouped=True); out.add(y, rows.pos); out.result()
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch
from torch import nn
from transformers.integrations.moe import _grouped_mm  # the dispatcher transformers' grouped_mm experts use

from moetool.engine.residency import Handle
from moetool.policies.base import Where
from moetool.quant.format import ExpertStack

_WHERE = tuple(Where)  # Where(i) without the enum call (a few us each, per group and layer)


class Status(IntEnum):
    """Where a device-side group's expert copy stands when the layer is scheduled (the compute order)."""

    HIT = 0  # resident: computes first
    IN_FLIGHT = 1  # a prefetch still copying: computes when its own copy lands
    MISS = 2  # a demand load started now: into a cached slot, or streamed through a staging buffer


@dataclass(slots=True)
class Rows:
    """A layer's running (token, slot) pairs, grouped: group after group, each group's rows in the
    order its GEMM takes them. Host arrays, and the same rows as index tensors on the compute device."""

    tok_host: torch.Tensor  # [n] token rows
    slot_host: torch.Tensor  # [n] routing slots
    pos_host: torch.Tensor  # [n] flat (token * k + slot) positions, what the grouped combine writes
    tok: torch.Tensor  # the same three on the compute device
    slot: torch.Tensor
    pos: torch.Tensor


@dataclass(slots=True)
class Group:
    """The (token, slot) pairs of one layer that run one expert at one precision in one place:
    rows `start:end` of the layer's `Rows`."""

    expert: int
    bits: int
    where: Where
    rows: Rows
    start: int
    end: int
    status: Status = Status.HIT
    handle: Handle | None = None

    def __len__(self) -> int:
        return self.end - self.start

    # Sliced on demand: the grouped path reads the layer's rows whole, only the per-expert paths
    # (eager, host, staged) need a group's own, and a slice is a torch call.
    @property
    def tok(self) -> torch.Tensor:
        return self.rows.tok[self.start:self.end]

    @property
    def slot(self) -> torch.Tensor:
        return self.rows.slot[self.start:self.end]

    @property
    def pos(self) -> torch.Tensor:
        return self.rows.pos[self.start:self.end]

    @property
    def tok_host(self) -> torch.Tensor:
        return self.rows.tok_host[self.start:self.end]

    @property
    def slot_host(self) -> torch.Tensor:
        return self.rows.slot_host[self.start:self.end]


class Combine:
    """A layer's output [T, H]: each group's routing-weighted expert rows, summed as the matching
    transformers kernel sums them, so a lossless policy stays bit-exact.

    fp32 addition is not associative, and with k = 16 a different order moves logits by ~1e-5, enough
    to flip a near-tied routing decision downstream. `grouped_mm` writes each (token, slot)'s row at
    its flat position and sums over the k slots in slot order (a skipped slot adds an exact 0); the
    eager loop adds whole experts in ascending expert order. Both hold T*k*H activations until the
    sum, which the budget's margin counts (`kv_margin`).
    """

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, grouped: bool):
        self.hidden, self.weight, self.grouped = hidden, weight, grouped  # weight [T, k], hidden's dtype
        T, k = weight.shape
        if grouped:
            self.flat = hidden.new_zeros(T * k, hidden.shape[-1])  # [T*k, H]
        else:
            self.outputs: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (expert, bits, tok, y)

    def add(self, y: torch.Tensor, pos: torch.Tensor, tok: torch.Tensor | None = None,
            slot: torch.Tensor | None = None, expert: int = 0, bits: int = 0) -> None:
        """Rows `y` [n, H] of the (token, slot) pairs at flat positions `pos` (token `tok`, slot `slot`)."""
        if self.grouped:
            self.flat.index_copy_(0, pos, (y * self.weight.view(-1)[pos, None]).to(self.flat.dtype))
        else:
            self.outputs.append((expert, bits, tok, (y * self.weight[tok, slot, None]).to(self.hidden.dtype)))

    def result(self) -> torch.Tensor:
        if self.grouped:
            T, k = self.weight.shape
            return self.flat.view(T, k, -1).sum(1).to(self.hidden.dtype)
        out = torch.zeros_like(self.hidden)  # [T, H]
        for _, _, tok, y in sorted(self.outputs, key=lambda o: o[:2]):
            out.index_add_(0, tok, y)
        return out


def grouped_mlp(module: nn.Module, x: torch.Tensor, stack: ExpertStack, offs: torch.Tensor,
                counts: list[int]) -> torch.Tensor:
    """The experts' MLP (`module`: the engine's experts module) on rows `x` [n, H] sorted by group, group i's rows ending at `offs[i]`:
    transformers' own grouped GEMM dispatcher and the model's own activation, so the result is the
    `grouped_mm` implementation's, row for row."""
    h = _grouped_mm(x, stack.gate_up.transpose(-2, -1), offs)  # [n, 2I]
    group_of_row = None
    if stack.gate_up_bias is not None:
        group_of_row = torch.from_numpy(np.repeat(np.arange(len(counts)), counts)).to(x.device)
        h.add_(stack.gate_up_bias[group_of_row])
    h = module.impl._apply_gate(h) if module.layer.gated else module.impl.act_fn(h)  # [n, I]
    y = _grouped_mm(h, stack.down.transpose(-2, -1), offs)  # [n, H]
    if group_of_row is not None:
        y.add_(stack.down_bias[group_of_row])
    return y

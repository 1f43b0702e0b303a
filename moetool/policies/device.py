"""The in-step half of the policy contract: what a policy decides inside the captured decode step.

The captured step (`engine/decode.py`: one compiled program, one CUDA graph on a GPU) runs every
layer's routing, plan and experts on the device without the host. A policy's part in it is
`Policy.plan_step(DeviceView) -> DevicePlan`: tensor operations only — no host read of device data,
no shape that depends on the routing, no Python branch on a tensor — so that
`torch.compile(fullgraph=True)` takes it and a CUDA graph can replay it. The host half (admission,
eviction orders, DynaExq's promotions, Fate's ARC, SMoE's score window, EAP's counts) runs one step
behind, from the step's routing log, through the hooks the host path already has (`admit`,
`end_step`, eviction orders) and `Policy.log_layer`.

    plan = policy.plan_step(view)       # DevicePlan of [T, k] device tensors
    plan.prefetch                       # [n] experts of the next MoE layer to fetch (-1: none)

The helpers below are the graph-safe forms of the host path's small pieces (`common.py`), written
so that a host plan and a device plan given the same routing and residency decide the same thing
(`tests/test_policy_device.py` compares them decision by decision).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceView:
    """What a policy sees of one MoE layer inside the captured step. Tensors are on the device."""

    layer: int  # decoder layer index
    moe_pos: int  # position among MoE layers (0 = shallowest)
    num_experts: int
    top_k_index: torch.Tensor  # [T, k] int64: the model's own routing
    top_k_weights: torch.Tensor  # [T, k]: the model's own routing weights
    router_logits: torch.Tensor | None  # [T, E] float32, when the policy reads them (`Policy.signals`)
    # (decoder layer, bits) -> [E] bool: the experts with a usable copy at `bits` now (the device slot
    # table, as the host half last wrote it).
    resident: Callable[[int, int], torch.Tensor]
    # A later MoE layer's router logits [T, E] on this layer's gate input (cross-layer look-ahead),
    # None where that router cannot run alone.
    predict: Callable[[int], torch.Tensor | None]


@dataclass
class DevicePlan:
    """Per (token, slot): which expert runs, at which bits (0: skipped, its weight dropped), with which
    weight; and what to fetch for the next MoE layer.

    `routed` marks the router's own plan at one precision (no policy changed it): the engine then
    needs no expert or weight of its own. `prefetch` holds expert ids of the next MoE layer at
    `prefetch_bits`, best first, -1 for none (a fixed length, so the step's shape never depends on
    the routing); the host half starts those copies one step behind.
    """

    expert: torch.Tensor  # [T, k] int64
    bits: torch.Tensor  # [T, k] int64
    weight: torch.Tensor  # [T, k]
    prefetch: torch.Tensor | None = None  # [n] int64
    prefetch_bits: int = 0
    routed: bool = False

    @classmethod
    def of_router(cls, view: DeviceView, bits: int) -> "DevicePlan":
        """Every routed expert as routed, at `bits` (a dropped slot, id outside 0..E-1, is skipped)."""
        idx = view.top_k_index
        valid = (idx >= 0) & (idx < view.num_experts)
        return cls(expert=idx, bits=torch.where(valid, bits, 0), weight=view.top_k_weights, routed=True)


def valid(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, k] bool: slots that name a real expert (`base.valid_slots` on the device)."""
    return (idx >= 0) & (idx < num_experts)


def lookup(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """`table[idx]` for an [E] table and a [T, k] index that may hold dropped ids (read as expert 0;
    callers mask those slots)."""
    return table.index_select(0, idx.clamp(0, table.shape[0] - 1).reshape(-1)).view(idx.shape)


def rank_in_token(weight: torch.Tensor, idx: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
    """[T, k] rank of each slot within its token: larger weight first, ties to the lower expert id,
    slots that do not run last. (DyMoE's critical experts of one decode token, eq. 3 and 5.)"""
    T, k = idx.shape
    big = torch.iinfo(torch.int64).max // 4
    by_id = torch.sort(torch.where(running, idx, big), dim=1, stable=True).indices  # [T, k] ascending id
    w = torch.where(running, weight.float(), float("-inf")).gather(1, by_id)
    order = by_id.gather(1, torch.sort(w, dim=1, descending=True, stable=True).indices)  # [T, k] slots, best first
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(k, device=idx.device).expand(T, k))
    return ranks


def best_first(score: torch.Tensor, chosen: torch.Tensor, n: int) -> torch.Tensor:
    """The `n` chosen experts of the largest `score` ([E] each), ties to the lower id, -1 padding:
    the host path's `argsort(descending=True, stable=True)` over the chosen experts, then `[:n]`."""
    key = torch.where(chosen, score.float(), float("-inf"))
    order = torch.sort(key, descending=True, stable=True).indices[:n]  # [n]
    return torch.where(chosen.index_select(0, order), order, -1)


def above_percentile(scores: torch.Tensor, q: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fate §4.2 on the device: ([E] bool chosen, [E] best score) for the experts whose score exceeds
    the q-quantile of some token's scores (`fate.above_percentile` without the host list)."""
    thr = torch.quantile(scores, q, dim=-1, keepdim=True)  # [T, 1]
    best = torch.where(scores > thr, scores, torch.full_like(scores, -1.0)).amax(0)  # [E]
    return best >= 0, best


__all__ = ["DevicePlan", "DeviceView", "above_percentile", "best_first", "lookup", "rank_in_token", "valid"]

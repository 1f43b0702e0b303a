"""Small pieces every paper's policy uses: layer order, routing counts, look-ahead scores, hardware
timings, slot splits and knob checks (the one the papers' knobs share, `parse_tiers`, is in `knobs.py`,
read without torch). Nothing here is one paper's mechanism (those live in the files named after the paper).

    popularity(torch.tensor([[0, 2], [0, 1]]), 4).tolist() == [2, 1, 1, 0]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from moetool.errors import MoetoolError
from moetool.policies.base import EngineContext, LayerView, check_bits, valid_slots
from moetool.policies.eviction import EVICTIONS

__all__ = ["all_experts", "check_bits", "check_eviction", "even_quota", "hw_seconds", "next_moe_layer",
           "popularity", "predicted_scores", "valid_slots"]


def all_experts(ctx: EngineContext) -> int:
    """Experts in the model: MoE layers x experts per layer."""
    return len(ctx.moe_layers) * ctx.num_experts


def next_moe_layer(ctx: EngineContext, moe_pos: int) -> int | None:
    """Decoder index of the MoE layer after position `moe_pos` (what `LayerView.predict` takes)."""
    return ctx.moe_layers[moe_pos + 1] if moe_pos + 1 < len(ctx.moe_layers) else None


def hw_seconds(ctx: EngineContext, key: str, bits: int | None = None) -> float | None:
    """`ctx.hw[key]` (or `ctx.hw[key][bits]`), None where the hardware profile lacks it."""
    value: Any = ctx.hw.get(key)
    if bits is not None:
        value = value.get(bits) if isinstance(value, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def predicted_scores(view: LayerView, ctx: EngineContext) -> tuple[int, torch.Tensor] | None:
    """(next MoE layer, its router's scores [T, E] on this layer's gate input), or None; the real tokens'
    rows only (`counted`): a pad row predicts no request's experts. The scores are the router's own
    (`router_scores`): softmax for the papers' models, a sigmoid over chosen groups for DeepSeek-V3's."""
    nxt = next_moe_layer(ctx, view.moe_pos)
    if nxt is None:
        return None
    logits = view.predict(nxt)  # [T, E]
    if logits is None or logits.numel() == 0:
        return None
    return nxt, ctx.routers.scores(nxt, counted(view, logits))


def routed_experts(plan_expert: torch.Tensor, running: torch.Tensor) -> list[int]:
    """The distinct experts a plan runs somewhere, ascending (numpy: a decode layer's plan is [1, k])."""
    return np.unique(plan_expert.numpy()[running.numpy()]).tolist()


def assign_by_expert(target: torch.Tensor, expert: torch.Tensor, running: torch.Tensor, values: dict[int, Any]) -> None:
    """`target[t, s] = values[expert[t, s]]` wherever the slot runs and its expert has a value, in place.

    One vectorised pass over the [T, k] plan (a lookup table over experts) instead of a mask per
    expert: per-layer work that does not grow with tokens x k in Python.
    """
    if not values:
        return
    e = expert.numpy()
    size = max(int(e.max(initial=0)), max(values)) + 1
    has = np.zeros(size, dtype=bool)
    table = np.zeros(size, dtype=target.numpy().dtype)
    keys = np.fromiter(values, dtype=np.int64, count=len(values))
    has[keys] = True
    table[keys] = list(values.values())
    e = np.clip(e, 0, size - 1)  # dropped slots (E or -1) are not running: any index does
    sel = running.numpy() & has[e]
    target.numpy()[sel] = table[e[sel]]


def counted(view: Any, rows: torch.Tensor) -> torch.Tensor:
    """`rows` ([T, ...], one per token of the view) of the real tokens only (`LayerView.real_rows`):
    what a policy counts, scores or ranks its requests by (DynaExq's hotness, Fate's popularity, DyMoE's
    token load, SMoE's score window) leaves a batch's left padding out."""
    real = getattr(view, "real_rows", None)
    return rows if real is None else rows[real]


def popularity(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert [E] (Fate's popularity, DyMoE's token load, DynaExq's counters)."""
    flat = idx[valid_slots(idx, num_experts)]  # [n]
    return torch.bincount(flat, minlength=num_experts)


def even_quota(layers: tuple[int, ...], slots: int) -> dict[int, int]:
    """Split `slots` evenly over `layers`, the remainder going to the shallowest ones."""
    if not layers:
        return {}
    base, extra = divmod(slots, len(layers))
    return {layer: base + (1 if i < extra else 0) for i, layer in enumerate(layers)}


def check_eviction(policy: str, name: str) -> None:
    if name not in EVICTIONS:
        raise MoetoolError(f"policy '{policy}': unknown eviction '{name}' (known: {', '.join(sorted(EVICTIONS))}).")

"""Stage 4 of the demo conversion and the gate statistics every stage is judged by.

`router_stats` measures how peaked a Qwen2-MoE-style model's gates are and how skewed its expert
popularity is (the issue's two router goals); `calibrate` picks one temperature for every router's
logits on fitting text, the last step of `lab.stages.fit_demo`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from moetool.demo import ConversionParams


@torch.no_grad()
def _gated_forward(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """(logits [B, T, V], each MoE layer's router logits [B*T, E]) of a Qwen2-MoE-style `model`."""
    got: dict[int, torch.Tensor] = {}
    gates = {l: blk.mlp.gate for l, blk in enumerate(model.model.layers) if hasattr(blk.mlp, "gate")}  # MoE layers
    hooks = [g.register_forward_hook(lambda m, i, o, l=l: got.__setitem__(l, o[0].float()))
             for l, g in gates.items()]
    try:
        logits = model(input_ids=ids).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, {l: v.reshape(-1, v.shape[-1]) for l, v in got.items()}


@torch.no_grad()
def router_stats(model, ids: torch.Tensor) -> list[dict[str, float]]:
    """Per MoE layer of a Qwen2-MoE-style `model` on `ids` [B, T]: how peaked and how skewed routing is.

    top1 / next: mean softmax score of the best expert and of the (k+1)-th (the best unselected);
    top_quarter_weight: share of the renormalised top-k weight carried by the best k/4 experts;
    top25_experts: share of routed (token, slot) pairs taken by the busiest 25% of experts.
    """
    return _gate_stats(model, _gated_forward(model, ids)[1])


def _gate_stats(model, got: dict[int, torch.Tensor]) -> list[dict[str, float]]:
    out = []
    for layer in sorted(got):
        probs = torch.softmax(got[layer], dim=-1)
        e, k = probs.shape[1], model.model.layers[layer].mlp.gate.top_k
        top = probs.sort(dim=-1, descending=True).values
        w = top[:, :k] / top[:, :k].sum(-1, keepdim=True)
        counts = torch.bincount(probs.topk(k, dim=-1).indices.flatten(), minlength=e).float().sort(descending=True).values
        out.append({"top1": top[:, 0].mean().item(), "next": top[:, k].mean().item(),
                    "top_quarter_weight": w[:, : max(1, k // 4)].sum(-1).mean().item(),
                    "top25_experts": (counts[: max(1, e // 4)].sum() / counts.sum()).item()})
    return out


def gate_ratio(stats: list[dict[str, float]]) -> float:
    """Mean top-1 score over mean (k+1)-th score, both averaged over layers (the issue's peakedness)."""
    return sum(r["top1"] for r in stats) / sum(r["next"] for r in stats)


@torch.no_grad()
def calibrate(dense, windows: torch.Tensor, params: ConversionParams, build: Callable[[Any, ConversionParams], Any],
              *, min_ratio: float = 3.25, step: float = 0.05, batch: int = 4,
              progress: Callable[[str], None] | None = None) -> tuple[ConversionParams, list[dict[str, float]]]:
    """Stage 4: one temperature t for every router's logits, chosen on fitting-text `windows` [n, T].

    Distillation keeps each layer's best-to-(k+1)-th log-gap at ln 4 or more (the hinge), and
    perplexity would rather have flatter weights than that: on the refined conversion, logits
    x 0.8 lowered held-out and unseen perplexity alike (routers' top-8 weighted equally was
    better still, see lab/LOG.md). So t is lowered from 1 in `step`s while the mean top-1 score
    stays >= `min_ratio` x the (k+1)-th on these windows (the issue asks >= 3; 3.25 leaves a
    margin for other text), and the t with the lowest perplexity there is kept. A scale leaves each
    router's ranking of experts for a given input as it was; only the weights move (and, through
    them, later layers' inputs). `build(dense, params)` makes the Qwen2-MoE model (`demo.convert`).
    Returns the scaled conversion and every t tried.
    """
    tried: list[dict[str, float]] = []
    t = 1.0
    while t > 0:
        model = build(dense, replace(params, router=params.router * t))
        nll, count, stats = 0.0, 0, []  # stats: (windows, per-layer gate statistics) per batch
        for i in range(0, windows.shape[0], batch):
            x = windows[i:i + batch]
            logits, got = _gated_forward(model, x)
            nll += F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten(), reduction="sum").item()
            count += x[:, 1:].numel()
            stats.append((x.shape[0], _gate_stats(model, got)))
        n = windows.shape[0]  # each batch's means weighted by its windows: the means over all of them
        per_layer = [{k: sum(b * st[l][k] for b, st in stats) / n for k in ("top1", "next")}
                     for l in range(len(stats[0][1]))]
        tried.append({"t": t, "ppl": math.exp(nll / count), "ratio": gate_ratio(per_layer)})
        if progress is not None:
            progress(f"stage 4: router temperature {t:.2f}: fitting-text perplexity {tried[-1]['ppl']:.3f}, "
                     f"top-1 / (k+1)-th {tried[-1]['ratio']:.2f}")
        if tried[-1]["ratio"] < min_ratio:
            break
        t = round(t - step, 6)
    allowed = [r for r in tried if r["ratio"] >= min_ratio] or tried[:1]  # t = 1 when even it falls short
    best = min(allowed, key=lambda r: r["ppl"])
    meta = params.meta | {"calibrate": {"t": best["t"], "min_ratio": min_ratio, "tried": tried}}
    return replace(params, router=params.router * best["t"], meta=meta), tried

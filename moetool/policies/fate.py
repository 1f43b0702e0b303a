"""Fate (Fang et al., 2025): cross-layer gate prefetch, a shallow-favoring ARC cache, INT4/INT2 transfers.

- prefetch: layer i+1's router applied to layer i's gate input (Table 1, position 2); in decode the
  experts above the 75th percentile of predicted scores, at most n = T / t_expert of them (§4.3);
  in prefill every predicted expert, in descending order of predicted popularity (§4.3, Fig. 6);
- cache: the first `L` MoE layers fully cached if the budget allows, the rest split evenly
  (`cache_deep`, §4.4), ARC eviction per layer;
- quantization: cache at INT4; in prefill the least popular `p` of the experts move at INT2 (§4.5);
- fit: L from per-layer prefetch recall (§4.4), n = T / t_expert from timings (§4.3), p from the loss
  at each INT2 share (§4.5); report: Table 1, Fig. 7 (prefetch recall with L), Fig. 10 (INT2 share).

    policy = make_policy("fate", {"L": "3", "p": "0.25"}, ctx)

DyMoE and SMoE can use Fate's prefetcher (`--set prefetcher=fate`), so `CrossLayerPrefetch` is
imported from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moetool.policies.base import (EngineContext, Fetch, Key, LayerPlan, LayerView, Params, Phase, Policy, Pool,
                                   ResidencyView, check_at_most, register)
from moetool.policies import device
from moetool.policies.common import (assign_by_expert, check_bits, check_eviction, hw_seconds, next_moe_layer,
                                     popularity, predicted_scores, routed_experts)
from moetool.policies.device import DevicePlan, DeviceView
from moetool.policies.stages import FitInputs, Fitted, ReportInputs, Section, primary_metric, table

# -- Fate's mechanisms -----------------------------------------------------------------------------


def above_percentile(scores: torch.Tensor, q: float) -> list[int]:
    """Experts whose predicted score exceeds the q-quantile of their token's scores (Fate §4.2: 75th).

    Per token, then united; ordered by the best score any token gave them, highest first. As §4.2
    words it ("exceeded"): strictly above the quantile (torch's linear interpolation over the E
    scores), so an expert tied with it is not chosen, and the set is E - 1 - floor(q (E - 1))
    experts without ties (15 of Qwen1.5-MoE's 60, 16 of DeepSeekMoE's 64). With fewer than about 4k
    experts that is fewer than the predicted top-k (E = 8, k = 4: 2): kept literal, as the profile's
    recall of this rule (Fig. 7) measures it; the paper's models all have E >= 4k.
    """
    thr = torch.quantile(scores, q, dim=-1, keepdim=True)  # [T, 1]
    best = torch.where(scores > thr, scores, torch.full_like(scores, -1.0)).amax(0)  # [E]
    chosen = (best >= 0).nonzero().squeeze(1)  # [m]
    return chosen[torch.argsort(best[chosen], descending=True, stable=True)].tolist()


def transfer_n(window_s: float, t_io_s: float, num_experts: int) -> int:
    """Fate §4.3: n = T / t_expert, the decode transfers that overlap one layer's compute window T.

    Floored, but at least 1 (a transfer that half overlaps still helps) and at most every expert of
    a layer. `fit` calls it with a measured window, the policy with the hardware profile's.
    """
    return int(min(num_experts, max(1, math.floor(window_s / t_io_s)))) if t_io_s > 0 else num_experts


def transfer_cap(ctx: EngineContext, bits: int, n: int = 0) -> int:
    """Fate §4.3's n for this engine: T = t_moe + t_attn + t_gate from the hardware profile, with
    t_moe the GPU time of the k routed experts of one token and t_expert the host-to-device time of
    one expert at `bits`. A fitted or set `n` > 0 wins. Without `t_load` in the profile: k (one
    token's worth).
    """
    if n > 0:
        return n
    t_io = hw_seconds(ctx, "t_load", bits)
    if not t_io:
        return ctx.top_k
    t_moe = ctx.top_k * (hw_seconds(ctx, "t_expert", bits) or 0.0)
    window = t_moe + (hw_seconds(ctx, "t_attn") or 0.0) + (hw_seconds(ctx, "t_gate") or 0.0)
    return transfer_n(window, t_io, ctx.num_experts)


def shallow_favoring(layers: tuple[int, ...], num_experts: int, L: int, total: int) -> dict[int, int]:
    """Fate §4.4: slots per layer. The first L layers first (sequentially, whole layers), then
    cache_deep = (cache_total - L * num_experts) / (num_layers - L) for each deeper layer.

    Layers are MoE layers (a dense first layer has no experts to cache). cache_deep is floored and
    the remainder goes one slot each to the shallowest deep layers; no layer gets more than E.
    """
    L = max(0, min(L, len(layers)))
    quota = {layer: 0 for layer in layers}
    left = total
    for layer in layers[:L]:
        quota[layer] = min(num_experts, left)
        left -= quota[layer]
    deep = layers[L:]
    if left > 0 and deep:
        cache_deep, extra = divmod(left, len(deep))  # Fate §4.4 cache_deep
        for i, layer in enumerate(deep):
            quota[layer] = min(num_experts, cache_deep + (1 if i < extra else 0))
    return quota


def pool_split(ctx: EngineContext, L: int, p: float, cache_bits: int, low_bits: int) -> tuple[int, dict[int, int]]:
    """(INT2 slots, `cache_bits` slots per MoE layer) from the expert budget.

    INT2 copies get 2 * ceil(p * E) slots (one layer's unpopular experts while the next layer's
    arrive), at most half the budget; the rest is §4.4's cache_total, split shallow-favoring.
    """
    budget, low_slots = ctx.cache_bytes, 0
    if p > 0 and low_bits != cache_bits:
        lo_bytes = ctx.expert_bytes[low_bits]
        low_slots = max(0, min(2 * math.ceil(p * ctx.num_experts), budget // 2 // lo_bytes))
        budget -= low_slots * lo_bytes
    cache_total = budget // ctx.expert_bytes[cache_bits]  # §4.4 cache_total
    return low_slots, shallow_favoring(ctx.moe_layers, ctx.num_experts, L, cache_total)


def by_popularity(counts: torch.Tensor, tie: torch.Tensor | None = None) -> list[int]:
    """The active experts (count > 0), most popular first (Fate §4.3's transfer order in prefill).

    Ties (the paper names none): the larger `tie` ([E], e.g. the summed predicted score), then the
    lower index.
    """
    active = (counts > 0).nonzero().squeeze(1)  # [M] ascending ids
    if tie is not None:
        active = active[torch.sort(tie[active].float(), descending=True, stable=True).indices]
    return active[torch.sort(counts[active], descending=True, stable=True).indices].tolist()


def int2_experts(counts: torch.Tensor, p: float, tie: torch.Tensor | None = None) -> set[int]:
    """Fate §4.5: the least popular floor(p * M) of the M active experts, the tail of `by_popularity`
    (ties: the smaller `tie`, then the higher index). §4.5 names a share p of experts without a
    rounding; floor (ours) keeps the INT2 share at most p, the share whose loss its search bounds."""
    order = by_popularity(counts, tie)
    n_low = math.floor(p * len(order) + 1e-9)
    return set(order[len(order) - n_low:]) if n_low > 0 else set()


def boundary_L(accuracy: list[float | None], threshold: float) -> int:
    """Fate §4.4: MoE layers before the first depth from which every layer's accuracy is >= threshold.

    accuracy[j] is the prefetch recall of MoE layer j (None for the first, which has no predictor and
    so always counts as shallow).
    """
    L = len(accuracy)
    for j in range(len(accuracy) - 1, -1, -1):
        if accuracy[j] is None or accuracy[j] < threshold:
            break
        L = j
    return L


def int2_share(losses: dict[float, float], max_loss: float) -> float:
    """Fate §4.5's heuristic search: scan shares upward, keep the last one whose loss <= max_loss."""
    best = 0.0
    for p in sorted(losses):
        if losses[p] > max_loss:
            break
        best = p
    return best


class CrossLayerPrefetch:
    """Fate §4.3: fetch layer i+1's experts predicted from layer i's gate input.

    Decode: experts above the `percentile` of predicted scores, not yet resident, best first, capped
    at n, at `bits`. Prefill: every expert in some token's predicted top-k, most popular first, the
    least popular p of them at `low_bits` (§4.5).
    """

    def __init__(self, ctx: EngineContext, bits: int, low_bits: int, p: float, n: int, percentile: float):
        self.ctx, self.bits, self.low_bits, self.p, self.percentile = ctx, bits, low_bits, p, percentile
        self.n = transfer_cap(ctx, bits, n)

    def __call__(self, view: LayerView) -> list[Fetch]:
        pred = predicted_scores(view, self.ctx)
        if pred is None:
            return []
        nxt, scores = pred  # [T, E]
        if view.step.phase == Phase.DECODE:
            wanted = [e for e in above_percentile(scores, self.percentile)
                      if self.bits not in view.residency.resident_bits(nxt, e)]
            return [Fetch(nxt, e, self.bits) for e in wanted[: self.n]]
        k = min(self.ctx.top_k, scores.shape[1])
        counts = popularity(torch.topk(scores, k, dim=-1).indices, scores.shape[1])  # [E] predicted popularity
        # One ranking for both rules: transfers most popular first (§4.3), and the INT2 experts (§4.5)
        # are the tail of that same order (equal popularity: the higher summed score ranks first).
        tie = scores.sum(0)  # [E]
        order = by_popularity(counts, tie)
        low = int2_experts(counts, self.p, tie) if self.low_bits != self.bits else set()
        out = []
        for e in order:
            have = view.residency.resident_bits(nxt, e)
            bits = self.low_bits if e in low else self.bits
            if self.bits in have or bits in have:
                continue
            out.append(Fetch(nxt, e, bits))
        return out

    def on_device(self, view: DeviceView) -> tuple[torch.Tensor | None, int]:
        """The decode rule inside the captured step: the next layer's experts above the percentile
        that are not resident at `bits`, best first, at most n (-1 padding)."""
        nxt = next_moe_layer(self.ctx, view.moe_pos)
        logits = view.predict(nxt) if nxt is not None else None
        if logits is None:
            return None, self.bits
        chosen, best = device.above_percentile(torch.softmax(logits.float(), dim=-1), self.percentile)  # [E]
        chosen = chosen & ~view.resident(nxt, self.bits)
        return device.best_first(best, chosen, min(self.n, chosen.shape[0])), self.bits


@register("fate")
class Fate(Policy):
    """Cross-layer prefetch + shallow-favoring ARC cache at `cache_bits` + INT2 for unpopular prefill experts.

    With cache_bits=16 and low_bits=16 every routed expert runs exactly, at 16 bits (lossless).
    """

    @dataclass(frozen=True)
    class Params(Params):
        L: int = 3  # shallow/deep boundary in MoE layers (Qwen1.5-MoE's value, §4.4)
        p: float = 0.25  # share of prefill experts moved at INT2, least popular first (§4.5)
        n: int = 0  # decode transfers per layer; 0 = T / t_expert from the hardware profile (§4.3)
        percentile: float = 0.75  # decode prefetch: predicted score above this quantile (§4.2)
        cache_bits: int = 4  # precision of cached experts (HQQ INT4, §4.5)
        low_bits: int = 2  # precision of the unpopular prefill experts (INT2, §4.5)
        position: int = 2  # Table 1 input position for prediction; the engine provides position 2 only
        eviction: str = "arc"  # per-layer eviction (§4.4)
        prefetcher: str = "fate"  # "fate" or "none" (ablation, Fig. 14)

        def __post_init__(self) -> None:
            if self.position not in (1, 2, 3):
                raise ValueError("position must be 1, 2 or 3 (Fate Table 1)")
            if self.position != 2:
                raise ValueError(f"position {self.position} is not available: the engine predicts from the "
                                 "gate input of the previous layer (position 2) only")
            if not 0.0 <= self.p <= 1.0 or not 0.0 <= self.percentile < 1.0:
                raise ValueError("p must be in [0, 1] and percentile in [0, 1)")
            if self.prefetcher not in ("fate", "none"):
                raise ValueError(f"prefetcher must be 'fate' or 'none', not '{self.prefetcher}'")

    def __init__(self, params: Params, ctx: EngineContext):
        super().__init__(params, ctx)
        check_eviction(self.name, params.eviction)
        check_bits(self.name, ctx, params.cache_bits, *((params.low_bits,) if params.p > 0 else ()))
        check_at_most(self, "L", len(ctx.moe_layers), "MoE layers")
        check_at_most(self, "n", ctx.num_experts, "experts per layer")
        self.low_slots, self.quota = pool_split(ctx, params.L, params.p, params.cache_bits, params.low_bits)
        self.prefetcher = CrossLayerPrefetch(ctx, params.cache_bits, params.low_bits, params.p, params.n,
                                             params.percentile) if params.prefetcher == "fate" else None

    def precisions(self) -> tuple[int, int]:
        return self.params.cache_bits, self.params.low_bits if self.params.p > 0 else self.params.cache_bits

    def pools(self) -> list[Pool]:
        pools = [Pool(self.params.cache_bits, sum(self.quota.values()), quota=self.quota,
                      eviction=self.params.eviction)]
        if self.low_slots:
            # INT2 copies are transient (§4.5 moves them for the prefill): one small global LRU pool,
            # enough for one layer's INT2 experts while the next layer's arrive.
            pools.append(Pool(self.params.low_bits, self.low_slots, eviction="lru"))
        return pools

    def warm(self) -> list[Fetch]:
        # Fully cached shallow layers are never evicted from: load them up front (§4.4, "all shallow
        # layer experts are fully cached").
        return [Fetch(layer, e, self.params.cache_bits) for layer, q in self.quota.items()
                if q >= self.ctx.num_experts for e in range(self.ctx.num_experts)]

    def admit(self, want: Fetch, residency: ResidencyView, shield: set[Key], demand: bool) -> list[Fetch] | None:
        """An INT2 copy is not cached for an expert already held at `cache_bits` (§4.5 moves the
        unpopular experts at INT2, not the ones the cache holds)."""
        if want.bits != self.params.cache_bits and self.params.cache_bits in residency.resident_bits(want.layer,
                                                                                                   want.expert):
            return None
        return residency.make_room(want, shield, demand)

    def plan(self, view: LayerView) -> LayerPlan:
        """Run every routed expert (no substitution, no skipping); only its precision is chosen.

        Decode: `cache_bits` (§4.5, INT4 only). Prefill: a resident copy if there is one (the
        prefetcher moved unpopular experts at INT2 on purpose), else INT2 for the least popular p of
        this layer's actual routing and `cache_bits` for the rest.
        """
        E, cfg = view.num_experts, self.params
        plan = LayerPlan.routed(view, cfg.cache_bits)
        if view.step.phase == Phase.DECODE or cfg.p <= 0 or cfg.low_bits == cfg.cache_bits:
            return plan
        # §4.5 moves the unpopular experts at INT2 whether or not the budget holds an INT2 pool
        # (low_slots = 0 at a budget under two INT2 experts: they then stream through staging).
        valid = plan.running()  # [T, k]
        low = int2_experts(popularity(view.top_k_index, E), cfg.p)
        bits_of = {}
        for e in routed_experts(plan.expert, valid):
            have = view.residency.resident_bits(view.layer, e)
            if cfg.cache_bits in have:
                bits_of[e] = cfg.cache_bits
            elif cfg.low_bits in have or e in low:
                bits_of[e] = cfg.low_bits
        assign_by_expert(plan.bits, plan.expert, valid, bits_of)
        return plan

    def prefetch(self, view: LayerView) -> list[Fetch]:
        return self.prefetcher(view) if self.prefetcher is not None else []

    def plan_step(self, view: DeviceView) -> DevicePlan:
        """A decode token inside the captured step: every routed expert at `cache_bits` (§4.5), and the
        cross-layer prefetch (§4.3). Its copies start one step behind, from the step's log: an expert
        predicted for layer i+1 arrives for the next token, not this one (the paper's overlap within
        a token is what a host-driven step does; measured against it in docs/engine.md "The captured
        decode step")."""
        plan = DevicePlan.of_router(view, self.params.cache_bits)
        if self.prefetcher is not None:
            plan.prefetch, plan.prefetch_bits = self.prefetcher.on_device(view)
        return plan

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "quota": self.quota,
                "transfer_cap": self.prefetcher.n if self.prefetcher is not None else None}

    # -- fit and report --------------------------------------------------------------------------
    @classmethod
    def fit(cls, inputs: FitInputs) -> Fitted:
        """L (§4.4) from the profile's per-layer decode prefetch recall; n (§4.3) from its timings;
        p (§4.5) from fate evals at several p (p = 0 among them), else the profile's INT2-share
        perplexity curve."""
        cfg, prof, out = inputs.config, inputs.profile, Fitted()
        info, fate = prof.info, out.evidence
        if prof.prefetch is not None:
            recall = {lp.layer: lp.recall_topk.get("decode", lp.recall_topk.get("prefill"))
                      for lp in prof.prefetch.layers}
            acc = [recall.get(layer) for layer in info.moe_layers]
            fate["L"] = {"value": boundary_L(acc, cfg.l_threshold), "threshold": cfg.l_threshold, "accuracy": acc,
                         "from": "profile.prefetch.layers[].recall_topk.decode (next router on this gate input)"}
        else:
            out.skipped["L"] = "the profile has no prefetch part (--what prefetch)"
        hw = prof.hw or {}
        if prof.timing is not None and (prof.timing.h2d_gbps or hw.get("h2d_gbps")):
            t, bits = prof.timing, cls.Params().cache_bits  # n for the INT4 cache's transfers
            window = sum(x.t_moe + x.t_attn + x.t_gate for x in t.layers) / max(1, len(t.layers))
            h2d = t.h2d_gbps or hw.get("h2d_gbps")
            nbytes = info.expert_bytes[bits]
            t_io = nbytes / (h2d * 1e9) + hw.get("copy_latency_s", 0.0)
            h2d_from = "measured" if t.h2d_gbps else "hw preset " + str(prof.settings.get("hw_base"))
            fate["n"] = {"value": transfer_n(window, t_io, info.num_experts), "T_s": window, "t_expert_s": t_io,
                         "expert_bytes": nbytes, "bits": bits, "h2d_gbps": h2d,
                         "from": f"profile.timing.layers (T = t_moe + t_attn + t_gate, decode, measured on {t.device}); "
                                 f"t_expert = INT4 blob / h2d ({h2d_from})"}
        else:
            out.skipped["n"] = "the profile has no timing part with a host-to-device bandwidth (--what timing)"
        by_p = {}
        for path, e in inputs.evals:
            m = primary_metric(e.metrics)
            if e.policy == cls.name and m and "p" in e.params:
                by_p[float(e.params["p"])] = (m, path)
        if len(by_p) >= 2 and 0.0 in by_p:
            (name, base, higher), _ = by_p[0.0]
            losses = {p: ((base - v) / base if higher else (v - base) / base) for p, ((_, v, _), _) in by_p.items()}
            fate["p"] = {"value": int2_share(losses, cfg.max_loss), "max_loss": cfg.max_loss,
                         "losses": {f"{p:g}": v for p, v in losses.items()}, "metric": name,
                         "from": [path for _, path in by_p.values()]}
        elif prof.sensitivity is not None and prof.sensitivity.int2_share:
            curve = {float(k): v for k, v in prof.sensitivity.int2_share.items()}
            base = curve.get(0.0)
            losses = {p: (v - base) / base for p, v in curve.items()} if base else {}
            fate["p"] = {"value": int2_share(losses, cfg.max_loss), "max_loss": cfg.max_loss,
                         "losses": {f"{p:g}": v for p, v in losses.items()}, "metric": "held-out perplexity",
                         "from": "profile.sensitivity.int2_share (INT4 cache, least popular share at INT2)"}
        else:
            out.skipped["p"] = "needs fate eval artifacts at p=0 and another p, or a profile with sensitivity"
        out.knobs = {k: v["value"] for k, v in fate.items()}
        return out

    @classmethod
    def report(cls, inputs: ReportInputs) -> Section:
        """Per profile: Table 1 (which input predicts the next gate), the INT2-share curve (Fig. 10,
        the fitted p marked) and per-layer prefetch recall (Fig. 7, the fitted L marked)."""
        part, md = Section(), []
        for path, prof in inputs.profiles:
            tag, fits = inputs.tag(path), inputs.fits_for(prof)
            if prof.similarity and prof.similarity.positions:
                pf = prof.prefetch.positions if prof.prefetch else {}
                md += [f"### Fate Table 1 (positions vs Gate_in(i+1)), `{path.name}`\n\n",
                       table(["position", "mean cosine", "prefetch recall prefill", "prefetch recall decode"],
                             [[pos, v, pf.get(pos, {}).get("prefill"), pf.get(pos, {}).get("decode")]
                              for pos, v in prof.similarity.positions.items()]), "\n"]
            if prof.sensitivity and prof.sensitivity.int2_share:
                md += [f"### INT2 share (Fate Fig. 10), INT4 otherwise, `{path.name}`\n\n",
                       table(["share p", "perplexity"], [[k, v] for k, v in prof.sensitivity.int2_share.items()]), "\n"]
                part.figures.append(_int2_figure(prof, fits, inputs.out_dir / f"int2_share{tag}.png"))
            if prof.prefetch and prof.prefetch.layers:
                part.figures.append(_prefetch_figure(prof, fits, inputs.out_dir / f"prefetch{tag}.png"))
        if md:
            part.markdown = "## Fate (Fang et al., 2025)\n\n" + "".join(md)
        return part


def _int2_figure(prof: Any, fits: list, path: Path) -> Path:
    from moetool.figures import plt, save

    curve = sorted((float(k), v) for k, v in prof.sensitivity.int2_share.items())
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([100 * p for p, _ in curve], [v for _, v in curve], "o-")
    for f in fits:
        if "p" in f.params.get("fate", {}):
            ax.axvline(100 * f.params["fate"]["p"], color="red", ls="--", label=f"fitted p = {f.params['fate']['p']:g}")
            ax.legend()
    ax.set(xlabel="% of active experts at INT2 (least popular first), rest INT4", ylabel="held-out perplexity",
           title="Perplexity vs INT2 share (Fate Fig. 10)")
    return save(fig, path)


def _prefetch_figure(prof: Any, fits: list, path: Path) -> Path:
    from moetool.figures import int_axis, plt, save

    p, layers = prof.prefetch, list(prof.info.moe_layers)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    xs = [lp.layer for lp in p.layers]
    for name, style, get in (("decode, top-k", "o-", lambda lp: lp.recall_topk.get("decode")),
                             ("decode, 75th pct", "s--", lambda lp: lp.recall_p75.get("decode")),
                             ("prefill, top-k", "^:", lambda lp: lp.recall_topk.get("prefill"))):
        ax.plot(xs, [get(lp) if get(lp) is not None else np.nan for lp in p.layers], style, label=name)
    int_axis(ax, layers[0], layers[-1])
    for f in fits:
        fl = f.evidence.get("fate", {}).get("L")
        if fl:
            ax.axhline(fl["threshold"], color="gray", ls=":", label=f"threshold {fl['threshold']:g}")
            if fl["value"] < len(layers):
                ax.axvline(layers[fl["value"]] - 0.5, color="red", ls="--", label=f"fitted L = {fl['value']}")
    ax.set(xlabel="predicted MoE layer", ylabel="recall of the true experts", ylim=(0, 1.05),
           title="Cross-layer prefetch accuracy (Fate Fig. 7)")
    ax.legend(fontsize=7)
    return save(fig, path)

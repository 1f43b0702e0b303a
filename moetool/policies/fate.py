"""Fate (Fang et al., 2025): cross-layer gate prefetch, a shallow-favoring ARC cache, INT4/INT2 transfers.

- prefetch: layer i+1's router applied to layer i's gate input (Table 1, position 2); in decode the
  experts above the 75th percentile of predicted scores, at most n = T / t_expert of them (§4.3);
  in prefill every predicted expert, in descending order of predicted popularity (§4.3, Fig. 6);
- cache: the first `L` MoE layers fully cached if the budget allows, the rest split evenly
  (`cache_deep`, §4.4), ARC eviction per layer;
- quantization: cache at INT4; in prefill the least popular `p` of the experts move at INT2 (§4.5);
- fit: L from per-layer prefetch recall (§4.4), n = T / t_expert from timings (§4.3), p from the loss
  at each INT2 share (§4.5); report: Table 1, Fig. 7 (prefetch recall with L), Fig. 10 (INT2 share).
  Both, and the knobs, are in `fate_knobs.py` (read without torch); this file is the engine half.

    policy = make_policy("fate", {"L": "3", "p": "0.25"}, ctx)

DyMoE and SMoE can use Fate's prefetcher (`--set prefetcher=fate`), so `CrossLayerPrefetch` is
imported from here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from moetool.bits import Bits
from moetool.errors import MoetoolError
from moetool.policies.base import (EngineContext, Fetch, Key, LayerPlan, LayerView, Params, Phase, Policy, Pool,
                                   ResidencyView, check_at_most, register)
from moetool.policies import device
from moetool.policies.common import (assign_by_expert, check_bits, check_eviction, counted, hw_seconds, next_moe_layer,
                                     popularity, predicted_scores, routed_experts)
from moetool.policies.device import DevicePlan, DeviceView
from moetool.policies.fate_knobs import FateKnobs, transfer_n

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


def ample(ctx: EngineContext) -> bool:
    """Whether the expert cache holds every expert at 16 bits (stored in the bundle): memory that is not
    "insufficient", where §4.5 does not quantize the cache."""
    every = len(ctx.moe_layers) * ctx.num_experts
    return Bits.BF16 in ctx.available_bits and ctx.cache_bytes >= every * ctx.expert_bytes[Bits.BF16]


def pool_split(ctx: EngineContext, L: int, p: float, cache_bits: int, low_bits: int) -> tuple[int, dict[int, int]]:
    """(INT2 slots, `cache_bits` slots per MoE layer) from the expert budget.

    INT2 copies get 2 * floor(p * E) slots (one layer's unpopular experts while the next layer's
    arrive: at most floor(p * M) <= floor(p * E) of its M active experts, `int2_experts`), at most half
    the budget; the rest is §4.4's cache_total, split shallow-favoring.
    """
    budget, low_slots = ctx.cache_bytes, 0
    if p > 0 and low_bits != cache_bits:
        lo_bytes = ctx.expert_bytes[low_bits]
        low_slots = max(0, min(2 * low_count(p, ctx.num_experts), budget // 2 // lo_bytes))
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


def low_count(p: float, active: int) -> int:
    """How many of `active` experts §4.5 moves at INT2: floor(p * M) (see `int2_experts`)."""
    return math.floor(p * active + 1e-9)


def int2_experts(counts: torch.Tensor, p: float, tie: torch.Tensor | None = None) -> set[int]:
    """Fate §4.5: the least popular floor(p * M) of the M active experts, the tail of `by_popularity`
    (ties: the smaller `tie`, then the higher index). §4.5 names a share p of experts without a
    rounding; floor (ours) keeps the INT2 share at most p, the share whose loss its search bounds."""
    order = by_popularity(counts, tie)
    n_low = low_count(p, len(order))
    return set(order[len(order) - n_low:]) if n_low > 0 else set()


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
        chosen, best = device.above_percentile(self.ctx.routers.scores(nxt, logits), self.percentile)  # [E]
        chosen = chosen & ~view.resident(nxt, self.bits)
        return device.best_first(best, chosen, min(self.n, chosen.shape[0])), self.bits


@register("fate")
class Fate(FateKnobs, Policy):
    """Cross-layer prefetch + shallow-favoring ARC cache at `cache_bits` + INT2 for unpopular prefill experts.

    With cache_bits=16 and low_bits=16 every routed expert runs exactly, at 16 bits (lossless).
    """

    reads_scores = True  # `ctx.routers`: the router's own scores

    def __init__(self, params: Params, ctx: EngineContext):
        super().__init__(params, ctx)
        check_eviction(self.name, params.eviction)
        check_at_most(self, "L", len(ctx.moe_layers), "MoE layers")
        check_at_most(self, "n", ctx.num_experts, "experts per layer")
        # §4.5 quantizes the cache "when memory resources are insufficient": where every expert fits at
        # 16 bits, they are cached so, all of them warmed, and nothing moves at INT2 (nothing moves)
        # (auto upgrades the default cache_bits only: another one given, INT2 say, is what was asked for)
        self.unquantized = params.quantize_cache == "auto" and params.cache_bits == type(params)().cache_bits \
            and ample(ctx)
        if self.unquantized:
            self.params = dataclasses.replace(self.params, cache_bits=int(Bits.BF16))
        params = self.params  # as clamped, and at the bits it caches
        self.int2 = params.p > 0 and params.low_bits != params.cache_bits and not self.unquantized
        if self.int2 and low_count(params.p, ctx.num_experts) == 0:
            # floor(p * M) of M <= E active experts is 0 for any M: p moves nothing, while an INT2 pool
            # for it would take cache from the INT4 experts (the default on a model of < 4 experts)
            why = (f"knob 'p' of policy 'fate' is {params.p:g}, but floor(p * M) of a layer's M <= {ctx.num_experts} "
                   f"active experts is 0, so no expert would move at INT2 (§4.5; p >= {1 / ctx.num_experts:.3g} moves one).")
            if params.p != type(params)().p:
                raise MoetoolError(why)
            self.clamped["p"] = why
            self.params = params = dataclasses.replace(params, p=0.0)
            self.int2 = False
        check_bits(self.name, ctx, params.cache_bits, *((params.low_bits,) if self.int2 else ()))
        self.low_slots, self.quota = pool_split(ctx, params.L, params.p if self.int2 else 0.0, params.cache_bits,
                                                params.low_bits)
        bare = [layer for layer in ctx.moe_layers if self.quota[layer] == 0]
        self.says_bare_layers = True
        if bare:  # §4.4: "if memory resources are limited, Fate allocates expert cache space sequentially to the first L layers"
            many = len(bare) > 1
            self.notes.append(f"fate's cache of {sum(self.quota.values())} experts at {params.cache_bits} bits fills its first "
                              f"L={params.L} MoE layers in order (§4.4, memory limited), so MoE layer{'s' if many else ''} "
                              f"{', '.join(map(str, bare))} {'cache' if many else 'caches'} none and "
                              f"{'load every expert they run' if many else 'loads every expert it runs'} "
                              "(a smaller L spreads the cache)")
        self.prefetcher = CrossLayerPrefetch(ctx, params.cache_bits, params.low_bits, params.p, params.n,
                                             params.percentile) if params.prefetcher == "fate" else None

    def precisions(self) -> tuple[int, int]:
        return self.params.cache_bits, self.params.low_bits if self.int2 else self.params.cache_bits

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
        prefetcher moved unpopular experts at INT2 on purpose), else one in flight (the prefetch list
        carries "the quantization bit width for each expert", §4.1, from the predicted popularity:
        asking the other precision would copy the expert a second time), else INT2 for the least
        popular p of this layer's actual routing and `cache_bits` for the rest.
        """
        E, cfg = view.num_experts, self.params
        plan = LayerPlan.routed(view, cfg.cache_bits)
        if view.step.phase == Phase.DECODE or not self.int2:
            return plan
        # §4.5 moves the unpopular experts at INT2 whether or not the budget holds an INT2 pool
        # (low_slots = 0 at a budget under two INT2 experts: they then stream through staging).
        valid = plan.running()  # [T, k]
        counts = popularity(counted(view, view.top_k_index), E)  # the requests' popularity
        # an expert routed by padding alone serves no request: the tail too
        low = int2_experts(counts, cfg.p) | set((counts == 0).nonzero().squeeze(1).tolist())
        bits_of = {}
        for e in routed_experts(plan.expert, valid):
            have = view.residency.resident_bits(view.layer, e)
            coming = view.residency.loading_bits(view.layer, e) if not have else ()
            if cfg.cache_bits in have or (not have and cfg.cache_bits in coming):
                bits_of[e] = cfg.cache_bits
            elif cfg.low_bits in have or cfg.low_bits in coming or e in low:
                bits_of[e] = cfg.low_bits
        assign_by_expert(plan.bits, plan.expert, valid, bits_of)
        return plan

    def prefetch(self, view: LayerView) -> list[Fetch]:
        return self.prefetcher(view) if self.prefetcher is not None else []

    def plan_step(self, view: DeviceView) -> DevicePlan:
        """A decode token inside the captured step: every routed expert at `cache_bits` (§4.5), and the
        cross-layer prefetch (§4.3). Its copies start one step behind, from the step's log: an expert
        predicted for layer i+1 arrives for the token after next (the next is in flight), not this one
        (the paper's overlap within a token is what a host-driven step does; measured against it in
        docs/engine.md "The captured decode step")."""
        plan = DevicePlan.of_router(view, self.params.cache_bits)
        if self.prefetcher is not None:
            plan.prefetch, plan.prefetch_bits = self.prefetcher.on_device(view)
        return plan

    def describe(self) -> dict[str, Any]:
        # whether the cache ran unquantized (§4.5, memory sufficient) and whether any expert moved at INT2
        return {**super().describe(), "quota": self.quota, "cache_quantized": not self.unquantized,
                "int2_prefill": self.int2,
                "transfer_cap": self.prefetcher.n if self.prefetcher is not None else None}

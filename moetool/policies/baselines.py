"""Baseline policies: resident, static, lod, lru, eap.

- `resident`: every expert on the device at the reference precision (the exact upper bound).
- `static`: every expert on the device at one uniform precision (`--set bits=8|4|2`).
- `lod`: load on demand, no reuse across tokens (every use is a transfer).
- `lru`: a per-layer LRU cache of experts, as in mixtral-offloading.
- `eap`: LRU cache + activation-path prefetch: the next layer's experts predicted from
  co-activation counts of earlier tokens (the MoE-Infinity / Lina family; Fate's EAP baseline).

Their knobs are in `baselines_knobs.py`.

    policy = make_policy("lru", {}, ctx)
"""

from __future__ import annotations

import torch

from moetool.errors import MoetoolError, size_text
from moetool.policies.base import (EngineContext, Fetch, LayerView, Params, Policy, Pool, check_at_most, register,
                                   valid_slots)
from moetool.policies.baselines_knobs import (ActivationPathPrefetchKnobs, LoadOnDemandKnobs, LRUCacheKnobs,
                                              ResidentKnobs, StaticKnobs)
from moetool.policies.common import all_experts, check_eviction, counted, even_quota


@register("resident")
class Resident(ResidentKnobs, Policy):
    host_routing = False  # every expert resident, the router's own plan: nothing to decide per layer

    def __init__(self, params: Params, ctx: EngineContext):
        super().__init__(params, ctx)
        need = all_experts(ctx) * ctx.expert_bytes[params.bits]
        if need > ctx.cache_bytes:
            raise MoetoolError(f"policy '{self.name}' keeps all {all_experts(ctx)} experts at {params.bits} bits "
                               f"({size_text(need)}) but the budget leaves {size_text(ctx.cache_bytes)} "
                               "for experts; raise --budget.")

    def pools(self) -> list[Pool]:
        # The pool holds every expert: nothing is ever evicted, so it needs no eviction order.
        return [Pool(self.params.bits, all_experts(self.ctx), eviction=None)]

    def warm(self) -> list[Fetch]:
        return [Fetch(layer, e, self.params.bits) for layer in self.ctx.moe_layers for e in range(self.ctx.num_experts)]


@register("static")
class Static(StaticKnobs, Resident):
    """Uniform quantization, all resident: `resident` at `bits` (default 4)."""


@register("lod")
class LoadOnDemand(LoadOnDemandKnobs, Policy):
    """Every routed expert loaded when used, none kept: the base policy's defaults."""


@register("lru")
class LRUCache(LRUCacheKnobs, Policy):
    """Per-layer expert cache; the budget's slots split evenly over layers (mixtral-offloading)."""

    def __init__(self, params: Params, ctx: EngineContext):
        super().__init__(params, ctx)
        check_eviction(self.name, params.eviction)
        slots = min(ctx.cache_bytes // ctx.expert_bytes[params.bits], all_experts(ctx))
        self.quota = even_quota(ctx.moe_layers, slots)

    def pools(self) -> list[Pool]:
        # Plain recency: a prefetched copy's first use is a reference like any other (mixtral-offloading);
        # another order (arc, lfu) counts its admission only, the engine's default (ARC's lists need it)
        return [Pool(self.params.bits, sum(self.quota.values()), quota=self.quota, eviction=self.params.eviction,
                     prefetch_is_reference=self.params.eviction != "lru")]


@register("eap")
class ActivationPathPrefetch(ActivationPathPrefetchKnobs, LRUCache):
    """LRU cache + prefetch of the next layer's experts predicted from co-activation statistics.

    counts[l][i, j] counts tokens that used expert i in MoE layer l and expert j in layer l+1. For
    the current tokens, the score of j is the sum of counts[l][i, j] over their experts i; the
    top `k` (the model's top-k, or `--set k=`) are prefetched. Counts are updated from the actual
    routing of each step, so the predictor learns online from previous tokens.
    """

    def __init__(self, params: Params, ctx: EngineContext):
        super().__init__(params, ctx)
        check_at_most(self, "k", ctx.num_experts, "experts per layer")
        E, n = ctx.num_experts, len(ctx.moe_layers)
        self.counts = torch.zeros(n, E, E)  # [L, E, E]
        self.prev: torch.Tensor | None = None  # [T, E] experts of the previous MoE layer in this forward

    def log_layer(self, view: LayerView) -> list[Fetch]:
        """The captured step: the counts and the prediction read only the routing, so they run on the
        host one step behind; the next layer's experts are fetched for the token after next (the next is in flight)."""
        return self.prefetch(view)

    def prefetch(self, view: LayerView) -> list[Fetch]:
        i = view.moe_pos
        if i == 0:
            self.prev = None  # a new forward: the first MoE layer has no predecessor
        E = self.ctx.num_experts
        idx = counted(view, view.top_k_index)  # the requests' tokens: a batch's left padding co-activates nothing
        now = torch.zeros(idx.shape[0], E)  # [T, E] one-hot of this layer's experts
        # a slot the router dropped (-1, or E) runs no expert: it co-activates nothing
        now.scatter_add_(1, idx.clamp(0, E - 1), valid_slots(idx, E).float()).clamp_(max=1.0)
        if self.prev is not None and i > 0:
            self.counts[i - 1] += self.prev.t() @ now  # co-activation of layer i-1 -> layer i
        self.prev = now
        if i + 1 >= len(self.ctx.moe_layers):
            return []
        score = (now @ self.counts[i]).sum(0)  # [E]
        if score.sum() == 0:
            return []
        k = self.params.k or self.ctx.top_k
        nxt = self.ctx.moe_layers[i + 1]
        return [Fetch(nxt, int(e), self.params.bits) for e in torch.topk(score, min(k, E)).indices
                if score[e] > 0]

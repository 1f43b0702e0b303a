"""DyMoE (Huang et al., 2026): importance-driven mixed precision with a depth schedule and look-ahead prefetch.

- importance: prefill, the heavy-hitter token load of each expert (eq. 1-2; s_i is the engine's
  "token_importance" signal, `engine/signals.py`); decode, the gate score (eq. 3);
- depth-aware scheduling: retention r(l) on a cosine schedule (eq. 4), t_l = ceil(r(l) * M) critical
  experts per layer (eq. 5), critical at `high_bits`, the rest at `low_bits` (0 = skipped);
- look-ahead prefetch: the next layer's router on this layer's hidden state (eq. 6), token-frequency
  top-t in prefill (eq. 7), direct top-t in decode (eq. 8);
- a mixed-precision cache with three rules: no duplication, precision promotion, conservative reuse;
- fit: lambda for a target share r of critical experts (Table 2), or for the r a budget holds (eq. 4-5); report: the
  fitted schedule, Table 3's ablation, Fig. 5 (per-layer sensitivity) and Fig. 11 (quality vs r).
  Both, the knobs and the depth schedule (eq. 4-5) are in `dymoe_knobs.py` (read without torch);
  this file is the engine half.

In the captured decode step (`plan_step`) the decode rules run on the device as written; the cache's
admissions (rules 1 and 2) and the look-ahead's copies happen one step behind, from the step's log:
an expert eq. 8 predicts for layer l+1 is fetched for the token after next (the next is already in
flight), not for this one (measured against the host path in docs/engine.md "The captured decode step").

    policy = make_policy("dymoe", {"config": "4/0", "r": "0.9"}, ctx)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from moetool.errors import MoetoolError
from moetool.policies.base import (EngineContext, Fetch, Key, LayerPlan, LayerView, Params, Phase, Policy, Pool,
                                   ResidencyView, Where, register)
from moetool.policies.common import (assign_by_expert, check_bits, check_eviction, counted, even_quota, next_moe_layer,
                                     popularity, predicted_scores, routed_experts, valid_slots)
from moetool.policies.device import DevicePlan, DeviceView, lookup, rank_in_token, valid
from moetool.policies.dymoe_knobs import EPS, DyMoEKnobs, critical_count, critical_share, retention, solve_lambda
from moetool.policies.fate import CrossLayerPrefetch
from moetool.policies.knobs import parse_tiers

# -- phase-adaptive importance (§4.2) --------------------------------------------------------------


def prefill_importance(idx: torch.Tensor, s: torch.Tensor | None, num_experts: int,
                       hh_ratio: float) -> torch.Tensor:
    """DyMoE eq. 2: heavy-hitter tokens routed to each expert [E]; T_imp = the top ceil(hh_ratio * T) tokens by s_i.

    s_i is eq. 1 (the engine averages the attention each token receives over heads). The paper's
    models have softmax attention in every layer; after a Mamba, linear-attention or convolution
    mixer the engine passes the nearest softmax layer's s_i before it (our choice: heavy hitters
    persist across layers). Without any, every token counts, which is the plain token load.
    """
    T = idx.shape[0]
    if s is None or s.numel() != T:
        return popularity(idx, num_experts).float()
    n = max(1, math.ceil(hh_ratio * T - EPS))
    heavy = torch.zeros(T, dtype=torch.bool)
    heavy[torch.topk(s.float(), min(n, T)).indices] = True  # T_imp
    return popularity(idx[heavy], num_experts).float()  # [E]


def decode_importance(idx: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """DyMoE eq. 3: I(E_j) = g_j, the routing weight [E]; summed over tokens when a step decodes several."""
    valid = valid_slots(idx, num_experts)
    out = torch.zeros(num_experts)
    out.index_add_(0, idx[valid], weights[valid].float())
    return out  # [E]


def critical_experts(view: LayerView, r_l: float, hh_ratio: float) -> set[int]:
    """The t_l most important of the M experts selected in this layer (eq. 5).

    M is the number of distinct experts the router selected in this layer for this forward: k for
    one decode token (Fig. 9 ranks the token's top-k by gate score), the prompt's union in prefill
    (Fig. 8 ranks the activated experts by heavy-hitter load). So r = 1 keeps every selected expert
    critical, which is how Table 2's r = 1.0 column equals uniform Int4. Ties (often in prefill,
    where many experts get no heavy hitter) go to the larger token load, then to the larger weight.
    The plan ranks a decode step per token (`critical_slots`); for one token the two agree.
    """
    E, idx = view.num_experts, counted(view, view.top_k_index)  # a batch's left padding is no request's
    load = popularity(idx, E).float()  # [E]
    weight = decode_importance(idx, counted(view, view.top_k_weights), E)  # [E]
    if view.step.phase == Phase.PREFILL:
        importance = view.token_importance
        primary = prefill_importance(idx, counted(view, importance) if importance is not None else None, E, hh_ratio)
    else:
        primary = weight
    selected = (load > 0).nonzero().squeeze(1).tolist()
    t = critical_count(r_l, len(selected))
    ranked = sorted(selected, key=lambda e: (-float(primary[e]), -float(load[e]), -float(weight[e]), e))
    return set(ranked[:t])


def critical_slots(idx: torch.Tensor, weights: torch.Tensor, num_experts: int, r_l: float) -> torch.Tensor:
    """[T, k] bool: each decode token's t_l critical slots (eq. 3 and 5), the token ranked on its own.

    The paper decodes one token at a time (§1, batch size one): M is that token's k selected experts
    and t_l = ceil(r_l M). A step decoding several sequences ranks each sequence's token alone (ours),
    so a request keeps the experts it would keep decoded alone: pooling the batch's weights let one
    token lose every expert in 4/0 to its batch-mates'. The captured step ranks the same way
    (`plan_step`)."""
    run = valid(idx, num_experts)  # [T, k]
    k = idx.shape[1]
    t_of = torch.tensor([critical_count(r_l, m) for m in range(k + 1)])  # eq. 5, per M
    return run & (rank_in_token(weights, idx, run) < t_of[run.sum(1, keepdim=True)])


# -- look-ahead prefetch (§4.4.1) ------------------------------------------------------------------


class LookAhead:
    """DyMoE eq. 6-8: the next layer's gate on this hidden state; prefetch its t critical experts at `bits`.

    t is that layer's eq. 5 count with M predicted the same way (k in decode; the experts of the
    predicted top-k union in prefill): the paper prefetches "critical experts", leaving t unnamed.
    """

    def __init__(self, ctx: EngineContext, bits: int, schedule: list[float]):
        self.ctx, self.bits, self.schedule = ctx, bits, schedule

    def __call__(self, view: LayerView) -> list[Fetch]:
        pred = predicted_scores(view, self.ctx)  # eq. 6: g_hat = Softmax(h^(l) W_g^(l+1))
        if pred is None:
            return []
        nxt, g_hat = pred  # [T, E]
        r_next = self.schedule[view.moe_pos + 1]
        k = min(self.ctx.top_k, g_hat.shape[1])
        if view.step.phase == Phase.PREFILL:
            c = popularity(torch.topk(g_hat, k, dim=-1).indices, g_hat.shape[1])  # [E] eq. 7: c_e
            M = int((c > 0).sum())
            # Eq. 7 ranks by c_e alone; ties (ours): the larger mean predicted score, then the lower id.
            # Two stable sorts, not one key c + eps * score: in float32 a 1e-3 * score tie-break is lost
            # once c_e reaches a few hundred tokens, and the ties then fell to the lower id.
            order = torch.sort(g_hat.mean(0), descending=True, stable=True).indices  # [E]
            order = order[torch.sort(c[order], descending=True, stable=True).indices]  # [E] c_e first
        else:
            # eq. 8: TopK_t(g_hat) (one token; summed when a step decodes several); ties: the lower id
            order = torch.sort(g_hat.sum(0), descending=True, stable=True).indices  # [E]
            M = len(set(torch.topk(g_hat, k, dim=-1).indices.flatten().tolist()))
        t = critical_count(r_next, M)
        top = order[:t].tolist()
        return [Fetch(nxt, e, self.bits) for e in top if self.bits not in view.residency.resident_bits(nxt, e)]

    def on_device(self, view: DeviceView) -> tuple[torch.Tensor | None, int]:
        """Eq. 6 and 8 inside the captured step (one decode token: M = k, so t is known when traced):
        the next layer's t critical experts by predicted score, those not resident at `bits` (-1)."""
        nxt = next_moe_layer(self.ctx, view.moe_pos)
        logits = view.predict(nxt) if nxt is not None else None
        if logits is None:
            return None, self.bits
        g_hat = self.ctx.routers.scores(nxt, logits)  # [T, E] eq. 6 (the router's own scores)
        t = critical_count(self.schedule[view.moe_pos + 1], min(self.ctx.top_k, g_hat.shape[1]))
        top = torch.sort(g_hat.sum(0), descending=True, stable=True).indices[:t]  # [t] eq. 8
        return torch.where(lookup(view.resident(nxt, self.bits), top), -1, top), self.bits


# -- mixed-precision cache (§4.4.2) ----------------------------------------------------------------
# One per-layer pool per precision, each with the `eviction` order (§4.4.2 extends LRU), governed by
# the three rules in `DyMoE.admit` (no duplication, precision promotion) and `run_bits` (conservative
# reuse).


def run_bits(residency: ResidencyView, layer: int, expert: int, critical: bool, high: int, low: int) -> int:
    """The precision to run: high if critical (rule 2: a low copy does not serve it), else the
    resident high copy if any (rule 3, conservative reuse), else low.

    Rule 3 reuses a high copy "already cached": one still in flight (a look-ahead prefetch of an
    expert that turned out sub-critical) does not count, as written. The low copy then runs from
    the staging buffer, since rule 1 will not cache it beside the high one coming in; waiting for
    the high copy instead would move no extra bytes but run the expert at a precision the plan did
    not ask for (our reading; the paper's cache has no in-flight state)."""
    if critical or high in residency.resident_bits(layer, expert):
        return high
    return low


@register("dymoe")
class DyMoE(DyMoEKnobs, Policy):
    """Critical experts (eq. 2/3, 4, 5) at `high_bits`, the others at `low_bits` or skipped; look-ahead
    prefetch (eq. 6-8); a mixed-precision per-layer cache (§4.4.2)."""

    reads_scores = True  # `ctx.routers`: the router's own scores

    signals = frozenset({"token_importance"})  # eq. 1's s_i in prefill (the engine's "token_importance")

    def __init__(self, params: Params, ctx: EngineContext):
        super().__init__(params, ctx)
        self.high, self.low = parse_tiers(params.config, "'4/2' or '4/0'") or (params.high_bits, params.low_bits)
        if not self.high > self.low >= 0:
            raise MoetoolError(f"policy 'dymoe': high bits must exceed low bits, not {self.high}/{self.low}.")
        check_eviction(self.name, params.eviction)
        check_bits(self.name, ctx, self.high, *((self.low,) if self.low else ()))
        L = len(ctx.moe_layers)
        floor = critical_share(0.0, L, ctx.top_k)
        if params.lam < 0 and params.r < floor - EPS:  # eq. 4-5 keep more than r on this model whatever lam is
            why = (f"knob 'r' of policy 'dymoe' is {params.r:g}, but the cosine schedule (eq. 4-5) keeps at least "
                   f"{floor:.3f} of a token's top-{ctx.top_k} experts critical over {L} MoE layers.")
            if params.r != type(params)().r:
                raise MoetoolError(why)
            self.clamped["r"] = why  # the paper's default on a model with few experts a token: lam = 0 runs
        self.lam = params.lam if params.lam >= 0 else solve_lambda(params.r, L, ctx.top_k)
        self.schedule = [retention(l, L, self.lam) for l in range(L)]  # eq. 4 per MoE position
        self.share = critical_share(self.lam, L, ctx.top_k)  # Table 2's r as it runs (decode, M = top-k)
        if params.lam < 0 and "r" not in self.clamped and self.share - params.r > 0.02:
            self.notes.append(f"DyMoE's r = {params.r:g} keeps a share of {self.share:.3f} of a token's experts critical "
                              f"on this model: eq. 5's counts move it in steps of 1/(L k) = 1/{L * ctx.top_k} "
                              "(recorded as critical_share).")
        self.slots = self._split(self.share)
        self.prefetcher = {
            "dymoe": lambda: LookAhead(ctx, self.high, self.schedule),
            "fate": lambda: CrossLayerPrefetch(ctx, self.high, self.high, 0.0, 0, 0.75),
            "none": lambda: None,
        }[params.prefetcher]()

    def _split(self, r_mean: float) -> dict[int, int]:
        """Slots per precision. The paper's single mixed LRU has no fixed split; our pools are fixed, so
        bytes are shared in proportion to expected demand: r_mean of requests high, the rest low."""
        hb = self.ctx.expert_bytes[self.high]
        most = len(self.ctx.moe_layers) * self.ctx.num_experts
        if not self.low:
            return {self.high: min(most, self.ctx.cache_bytes // hb)}
        lb = self.ctx.expert_bytes[self.low]
        share = r_mean * hb / (r_mean * hb + (1.0 - r_mean) * lb)
        hi = min(most, int(share * self.ctx.cache_bytes) // hb)
        lo = min(most, (self.ctx.cache_bytes - hi * hb) // lb)
        return {self.high: hi, self.low: lo}

    def precisions(self) -> tuple[int, int]:
        return self.high, self.low  # `config` overrides the knobs

    def pools(self) -> list[Pool]:
        # §4.4.2 extends "the standard LRU cache": a look-ahead copy's first use is a reference like any
        # other (plain recency). Another order (`eviction=arc`, lfu) counts its admission only, as the
        # engine's default does: ARC would put every prefetched expert in its frequency list on first use
        return [Pool(b, n, quota=even_quota(self.ctx.moe_layers, n), eviction=self.params.eviction,
                     prefetch_is_reference=self.params.eviction != "lru") for b, n in self.slots.items() if n > 0]

    def admit(self, want: Fetch, residency: ResidencyView, shield: set[Key], demand: bool) -> list[Fetch] | None:
        """§4.4.2 rule 1 (no duplication): never a low copy next to a high one, resident or in flight;
        rule 2 (precision promotion): a high copy admitted for an expert held low evicts the low copy,
        even one still in flight (rule 1 counts copies in flight). Its slot is safe to reuse at once:
        copies run in order on one copy stream (`engine/transfer.py`), so a later fill lands after it."""
        layer, expert = want.layer, want.expert
        held = set(residency.resident_bits(layer, expert)) | set(residency.loading_bits(layer, expert))
        if want.bits not in (self.high, self.low) or (want.bits == self.low and self.high in held):
            return None
        victims = residency.make_room(want, shield, demand)
        if victims is not None and want.bits == self.high and self.low in held:
            victims = [Fetch(layer, expert, self.low), *victims]
        return victims

    def plan(self, view: LayerView) -> LayerPlan:
        """Critical experts at high bits; sub-critical at low bits (a resident high copy if any), or
        skipped in 4/0 (their routing weight dropped, the others' weights kept as the model gave them)."""
        plan = LayerPlan.routed(view, self.high)
        valid = plan.running()  # [T, k]
        r_l, per_slot = self.schedule[view.moe_pos], None
        if view.step.phase == Phase.DECODE:  # each sequence's token ranked alone (`critical_slots`)
            per_slot = critical_slots(view.top_k_index, view.top_k_weights, view.num_experts, r_l)
            critical = set(view.top_k_index[per_slot].tolist())
        else:  # the prompt's selected experts, ranked by heavy-hitter load (Fig. 8)
            critical = critical_experts(view, r_l, self.params.hh_ratio)
        bits_of, skipped = {}, {}
        for e in routed_experts(plan.expert, valid):
            if e not in critical and self.low == 0:
                # "4/0" (§5: it "entirely bypasses non-critical experts"): a 0-bit expert is not run at
                # all, its routing weight dropped, even where a high copy is resident (our reading: rule
                # 3's reuse answers a request for a low precision, and 4/0 requests none)
                skipped[e] = 0
            else:
                bits_of[e] = run_bits(view.residency, view.layer, e, e in critical, self.high, self.low)
        assign_by_expert(plan.bits, plan.expert, valid, bits_of)
        assign_by_expert(plan.weight, plan.expert, valid, skipped)
        assign_by_expert(plan.where, plan.expert, valid, {e: int(Where.SKIP) for e in skipped})
        if per_slot is not None and self.low == 0:
            # 4/0: a slot sub-critical for its own token is skipped, even where another token of the
            # step has the same expert critical (it runs, at high bits, for that token only)
            drop = valid & ~per_slot
            plan.weight[drop], plan.where[drop] = 0, int(Where.SKIP)
        return plan

    def prefetch(self, view: LayerView) -> list[Fetch]:
        return self.prefetcher(view) if self.prefetcher is not None else []

    def plan_step(self, view: DeviceView) -> DevicePlan:
        """`plan` for one decode token inside the captured step: the t_l critical experts (eq. 3 and
        5: the token's top weights, ties to the lower id) at high bits; the others skipped in 4/0,
        else at high bits where a high copy is resident (rule 3) and at low bits otherwise.

        Ranks slots, not experts: a top-k router names k distinct experts per token. A token naming one
        expert in two slots (no router in transformers does) would be ranked per slot here, where the
        host plan sums its weights and counts it once in M."""
        idx, w = view.top_k_index, view.top_k_weights  # [T, k]
        if idx.shape[0] != 1:
            raise NotImplementedError("DyMoE's in-step plan decides for one decode token (batch 1)")
        run = valid(idx, view.num_experts)
        M = run.sum(1, keepdim=True)  # [1, 1] experts selected (k unless the router dropped a slot)
        r_l, k = self.schedule[view.moe_pos], idx.shape[1]
        t_of = torch.tensor([critical_count(r_l, m) for m in range(k + 1)], device=idx.device)  # eq. 5, per M
        critical = run & (rank_in_token(w, idx, run) < t_of[M])
        # Rule 3 (a resident high copy serves a sub-critical expert) where there is a low precision; in
        # 4/0 a sub-critical expert is not run at all (the host plan's order of the two rules).
        high = critical | lookup(view.resident(view.layer, self.high), idx) if self.low else critical
        bits = torch.where(run, torch.where(high, self.high, self.low), 0)  # [T, k]; 0: skipped (4/0)
        plan = DevicePlan(expert=idx, bits=bits, weight=torch.where(bits > 0, w, torch.zeros_like(w)))
        if self.prefetcher is not None:
            plan.prefetch, plan.prefetch_bits = self.prefetcher.on_device(view)
        return plan

    def describe(self) -> dict[str, Any]:
        out = {**super().describe(), "lam_used": self.lam, "critical_share": self.share,
               "retention": [round(x, 4) for x in self.schedule], "slots": self.slots}
        if self.params.lam >= 0 or "r" in self.clamped:
            # An explicit lam overrides r (eq. 4), and an r below the schedule's floor runs lam = 0, so the
            # recorded r is the share that ran: the report's Table 3 rows and Fig. 11 read r.
            out["r"] = self.share
        return out

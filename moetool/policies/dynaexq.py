"""DynaExq (Chu et al., 2026): online, hotness-driven precision allocation under a fixed budget.

Every expert is resident at `b_lo` (a pool sized to all of them); each MoE layer also holds up to
`n_hi` experts at `b_hi`, chosen from a hotness EMA of router counts (§3.5) by a top-n rule with
hysteresis. Promotions are background migrations (`end_step`), admitted by the budget
(`admit`), published by the engine only when their copy has completed; the forward always
runs the version that is resident now (§3.2's invariant), so it never waits for a promotion: the
engine's residency is the handle table (a copy in flight is PROMOTING, a resident high copy outside
the target set is DEMOTING until a promotion reclaims its slot), so the policy keeps no state of its own.
In the captured decode step the counters and promotions run one step behind, from the step's log:
the paper's promotions are asynchronous already, so only the counters' timing moves (by one token).

Where this departs from the paper, by choice:
- the low tier never leaves. §3.1 reclaims an expert's old (low) version once its high one is
  published, and §3.2's DEMOTING copies the low version back before the high one goes; here the
  low copy stays, so a demotion is only the reclaim of the high slot (no transfer, never a moment
  without a low copy), at the cost of L * n_hi low copies' bytes that the paper would give to
  high ones (`budget_n_hi`: its n_hi divides by b_hi, not b_hi - b_lo);
- a published high copy serves from the next layer that routes to it, which may be in the same
  step (§3.1 makes it visible "at the next iteration"): the engine publishes a landed copy at each
  layer's start, for every policy.

Fit: n_hi for a budget (§3.1). Report: workload shift (Fig. 2), expert activation ratio vs batch
size (Tables 1-2), and §5's claim that 4/2 beats static INT2 at the same budget. Both, and the knobs,
are in `dynaexq_knobs.py` (read without torch); this file is the engine half.

    policy = make_policy("dynaexq", {"config": "4/2"}, ctx)
"""

from __future__ import annotations

from typing import Any

import torch

from moetool.errors import MoetoolError, size_text
from moetool.policies.base import (EngineContext, Fetch, Key, LayerPlan, LayerView, Params, Policy, Pool,
                                   ResidencyView, Step, register)
from moetool.policies.common import assign_by_expert, check_bits, counted, popularity, routed_experts
from moetool.policies.device import DevicePlan, DeviceView, lookup
from moetool.policies.dynaexq_knobs import DynaExqKnobs, budget_n_hi
from moetool.policies.knobs import parse_tiers


class Hotness:
    """§3.5 hotness: counters c_{l,e} over an update interval, then S <- ema * S + (1 - ema) * c.

    The paper's interval T_u is wall time; here it is `interval_tokens` tokens, so runs repeat
    exactly (an update happens at the first step boundary after that many tokens). The next interval
    starts at that boundary: a step that ends an interval mid-prompt, or spans several T_u (a long
    prompt), is one update with all its counts, and the tokens past T_u are not carried over.
    """

    def __init__(self, num_layers: int, num_experts: int, ema: float, interval_tokens: int):
        self.count = torch.zeros(num_layers, num_experts)  # [L, E] c, this interval
        self.score = torch.zeros(num_layers, num_experts)  # [L, E] S
        self.ema, self.interval = ema, interval_tokens
        self.tokens = 0

    def observe(self, pos: int, idx: torch.Tensor) -> None:
        self.count[pos] += popularity(idx, self.count.shape[1]).float()

    def tick(self, tokens: int) -> bool:
        """Count a step's tokens; at the end of an interval update S, reset c, and say so."""
        self.tokens += tokens
        if self.tokens < self.interval:
            return False
        self.score.mul_(self.ema).add_((1.0 - self.ema) * self.count)  # S <- a S + (1 - a) c
        self.count.zero_()
        self.tokens = 0
        return True


def select_high(score: torch.Tensor, current: set[int], n: int, margin: float) -> set[int]:
    """§3.5 H_l = TopN(S_l, n_hi) with hysteresis against the current set.

    Free capacity is filled with the hottest experts that saw any traffic (the paper's TopN would
    also fill it with experts of score 0; they are promoted once routed). Then an outside expert
    replaces an inside one only if it is hotter by more than `margin` (additive, in routed tokens
    per interval; at equality the incumbent stays): hottest outside against coldest inside, then
    the next pair, while that holds. That is the paper's two conditions (promote only above the
    lowest-ranked inside + margin, evict only below the highest-ranked outside - margin) applied one
    swap at a time, each against the set the previous swaps left, so two experts within the margin
    of each other are never swapped. Ties rank the lower expert id hotter.
    """
    s = score.tolist()
    H = set(current)
    for e in sorted(H, key=lambda e: (s[e], -e))[: max(0, len(H) - n)]:
        H.discard(e)  # the capacity shrank: drop the coldest
    outside = sorted((e for e in range(len(s)) if e not in H), key=lambda e: (-s[e], e))
    for e in outside:
        if len(H) >= n or s[e] <= 0:
            break
        H.add(e)
    outside = [e for e in outside if e not in H]
    inside = sorted(H, key=lambda e: (s[e], -e))
    for o, i in zip(outside, inside):
        if s[o] <= s[i] + margin:
            break
        H.discard(i)
        H.add(o)
    return H


@register("dynaexq")
class DynaExq(DynaExqKnobs, Policy):
    """Two tiers: all experts at b_lo, the n_hi hottest per layer also at b_hi (Tables 1-4)."""

    def __init__(self, params: Params, ctx: EngineContext):
        super().__init__(params, ctx)
        self.hi, self.lo = parse_tiers(params.config, "'16/4' or '4/2'") or (params.b_hi, params.b_lo)
        if not self.hi > self.lo > 0:
            raise MoetoolError(f"policy 'dynaexq': b_hi must exceed b_lo > 0, not {self.hi}/{self.lo}.")
        check_bits(self.name, ctx, self.hi, self.lo)
        L, E = len(ctx.moe_layers), ctx.num_experts
        lo_bytes = L * E * ctx.expert_bytes[self.lo]
        if lo_bytes > ctx.cache_bytes:
            raise MoetoolError(f"policy 'dynaexq' keeps every expert at {self.lo} bits ({size_text(lo_bytes)}) but the "
                               f"budget leaves {size_text(ctx.cache_bytes)} for experts; raise --budget.")
        most = budget_n_hi(ctx.cache_bytes, L, E, ctx.expert_bytes[self.lo], ctx.expert_bytes[self.hi])
        if params.n_hi > most:
            raise MoetoolError(f"policy 'dynaexq': n_hi={params.n_hi} does not fit the budget (at most {most}).")
        self.n_hi = most if params.n_hi < 0 else params.n_hi
        if self.n_hi == 0 and params.n_hi < 0:  # derived, not asked for: the run is static b_lo, said
            self.notes.append(f"DynaExq's budget holds every expert at {self.lo} bits and none at {self.hi} (n_hi = 0, "
                              f"§3.1), so this run is static INT{self.lo}; one hot expert a layer at {self.hi} bits "
                              f"takes {size_text(L * ctx.expert_bytes[self.hi])} more.")
        self.pos = {layer: i for i, layer in enumerate(ctx.moe_layers)}
        self.hotness = Hotness(L, E, params.ema, params.interval_tokens)
        self.target: dict[int, set[int]] = {layer: set() for layer in ctx.moe_layers}  # H_l

    def precisions(self) -> tuple[int, int]:
        return self.hi, self.lo  # `config` overrides the knobs

    def pools(self) -> list[Pool]:
        # No eviction orders: the low pool holds every expert, and `admit` picks high victims itself.
        L, E = len(self.ctx.moe_layers), self.ctx.num_experts
        return [Pool(self.lo, L * E, eviction=None), *([Pool(self.hi, L * self.n_hi, eviction=None)] if self.n_hi else [])]

    def warm(self) -> list[Fetch]:
        return [Fetch(layer, e, self.lo) for layer in self.ctx.moe_layers for e in range(self.ctx.num_experts)]

    def admit(self, want: Fetch, cache: ResidencyView, shield: set[Key], demand: bool) -> list[Fetch] | None:
        """Admission control (§3.3 try_reserve): the low pool has a slot for every expert; a promotion
        gets a free high slot of its layer, or reclaims a DEMOTING one (coldest first), or is deferred
        (None; `end_step` offers it again)."""
        if want.bits == self.lo:
            return [] if cache.free(self.lo) > 0 else None
        if want.bits != self.hi or want.expert not in self.target.get(want.layer, ()):
            return None
        holders = cache.residents(self.hi, want.layer)
        if len(holders) < self.n_hi and cache.free(self.hi) > 0:
            return []
        pos = self.pos[want.layer]
        demoted = [k for k in holders if k[1] not in self.target[want.layer] and k not in shield
                   and self.hi in cache.resident_bits(*k)]
        if not demoted:
            return None
        victim = min(demoted, key=lambda k: (float(self.hotness.score[pos, k[1]]), k[1]))
        return [Fetch(victim[0], victim[1], self.hi)]

    def plan(self, view: LayerView) -> LayerPlan:
        """Run every routed expert at the best precision resident now; a promotion in flight is not
        waited for (the low copy runs until the engine publishes the high one)."""
        self.hotness.observe(view.moe_pos, counted(view, view.top_k_index))  # §3.5: the requests' selections
        plan = LayerPlan.routed(view, self.lo)
        valid = plan.running()  # [T, k]
        assign_by_expert(plan.bits, plan.expert, valid, {e: self.hi for e in routed_experts(plan.expert, valid)
                                                         if self.hi in view.residency.resident_bits(view.layer, e)})
        return plan

    def plan_step(self, view: DeviceView) -> DevicePlan:
        """`plan` inside the captured step: b_hi where a high copy is resident on the device, else b_lo
        (always resident). The hotness counters are fed one step behind (`log_layer`)."""
        plan = DevicePlan.of_router(view, self.lo)
        high = lookup(view.resident(view.layer, self.hi), view.top_k_index)  # [T, k]
        plan.bits = torch.where((plan.bits > 0) & high, self.hi, plan.bits)
        plan.routed = False
        return plan

    def log_layer(self, view: LayerView) -> list[Fetch]:
        self.hotness.observe(view.moe_pos, view.top_k_index)  # §3.5's counters, as `plan` keeps them
        return []

    def device_misses(self, bits: int) -> bool:
        return False  # b_hi only where resident; every expert resident at b_lo

    def end_step(self, step: Step, cache: ResidencyView) -> list[Fetch]:
        """At an interval's end, new targets H_l; every step, the promotions still outstanding."""
        if not self.n_hi:
            self.hotness.tick(step.num_tokens)
            return []
        if self.hotness.tick(step.num_tokens):
            held: dict[int, set[int]] = {layer: set() for layer in self.ctx.moe_layers}
            for layer, e in cache.residents(self.hi):
                held[layer].add(e)
            for layer, i in self.pos.items():
                self.target[layer] = select_high(self.hotness.score[i], held[layer], self.n_hi,
                                                 self.params.hysteresis)
        out = []
        for layer, i in self.pos.items():
            for e in sorted(self.target[layer], key=lambda e: -float(self.hotness.score[i, e])):
                if self.hi not in cache.resident_bits(layer, e) and self.hi not in cache.loading_bits(layer, e):
                    out.append(Fetch(layer, e, self.hi))
        return out

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "n_hi_used": self.n_hi}

"""SMoE (Zhu et al.): expert scheduling with substitution, score-based eviction, CPU-assisted compute.

- expert-cache router (Algorithm 1): per token, S_{k+1} is the (k+1)-th highest gate score; active
  experts above (1+alpha) S_{k+1} are top-score and always run; the other active ones are low-score
  and, unless resident or top-score for some token, are substituted by inactive resident (or
  top-score) experts scoring in [(1-alpha) S_{k+1}, S_{k+1}];
- score-based eviction (eq. 3, the `score` order registered here) with the engine's in-use shield;
- top-score prefetch: the next layer's router on this layer's gate input (§IV-C);
- CPU-assisted compute (Algorithm 2, eq. 4): misses split between PCIe loads and CPU compute;
- fit (eq. 5, `smoe_fit.py`): alpha from a polynomial T(alpha) fitted to smoe runs at several alphas;
- report: gate scores of selected vs unselected experts (Fig. 4), T(alpha), §VI-B's quality claim.

Both, and the knobs, are in `smoe_knobs.py` (read without torch); this file is the engine half.

In the captured decode step Algorithm 1 and the prefetch run on the device as written (`plan_step`);
eq. 3's score window, the cache's admissions and the prefetch's copies run one step behind, from the
step's log, so a substitute is chosen among the experts resident one token earlier (measured against
the host path in docs/engine.md "The captured decode step"). Algorithm 2 has no captured form: with
`cpu_assist` on, SMoE runs on the host path and the run says so.

    policy = make_policy("smoe", {"alpha": "0.3"}, ctx)
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from moetool.policies.base import EngineContext, Fetch, Key, LayerPlan, LayerView, Params, Policy, Pool, Where, register
from moetool.policies.common import all_experts, check_eviction, even_quota, hw_seconds, next_moe_layer, predicted_scores
from moetool.policies.device import DevicePlan, DeviceView, best_first
from moetool.policies.eviction import Eviction, register_eviction
from moetool.policies.fate import CrossLayerPrefetch
from moetool.policies.smoe_knobs import SMoEKnobs


def thresholds(scores: torch.Tensor, k: int, alpha: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Algorithm 1: T = (1+alpha) S_{k+1}, L = S_{k+1}, R = (1-alpha) S_{k+1}, each [T]."""
    s_k1 = torch.sort(scores, dim=-1, descending=True).values[:, k]  # [T] (k+1)-th highest, 0-based k
    return (1.0 + alpha) * s_k1, s_k1, (1.0 - alpha) * s_k1


def cache_router(scores: torch.Tensor, idx: torch.Tensor, resident: torch.Tensor, alpha: float) -> torch.Tensor:
    """SMoE Algorithm 1 with the §IV-B rules; returns the experts to run [T, k] (substitutes in place).

    scores [T, E], idx [T, k] the model's routing, resident [E] bool (usable on the device).
    The bounds, as Algorithm 1 prints them (§IV-B): top-score is score > T (into O and C); B_t is
    L <= score < T, so an active expert scoring exactly T is neither top-score nor low-score and runs
    as routed (the constraint after eq. 2 also keeps score < (1+alpha) S_{k+1} for E_l). At alpha = 0,
    T = L and B_t is empty: nothing is substituted, even where the k-th and (k+1)-th scores tie.
    Choices where the paper is loose:
    - sets are decided by membership first, thresholds second: B_t holds the token's active experts
      in [L, T), A_t its inactive experts in [R, L]. Algorithm 1 read literally would put the inactive
      (k+1)-th expert (score exactly L) into B_t and keep it out of A_t; the constraint after eq. 2,
      (1-alpha) S_{k+1} < Score(e) <= S_{k+1} for E_s, admits it as a substitute, as we do. A_t's lower
      end is Algorithm 1's R <= score (the constraint's is strict); it matters only at a tie with R;
    - an active expert below L (a router that selects with a bias, so the routed k are not the top k
      of the scores) is in neither set; Algorithm 1 would leave it out of O[t], we run it as routed;
    - G (resident) is what is usable on the device now: a prefetch still in flight is not in it,
      neither as a low-score expert to keep nor as a substitute (Table II: "experts already in the GPU";
      Algorithm 2's split, `SMoE._assist`, does count it as on the device, since it is waited for);
    - C (top-score experts) is gathered over all tokens before any substitution, so one token's
      low-score expert may be replaced by another token's top-score one (§VI-B, batch = 3);
    - a low-score expert already resident or in C is kept (§IV-B text); only the rest form B_t;
    - |A| >= |B|: the top |B| of A replace B (best substitute for the best-scored low expert);
      |A| < |B|: all of A replace the lowest |A| of B, and the top |B| - |A| of B stay (to be
      loaded or computed on the CPU).
    """
    T, k = idx.shape
    E = scores.shape[1]
    if k >= E:
        return idx.clone()
    valid = (idx >= 0) & (idx < E)  # [T, k]
    safe = idx.clamp(0, E - 1)
    hi, lo, low_bound = thresholds(scores, k, alpha)  # [T] each
    sel = scores.gather(1, safe)  # [T, k] scores of the active experts
    top = valid & (sel > hi[:, None])  # [T, k] top-score slots
    # C: top-score experts of every token (a scatter, not a boolean index: the same on the device)
    in_c = torch.zeros(E, dtype=torch.long, device=idx.device).scatter_reduce(
        0, safe.reshape(-1), top.reshape(-1).long(), "amax") > 0  # [E]
    usable = resident | in_c  # [E] where a substitute may come from
    # Every token at once (a [T, k] and a [T, E] pass, no loop over tokens):
    # B_t: active, valid, L <= score < T (Algorithm 1; not `~top`: a score of exactly T is in neither
    # set), not usable as is; best-scored first.
    b = valid & (sel < hi[:, None]) & (sel >= lo[:, None]) & ~usable.index_select(0, safe.reshape(-1)).view(T, k)
    active = torch.zeros(T, E, dtype=torch.long, device=idx.device).scatter_add_(1, safe, valid.long()) > 0  # [T, E]
    inactive = ~active  # a dropped slot (E or -1) activates nothing
    # A_t: inactive and usable experts with R <= score <= L; best-scored first.
    # An expert scoring 0 is one the router could not choose (outside the token's groups, `router_scores`).
    a = inactive & usable & (scores > 0) & (scores >= low_bound[:, None]) & (scores <= lo[:, None])  # [T, E]
    b_rank = torch.argsort(torch.where(b, -sel, float("inf")), dim=1, stable=True)  # [T, k] B's slots first, best first
    a_rank = torch.argsort(torch.where(a, -scores, float("inf")), dim=1, stable=True)  # [T, E] A's experts first
    n_b, n_a = b.sum(1, keepdim=True), a.sum(1, keepdim=True)  # [T, 1]
    # |A| >= |B|: B's r-th best takes A's r-th best. |A| < |B|: B's top |B| - |A| stay, and B's r-th
    # best (r >= |B| - |A|) takes A's (r - (|B| - |A|))-th best. Either way: shift = max(0, |B| - |A|).
    r = torch.arange(k, device=idx.device).expand(T, k)  # [T, k] rank within B
    shift = (n_b - n_a).clamp(min=0)
    takes = (r < n_b) & (r >= shift)  # [T, k] B ranks that are replaced
    pick = a_rank.gather(1, (r - shift).clamp(0, E - 1))  # [T, k] A's expert for each B rank
    # b_rank is a permutation of each token's slots: every slot is written once, by its rank.
    return idx.scatter(1, b_rank, torch.where(takes, pick, idx.gather(1, b_rank)))


def cpu_split(costs_cpu: list[float], c_load: float, rule: str = "alg2") -> int:
    """How many of the misses, sorted by score highest first, to load; the rest run on the CPU.

    "alg2": SMoE Algorithm 2 as printed. Two pointers: the left one loads over PCIe (C_load each),
    the right one computes on the CPU (its own cost); whichever running total is not larger advances.
    It approximates eq. 4 but, comparing totals before the move, always sends the second expert to the
    CPU however slow the CPU is. "eq4": the exact minimiser of eq. 4,
    max(n_load C_load, T_CPU), over the same score order (the best-scored are loaded).
    """
    if rule == "eq4":
        suffix = [0.0] * (len(costs_cpu) + 1)  # suffix[i]: CPU time of experts i.. on the CPU
        for i in range(len(costs_cpu) - 1, -1, -1):
            suffix[i] = suffix[i + 1] + costs_cpu[i]
        return min(range(len(costs_cpu) + 1), key=lambda n: (max(n * c_load, suffix[n]), -n))
    t_cpu = t_load = 0.0
    n_load = 0
    left, right = 0, len(costs_cpu) - 1
    while left <= right:
        if t_load <= t_cpu:
            t_load += c_load
            n_load += 1
            left += 1
        else:
            t_cpu += costs_cpu[right]
            right -= 1
    return n_load


@register_eviction("score")
class ScoreEviction(Eviction):
    """SMoE eq. 3: evict the key whose layer's router scores averaged lowest over the last n iterations.

    The residency feeds one score vector per layer per forward step with `observe` (SMoE records
    every expert's score, active or not, so inactive substitutes are kept too). Eq. 3 averages
    iterations max(1, j-n) .. j, i.e. up to n+1 of them. Ties, and keys of a layer with no scores
    yet, fall back to least recent use. Any policy may use it (`--set eviction=score`).
    """

    reads_scores = True

    def __init__(self, n: int = 3):
        self.n = n
        self.history: dict[int, list[torch.Tensor]] = {}  # layer -> score vectors [E], oldest first
        self.recent: OrderedDict[Key, None] = OrderedDict()  # least recently used first

    def observe(self, layer: int, scores: torch.Tensor) -> None:
        window = self.history.setdefault(layer, [])
        window.append(scores.detach().to("cpu", torch.float32))  # [E]
        del window[: max(0, len(window) - (self.n + 1))]

    def mean_scores(self, layer: int) -> torch.Tensor | None:
        window = self.history.get(layer)
        return torch.stack(window).mean(0) if window else None  # [E]

    def touch(self, key: Key) -> None:
        self.recent[key] = None
        self.recent.move_to_end(key)

    def insert(self, key: Key) -> None:
        self.touch(key)

    def remove(self, key: Key) -> None:
        self.recent.pop(key, None)

    def victim(self, candidates: list[Key]) -> Key:
        means = {layer: self.mean_scores(layer) for layer in {k[0] for k in candidates}}
        rank = {k: i for i, k in enumerate(self.recent)}

        def mean(key: Key) -> float:
            m = means[key[0]]
            return float(m[key[1]]) if m is not None and 0 <= key[1] < m.numel() else 0.0

        return min(candidates, key=lambda k: (mean(k), rank.get(k, -1)))


class TopScorePrefetch:
    """SMoE §IV-C: prefetch the next layer's predicted top-score experts (above (1+alpha) S_{k+1}).

    The paper predicts from a hidden state that has been through the resident experts and the next
    layer's attention; the engine offers the next router on this layer's gate input (Fate's
    position 2), the closest signal available without running attention twice.
    """

    def __init__(self, ctx: EngineContext, bits: int, alpha: float):
        self.ctx, self.bits, self.alpha = ctx, bits, alpha

    def __call__(self, view: LayerView) -> list[Fetch]:
        pred = predicted_scores(view, self.ctx)
        if pred is None:
            return []
        nxt, scores = pred  # [T, E]
        best = self._best(scores)
        chosen = (best >= 0).nonzero().squeeze(1)
        chosen = chosen[torch.argsort(best[chosen], descending=True, stable=True)].tolist()
        return [Fetch(nxt, e, self.bits) for e in chosen if self.bits not in view.residency.resident_bits(nxt, e)]

    def _best(self, scores: torch.Tensor) -> torch.Tensor:
        """[E] the best predicted score of each expert that is top-score for some token, else -1."""
        hi, _, _ = thresholds(scores, min(self.ctx.top_k, scores.shape[1] - 1), self.alpha)
        return torch.where(scores > hi[:, None], scores, torch.full_like(scores, -1.0)).amax(0)  # [E]

    def on_device(self, view: DeviceView) -> tuple[torch.Tensor | None, int]:
        """The same inside the captured step: every predicted top-score expert not resident, best first."""
        nxt = next_moe_layer(self.ctx, view.moe_pos)
        logits = view.predict(nxt) if nxt is not None else None
        if logits is None:
            return None, self.bits
        best = self._best(self.ctx.routers.scores(nxt, logits))
        chosen = (best >= 0) & ~view.resident(nxt, self.bits)
        return best_first(best, chosen, chosen.shape[0]), self.bits


@register("smoe")
class SMoE(SMoEKnobs, Policy):
    """Expert-cache router + score eviction + top-score prefetch + CPU-assisted compute, at `bits`."""

    reads_scores = True  # `ctx.routers`: the router's own scores

    signals = frozenset({"router_logits"})  # Algorithm 1 reads every expert's score, in the captured step too

    def __init__(self, params: Params, ctx: EngineContext):
        super().__init__(params, ctx)
        check_eviction(self.name, params.eviction)
        slots = min(ctx.cache_bytes // ctx.expert_bytes[params.bits], all_experts(ctx))
        # The paper does not say how the cache is scoped; per layer, like the systems it compares with.
        self.quota = even_quota(ctx.moe_layers, slots)
        self.c_load = hw_seconds(ctx, "t_load", params.bits)
        self.c_cpu = hw_seconds(ctx, "c_cpu")
        # C_CPU of an expert serving n tokens, as the engine's cost model charges it (`CostModel.c_cpu_model`):
        # its compute and its rows' copy back to the device
        model = ctx.hw.get("c_cpu_model") or {"floor": 0.0, "per_token": self.c_cpu}
        self.c_cpu_of = lambda n: max(model["floor"], model["per_token"] * n) + model.get("trip", 0.0)
        self.prefetcher = {
            "smoe": lambda: TopScorePrefetch(ctx, params.bits, params.alpha),
            "fate": lambda: CrossLayerPrefetch(ctx, params.bits, params.bits, 0.0, 0, 0.75),
            "none": lambda: None,
        }[params.prefetcher]()

    def pools(self) -> list[Pool]:
        options = {"n": self.params.window} if self.params.eviction == "score" else {}
        return [Pool(self.params.bits, sum(self.quota.values()), quota=self.quota, eviction=self.params.eviction,
                     eviction_options=options)]

    def plan(self, view: LayerView) -> LayerPlan:
        """Substitute (Algorithm 1), then split the remaining misses between PCIe and CPU (Algorithm 2).

        A substitute takes the substituted slot's original routing weight: the paper does not say;
        keeping the slot's weight leaves the weights' sum as the model made it.
        """
        bits, E = self.params.bits, view.num_experts
        plan = LayerPlan.routed(view, bits)
        if view.router_logits.numel() == 0:
            return plan  # no scores: run as routed
        scores = self.ctx.routers.scores(view.layer, view.router_logits)  # [T, E] (softmax for the paper's models)
        # [E]: the layer's usable copies, read off its own holders (a call per expert had been 0.5 ms a layer at 128)
        res = view.residency
        resident = torch.zeros(E, dtype=torch.bool)
        resident[[e for _, e in res.residents(bits, view.layer) if bits in res.resident_bits(view.layer, e)]] = True
        real = view.real_rows
        if real is None:
            plan.expert = cache_router(scores, view.top_k_index, resident, self.params.alpha)
        else:  # a batch's left padding is no request: it adds no top-score expert to C, and keeps its routing
            plan.expert = view.top_k_index.clone()
            plan.expert[real] = cache_router(scores[real], view.top_k_index[real], resident, self.params.alpha)
        if self.params.cpu_assist and self.c_load and self.c_cpu:
            self._assist(view, plan, scores, resident)
        return plan

    def _assist(self, view: LayerView, plan: LayerPlan, scores: torch.Tensor, resident: torch.Tensor) -> None:
        """Algorithm 2 over the experts that are neither resident nor in flight, highest score first.

        C_CPU of an expert is what the engine's cost model charges for the tokens it serves
        (`ctx.hw["c_cpu_model"]`): reading its weights bounds it, so it is constant across low batch
        sizes, as §V-A treats it ("stable CPU times across low-batch sizes", Fig. 8), until the tokens'
        arithmetic outweighs the read (a big prefill expert stays off the CPU). A profile's measured
        c_cpu_s is per token, and the clock multiplies it by the tokens; so does this. The paper also
        keeps C_load and C_CPU from "the past p instances" of measured times; ours are the cost model's
        constants (on the sim clock, exactly what the run is charged; on the wall clock, the --hw
        profile's). An in-flight copy (a prefetch) stays on the device: the engine waits for its own
        event only.
        """
        run = plan.running()  # [T, k]
        misses = [e for e in plan.expert[run].unique().tolist() if not resident[e]
                  and self.params.bits not in view.residency.loading_bits(view.layer, e)]
        if not misses:
            return
        E = scores.shape[1]
        # ranked by, and costed for, the requests' tokens (an expert only a batch's padding routes: score 0)
        mine = run if view.real_rows is None else run & view.real_rows[:, None]  # [T, k]
        best = torch.where(mine, scores.gather(1, plan.expert.clamp(0, E - 1)), torch.zeros(()))  # [T, k]
        score = {e: float(best[plan.expert == e].max()) for e in misses}
        misses.sort(key=lambda e: -score[e])
        costs = [self.c_cpu_of(int(((plan.expert == e) & mine).any(1).sum())) for e in misses]
        n_load = cpu_split(costs, self.c_load, self.params.cpu_rule)
        for e in misses[n_load:]:
            plan.where[(plan.expert == e) & run] = Where.CPU

    def prefetch(self, view: LayerView) -> list[Fetch]:
        return self.prefetcher(view) if self.prefetcher is not None else []

    def plan_step(self, view: DeviceView) -> DevicePlan:
        """Algorithm 1 inside the captured step, on the device slot table's residency; the prefetch.
        Eq. 3's score window is fed from the step's log, one step behind."""
        bits = self.params.bits
        plan = DevicePlan.of_router(view, bits)
        if view.router_logits is not None:
            resident = view.resident(view.layer, bits)  # [E]
            scores = self.ctx.routers.scores(view.layer, view.router_logits)
            expert = cache_router(scores, view.top_k_index, resident, self.params.alpha)
            plan = DevicePlan(expert=expert, bits=plan.bits, weight=view.top_k_weights)
        if self.prefetcher is not None:
            plan.prefetch, plan.prefetch_bits = self.prefetcher.on_device(view)
        return plan

    def captured_unsupported(self) -> str | None:
        if self.params.cpu_assist and self.c_load and self.c_cpu:
            return ("SMoE's CPU-assisted experts (Algorithm 2) have no captured form (a host callback inside a "
                    "CUDA graph would hold the interpreter); --set cpu_assist=false runs SMoE captured")
        return super().captured_unsupported()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "c_load": self.c_load, "c_cpu": self.c_cpu,
                "cpu_assist_active": bool(self.params.cpu_assist and self.c_load and self.c_cpu)}

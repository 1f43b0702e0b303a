"""Cross-layer prefetch accuracy: how well MoE layer i+1's router, fed layer i's gate input, names the
experts layer i+1 will actually use (Fate §4.2-4.3, Fig. 7, Table 1; DyMoE eq. 6; SMoE §IV-C).

Per MoE layer i+1 (the first MoE layer has no predictor), per phase:
- recall at top-k: |predicted top-k & true top-k| / |true top-k|; per token in decode, over the
  union of the prompt's tokens in prefill (what a prefill prefetch has to cover);
- recall at the 75th-percentile rule (Fate §4.2): the predicted set is every expert whose predicted
  score is above the 75th percentile of its token's scores; `fetched_p75` says how many that is;
- SMoE's top-score prediction (decode): the experts above (1+alpha) S_{k+1} in the predicted scores
  against those in the true scores (recall and precision);
- recall at top-k from Fate's three positions (Table 1's "Prefetch Accuracy").

    acc = PrefetchAccumulator(route=lambda layer, h: route(lm, layer, h), num_experts=64, top_k=8)
    acc.add(trace); acc.result().layers[0].recall_topk["decode"]
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from moetool.policies.fate import above_percentile
from moetool.policies.smoe import thresholds
from moetool.profile.similarity import POSITIONS
from moetool.profile.trace import Trace
from moetool.profile_artifact import LayerPrefetch, PrefetchProfile
from moetool.router_scores import ScoreRules

Router = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (layer, [T, H]) -> logits, top-k
PERCENTILE = 0.75  # Fate §4.2
SMOE_ALPHA = 0.3  # SMoE §VI-B's middle value; the top-score rule of its prefetcher


def _sets(idx: torch.Tensor, E: int) -> list[set[int]]:
    return [set(int(e) for e in row if 0 <= e < E) for row in idx.tolist()]


def recall(pred: set[int], true: set[int]) -> float | None:
    return len(pred & true) / len(true) if true else None


def top_score_set(scores: torch.Tensor, k: int, alpha: float) -> list[set[int]]:
    """Per token, the experts above (1+alpha) S_{k+1} (SMoE Algorithm 1's top-score experts)."""
    hi, _, _ = thresholds(scores, min(k, scores.shape[1] - 1), alpha)  # [T]
    return [set(torch.nonzero(row > h).flatten().tolist()) for row, h in zip(scores, hi)]


class PrefetchAccumulator:
    def __init__(self, route: Router, num_experts: int, top_k: int, percentile: float = PERCENTILE,
                 smoe_alpha: float = SMOE_ALPHA, routers: ScoreRules = ScoreRules()):
        self.route, self.E, self.k, self.routers = route, num_experts, top_k, routers
        self.percentile, self.alpha = percentile, smoe_alpha
        self.sums: dict[tuple, float] = defaultdict(float)  # (layer position, metric, phase) -> sum
        self.counts: dict[tuple, int] = defaultdict(int)
        self.pairs: list[tuple[int, int]] = []
        self.samples = {"prefill": 0, "decode": 0}

    def _put(self, key: tuple, value: float | None) -> None:
        if value is not None:
            self.sums[key] += value
            self.counts[key] += 1

    def add(self, trace: Trace) -> None:
        phase = trace.phase
        self.pairs = [(trace.layers[j].layer, trace.layers[j - 1].layer) for j in range(1, len(trace.layers))]
        self.samples[phase] += 1 if phase == "prefill" else trace.layers[0].top_k.shape[0]
        for j in range(1, len(trace.layers)):
            prev, cur = trace.layers[j - 1], trace.layers[j]
            true = _sets(cur.top_k, self.E)
            for pos, x in zip(POSITIONS, (cur.attn_in, prev.gate_in, prev.attn_in)):
                logits, pred_idx = self.route(cur.layer, x)  # [T, E], [T, k]
                pred = _sets(pred_idx, self.E)
                self._recalls(j, f"pos{pos}", phase, pred, true)
                if pos != "2":
                    continue
                self._recalls(j, "topk", phase, pred, true)
                scores = self.routers.scores(cur.layer, logits)  # [T, E], the router's own (`router_scores`)
                if phase == "prefill":
                    p75 = [set(above_percentile(scores, self.percentile))]
                else:
                    p75 = [set(above_percentile(s[None], self.percentile)) for s in scores]
                self._recalls(j, "p75", phase, p75, true)
                for s in p75:
                    self._put((j, "fetched", phase), float(len(s)))
                if phase == "decode":
                    true_ts = top_score_set(self.routers.scores(cur.layer, cur.logits), self.k, self.alpha)
                    pred_ts = top_score_set(scores, self.k, self.alpha)
                    for p, t in zip(pred_ts, true_ts):
                        self._put((j, "smoe_recall", phase), recall(p, t))
                        self._put((j, "smoe_precision", phase), recall(t, p))

    def _recalls(self, j: int, metric: str, phase: str, pred: list[set[int]], true: list[set[int]]) -> None:
        if phase == "prefill":  # the prompt's union: what a prefill prefetch must bring
            pred, true = [set().union(*pred)], [set().union(*true)]
        if len(pred) == 1 and len(true) > 1:
            pred = pred * len(true)
        for p, t in zip(pred, true):
            self._put((j, metric, phase), recall(p, t))

    def _mean(self, key: tuple) -> float | None:
        return self.sums[key] / self.counts[key] if self.counts.get(key) else None

    def result(self) -> PrefetchProfile:
        phases = [p for p in ("prefill", "decode") if self.samples[p]]

        def by_phase(j: int, metric: str) -> dict[str, float]:
            return {p: v for p in phases if (v := self._mean((j, metric, p))) is not None}

        layers = tuple(LayerPrefetch(
            layer=layer, previous=prev, recall_topk=by_phase(j, "topk"), recall_p75=by_phase(j, "p75"),
            fetched_p75=by_phase(j, "fetched"), smoe_recall=self._mean((j, "smoe_recall", "decode")),
            smoe_precision=self._mean((j, "smoe_precision", "decode")),
            positions={pos: by_phase(j, f"pos{pos}") for pos in POSITIONS})
            for j, (layer, prev) in enumerate(self.pairs, start=1))
        positions = {}
        for pos in POSITIONS:
            positions[pos] = {}
            for p in phases:
                vals = [lp.positions[pos][p] for lp in layers if p in lp.positions[pos]]
                if vals:
                    positions[pos][p] = sum(vals) / len(vals)
        return PrefetchProfile(layers=layers, positions=positions, percentile=self.percentile,
                               smoe_alpha=self.alpha, samples=dict(self.samples))

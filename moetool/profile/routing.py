"""Routing skew: what each expert is asked to do, per layer, phase and data set.

Counts per expert in prefill and decode (their sum over experts is tokens x k), the heavy-hitter token
load (DyMoE Fig. 4, eq. 1-2: tokens in the top `hh_ratio` by attention received), the share of routed
tokens the top 10% / 25% of experts take, Gini and entropy, gate scores of selected vs unselected
experts (SMoE Fig. 4), the top-10 hot set per data set and its Jaccard overlap across data sets
(DynaExq Fig. 2), and the share of experts a batch of b tokens or sequences activates (DynaExq
Tables 1-2).

    acc = RoutingAccumulator(num_experts=64, top_k=8, layers=(0, 1), hh_ratio=0.2)
    acc.add(trace, source="heldout"); result = acc.result()
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from moetool.policies.common import popularity
from moetool.profile.trace import Trace
from moetool.profile_artifact import LayerRouting, RoutingProfile
from moetool.router_scores import ScoreRules

BATCH_SIZES = (1, 2, 4, 8, 16, 32)  # DynaExq Tables 1-2
SCORE_BINS = tuple(float(x) for x in np.concatenate([[0.0], np.logspace(-4, 0, 25)]))  # gate scores, log-spaced
HOT_SET = 10  # DynaExq Fig. 2: top-10 most activated experts
GROUPS = 32  # random batches drawn per batch size for the activation ratio


def gini(x: np.ndarray) -> float:
    """Gini coefficient of non-negative loads (mean absolute difference / (2 * mean))."""
    x = np.sort(np.asarray(x, dtype=np.float64))
    n, total = len(x), x.sum()
    if n == 0 or total <= 0:
        return 0.0
    ranks = np.arange(1, n + 1)
    return float((2 * (ranks * x).sum()) / (n * total) - (n + 1) / n)


def entropy(x: np.ndarray) -> float:
    """Shannon entropy of the load distribution normalised by log(E): 1 is perfectly balanced."""
    x = np.asarray(x, dtype=np.float64)
    if len(x) < 2 or x.sum() <= 0:
        return 0.0
    p = x[x > 0] / x.sum()
    return float(-(p * np.log(p)).sum() / math.log(len(x)))


def top_share(x: np.ndarray, fraction: float) -> float:
    """Share of the total taken by the top ceil(fraction * E) experts."""
    x = np.sort(np.asarray(x, dtype=np.float64))[::-1]
    if x.sum() <= 0:
        return 0.0
    return float(x[: max(1, math.ceil(fraction * len(x) - 1e-9))].sum() / x.sum())


def jaccard(a: set[int], b: set[int]) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def hot_set(counts: np.ndarray, k: int) -> tuple[int, ...]:
    order = np.argsort(-np.asarray(counts), kind="stable")
    return tuple(int(e) for e in order[:k] if counts[e] > 0)


def activation_ratio(active: np.ndarray, sizes: tuple[int, ...], rng: np.random.Generator) -> dict[str, float]:
    """Mean share of experts in the union of `b` random rows of `active` [N, E] (bool), per b <= N."""
    out = {}
    n = active.shape[0]
    for b in sizes:
        if b > n:
            break
        draws = [rng.choice(n, size=b, replace=False) for _ in range(GROUPS if b < n else 1)]
        out[str(b)] = float(np.mean([active[d].any(0).mean() for d in draws]))
    return out


class RoutingAccumulator:
    def __init__(self, num_experts: int, top_k: int, layers: tuple[int, ...], hh_ratio: float = 0.2,
                 seed: int = 0, routers: ScoreRules = ScoreRules()):
        self.E, self.k, self.layers, self.hh_ratio, self.seed = num_experts, top_k, layers, hh_ratio, seed
        self.routers = routers  # each layer's own scores (`router_scores`), for SMoE Fig. 4's statistics
        L = len(layers)
        self.counts = {p: np.zeros((L, num_experts), np.int64) for p in ("prefill", "decode")}
        self.heavy = np.zeros((L, num_experts), np.int64)
        self.by_data: dict[str, np.ndarray] = {}
        self.sorted_sum = np.zeros((L, num_experts))
        self.hist = {s: np.zeros(len(SCORE_BINS) - 1, np.int64) for s in ("selected", "unselected")}
        self.tokens = {"prefill": 0, "decode": 0}
        self.active: dict[str, list[np.ndarray]] = {"prefill": [], "decode": []}  # rows [L, E] bool
        self.importance_seen = False

    def add(self, trace: Trace, source: str) -> None:
        phase = trace.phase
        data = self.by_data.setdefault(source, np.zeros((len(self.layers), self.E), np.int64))
        T = trace.layers[0].top_k.shape[0]
        self.tokens[phase] += T
        per_token = np.zeros((T, len(self.layers), self.E), bool) if phase == "decode" else None
        seq_active = np.zeros((len(self.layers), self.E), bool)
        for i, lt in enumerate(trace.layers):
            counts = popularity(lt.top_k, self.E).numpy()  # [E]
            self.counts[phase][i] += counts
            data[i] += counts
            seq_active[i] = counts > 0
            if per_token is not None:
                rows = torch.arange(T)[:, None].expand_as(lt.top_k)
                ok = (lt.top_k >= 0) & (lt.top_k < self.E)
                per_token[rows[ok].numpy(), i, lt.top_k[ok].numpy()] = True
            if phase == "prefill" and lt.importance is not None and lt.importance.numel() == T:
                self.importance_seen = True
                n = max(1, math.ceil(self.hh_ratio * T - 1e-9))
                heavy = torch.topk(lt.importance, min(n, T)).indices  # T_imp (DyMoE eq. 2)
                self.heavy[i] += popularity(lt.top_k[heavy], self.E).numpy()
            if phase == "decode":
                self._scores(i, lt.logits, lt.top_k)
        if per_token is not None:
            self.active["decode"].extend(per_token)
        else:
            self.active["prefill"].append(seq_active)

    def _scores(self, i: int, logits: torch.Tensor, top_k: torch.Tensor) -> None:
        scores = self.routers.scores(self.layers[i], logits)  # [T, E]
        self.sorted_sum[i] += torch.sort(scores, dim=-1, descending=True).values.sum(0).numpy()
        selected = torch.zeros_like(scores, dtype=torch.bool)
        ok = (top_k >= 0) & (top_k < self.E)
        selected.scatter_(1, top_k.clamp(0, self.E - 1), ok)
        for name, mask in (("selected", selected), ("unselected", ~selected)):
            self.hist[name] += np.histogram(scores[mask].numpy(), bins=SCORE_BINS)[0]

    def result(self) -> RoutingProfile:
        hot_k = min(HOT_SET, max(1, self.E // 4))  # a hot set of all experts would overlap trivially
        layers = []
        for i, layer in enumerate(self.layers):
            total = self.counts["prefill"][i] + self.counts["decode"][i]
            load, hh = self.counts["prefill"][i], self.heavy[i]
            corr = None
            if self.importance_seen and load.std() > 0 and hh.std() > 0:
                corr = float(np.corrcoef(load, hh)[0, 1])
            n_dec = max(1, self.tokens["decode"])
            layers.append(LayerRouting(
                layer=layer, prefill=_ints(self.counts["prefill"][i]), decode=_ints(self.counts["decode"][i]),
                heavy_hitter=_ints(hh), hh_load_corr=corr, top10_share=top_share(total, 0.10),
                top25_share=top_share(total, 0.25), gini=gini(total), entropy=entropy(total),
                mean_sorted_score=tuple(float(x) for x in self.sorted_sum[i] / n_dec),
                by_data={d: _ints(c[i]) for d, c in self.by_data.items()},
                hot_sets={d: hot_set(c[i], hot_k) for d, c in self.by_data.items()}))
        pairs = {}
        for a, b in itertools.combinations(sorted(self.by_data), 2):
            pairs[f"{a}|{b}"] = float(np.mean([jaccard(set(lr.hot_sets[a]), set(lr.hot_sets[b])) for lr in layers]))
        rng = np.random.default_rng(self.seed)
        ratio = {}
        for phase, rows in self.active.items():
            if rows:
                stacked = np.stack(rows)  # [N, L, E]
                per_layer = [activation_ratio(stacked[:, i], BATCH_SIZES, rng) for i in range(len(self.layers))]
                ratio[phase] = {b: float(np.mean([d[b] for d in per_layer])) for b in per_layer[0]}
        how = ("eager attention probabilities, mean over heads, summed over queries (H2O-style accumulated "
               "score); heavy hitters = top hh_ratio of each prompt's tokens") if self.importance_seen else \
            "unavailable: the model's attention returned no probabilities (heavy-hitter load left at 0)"
        return RoutingProfile(tokens=dict(self.tokens), top_k=self.k, num_experts=self.E, hh_ratio=self.hh_ratio,
                              importance=how, hot_k=hot_k, layers=tuple(layers), score_bins=SCORE_BINS,
                              score_hist={k: _ints(v) for k, v in self.hist.items()}, jaccard=pairs,
                              activation_ratio=ratio)


def _ints(x: np.ndarray) -> tuple[int, ...]:
    return tuple(int(v) for v in x)

"""Hidden-state similarity: between adjacent decoder layers (DyMoE Fig. 6) and at Fate's three positions.

Fate Table 1 compares the input of MoE layer i+1's router, Gate_in_{i+1}, with Attn_in_{i+1} (position
1), Gate_in_i (position 2) and Attn_in_i (position 3), where Attn_in is the input of a layer's
self-attention (after its input norm) and Gate_in the input of its router (after the post-attention
norm). Cosine similarity is taken per token and averaged over every token of both phases.

    acc = SimilarityAccumulator(layers=(0, 1, 2)); acc.add(trace); acc.result().positions["2"]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetool.profile.trace import Trace
from moetool.profile_artifact import LayerSimilarity, SimilarityProfile

POSITIONS = ("1", "2", "3")  # Fate Table 1


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row cosine similarity [T] of two [T, H] tensors (in [-1, 1])."""
    return F.cosine_similarity(a.float(), b.float(), dim=-1, eps=1e-12).clamp(-1.0, 1.0)


class SimilarityAccumulator:
    def __init__(self, layers: tuple[int, ...]):
        self.layers = layers
        self.adjacent_sum: torch.Tensor | None = None  # [n_layers - 1]
        self.pos_sum = torch.zeros(max(0, len(layers) - 1), len(POSITIONS), dtype=torch.float64)
        self.tokens = 0

    def add(self, trace: Trace) -> None:
        T = trace.layers[0].gate_in.shape[0]
        self.tokens += T
        if len(trace.hidden) > 1:
            adj = torch.stack([cosine(a, b).double().sum() for a, b in zip(trace.hidden, trace.hidden[1:])])
            self.adjacent_sum = adj if self.adjacent_sum is None else self.adjacent_sum + adj
        for j in range(1, len(trace.layers)):
            prev, cur = trace.layers[j - 1], trace.layers[j]
            for p, x in enumerate((cur.attn_in, prev.gate_in, prev.attn_in)):
                self.pos_sum[j - 1, p] += cosine(x, cur.gate_in).double().sum()

    def result(self) -> SimilarityProfile:
        n = max(1, self.tokens)
        adjacent = tuple(float(x) / n for x in self.adjacent_sum) if self.adjacent_sum is not None else ()
        layers = tuple(LayerSimilarity(layer=self.layers[j + 1], previous=self.layers[j],
                                       positions={p: float(self.pos_sum[j, i]) / n for i, p in enumerate(POSITIONS)})
                       for j in range(len(self.layers) - 1))
        positions = {p: float(self.pos_sum[:, i].mean()) / n for i, p in enumerate(POSITIONS)} if layers else {}
        return SimilarityProfile(adjacent=adjacent, layers=layers, positions=positions, tokens=self.tokens)

"""Signals the engine computes for a policy that names them (`Policy.signals`), so that the engine
imports no paper: a policy asks by name, the engine computes it where the data is.

- "token_importance": s_i, the attention each prompt token receives, averaged over heads and summed
  over the queries that see it (H2O's accumulated score; DyMoE eq. 1 reads it as "the attention
  score of t_i"). Prefill only: it needs eager attention's probabilities.
- "router_logits": a layer's full router logits inside the captured step (the host path always
  hands them to `plan`).

    s = token_importance(attn_weights)   # [B*Tk] from [B, heads, Tq, Tk]
"""

from __future__ import annotations

import torch


def token_importance(attn_weights: torch.Tensor) -> torch.Tensor:
    """s_i for every key position [B*Tk] from attention probabilities [B, heads, Tq, Tk]. The engine
    (for `plan`) and `profile` (for the routing profile) both call this."""
    return attn_weights.float().mean(1).sum(1).reshape(-1)


def mean_scores(scores: torch.Tensor) -> torch.Tensor:
    """A layer's router scores [T, E] (`router_scores`: the router's own), averaged over its tokens [E]:
    one iteration of a score window, e.g. SMoE eq. 3's eviction order."""
    return scores.float().mean(0)

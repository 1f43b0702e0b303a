"""The scores a MoE layer's router gives its experts, [T, E] from its logits, for what reads them.

The papers' models route with a softmax over the router's logits, so their rules read an expert's
score as softmax(logits): SMoE's thresholds and score window (Algorithm 1, eq. 3), Fate's
percentile (§4.2), DyMoE's look-ahead (eq. 6) and the routing profile (SMoE Fig. 4). Many routers
do not. DeepSeek-V3's (and GLM-4.5's, dots1's, Kimi's ...) weight an expert by a sigmoid, choose
with a load-balancing bias added, and only among the best groups of experts; DeepSeek-V4's take a
sqrt-softplus. Read through a softmax, such a router's scores put experts it could not choose (an
excluded group) above the ones it chose, and their ratios, which SMoE's thresholds compare, are
not the ones its weights have.

Each layer's rule is found once, by running the layer's own block on probe tokens and keeping the
candidate (score function x selection bias x group limit) that reproduces both the experts the
block chose and the weights it gave them (`score_rules`). A rule's scores are what weights an
expert, f(logits), with 0 for the experts outside the groups a token may choose from. The bias
only steers the choice (DeepSeek-V3 §2.1.2), so it chooses the groups but is no part of a score.
A layer that no candidate reproduces (DeepSeek-V4's hash layers choose by token id; a router of a
kind not listed here) keeps the softmax, and the run says which layers (`ScoreRules.unmatched`).

    rules = score_rules(lm)                  # once, with the model's routers loaded
    s = rules.scores(layer, logits)          # [T, E], on logits' device; tensor ops only
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

PROBE_TOKENS = 64
# Attributes, on the router or its block, that hold a bias the router adds to its scores to choose.
BIAS_NAMES = ("e_score_correction_bias", "expert_bias", "router_bias")
# Config fields of a group-limited choice: the number of groups, and how many a token may use.
GROUP_NAMES = ("n_group", "num_expert_group", "n_groups", "num_group")


@dataclass(frozen=True)
class ScoreRule:
    """How one router scores its experts. The default is the papers' softmax over the logits."""

    func: str = "softmax"  # "softmax", or an elementwise activation's name in transformers' ACT2FN
    bias: torch.Tensor | None = None  # [E] float32 added to choose the groups (never to a score)
    groups: int = 1  # a token chooses among the best `topk_groups` of `groups` equal groups
    topk_groups: int = 1
    group_score: str = "top2"  # a group's rank: its two best choice scores summed, or its best ("max")
    bias_on_logits: bool = False  # the bias is added to the logits to choose, not to f(logits) (Kolibri1)
    _on: dict = field(default_factory=dict, compare=False, repr=False)  # device -> the bias there

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """[T, E] from logits [T, E]: f(logits), 0 outside the token's chosen groups."""
        s = self.weights(logits)
        keep = self.allowed(s)
        return s if keep is None else torch.where(keep, s, torch.zeros_like(s))

    def weights(self, logits: torch.Tensor) -> torch.Tensor:
        """[T, E] f(logits): what weights each expert where it is chosen."""
        z = logits.float()
        if self.func == "softmax":
            return torch.softmax(z, dim=-1)
        if self.func == "sigmoid":
            return torch.sigmoid(z)
        if "act" not in self._on:  # another of the config's scoring functions: its module made once, not per call
            self._on["act"] = _activation(self.func)
        return self._on["act"](z)

    def allowed(self, s: torch.Tensor) -> torch.Tensor | None:
        """[T, E] bool: the experts in the groups each token may choose from; None without groups."""
        if self.groups <= 1 or self.topk_groups >= self.groups:
            return None
        T, E = s.shape
        choice = s if self.bias is None else s + self._bias(s.device)
        per = choice.view(T, self.groups, E // self.groups)
        rank = per.topk(2, dim=-1).values.sum(-1) if self.group_score == "top2" else per.amax(-1)  # [T, G]
        keep = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, rank.topk(self.topk_groups, dim=-1).indices, True)
        return keep.repeat_interleave(E // self.groups, dim=1)

    def describe(self) -> str:
        parts = [self.func]
        if self.bias is not None:
            parts.append("a selection bias on the logits" if self.bias_on_logits else "a selection bias")
        if self.groups > 1 and self.topk_groups < self.groups:
            parts.append(f"the best {self.topk_groups} of {self.groups} groups ({self.group_score})")
        return ", ".join(parts)

    def _bias(self, device: torch.device) -> torch.Tensor:
        # One copy per device, made once: the host path scores CPU logits, the captured step device ones,
        # and a copy made inside the step would be a transfer in it.
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # `--device cuda`: the tensors' device has its index
            device = torch.device("cuda", torch.cuda.current_device())
        key = f"bias {device}"
        if key not in self._on:
            self._on[key] = self.bias.to(device)
        return self._on[key]


SOFTMAX = ScoreRule()


@dataclass(frozen=True)
class ScoreRules:
    """Every MoE layer's rule (decoder layer -> rule); layers not listed score by softmax."""

    by_layer: dict[int, ScoreRule] = field(default_factory=dict)
    unmatched: tuple[int, ...] = ()  # layers whose router no candidate reproduced (softmax stands in)

    def scores(self, layer: int, logits: torch.Tensor) -> torch.Tensor:
        return self.by_layer.get(layer, SOFTMAX).scores(logits)

    def place(self, device: torch.device) -> "ScoreRules":
        """Make each bias's copy on `device` now, so that the captured step reads a tensor already there
        (a copy made inside it would be a host-to-device transfer in every replay)."""
        for rule in self.by_layer.values():
            if rule.bias is not None:
                rule._bias(torch.device(device))
        return self

    def kinds(self) -> dict[str, str]:
        """What each non-softmax layer's rule is, for the run's record: description -> layers."""
        out: dict[str, list[int]] = {}
        for layer, rule in sorted(self.by_layer.items()):
            if rule != SOFTMAX:
                out.setdefault(rule.describe(), []).append(layer)
        return {k: ", ".join(map(str, v)) for k, v in out.items()}


def score_rules(lm: Any) -> ScoreRules:  # lm: a model.LoadedModel
    """Each MoE layer's rule, found on its own block (see the module's text). Layers of one router
    kind and config share the search; each keeps its own bias tensor."""
    by_layer: dict[int, ScoreRule] = {}
    unmatched: list[int] = []
    for g in lm.geometry.layers:
        rule = _found(lm, g)
        if rule is None:
            unmatched.append(g.index)
        elif rule != SOFTMAX:
            by_layer[g.index] = rule
    return ScoreRules(by_layer, tuple(unmatched))


def _found(lm: Any, g: Any) -> ScoreRule | None:
    """The first candidate rule that reproduces the block's choice and weights on probe tokens."""
    seen = _probe(lm, g)
    if seen is None:
        return None
    logits, chosen, weights = seen
    block = lm.model.get_submodule(g.path)
    router = block.get_submodule(g.router)
    for rule in _candidates(lm, block, router, g.num_experts):
        if _reproduces(rule, logits, chosen, weights, g.top_k):
            return rule
    return None


def _candidates(lm: Any, block: nn.Module, router: nn.Module, num_experts: int) -> list[ScoreRule]:
    """The rules to try, the most specific first (a zero bias or one group chooses as none does)."""
    from moetool.checkpoint import text_config  # here, not at the top: the policies import this module

    cfg = text_config(lm.model.config)
    funcs = ["softmax", "sigmoid"]
    named = getattr(cfg, "scoring_func", None)
    if isinstance(named, str) and named not in funcs and _activation(named) is not None:
        funcs.append(named)
    bias = None
    # The router's or block's own, or one a module inside the router keeps (ERNIE 4.5: `gate.moe_statics`, [1, E])
    for owner in (router, block, *(m for _, m in router.named_modules() if m is not router)):
        for name in BIAS_NAMES:
            t = getattr(owner, name, None)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() == num_experts and t.device.type != "meta":
                bias = t.detach().float().cpu().reshape(num_experts)
                break
        if bias is not None:
            break
    groups = next((int(v) for n in GROUP_NAMES if isinstance(v := getattr(cfg, n, None), int) and v > 1), 1)
    topk_groups = getattr(cfg, "topk_group", None)
    grouped = groups > 1 and num_experts % groups == 0 and isinstance(topk_groups, int) and 0 < topk_groups < groups
    out = []
    for func in funcs:
        for b in ([bias, None] if bias is not None else [None]):
            if grouped:
                out += [ScoreRule(func=func, bias=b, groups=groups, topk_groups=topk_groups, group_score=how)
                        for how in ("top2", "max")]
            out.append(ScoreRule(func=func, bias=b))
            if b is not None:
                out.append(ScoreRule(func=func, bias=b, bias_on_logits=True))
    return out


def _reproduces(rule: ScoreRule, logits: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, k: int) -> bool:
    """Whether `rule` chooses the block's experts for every probe token and weights them in the same
    proportions (the block may normalise its top-k weights and scale them: proportions survive that)."""
    s = rule.weights(logits)  # [T, E]
    pick = s if rule.bias is None else (logits.float() if rule.bias_on_logits else s) + rule.bias
    keep = rule.allowed(s)
    if keep is not None:
        pick = torch.where(keep, pick, torch.full_like(pick, float("-inf")))
    mine = torch.sort(torch.topk(pick, k, dim=-1).indices, dim=-1).values
    if not torch.equal(mine, torch.sort(chosen, dim=-1).values):
        return False
    w = s.gather(1, chosen)
    ours = w / w.sum(-1, keepdim=True).clamp_min(1e-30)
    theirs = weights.float() / weights.float().sum(-1, keepdim=True).clamp_min(1e-30)
    return bool(torch.allclose(ours, theirs, rtol=1e-3, atol=1e-4))


@torch.no_grad()
def _probe(lm: Any, g: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(logits [T, E], chosen experts [T, k], their weights [T, k]) of layer `g`'s block on random
    tokens, read where the block hands its routing to its experts; the experts never run (a hook stops
    the block there). None when the block does not run that far on its own."""
    from moetool.inference import router_logits

    block = lm.model.get_submodule(g.path)
    router = block.get_submodule(g.router)
    experts = getattr(block, "experts", None)
    param = next((p for p in router.parameters() if p.is_floating_point()), None)
    if experts is None or param is None or param.device.type == "meta":
        return None
    x = torch.randn(PROBE_TOKENS, g.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(param.device, param.dtype)
    seen: dict[str, torch.Tensor] = {}

    def keep_logits(module, args, output):
        seen.setdefault("logits", router_logits(output, g.num_experts).detach().float().cpu())

    def stop(module, args, kwargs):
        idx = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        w = args[2] if len(args) > 2 else kwargs.get("top_k_weights")
        if isinstance(idx, torch.Tensor) and isinstance(w, torch.Tensor):
            seen["chosen"], seen["weights"] = idx.detach().long().cpu(), w.detach().float().cpu()
        raise _Stopped

    hooks = [router.register_forward_hook(keep_logits), experts.register_forward_pre_hook(stop, with_kwargs=True)]
    try:
        block(x[None])
    except _Stopped:
        pass
    except Exception:  # noqa: BLE001 - a block that needs more than hidden states (token ids, states): no rule
        return None
    finally:
        for h in hooks:
            h.remove()
    if not {"logits", "chosen", "weights"} <= seen.keys():
        return None
    logits, chosen, weights = seen["logits"], seen["chosen"], seen["weights"]
    if chosen.shape != weights.shape or chosen.shape[0] != logits.shape[0] or chosen.shape[1] != g.top_k:
        return None
    if bool(((chosen < 0) | (chosen >= g.num_experts)).any()):
        return None
    return logits, chosen, weights


class _Stopped(Exception):
    """Raised by the probe's hook where the block hands its routing to its experts."""


def _activation(name: str):
    from transformers.activations import ACT2FN

    try:
        return ACT2FN[name]
    except KeyError:
        return None


__all__ = ["SOFTMAX", "ScoreRule", "ScoreRules", "score_rules"]

"""Each router's own scores (`router_scores`): found on its block, reproducing its choice and weights,
and what SMoE, Fate and DyMoE read in place of softmax(logits)."""

import dataclasses

import pytest
import torch

from moetool.engine import build_engine
from moetool.engine.store import HostStore
from moetool.model import load_model
from moetool.policies import make_policy
from moetool.policies.smoe import cache_router
from moetool.router_scores import SOFTMAX, ScoreRule, ScoreRules, score_rules

import policy_fakes
from tiny import save_tiny

# DeepSeek-V3's router as released: a sigmoid, a load-balancing bias that steers the choice, and a
# token's top-4 chosen only among its best 2 of 4 groups of 4 experts.
GROUPED = dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)


def _grouped_deepseek(path, seed=0):
    """A tiny DeepSeek-V3 with group-limited routing and a nonzero selection bias in every router."""
    save_tiny("deepseek_v3", path, seed=seed, **GROUPED)
    lm = load_model(str(path))
    gen = torch.Generator().manual_seed(seed)
    for g in lm.geometry.layers:
        router = lm.model.get_submodule(g.path).get_submodule(g.router)
        router.e_score_correction_bias.copy_(torch.rand(g.num_experts, generator=gen) * 0.2)
    return lm


def _router_choice(lm, g, hidden):
    router = lm.model.get_submodule(g.path).get_submodule(g.router)
    logits, _, idx = router(hidden)
    return logits.float(), idx


def test_a_grouped_sigmoid_router_is_found_and_its_choice_reproduced(tmp_path):
    lm = _grouped_deepseek(tmp_path / "ds")
    rules = score_rules(lm)
    assert rules.unmatched == ()
    g = lm.geometry.layers[0]
    rule = rules.by_layer[g.index]
    assert (rule.func, rule.groups, rule.topk_groups, rule.group_score) == ("sigmoid", 4, 2, "top2")
    assert rule.bias is not None and float(rule.bias.abs().sum()) > 0
    hidden = torch.randn(200, g.hidden_size, generator=torch.Generator().manual_seed(7))  # not the probe's tokens
    logits, idx = _router_choice(lm, g, hidden)
    s = rule.scores(logits)
    # Every expert the router chose scores above 0 (its group is allowed); half the experts score 0.
    assert bool((s.gather(1, idx) > 0).all())
    assert int((s > 0).sum(1).min()) == int((s > 0).sum(1).max()) == 8
    # Its choice is the top-4 of score + bias among the allowed experts, token by token.
    pick = torch.where(s > 0, s + rule.bias, torch.full_like(s, float("-inf")))
    assert torch.equal(pick.topk(4, dim=1).indices.sort(1).values, idx.sort(1).values)
    # What the policies read before: softmax(logits) ranks an excluded group's expert into a token's top-4.
    soft = torch.softmax(logits, -1)
    assert not torch.equal(soft.topk(4, dim=1).indices.sort(1).values, idx.sort(1).values)


@pytest.mark.parametrize("arch, want", [("qwen2_moe", None), ("mixtral", None), ("gpt_oss", None),
                                        ("glm4_moe", "sigmoid"), ("minimax_m2", "sigmoid")])
def test_each_router_gets_its_own_rule(tmp_path, arch, want):
    lm = load_model(str(save_tiny(arch, tmp_path / arch)))
    rules = score_rules(lm)
    assert rules.unmatched == ()
    funcs = {r.func for r in rules.by_layer.values()}
    assert funcs == (set() if want is None else {want})  # softmax layers are left out: they are the default


def test_a_router_no_rule_reproduces_keeps_softmax_and_is_named(tmp_path):
    # DeepSeek-V4's hash layers choose by token id: no score ranks their choice.
    lm = load_model(str(save_tiny("deepseek_v4", tmp_path / "v4")))
    rules = score_rules(lm)
    assert rules.unmatched == tuple(g.index for g in lm.geometry.layers)
    logits = torch.randn(3, lm.geometry.layers[0].num_experts)
    assert torch.equal(rules.scores(lm.geometry.layers[0].index, logits), torch.softmax(logits, -1))


def test_a_selection_bias_kept_inside_the_router_is_found(tmp_path):
    """ERNIE 4.5 keeps its bias in a module of its router (`gate.moe_statics`), shaped [1, E]: trained,
    it steers the choice, and only a rule with it reproduces the router (softmax alone had been unmatched)."""
    lm = load_model(str(save_tiny("ernie4_5_moe", tmp_path / "ernie", moe_num_experts=8)))
    gen = torch.Generator().manual_seed(1)
    for g in lm.geometry.layers:
        statics = lm.model.get_submodule(g.path).get_submodule(g.router).moe_statics
        assert statics.e_score_correction_bias.shape == (1, g.num_experts)
        statics.e_score_correction_bias.data.copy_(torch.randn(1, g.num_experts, generator=gen))
    rules = score_rules(lm)
    assert rules.unmatched == ()
    assert all(r.func == "softmax" and r.bias is not None and r.bias.shape == (8,) for r in rules.by_layer.values())
    assert set(rules.by_layer) == {g.index for g in lm.geometry.layers}


def test_a_selection_bias_added_to_the_logits_is_found(tmp_path):
    """Kolibri1 chooses by logits + bias and weights by sigmoid(logits): with a trained bias no rule that
    adds it to the scores reproduced the choice, and every layer was left on softmax."""
    lm = load_model(str(save_tiny("kolibri1", tmp_path / "k", norm_topk_prob=True)))
    gen = torch.Generator().manual_seed(2)
    for g in lm.geometry.layers:
        router = lm.model.get_submodule(g.path).get_submodule(g.router)
        router.e_score_correction_bias.copy_(torch.randn(g.num_experts, generator=gen) * 2)
    rules = score_rules(lm)
    assert rules.unmatched == ()
    assert rules.kinds() == {"sigmoid, a selection bias on the logits": ", ".join(str(g.index) for g in lm.geometry.layers)}


def test_grouped_scores_compile_whole():
    """The rule runs inside the captured step: no graph break, the eager values."""
    rule = ScoreRule(func="sigmoid", bias=torch.rand(16), groups=4, topk_groups=2)
    logits = torch.randn(3, 16)
    compiled = torch.compile(rule.scores, fullgraph=True, backend="eager")
    assert torch.equal(compiled(logits), rule.scores(logits))


def test_smoe_never_substitutes_an_expert_the_router_could_not_choose():
    # One token, k = 2 over 4 experts in 2 groups of 2, one group allowed: scores (.7, .6 | 0, 0).
    # S_{k+1} = 0, so R = L = 0: an excluded expert scoring 0 would fall in [R, L] as a substitute.
    scores = torch.tensor([[0.7, 0.6, 0.0, 0.0]])
    idx = torch.tensor([[0, 1]])
    out = cache_router(scores, idx, torch.tensor([False, False, True, True]), alpha=0.5)
    assert torch.equal(out, idx)


def test_policies_read_the_routers_scores_not_softmax():
    """Fate's and DyMoE's look-ahead and SMoE's thresholds take `ctx.routers`' scores: a rule that
    leaves only experts 4..7 allowed keeps every prediction there."""
    allowed = ScoreRule(func="sigmoid", bias=torch.tensor([0.0] * 4 + [5.0] * 4), groups=2, topk_groups=1)
    ctx = dataclasses.replace(policy_fakes.make_ctx(E=8, k=2, cache_bytes=100_000),
                              routers=ScoreRules({0: allowed, 1: allowed}))
    logits = torch.tensor([[9.0, 8.0, 7.0, 6.0, 0.0, -1.0, -2.0, -3.0]])  # softmax would pick 0 and 1
    for name, settings in (("fate", {"cache_bits": "4"}), ("dymoe", {})):
        pol = make_policy(name, settings, ctx)
        view = policy_fakes.make_view([[4, 5]], policy_fakes.FakeCache(pol.pools()), pos=0, logits=logits,
                                      predict=lambda later: logits)
        fetched = {f.expert for f in pol.prefetch(view)}
        assert fetched and fetched <= {4, 5, 6, 7}, (name, fetched)


def test_a_run_records_its_routers_scores(tmp_path):
    lm = _grouped_deepseek(tmp_path / "ds")
    store = HostStore.from_experts(lm.experts, torch.float32)
    engine, _ = build_engine(lm, store, "smoe", budget="50%", clock="sim")
    assert engine.policy.ctx.routers.by_layer  # the sigmoid rules reached the policy
    assert engine.stats.context()["router_scores"] == {
        "sigmoid, a selection bias, the best 2 of 4 groups (top2)": ", ".join(str(g.index) for g in lm.geometry.layers)}
    assert SOFTMAX not in engine.policy.ctx.routers.by_layer.values()


def test_a_grouped_rule_runs_inside_the_captured_step(tmp_path):
    """SMoE on the grouped, biased router: its in-step plan (Algorithm 1 on the router's own scores) and
    its score window compile whole with the rule inside, and decode."""
    from moetool.engine.decode import DecodeProgram

    lm = _grouped_deepseek(tmp_path / "ds")
    engine, _ = build_engine(lm, HostStore.from_experts(lm.experts, torch.float32), "smoe", budget="50%",
                             settings={"cpu_assist": "false"}, captured=True, max_tokens=32)
    program = DecodeProgram(engine, max_tokens=32, backend="eager", unverified_ok=True)
    tokens = program.generate(torch.tensor([[5, 17, 33, 2]]), 6)
    assert len(tokens) == 6 and program.steps == 5

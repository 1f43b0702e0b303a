"""DyMoE's mechanisms against the paper's equations and cache rules, on hand-made views."""

import json
from functools import partial

import pytest
import torch

from moetool.errors import MoetoolError
from moetool.policies import make_policy
from moetool.policies.base import Fetch, Phase, Where
from moetool.policies.dymoe import (critical_count, critical_experts, critical_share, prefill_importance,
                                    retention, solve_lambda)

import policy_fakes
from policy_fakes import FakeCache, load, residency_for

make_ctx = partial(policy_fakes.make_ctx, layers=(0, 1, 2, 3), cache_bytes=20_000)
make_view = policy_fakes.make_view


# -- eq. 4-5 ---------------------------------------------------------------------------------------


def test_cosine_retention_and_critical_counts():
    # L = 4, lam = 0.5: (cos(pi l / 3) + 1) / 2 = 1, .75, .25, 0 -> r = 1, .875, .625, .5
    assert [retention(l, 4, 0.5) for l in range(4)] == pytest.approx([1.0, 0.875, 0.625, 0.5])
    assert [critical_count(retention(l, 4, 0.5), 8) for l in range(4)] == [8, 7, 5, 4]
    assert [critical_count(retention(l, 4, 0.5), 2) for l in range(4)] == [2, 2, 2, 1]
    assert critical_count(0.75, 4) == 3  # exact products are not rounded up
    assert retention(0, 1, 0.3) == 1.0  # a single MoE layer keeps everything


def test_lambda_solved_for_the_share_of_critical_experts_kept():
    """Table 2's r is "the average proportion of Critical experts preserved across layers": the mean of
    t_l / M (eq. 5, which rounds up), not the mean of r(l). Solving mean r(l) = r (lam = 2r - 1) kept 98%
    of a top-2 model's experts critical at r = 0.75 and every one at r = 0.9 (Mixtral's shape)."""
    # Mixtral: 32 layers, top-2. lam just above 0: layers 0-15 keep both, 16-31 one -> 48 / 64 = 0.75
    lam = solve_lambda(0.75, 32, 2)
    assert lam == pytest.approx(1e-6) and critical_share(lam, 32, 2) == 0.75
    assert [critical_count(retention(l, 32, lam), 2) for l in range(32)] == [2] * 16 + [1] * 16
    assert critical_share(0.0, 32, 2) == 47 / 64  # lam = 0: the last layer's r = 0 keeps none
    assert critical_share(0.5, 32, 2) == 63 / 64  # what the old rule ran for r = 0.75
    for L, M, r in ((32, 2, 0.9), (48, 8, 0.75), (48, 8, 0.9), (27, 6, 0.75), (4, 8, 0.8)):
        lam = solve_lambda(r, L, M)
        got = critical_share(lam, L, M)
        assert got >= r and critical_share(lam - 2e-6, L, M) < r  # the least lam that reaches r
    # below the schedule's floor lam = 0 runs (a top-1 model keeps its one expert whatever lam is)
    assert solve_lambda(0.75, 8, 1) == 0.0 and critical_share(0.0, 8, 1) == 7 / 8
    assert solve_lambda(0.4, 4, 8) == 0.0


# -- eq. 1-3 and the critical set -------------------------------------------------------------------


def test_prefill_heavy_hitter_load_eq2():
    idx = torch.tensor([[0], [0], [0], [1], [2], [2]])
    s = torch.tensor([0.1, 0.1, 0.1, 0.9, 0.8, 0.05])  # heavy hitters (top 2 = ceil(0.3 * 6)): tokens 3, 4
    assert prefill_importance(idx, s, 4, 0.3).tolist() == [0.0, 1.0, 1.0, 0.0]
    assert prefill_importance(idx, None, 4, 0.3).tolist() == [3.0, 1.0, 2.0, 0.0]  # no s_i: token load


def test_prefill_critical_experts_follow_heavy_hitters_not_load():
    # M = 3 selected experts; r = 0.5 -> t = ceil(1.5) = 2. Expert 0 has the largest load but no heavy hitter.
    idx = [[0], [0], [0], [1], [2], [2]]
    s = torch.tensor([0.1, 0.1, 0.1, 0.9, 0.8, 0.05])
    view = make_view(idx, FakeCache({4: 8}), phase=Phase.PREFILL, importance=s)
    assert critical_experts(view, 0.5, 0.3) == {1, 2}
    view.token_importance = None  # without s_i the token load decides
    assert critical_experts(view, 0.5, 0.3) == {0, 2}


def test_decode_critical_by_gate_score_eq3():
    w = torch.tensor([[0.1, 0.5, 0.3, 0.1]])
    view = make_view([[4, 1, 6, 2]], FakeCache({4: 8}), weights=w)  # M = k = 4
    assert critical_experts(view, 0.5, 0.2) == {1, 6}  # t = 2: the two largest g_j
    assert critical_experts(view, 0.75, 0.2) == {1, 6, 2}  # t = 3; tie 4 vs 2 broken by index


# -- plans: 4/2, 4/0, conservative reuse --------------------------------------------------------------


def _policy(**settings):
    return make_policy("dymoe", {k: str(v) for k, v in settings.items()}, make_ctx(k=4))


def test_plan_4_2_and_4_0():
    w = torch.tensor([[0.1, 0.5, 0.3, 0.1]])
    idx = [[4, 1, 6, 2]]
    pol = _policy(lam=0.5)  # layer 3 of 4: r = 0.5 -> t = 2 critical of 4
    plan = pol.plan(make_view(idx, FakeCache(pol.pools()), pos=3, weights=w))
    assert plan.bits.tolist() == [[2, 4, 4, 2]]
    assert (plan.where == Where.GPU).all() and torch.equal(plan.weight, w)
    pol = _policy(lam=0.5, config="4/0")
    plan = pol.plan(make_view(idx, FakeCache(pol.pools()), pos=3, weights=w))
    assert plan.where.tolist() == [[Where.SKIP, Where.GPU, Where.GPU, Where.SKIP]]
    assert torch.equal(plan.weight, torch.tensor([[0.0, 0.5, 0.3, 0.0]]))  # 0-bit drops its weight only
    assert plan.bits[0, 1:3].tolist() == [4, 4]
    assert [p.bits for p in pol.pools()] == [4]


def test_rule_conservative_reuse():
    pol = _policy(lam=0.5)
    cache = FakeCache(pol.pools())
    cache.put(3, 4, 4)  # a sub-critical expert already held at high precision
    plan = pol.plan(make_view([[4, 1, 6, 2]], cache, pos=3, weights=torch.tensor([[0.1, 0.5, 0.3, 0.1]])))
    assert plan.bits.tolist() == [[4, 4, 4, 2]]  # served by the high copy, no low load


def test_rule_precision_promotion_evicts_the_low_copy():
    pol = _policy()
    res = residency_for(pol)
    load(pol, res, Fetch(0, 5, 2))
    plan = pol.plan(make_view([[5, 1, 2, 3]], res, pos=0))  # layer 0: r = 1, all critical
    assert plan.bits[0, 0] == 4  # a low copy does not serve a critical request: a miss
    victims = load(pol, res, Fetch(0, 5, 4))
    assert Fetch(0, 5, 2) in victims
    assert res.resident_bits(0, 5) == (4,)
    assert (0, 5) not in res.residents(2)


def test_rule_no_duplication():
    pol = _policy()
    res = residency_for(pol)
    load(pol, res, Fetch(0, 5, 4))
    assert pol.admit(Fetch(0, 5, 2), res, set(), demand=False) is None
    load(pol, res, Fetch(1, 6, 4), publish=False)  # a high copy in flight also counts
    assert pol.admit(Fetch(1, 6, 2), res, set(), demand=True) is None


def test_lru_within_each_precision_pool():
    # budget 2000 B, r = 1 at lam = 1 -> all bytes to the high pool: 5 slots, 4 layers -> 2,1,1,1
    pol = make_policy("dymoe", {"lam": "1"}, make_ctx(cache_bytes=2000))
    assert [(p.bits, p.slots, p.quota) for p in pol.pools()] == [(4, 5, {0: 2, 1: 1, 2: 1, 3: 1})]
    res = residency_for(pol)
    for e in (0, 1):
        load(pol, res, Fetch(0, e, 4))
    res.used(0, [(0, 4, True)])  # 0 used again: 1 is least recent
    assert pol.admit(Fetch(0, 2, 4), res, set(), True) == [Fetch(0, 1, 4)]


def test_eviction_knob_takes_any_registered_order():
    for name in ("lru", "arc", "lfu", "score"):
        assert make_policy("dymoe", {"eviction": name}, make_ctx()).params.eviction == name
    with pytest.raises(MoetoolError, match="unknown eviction"):
        make_policy("dymoe", {"eviction": "fifo"}, make_ctx())
    pol = make_policy("dymoe", {"eviction": "score"}, make_ctx())
    res = residency_for(pol)
    assert res.wants_scores()  # the engine then feeds each layer's scores to the residency
    res.observe(0, torch.tensor([0.5, 0.5]))
    assert res.order(4, 0).mean_scores(0) is not None


# -- look-ahead prefetch, eq. 6-8 --------------------------------------------------------------------


def test_lookahead_prefill_token_frequency_eq7():
    pol = make_policy("dymoe", {"lam": "0.5"}, make_ctx(k=1))
    # layer 0 -> predicts layer 1 (r = .875); predicted top-1 of 6 tokens: 3 x3, 5 x2, 7 x1 -> M = 3, t = 3
    top = torch.tensor([3, 3, 3, 5, 5, 7])
    logits = torch.full((6, 8), -5.0)
    logits[torch.arange(6), top] = 5.0
    cache = FakeCache(pol.pools())
    view = make_view([[0]] * 6, cache, phase=Phase.PREFILL, predict=lambda later: logits if later == 1 else None)
    assert pol.prefetch(view) == [Fetch(1, 3, 4), Fetch(1, 5, 4), Fetch(1, 7, 4)]
    view3 = make_view([[0]] * 6, cache, pos=2, phase=Phase.PREFILL, predict=lambda later: logits)
    assert pol.prefetch(view3) == [Fetch(3, 3, 4), Fetch(3, 5, 4)]  # layer 3: r = .5, ceil(1.5) = 2


def test_lookahead_decode_direct_topt_eq8():
    pol = make_policy("dymoe", {"lam": "0.5"}, make_ctx(k=4))
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, 0.5, 2.0, -1.0, 1.5]])
    cache = FakeCache(pol.pools())
    cache.put(3, 3, 4)  # already resident at high precision: not fetched
    view = make_view([[0, 1, 2, 3]], cache, pos=2, predict=lambda later: logits)
    # layer 3: r = 0.5, M = k = 4 -> t = 2 -> top-2 of g_hat: 1, 3
    assert pol.prefetch(view) == [Fetch(3, 1, 4)]
    assert make_policy("dymoe", {"prefetcher": "none"}, make_ctx()).prefetch(view) == []


def test_knobs_and_description():
    pol = make_policy("dymoe", {"r": "0.9", "config": "4/0"}, make_ctx(layers=range(5)))
    assert (pol.high, pol.low, pol.lam) == (4, 0, pytest.approx(0.414214, abs=1e-6))
    d = pol.describe()
    assert d["retention"][0] == 1.0 and d["critical_share"] == pytest.approx(0.9)  # 9 of 10 critical
    json.dumps(d)
    assert "token_importance" in type(pol).signals
    with pytest.raises(MoetoolError, match="config"):
        make_policy("dymoe", {"config": "4-2"}, make_ctx())
    with pytest.raises(MoetoolError, match="high bits"):
        make_policy("dymoe", {"config": "2/4"}, make_ctx())


def test_an_explicit_lambda_records_the_retention_it_gives():
    """lam overrides r (eq. 4), so a run with `--set lam=1` keeps every expert critical and must not be
    recorded (and reported in Table 3 / Fig. 11) at the default r = 0.75."""
    from moetool.policies.dymoe_report import ablation_row

    d = make_policy("dymoe", {"lam": "1"}, make_ctx()).describe()
    assert d["r"] == 1.0 and ablation_row("dymoe", d) == "3. Cache + Prefetch"
    d = make_policy("dymoe", {"lam": "0", "config": "4/0"}, make_ctx(layers=range(4))).describe()
    assert d["r"] == pytest.approx(5 / 8) and ablation_row("dymoe", d).startswith("6.")  # t_l = 2, 2, 1, 0 of 2
    d = make_policy("dymoe", {"r": "0.9"}, make_ctx(layers=range(5))).describe()
    assert d["r"] == 0.9 and d["critical_share"] == pytest.approx(0.9)  # r as given when lam is solved


def test_an_r_below_what_the_schedule_keeps_is_refused_or_its_default_recorded():
    """On a top-1 model every layer but the last (r = 0 at lam = 0) keeps its one expert critical whatever
    lam is (eq. 5 rounds up): over 8 layers the default r = 0.75 runs at lam = 0 and records the share
    that ran, 7/8; an r given is refused."""
    pol = make_policy("dymoe", {}, make_ctx(layers=range(8), k=1))
    assert pol.lam == 0.0 and pol.describe()["r"] == 7 / 8 and "r" in pol.clamped
    with pytest.raises(MoetoolError, match="knob 'r' of policy 'dymoe' is 0.8, but the cosine schedule"):
        make_policy("dymoe", {"r": "0.8"}, make_ctx(layers=range(8), k=1))
    assert make_policy("dymoe", {}, make_ctx(layers=range(4), k=1)).clamped == {}  # 3 of 4: 0.75 is reached


def test_set_r_overrides_a_fitted_lambda():
    """A fit carries r and the lam solved for it; `--set r=` must re-solve lam, not keep the fit's."""
    fitted = {"r": 0.5, "lam": 0.0}
    assert make_policy("dymoe", {}, make_ctx(), fitted).lam == 0.0
    pol = make_policy("dymoe", {"r": "0.9"}, make_ctx(layers=range(5)), fitted)
    assert pol.lam == pytest.approx(0.414214, abs=1e-6) and pol.describe()["critical_share"] == pytest.approx(0.9)
    # both set: lam wins, so the r given would change nothing and the run would record another r
    with pytest.raises(MoetoolError, match="--set r=0.9 changes nothing with lam=0.2"):
        make_policy("dymoe", {"r": "0.9", "lam": "0.2"}, make_ctx(), fitted)
    assert make_policy("dymoe", {"lam": "0.2"}, make_ctx(), fitted).lam == 0.2  # lam alone: the fit's r is not read


def test_a_fits_r_edited_by_hand_is_taken_and_its_lam_solved_again_said():
    """A fit's r edited from 0.9 to 0.7 beside the lam solved for 0.9: lam won, the run recorded r = 0.9, unsaid."""
    from moetool.engine import _fresh_fit
    from moetool.policies.dymoe import solve_lambda
    from moetool.policies.knobs import Sizing

    ctx = make_ctx(layers=range(5))
    lam = solve_lambda(0.9, 5, 2)
    assert critical_share(lam, 5, 2) >= 0.9
    anywhere = {"r": Sizing()}  # an r fitted from --r holds at any budget
    mine, dropped = _fresh_fit("dymoe", {}, {"r": 0.9, "lam": lam}, anywhere, "25%", ctx)
    assert mine == {"r": 0.9, "lam": lam} and dropped == {}  # the pair the fit wrote: taken
    mine, dropped = _fresh_fit("dymoe", {}, {"r": 0.7, "lam": lam}, anywhere, "25%", ctx)
    assert mine == {"r": 0.7} and dropped["lam"].startswith("it gives r = 0.9 on this model, not the fit's r = 0.7")
    ran = make_policy("dymoe", {}, ctx, mine).describe()["critical_share"]
    assert ran == pytest.approx(critical_share(solve_lambda(0.7, 5, 2), 5, 2)) and ran < 0.9  # lam solved from 0.7


@pytest.mark.parametrize("layers, k", [(48, 8), (58, 8), (16, 8), (32, 2)])
def test_a_fit_at_the_cosine_floor_is_taken_as_written(tmp_path, layers, k):
    """A tight budget fits lam = 0, whose share (0.5598958 over Qwen3-30B's 48 layers of top-8) the fit
    writes as r = 0.5599: a run read the rounding up as an edit, dropped the fitted lam and ran the next
    step of 1/(L k) (1/384 more experts at INT4), saying "r = 0.56 ... not the fit's r = 0.56"."""
    from moetool.engine import _fresh_fit
    from moetool.policies.knobs import Sizing

    share = critical_share(0.0, layers, k)
    written = {"r": round(share, 4), "lam": 0.0}
    mine, dropped = _fresh_fit("dymoe", {}, written, {"r": Sizing()}, "25%", make_ctx(layers=range(layers), k=k))
    assert dropped == {} and mine == written


def test_lookahead_prefill_ties_go_to_the_larger_mean_score_at_any_prompt_length():
    """Eq. 7 ranks by c_e; equal counts go to the larger mean predicted score (the code's stated tie
    rule). Folded into one float32 key c + 1e-3 * score, that tie-break vanished once c_e reached a
    few hundred tokens (the float's step at 300 is 3e-5), and the lower id won instead."""
    pol = make_policy("dymoe", {"lam": "0.5"}, make_ctx(k=1))
    for n in (3, 300):
        # n tokens predict expert 2 (logit 4) with expert 5 second (0.1); n predict 5 (4) with 2 second (0).
        logits = torch.full((2 * n, 8), -30.0)
        logits[:n, 2], logits[:n, 5] = 4.0, 0.1
        logits[n:, 5], logits[n:, 2] = 4.0, 0.0
        # c_2 = c_5 = n, M = 2; layer 3 (r = 0.5): t = ceil(0.5 * 2) = 1. Mean g_hat: expert 5
        # (e^.1 / (e^4 + e^.1) + e^4 / (e^4 + 1)) / 2 = (.01984 + .98201) / 2 = .50093, expert 2
        # (.98016 + .01799) / 2 = .49907: the tie goes to 5.
        view = make_view([[0]] * (2 * n), FakeCache(pol.pools()), pos=2, phase=Phase.PREFILL,
                         predict=lambda later: logits)
        assert pol.prefetch(view) == [Fetch(3, 5, 4)], f"{n} tokens per expert"


def test_the_cache_is_standard_lru_a_prefetched_copys_first_use_is_a_reference():
    """§4.4.2 extends "the standard LRU cache". The engine's default counts a prefetched copy's admission,
    not its first use (what ARC's lists need), so DyMoE evicted the expert it had used last when that one
    had arrived by look-ahead."""
    from policy_fakes import load, residency_for

    ctx = make_ctx(layers=(0, 1), E=8, k=1, cache_bytes=4 * 400)  # 4 INT4 slots: 2 a layer
    pol = make_policy("dymoe", {"config": "4/0", "r": "0.75"}, ctx)
    res = residency_for(pol)
    load(pol, res, Fetch(1, 2, 4), demand=True)
    res.used(1, [(2, 4, False)])  # step 0: layer 1 runs e2 (a miss)
    load(pol, res, Fetch(1, 1, 4), demand=False)  # the look-ahead brings e1
    res.used(1, [(2, 4, True)])  # step 1: e2 again
    res.used(1, [(1, 4, True)])  # step 2: e1's first use, the most recent
    victims = load(pol, res, Fetch(1, 3, 4), demand=True)
    assert [(v.layer, v.expert) for v in victims] == [(1, 2)]  # the least recently used
    # ARC (`--set eviction=arc`) counts a prefetch's admission only: its first use would put it in T2 at once
    assert all(p.prefetch_is_reference for p in make_policy("dymoe", {"eviction": "arc"}, ctx).pools())


def test_a_batched_decode_ranks_each_token_as_if_decoded_alone():
    """Eq. 5's t_l was taken over the union of a step's tokens and ranked by their summed weights: in 4/0
    one token could lose every expert to its batch-mate's (its MoE output zero) while decoded alone it
    kept its best. Each token is ranked alone now, in 4/0 and 4/2, as the captured step ranks it."""
    ctx = make_ctx(layers=(0, 1, 2, 3), E=8, k=2)
    idx, w = [[0, 1], [2, 3]], torch.tensor([[0.6, 0.4], [0.55, 0.45]])
    for config in ("4/0", "4/2"):
        pol = make_policy("dymoe", {"config": config, "lam": "0"}, ctx)
        cache = FakeCache(pol.pools())
        for pos in (1, 2):  # r = 0.75 (t = 2 of k = 2) and 0.25 (t = 1)
            batched = pol.plan(make_view(idx, cache, layer=pos, pos=pos, weights=w))
            alone = [pol.plan(make_view([idx[t]], cache, layer=pos, pos=pos, weights=w[t:t + 1])) for t in range(2)]
            assert batched.where.tolist() == [a.where.tolist()[0] for a in alone], (config, pos)
            assert batched.bits.tolist() == [a.bits.tolist()[0] for a in alone], (config, pos)
        if config == "4/0":
            assert batched.where.tolist() == [[int(Where.GPU), int(Where.SKIP)]] * 2  # pos 2: each keeps its best

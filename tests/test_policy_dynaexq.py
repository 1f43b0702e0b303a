"""DynaExq: hotness EMA, top-n with hysteresis, budget admission, and publication without waiting."""

import json
from functools import partial

import pytest
import torch

from moetool.errors import MoetoolError
from moetool.policies import make_policy
from moetool.policies.base import Fetch, Phase, Step
from moetool.policies.dynaexq import Hotness, select_high

import policy_fakes
from policy_fakes import load, residency_for

# 2 layers of 4 experts: the low tier takes 2 * 4 * 400 = 3200 B; 8000 B leave (8000 - 3200) // 1600 // 2 = 1 per layer
make_ctx = partial(policy_fakes.make_ctx, E=4, k=1, cache_bytes=8000)
make_view = partial(policy_fakes.make_view, E=4, weight=1.0)


def warmed(policy):
    res = residency_for(policy)
    for f in policy.warm():
        load(policy, res, f, demand=False)
    return res


def pools(policy):
    return {p.bits: p.slots for p in policy.pools()}


def test_hotness_ema_per_interval():
    h = Hotness(1, 3, ema=0.5, interval_tokens=4)
    h.observe(0, torch.tensor([[0], [0], [1]]))
    assert not h.tick(3)  # 3 < T_u tokens: no update yet
    h.observe(0, torch.tensor([[0]]))
    assert h.tick(1)
    assert h.score[0].tolist() == [1.5, 0.5, 0.0]  # S = 0.5 * 0 + 0.5 * c, c = [3, 1, 0]
    assert h.count.sum() == 0  # counters reset
    h.observe(0, torch.tensor([[2], [2], [2], [2]]))
    h.tick(4)
    assert h.score[0].tolist() == [0.75, 0.25, 2.0]


def test_topn_with_hysteresis():
    s = torch.tensor([5.0, 4.5, 1.0, 0.0])
    assert select_high(s, set(), 2, 1.0) == {0, 1}  # free capacity: the hottest
    assert select_high(s, {0, 2}, 2, 1.0) == {0, 1}  # 4.5 > 1.0 + 1: swap
    assert select_high(s, {0, 2}, 2, 4.0) == {0, 2}  # 4.5 <= 1.0 + 4: the incumbent stays
    assert select_high(torch.tensor([5.0, 2.5, 2.0, 0.0]), {0, 2}, 2, 1.0) == {0, 2}  # within the margin
    assert select_high(torch.tensor([5.0, 2.0, 2.0, 0.0]), {0, 2}, 2, 0.0) == {0, 2}  # margin 0, tie: keep
    assert select_high(s, {0, 1, 2}, 2, 1.0) == {0, 1}  # capacity shrank: the coldest leaves
    assert select_high(torch.tensor([3.0, 0.0, 0.0, 0.0]), set(), 2, 1.0) == {0}  # no traffic, no promotion


def test_pools_budget_and_knobs():
    pol = make_policy("dynaexq", {}, make_ctx())
    assert pools(pol) == {4: 8, 16: 2} and pol.n_hi == 1
    assert pol.warm() == [Fetch(layer, e, 4) for layer in (0, 1) for e in range(4)]
    assert pools(make_policy("dynaexq", {"config": "4/2"}, make_ctx())) == {2: 8, 4: 2 * 4}  # n_hi capped at E
    assert pools(make_policy("dynaexq", {"n_hi": "0"}, make_ctx())) == {4: 8}
    with pytest.raises(MoetoolError, match="n_hi=2 does not fit"):
        make_policy("dynaexq", {"n_hi": "2"}, make_ctx())
    with pytest.raises(MoetoolError, match="raise --budget"):
        make_policy("dynaexq", {}, make_ctx(cache_bytes=3000))
    json.dumps(make_policy("dynaexq", {}, make_ctx()).describe())


def test_promotion_is_a_migration_published_without_waiting():
    pol = make_policy("dynaexq", {"ema": "0", "interval_tokens": "1", "hysteresis": "0"}, make_ctx())
    cache = warmed(pol)
    plan = pol.plan(make_view([[2], [2], [1]], cache))
    assert plan.bits.tolist() == [[4], [4], [4]]
    promotions = pol.end_step(Step(0, Phase.DECODE, 3), cache)
    assert promotions == [Fetch(0, 2, 16)]  # layer 0's hottest; layer 1 saw no traffic
    victims = load(pol, cache, promotions[0], demand=False, publish=False)
    assert victims == []  # admitted: a free high slot in layer 0
    # §3.2 PROMOTING: the high copy is in flight, the handle still resolves to the low one
    assert set(cache.loading_bits(0, 2)) == {16} and set(cache.resident_bits(0, 2)) == {4}
    plan = pol.plan(make_view([[2]], cache))
    assert plan.bits.tolist() == [[4]]  # the forward runs the low copy while the high one is in flight
    assert pol.end_step(Step(1, Phase.DECODE, 1), cache) == []  # in flight: not offered again
    cache.publish(0, 2, 16)
    assert 16 in cache.resident_bits(0, 2) and 2 in pol.target[0]  # RESIDENT-HI
    assert pol.plan(make_view([[2]], cache)).bits.tolist() == [[16]]
    assert set(cache.resident_bits(0, 1)) == {4} and not cache.loading_bits(0, 1)  # RESIDENT-LO


def test_demotion_reclaims_the_slot_and_admission_defers():
    pol = make_policy("dynaexq", {"ema": "0", "interval_tokens": "1", "hysteresis": "0"}, make_ctx())
    cache = warmed(pol)
    pol.plan(make_view([[2]], cache))
    [f] = pol.end_step(Step(0, Phase.DECODE, 1), cache)
    load(pol, cache, f, demand=False)
    pol.plan(make_view([[3], [3]], cache))  # the hot set moves to expert 3
    [f] = pol.end_step(Step(1, Phase.DECODE, 2), cache)
    assert f == Fetch(0, 3, 16)
    assert 16 in cache.resident_bits(0, 2) and 2 not in pol.target[0]  # DEMOTING: out of H_l, still serving
    assert pol.plan(make_view([[2]], cache)).bits.tolist() == [[16]]
    assert pol.admit(f, cache, {(0, 2)}, demand=False) is None  # 2 is in use this layer: deferred
    assert pol.end_step(Step(2, Phase.DECODE, 0), cache) == [f]  # and offered again
    victims = pol.admit(f, cache, set(), demand=False)
    assert victims == [Fetch(0, 2, 16)]  # the DEMOTING copy's slot is reclaimed
    cache.begin_load(f, victims)
    assert set(cache.resident_bits(0, 2)) == {4}  # its handle resolves to the low copy at once
    assert pol.plan(make_view([[2]], cache)).bits.tolist() == [[4]]
    assert pol.admit(Fetch(0, 1, 16), cache, set(), False) is None  # not in the target set


def test_hysteresis_holds_the_incumbent():
    pol = make_policy("dynaexq", {"ema": "0", "interval_tokens": "1", "hysteresis": "2"}, make_ctx())
    cache = warmed(pol)
    pol.target[0] = {2}
    load(pol, cache, Fetch(0, 2, 16), demand=False)
    pol.plan(make_view([[2], [3], [3]], cache))  # 3 is hotter by 1 < margin 2
    assert pol.end_step(Step(0, Phase.DECODE, 3), cache) == [] and pol.target[0] == {2}
    pol.plan(make_view([[2], [3], [3], [3], [3]], cache))  # by 3 > 2
    assert pol.end_step(Step(1, Phase.DECODE, 5), cache) == [Fetch(0, 3, 16)]


def test_set_tiers_drop_a_fitted_n_hi():
    """A fit's n_hi holds for its tiers: asking for 4/2 re-derives n_hi from the budget instead."""
    ctx = make_ctx()
    own = make_policy("dynaexq", {"config": "4/2"}, ctx)
    assert own.n_hi > 0
    # recorded as run: the run's params said b_hi=16, b_lo=4 (the defaults `config` overrode)
    assert (own.describe()["b_hi"], own.describe()["b_lo"], own.describe()["config"]) == (4, 2, "4/2")
    assert make_policy("dynaexq", {"config": "4/2"}, ctx, {"n_hi": 0}).n_hi == own.n_hi
    assert make_policy("dynaexq", {}, ctx, {"n_hi": 0}).n_hi == 0  # the fit's own tiers: kept
    assert make_policy("dynaexq", {"config": "4/2", "n_hi": "1"}, ctx, {"n_hi": 0}).n_hi == 1


def test_edges_of_the_interval_and_the_margin():
    """§3.5 at its edges, as the code chooses them. An interval that ends inside a long prompt is one
    update with all the prompt's counts, and the next interval starts at that step's end (nothing
    carried over). The margin holds at equality. Two experts within the margin of each other are not
    swapped even where each clears it against another: c (7) replaces b (5) by 2 > 1, then d (6.8)
    against x (5.9), the coldest left, falls short (0.9 <= 1)."""
    h = Hotness(1, 3, ema=0.5, interval_tokens=4)
    assert not h.tick(3)
    h.observe(0, torch.tensor([[1]] * 10))  # a 10-token prompt ends the interval mid-way
    assert h.tick(10) and h.score[0].tolist() == [0.0, 5.0, 0.0] and h.tokens == 0
    assert not h.tick(3)  # the 9 tokens past T_u are not carried into the next interval
    s = torch.tensor([5.0, 3.0, 2.0, 0.0])
    assert select_high(s, {0, 2}, 2, 1.0) == {0, 2}  # 3 = 2 + 1: not more than the margin
    assert select_high(s, {0, 2}, 2, 0.99) == {0, 1}
    #                  a     b    x    c    d
    s = torch.tensor([10.0, 5.0, 5.9, 7.0, 6.8])
    assert select_high(s, {0, 1, 2}, 3, 1.0) == {0, 2, 3}
    assert select_high(s, set(), 5, 1.0) == {0, 1, 2, 3, 4}  # n_hi = E: every expert with traffic


@pytest.mark.parametrize("config", ["16/4", "4/2"])
def test_in_step_plan_decides_as_the_host_plan_on_edge_traces(config):
    """k = 1, a dropped slot, an expert routed twice in a batch, a promotion in flight (runs low) and
    a published one (runs high): `plan_step` picks the bits `plan` picks, slot by slot."""
    from moetool.policies.device import DeviceView

    hi, lo = map(int, config.split("/"))
    for idx in ([[2]], [[2], [4], [1]], [[2], [3], [2]]):
        pol = make_policy("dynaexq", {"config": config}, make_ctx(cache_bytes=20_000))
        cache = warmed(pol)
        pol.target[0] = {2, 3}
        load(pol, cache, Fetch(0, 2, hi), demand=False)  # RESIDENT-HI
        load(pol, cache, Fetch(0, 3, hi), demand=False, publish=False)  # PROMOTING
        view = make_view(idx, cache)
        host = pol.plan(view)
        dview = DeviceView(layer=0, moe_pos=0, num_experts=4, top_k_index=view.top_k_index,
                           top_k_weights=view.top_k_weights, router_logits=None, predict=lambda later: None,
                           resident=lambda layer, bits: torch.tensor([bits in cache.resident_bits(layer, e)
                                                                      for e in range(4)]))
        dev = pol.plan_step(dview)
        want = [[hi if e == 2 else 0 if e == 4 else lo for e in row] for row in idx]  # 4: a dropped slot
        assert dev.bits.tolist() == want
        assert torch.where(host.running(), host.bits, 0).tolist() == want


def test_a_budget_holding_no_expert_at_b_hi_says_the_run_is_static():
    """n_hi derived as 0 (every expert fits at b_lo, none at b_hi) ran static INT4 with no word; only
    the record's n_hi_used betrayed it. n_hi = 0 asked for is what was asked: no note."""
    from policy_fakes import make_ctx

    ctx = make_ctx(layers=(0, 1), E=8, k=2, cache_bytes=2 * 8 * 400 + 1500)  # all at INT4, under 2 x 1600
    derived = make_policy("dynaexq", {}, ctx)
    assert derived.n_hi == 0 and any("static INT4" in n for n in derived.notes)
    asked = make_policy("dynaexq", {"n_hi": "0"}, ctx)
    assert asked.n_hi == 0 and asked.notes == []
    room = make_policy("dynaexq", {}, make_ctx(layers=(0, 1), E=8, k=2, cache_bytes=2 * 8 * 400 + 3200))
    assert room.n_hi == 1 and room.notes == []

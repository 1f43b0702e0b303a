"""Fate's mechanisms against the paper's rules, and ARC on a hand-computed textbook trace."""

import dataclasses
import json

import pytest
import torch

from moetool.errors import MoetoolError
from moetool.policies import make_policy
from moetool.policies.base import Fetch, Phase, Pool, Where
from moetool.policies.common import popularity
from moetool.policies.eviction import ARC
from moetool.policies.fate import above_percentile, int2_experts, shallow_favoring, transfer_cap

import policy_fakes
from policy_fakes import FakeCache, load, make_ctx, make_view, residency_for


# -- ARC (Megiddo & Modha, FAST 2003), c = 3 -------------------------------------------------------------


def K(n):
    return (0, n)


def lists(arc):
    return ([k[1] for k in arc.t1], [k[1] for k in arc.t2], [k[1] for k in arc.b1], [k[1] for k in arc.b2], arc.p)


def access(arc, resident, x, c=3):
    """A cache of c pages driving ARC as the residency does: touch on a hit; request, victim, remove, insert."""
    if K(x) in resident:
        arc.touch(K(x))
        return
    arc.request(K(x))
    if len(resident) == c:
        v = arc.victim(sorted(resident))
        arc.remove(v)
        resident.discard(v)
    arc.insert(K(x))
    resident.add(K(x))


# Hand-computed from the ARC algorithm (cases I-IV, REPLACE) (T1, T2, B1, B2 LRU -> MRU, then p), after each request.
ARC_TRACE = [
    (1, ([1], [], [], [], 0)),
    (2, ([1, 2], [], [], [], 0)),
    (3, ([1, 2, 3], [], [], [], 0)),
    (1, ([2, 3], [1], [], [], 0)),  # case I: a hit moves 1 to T2
    (4, ([3, 4], [1], [2], [], 0)),  # case IV.B: |T1| = 2 > p = 0, T1's LRU 2 becomes a B1 ghost
    (5, ([4, 5], [1], [3], [], 0)),  # case IV.A, |T1| < c: B1's LRU (2) forgotten, then 3 -> B1
    (3, ([5], [1, 3], [4], [], 1)),  # case II: p += 1 (|B1| >= |B2|); |T1| = 2 > 1 so 4 -> B1; 3 -> T2
    (6, ([5, 6], [3], [4], [1], 1)),  # case IV.B: |T1| = 1 = p, 6 not in B2: T2's LRU 1 -> B2
    (1, ([6], [3, 1], [4, 5], [], 0)),  # case III: p -= 1; |T1| = 2 > 0: 5 -> B1; 1 -> T2
    (4, ([6], [1, 4], [5], [3], 1)),  # case II: p = 1; |T1| = 1 not > 1: T2's LRU 3 -> B2
    (3, ([], [1, 4, 3], [5, 6], [], 0)),  # case III: p = 0; 6 -> B1
    (7, ([7], [4, 3], [5, 6], [1], 0)),  # case IV.B: T1 empty, so T2's LRU 1 -> B2
    (8, ([8], [4, 3], [6, 7], [1], 0)),  # case IV.A: B1's LRU 5 forgotten; 7 -> B1
    (6, ([8], [3, 6], [7], [1, 4], 1)),  # case II (delta 1): T2's LRU 4 -> B2
    (7, ([8], [6, 7], [], [1, 4, 3], 3)),  # case II with |B1| < |B2|: delta = 2/1, p = min(3, 1 + 2)
    (1, ([8], [7, 1], [], [4, 3, 6], 2)),  # case III: p = 2; |T1| = 1 < p: T2's LRU 6 -> B2
    (4, ([], [7, 1, 4], [8], [3, 6], 1)),  # case III: p = 1 = |T1| and 4 was in B2: REPLACE takes T1 (8)
]


def test_arc_textbook_trace():
    arc, resident = ARC(c=3), set()
    for x, expected in ARC_TRACE:
        access(arc, resident, x)
        assert lists(arc) == expected, f"after request {x}"
        assert resident == set(arc.t1) | set(arc.t2)


def _arc_pool():
    policy = make_policy("lru", {"bits": "4"}, make_ctx(layers=(0,)))
    return policy, residency_for(policy, [Pool(4, 3, quota={0: 3}, eviction="arc")])


def test_arc_learns_capacity_and_matches_through_the_residency():
    """The registry builds ARC without c; through a per-layer pool of 3 slots it replays the same trace."""
    policy, res = _arc_pool()
    for x, expected in ARC_TRACE:
        hit = 4 in res.resident_bits(0, x)
        if not hit:
            load(policy, res, Fetch(0, x, 4))
        res.used(0, [(x, 4, hit)])
        assert lists(res.order(4, 0)) == expected, f"after request {x}"


def test_a_prefetched_copy_is_first_referenced_on_use():
    policy, res = _arc_pool()
    load(policy, res, Fetch(0, 5, 4), demand=False)  # a prefetch
    res.used(0, [(5, 4, True)])  # its first use: still referenced once (T1)
    assert lists(res.order(4, 0))[:2] == ([5], [])
    res.used(0, [(5, 4, True)])  # the second use is a re-reference (T2)
    assert lists(res.order(4, 0))[:2] == ([], [5])


def test_without_prefetch_is_reference_the_first_use_counts():
    policy = make_policy("lru", {"bits": "4"}, make_ctx(layers=(0,)))
    res = residency_for(policy, [Pool(4, 3, quota={0: 3}, eviction="arc", prefetch_is_reference=False)])
    load(policy, res, Fetch(0, 5, 4), demand=False)
    res.used(0, [(5, 4, True)])  # plain recency: the first use is a second reference (T2)
    assert lists(res.order(4, 0))[:2] == ([], [5])


def test_arc_never_picks_a_shielded_victim():
    arc, resident = ARC(c=2), set()
    for x in (1, 2):
        access(arc, resident, x, c=2)
    arc.request(K(3))
    assert arc.victim([K(2)]) == K(2)  # T1's LRU (1) is in use this layer


# -- Fate §4.2-4.5 ----------------------------------------------------------------------------------


def test_75th_percentile_rule():
    scores = torch.tensor([[0.30, 0.20, 0.15, 0.10, 0.10, 0.05, 0.05, 0.05]])
    # sorted: .05 .05 .05 .10 .10 .15 .20 .30; q = 0.75 at rank 5.25 -> .15 + .25 * .05 = .1625
    assert above_percentile(scores, 0.75) == [0, 1]
    two = torch.tensor([[0.30, 0.20, 0.15, 0.10, 0.10, 0.05, 0.05, 0.05],
                        [0.05, 0.05, 0.05, 0.10, 0.10, 0.15, 0.20, 0.30]])
    assert above_percentile(two, 0.75) == [0, 7, 1, 6]  # united over tokens, best score first
    # the literal rule at its edges (documented in above_percentile): E = 8 keeps 7 - floor(5.25) = 2
    # experts, fewer than a top-4's; scores tied with the quantile do not exceed it
    eight = torch.softmax(torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0]]), -1)
    assert above_percentile(eight, 0.75) == [0, 1]
    assert above_percentile(torch.tensor([[0.2, 0.2, 0.2, 0.2, 0.05, 0.05, 0.05, 0.05]]), 0.75) == []


def test_transfer_cap_n_is_T_over_t_expert():
    hw = {"t_load": {4: 6e-3}, "t_expert": {4: 1e-3}, "t_attn": 10e-3, "t_gate": 1e-3}
    # T = t_moe + t_attn + t_gate = 2 * 1 ms + 10 ms + 1 ms = 13 ms; n = floor(13 / 6) = 2
    assert transfer_cap(make_ctx(hw=hw), 4) == 2
    assert transfer_cap(make_ctx(hw=hw), 4, n=5) == 5  # a fitted n wins
    assert transfer_cap(make_ctx(k=3), 4) == 3  # no timings: one token's k
    assert transfer_cap(make_ctx(hw={"t_load": {4: 1.0}}), 4) == 1  # never below one


def test_decode_prefetch_above_percentile_capped_at_n():
    hw = {"t_load": {4: 6e-3}, "t_expert": {4: 1e-3}, "t_attn": 10e-3, "t_gate": 1e-3}  # n = 2
    policy = make_policy("fate", {}, make_ctx(E=16, hw=hw))
    probs = torch.full((1, 16), 0.2 / 12)
    probs[0, [0, 1, 4, 7]] = torch.tensor([0.30, 0.20, 0.17, 0.13])
    cache = FakeCache(policy.pools())
    view = make_view([[0, 1]], cache, E=16, predict=lambda later: probs.log() if later == 1 else None)
    # q75 at rank 11.25 of 16: 0.0167 + 0.25 * (0.13 - 0.0167) = 0.045 -> 0, 1, 4, 7; capped at n = 2
    assert policy.prefetch(view) == [Fetch(1, 0, 4), Fetch(1, 1, 4)]
    cache.put(1, 0, 4)  # already resident: not a transfer, the next one takes its place
    assert policy.prefetch(view) == [Fetch(1, 1, 4), Fetch(1, 4, 4)]


def test_prefill_prefetch_by_popularity_with_int2_for_the_least_popular():
    policy = make_policy("fate", {"p": "0.25"}, make_ctx(k=1))
    # predicted top-1 of 8 tokens: expert 3 x4, 5 x2, 1 x1, 6 x1 -> M = 4, floor(0.25 * 4) = 1 at INT2
    top = [3, 3, 3, 3, 5, 5, 1, 6]
    logits = torch.full((8, 8), -5.0)
    logits[torch.arange(8), torch.tensor(top)] = 5.0
    logits[7, 1] = 0.0  # token 7 also leans to 1: 1 outranks 6 on the tie in popularity
    view = make_view([[0]] * 8, FakeCache(policy.pools()), phase=Phase.PREFILL,
                     predict=lambda later: logits)
    assert policy.prefetch(view) == [Fetch(1, 3, 4), Fetch(1, 5, 4), Fetch(1, 1, 4), Fetch(1, 6, 2)]


def test_int2_least_popular_share():
    counts = torch.tensor([9, 0, 1, 5, 2, 0, 7, 3])  # 6 active
    assert int2_experts(counts, 0.25) == {2}  # floor(1.5) = 1
    assert int2_experts(counts, 0.5) == {2, 4, 7}
    assert int2_experts(counts, 0.0) == set()


def test_prefill_plan_runs_least_popular_at_int2_decode_at_int4():
    policy = make_policy("fate", {"p": "0.25"}, make_ctx(k=2))
    cache = FakeCache(policy.pools())
    idx = [[0, 1], [0, 2], [0, 1], [0, 3]]  # popularity: 0 x4, 1 x2, 2 x1, 3 x1; M = 4 -> 1 at INT2 (3)
    plan = policy.plan(make_view(idx, cache, phase=Phase.PREFILL))
    assert plan.bits.tolist() == [[4, 4], [4, 4], [4, 4], [4, 2]]
    assert torch.equal(plan.expert, torch.tensor(idx))
    cache.put(0, 0, 2)  # a copy prefetched at INT2 is used as it is
    plan = policy.plan(make_view(idx, cache, phase=Phase.PREFILL))
    assert plan.bits[:, 0].tolist() == [2, 2, 2, 2]
    plan = policy.plan(make_view([[3, 1]], cache, phase=Phase.DECODE))
    assert plan.bits.tolist() == [[4, 4]]


def test_lossless_at_16_16():
    policy = make_policy("fate", {"cache_bits": "16", "low_bits": "16"}, make_ctx(cache_bytes=50_000))
    idx = [[0, 1], [0, 2], [0, 1], [7, 3]]
    w = torch.rand(4, 2)
    for phase in (Phase.PREFILL, Phase.DECODE):
        plan = policy.plan(make_view(idx, FakeCache(policy.pools()), phase=phase, weights=w))
        assert torch.equal(plan.expert, torch.tensor(idx))
        assert (plan.bits == 16).all() and (plan.where == Where.GPU).all()
        assert torch.equal(plan.weight, w)
    assert [p.bits for p in policy.pools()] == [16]


def test_cache_deep_quota():
    layers = tuple(range(6))
    # not enough for the first L = 3 layers: filled sequentially
    assert shallow_favoring(layers, 8, 3, 10) == {0: 8, 1: 2, 2: 0, 3: 0, 4: 0, 5: 0}
    # cache_deep = (30 - 3 * 8) / (6 - 3) = 2
    assert shallow_favoring(layers, 8, 3, 30) == {0: 8, 1: 8, 2: 8, 3: 2, 4: 2, 5: 2}
    assert shallow_favoring(layers, 8, 3, 31) == {0: 8, 1: 8, 2: 8, 3: 3, 4: 2, 5: 2}
    assert shallow_favoring(layers, 8, 3, 100) == {layer: 8 for layer in layers}  # no layer beyond E


def test_fate_pools_and_warm_follow_the_quota():
    # 6 layers, E = 8; INT2 staging: min(2 * ceil(0.25 * 8), 6000 // 2 // 200) = 4 slots (800 B);
    # cache_total = (6000 - 800) // 400 = 13 -> layer 0 full, layer 1 gets 5
    policy = make_policy("fate", {}, make_ctx(layers=range(6), cache_bytes=6000))
    assert [(p.bits, p.slots, p.eviction) for p in policy.pools()] == [(4, 13, "arc"), (2, 4, "lru")]
    assert policy.quota == {0: 8, 1: 5, 2: 0, 3: 0, 4: 0, 5: 0}
    assert policy.warm() == [Fetch(0, e, 4) for e in range(8)]
    json.dumps(policy.describe())


def test_fate_knob_errors():
    with pytest.raises(MoetoolError, match="position 1"):
        make_policy("fate", {"position": "1"}, make_ctx())
    with pytest.raises(MoetoolError, match="eviction"):
        make_policy("fate", {"eviction": "nope"}, make_ctx())


def test_fate_composes_with_other_evictions():
    policy = make_policy("fate", {"eviction": "lru", "p": "0"}, make_ctx(layers=(0,), cache_bytes=1200))
    res = residency_for(policy)
    for e in (0, 1, 2):
        load(policy, res, Fetch(0, e, 4))
    assert policy.admit(Fetch(0, 3, 4), res, {(0, 0)}, True) == [Fetch(0, 1, 4)]  # LRU, 0 shielded


def test_popularity_ignores_dropped_slots():
    assert popularity(torch.tensor([[0, 8], [1, -1]]), 8).tolist() == [1, 1, 0, 0, 0, 0, 0, 0]


def test_the_captured_steps_n_counts_the_copies_that_fit_in_its_own_shorter_layer():
    """Fate §4.3's window T = t_moe + t_attn + t_gate on the captured path is the captured step's
    layer: with the H100 profile's dense time (1.61 ms a layer driven from the host, 0.164 ms in one
    graph replay) 2 INT4 copies fit, not 17: a sim run of the captured step on the H100 read the host
    path's time and prefetched up to 17 experts a layer."""
    from moetool.engine.clock import CostModel, load_hw

    hw, _ = load_hw("h100sxm-qwen15moe")
    int4 = 4_589_568  # an INT4 Qwen1.5-MoE expert's blob at group 64
    cost = CostModel(hw=hw, expert_bytes={4: int4}, expert_flops_per_token=2 * 3 * 2048 * 1408,
                     reference_bytes=2 * 3 * 2048 * 1408, dense_bytes_per_layer=60e6, dense_flops_per_token_per_layer=60e6)
    host, captured = cost.policy_view(), cost.policy_view(captured=True)
    assert host["t_attn"] == hw.t_dense_s and captured["t_attn"] == hw.t_dense_captured_s
    t_load = int4 / (hw.h2d_gbps * 1e9) + hw.copy_latency_s
    for view in (host, captured):
        window = 4 * hw.t_expert_s[4] + view["t_attn"] + hw.kernel_s
        assert transfer_cap(make_ctx(hw=view, k=4, E=60), 4) == min(60, int(window // t_load))
    assert transfer_cap(make_ctx(hw=host, k=4, E=60), 4) >= 5 * transfer_cap(make_ctx(hw=captured, k=4, E=60), 4)


def test_prefill_int2_experts_are_the_tail_of_the_transfer_order():
    """§4.3 transfers most popular first, §4.5 moves the least popular p at INT2: on a tie in
    popularity both follow one ranking (the higher summed score first), so the INT2 expert is the
    last transfer. Before, the INT2 set broke ties by index and could send an expert at INT2 ahead of
    an equally popular one at INT4."""
    policy = make_policy("fate", {"p": "0.25"}, make_ctx(k=1))
    # predicted top-1 of 8 tokens: 3 x4, 5 x2, 1 x1, 6 x1 -> M = 4, floor(0.25 * 4) = 1 at INT2.
    top = [3, 3, 3, 3, 5, 5, 1, 6]
    logits = torch.full((8, 8), -5.0)
    logits[torch.arange(8), torch.tensor(top)] = 5.0
    logits[6, 6] = 0.0  # token 6 (predicting 1) also leans to 6: 6 outranks 1 on the tie, 1 is last
    view = make_view([[0]] * 8, FakeCache(policy.pools()), phase=Phase.PREFILL, predict=lambda later: logits)
    assert policy.prefetch(view) == [Fetch(1, 3, 4), Fetch(1, 5, 4), Fetch(1, 6, 4), Fetch(1, 1, 2)]


def test_prefill_int2_share_holds_without_an_int2_pool():
    """§4.5's INT2 for the least popular p of a prefill does not depend on caching INT2 copies: at a
    budget under two INT2 experts the policy has no INT2 pool (they stream through staging), and the
    least popular expert still runs at INT2. Before, no pool meant no INT2 at all."""
    policy = make_policy("fate", {"p": "0.25"}, make_ctx(k=2, cache_bytes=399))
    assert policy.low_slots == 0 and policy.precisions() == (4, 2)
    idx = [[0, 1], [0, 2], [0, 1], [0, 3]]  # popularity: 0 x4, 1 x2, 2 x1, 3 x1; M = 4 -> 1 at INT2 (3)
    plan = policy.plan(make_view(idx, FakeCache(policy.pools()), phase=Phase.PREFILL))
    assert plan.bits.tolist() == [[4, 4], [4, 4], [4, 4], [4, 2]]
    same = make_policy("fate", {"p": "0.25", "low_bits": "4"}, make_ctx(k=2, cache_bytes=399))
    assert (same.plan(make_view(idx, FakeCache(same.pools()), phase=Phase.PREFILL)).bits == 4).all()


def test_an_expert_routed_by_padding_alone_moves_at_int2():
    """With a batch's pad rows left out of the popularity, an expert only they route ranked nowhere and
    moved at INT4, the costliest transfer, for no request."""
    import dataclasses

    ctx = make_ctx(layers=(0, 1), E=8, k=1, cache_bytes=20_000)
    pol = make_policy("fate", {"L": "0", "p": "0.25"}, ctx)
    idx = [[7]] * 3 + [[1]] * 4 + [[2]] * 2 + [[3]]  # the first three rows are a shorter prompt's padding
    view = dataclasses.replace(make_view(idx, residency_for(pol), layer=1, pos=1, phase=Phase.PREFILL),
                               real_rows=torch.tensor([False] * 3 + [True] * 7))
    plan = pol.plan(view)
    bits = {int(e): int(b) for e, b in zip(plan.expert.flatten(), plan.bits.flatten())}
    assert bits == {7: 2, 1: 4, 2: 4, 3: 4}  # floor(0.25 * 3) = 0 of the real experts at INT2; 7 no request's


def test_prefill_takes_a_copy_in_flight_at_the_bits_the_prefetch_chose():
    """§4.1's prefetch list carries each expert's bit width, from the predicted popularity (§4.5). The plan
    looked only at resident copies: an expert whose INT4 copy was still on the link but which the layer's
    actual routing put in the INT2 tail was copied a second time, at INT2 (and the other way round)."""
    ctx = make_ctx(layers=(0, 1), E=8, k=1, cache_bytes=20_000)
    pol = make_policy("fate", {"L": "0", "p": "0.25"}, ctx)
    res = residency_for(pol)
    load(pol, res, Fetch(1, 3, 4), demand=False, publish=False)  # predicted popular: INT4, still loading
    load(pol, res, Fetch(1, 5, 2), demand=False, publish=False)  # predicted unpopular: INT2, still loading
    idx = [[5]] * 5 + [[0]] * 3 + [[1]] * 2 + [[3]]  # actually: 5 the most popular, 3 the least
    plan = pol.plan(make_view(idx, res, layer=1, pos=1, phase=Phase.PREFILL))
    bits = {int(e): int(b) for e, b in zip(plan.expert.flatten(), plan.bits.flatten())}
    assert bits == {5: 2, 0: 4, 1: 4, 3: 4}  # 3 and 5 at the bits in flight; 0 and 1 as the routing says


def test_experts_in_flight_compute_in_the_order_their_copies_were_issued():
    """Fate Fig. 6: "Have prefetched: 2, 4. Loading: 3, 1, 5 ... Our order: 2, 4, 3, 1, 5". The engine
    computed the loading experts by id (1, 3, 5), waiting on 1's copy while 3's had landed."""
    from types import SimpleNamespace

    from moetool.engine.groups import group_plan
    from moetool.engine.runtime import Engine
    from moetool.engine.stats import LayerStats

    ctx = make_ctx(layers=(0, 1), E=8, k=1, cache_bytes=40_000)
    pol = make_policy("fate", {"L": "0", "p": "0", "quantize_cache": "always"}, ctx)
    res = residency_for(pol)
    for e in (2, 4):
        load(pol, res, Fetch(1, e, 4), demand=False)
    for i, e in enumerate((3, 1, 5)):  # the prefetcher's transfer order: most popular first
        load(pol, res, Fetch(1, e, 4), demand=False, publish=False)
        res.table[1, e, 4].seq = 100 + i  # what `_copy` numbers them as it issues them
    idx = [[3]] * 5 + [[1]] * 4 + [[5]] * 3 + [[2]] * 2 + [[4]]
    view = make_view(idx, res, layer=1, pos=1, phase=Phase.PREFILL)
    groups = group_plan(pol.plan(view), view.top_k_index, 8, LayerStats(), grouped=True, max_bits=16,
                        device=torch.device("cpu"))
    ordered, _ = Engine._schedule(SimpleNamespace(residency=res), 1, groups)
    assert [g.expert for g in ordered] == [2, 4, 3, 1, 5]


def test_the_cache_is_quantized_only_when_memory_is_insufficient():
    """§4.5: "Fate employs int4 quantization when memory resources are insufficient". The cache was INT4
    at any budget, ten times every expert at 16 bits included, losing quality the paper's system keeps."""
    from policy_fakes import BYTES

    every = 2 * 8 * BYTES[16]
    ample = make_policy("fate", {}, make_ctx(layers=(0, 1), E=8, cache_bytes=every))
    assert ample.params.cache_bits == 16 and ample.precisions() == (16, 16) and ample.low_slots == 0
    assert ample.quota == {0: 8, 1: 8} and len(ample.warm()) == 16  # every expert cached, from the start
    short = make_policy("fate", {}, make_ctx(layers=(0, 1), E=8, cache_bytes=every - 1))
    assert short.params.cache_bits == 4 and short.precisions() == (4, 2)
    always = make_policy("fate", {"quantize_cache": "always"}, make_ctx(layers=(0, 1), E=8, cache_bytes=every))
    assert always.params.cache_bits == 4 and always.describe()["cache_quantized"]
    assert not ample.describe()["cache_quantized"] and not ample.describe()["int2_prefill"]
    asked = make_policy("fate", {"cache_bits": "8", "low_bits": "2"}, make_ctx(layers=(0, 1), E=8, cache_bytes=every))
    assert asked.params.cache_bits == 8  # a cache_bits given is what was asked for
    no16 = make_ctx(layers=(0, 1), E=8, cache_bytes=every)
    no16 = type(no16)(**{**no16.__dict__, "available_bits": (4, 2)})  # a bundle made with --no-reference
    assert make_policy("fate", {}, no16).params.cache_bits == 4


def test_a_cache_that_stops_inside_the_first_L_layers_says_which_layers_cache_nothing():
    # Four MoE layers of 8 experts, L = 3, room for 10 INT4 experts and no INT2 pool: §4.4's limited-memory
    # case fills layer 0 (8) and layer 1 (2), so layers 2 and 3 cache none; the run says so.
    ctx = policy_fakes.make_ctx(layers=(0, 1, 2, 3), E=8, k=2, cache_bytes=10 * policy_fakes.BYTES[4])
    pol = make_policy("fate", {"L": "3", "p": "0"}, ctx)
    assert pol.quota == {0: 8, 1: 2, 2: 0, 3: 0}
    assert len(pol.notes) == 1 and "MoE layers 2, 3 cache none and load every expert they run" in pol.notes[0]
    one = make_policy("fate", {"L": "3", "p": "0"}, dataclasses.replace(ctx, cache_bytes=17 * policy_fakes.BYTES[4]))
    assert one.quota[3] == 0 and "MoE layer 3 caches none and loads every expert it runs" in one.notes[0]
    roomy = make_policy("fate", {"L": "3", "p": "0"}, dataclasses.replace(ctx, cache_bytes=40 * policy_fakes.BYTES[4]))
    assert not roomy.notes and min(roomy.quota.values()) > 0


def test_a_share_p_that_moves_no_expert_takes_no_int2_pool():
    """§4.5 moves floor(p * M) of a layer's M <= E active experts at INT2. The INT2 pool was sized
    2 * ceil(p * E): p = 0.1 on 8 experts carved two INT2 slots no expert could enter (the INT4 cache
    one slot smaller, a lower hit rate), and the default p = 0.25 on a model of 2 experts gave half a
    small cache to them. Such a p is refused when asked for; the default runs as p = 0, recorded."""
    big = make_ctx(k=2, E=8, cache_bytes=4000)
    with pytest.raises(MoetoolError, match=r"knob 'p' of policy 'fate' is 0.1, but floor\(p \* M\)"):
        make_policy("fate", {"p": "0.1"}, big)
    moves = make_policy("fate", {"p": "0.25"}, big)
    assert moves.low_slots == 2 * 2 and moves.precisions() == (4, 2)  # floor(0.25 * 8) = 2, two layers' worth
    small = make_ctx(k=1, E=2, cache_bytes=1000)
    default = make_policy("fate", {}, small)
    assert default.params.p == 0 and "p" in default.clamped and default.low_slots == 0
    assert default.precisions() == (4, 4) and sum(default.quota.values()) == 1000 // 400
    idx = [[0], [0], [1]]  # M = 2: floor(0.25 * 2) = 0 at INT2, as before; the cache now holds both
    assert (default.plan(make_view(idx, FakeCache(default.pools()), phase=Phase.PREFILL)).bits == 4).all()
    with pytest.raises(MoetoolError, match="knob 'p' of policy 'fate' is 0.25"):
        make_policy("fate", {"p": "0.25"}, small)

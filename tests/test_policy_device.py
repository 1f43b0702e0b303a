"""The two halves of the policy contract decide alike: for every policy, a decode token's host plan
(`plan`, `prefetch`) and its in-step plan (`plan_step`, on tensors as the captured step gives them)
name the same experts, precisions, skips, weights and prefetches, given the same routing, router
logits, look-ahead and residency. Routing traces and residencies are random (seeded), with ties in
the weights and dropped slots, so the tie rules are exercised too."""

import pytest
import torch

from moetool.policies import make_policy
from moetool.policies.base import Where
from moetool.policies.device import DeviceView, above_percentile, best_first, rank_in_token
from policy_fakes import FakeCache, make_ctx, make_view

E, K, LAYERS = 8, 3, (0, 1, 2)
CTX_HW = {"t_load": {16: 2e-4, 8: 1e-4, 4: 5e-5, 2: 3e-5}, "t_expert": {16: 2e-5, 8: 2e-5, 4: 2e-5, 2: 2e-5},
          "c_cpu": 1e-3, "t_attn": 1e-4, "t_gate": 5e-6}

POLICIES = [
    ("resident", {}), ("static", {"bits": "4"}), ("lod", {}), ("lru", {}), ("eap", {}),
    ("fate", {}), ("fate", {"percentile": "0.5", "n": "3"}), ("fate", {"cache_bits": "16", "p": "0"}),
    ("dymoe", {"config": "4/2"}), ("dymoe", {"config": "4/0", "r": "0.7"}), ("dymoe", {"config": "4/2", "prefetcher": "fate"}),
    ("dymoe", {"config": "8/4", "prefetcher": "none", "r": "0.9"}),
    ("smoe", {"cpu_assist": "false"}), ("smoe", {"cpu_assist": "false", "alpha": "0.6", "prefetcher": "fate"}),
    ("dynaexq", {"config": "16/4"}), ("dynaexq", {"config": "4/2"}),
]


def _trace(seed: int):
    """One decode token's routing [1, K] (distinct experts, sometimes a dropped slot, tied weights),
    its router logits [1, E], look-ahead logits per later layer, and a residency per precision."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(E, generator=g)[:K].view(1, K)
    if seed % 5 == 0:
        idx[0, -1] = E  # a slot the router marked dropped
    weights = torch.rand(1, K, generator=g)
    if seed % 3 == 0:
        weights[0, 1] = weights[0, 0]  # a tie: the lower expert id ranks first
    logits = torch.randn(1, E, generator=g) * 2
    ahead = {layer: torch.randn(1, E, generator=g) * 2 for layer in LAYERS}
    held = {b: torch.rand(len(LAYERS), E, generator=g) < 0.4 for b in (16, 8, 4, 2)}
    return idx, weights, logits, ahead, held


def _cache(pol, held) -> FakeCache:
    cache = FakeCache({b: len(LAYERS) * E for b in (16, 8, 4, 2)})
    for b, mask in held.items():
        for layer, e in mask.nonzero().tolist():
            cache.put(layer, e, b)
    return cache


def _host_decisions(pol, view):
    plan = pol.plan(view)
    run = plan.where != Where.SKIP
    bits = torch.where(run, plan.bits, 0)
    expert = torch.where(run, plan.expert, -1)
    weight = torch.where(run, plan.routing_weight(), 0.0)
    fetches = [(f.layer, f.expert, f.bits) for f in pol.prefetch(view)]
    return expert, bits, weight, fetches


def _device_decisions(pol, view, cache, ahead, pos):
    def resident(layer, bits):
        return torch.tensor([bits in cache.resident_bits(layer, e) for e in range(E)])

    dview = DeviceView(layer=view.layer, moe_pos=pos, num_experts=E, top_k_index=view.top_k_index,
                       top_k_weights=view.top_k_weights, router_logits=view.router_logits, resident=resident,
                       predict=lambda later: ahead[later])
    plan = pol.plan_step(dview)
    run = plan.bits > 0
    expert = torch.where(run, plan.expert, -1)
    weight = torch.where(run, plan.weight.float(), 0.0)
    fetches = []
    if plan.prefetch is not None:
        later = LAYERS[pos + 1]
        fetches = [(later, int(e), plan.prefetch_bits) for e in plan.prefetch.tolist() if e >= 0]
    return expert, plan.bits, weight, fetches


@pytest.mark.parametrize("name,knobs", POLICIES, ids=lambda x: str(x))
def test_in_step_plan_decides_as_the_host_plan(name, knobs):
    ctx = make_ctx(layers=LAYERS, E=E, k=K, cache_bytes=10**9, hw=CTX_HW)
    decisions = 0
    for seed in range(40):
        pol = make_policy(name, dict(knobs), ctx)
        idx, weights, logits, ahead, held = _trace(seed)
        cache = _cache(pol, held)
        pos = seed % len(LAYERS)
        view = make_view(idx.tolist(), cache, pos=pos, E=E, weights=weights, logits=logits,
                         predict=lambda later: ahead[later])
        h_expert, h_bits, h_weight, h_fetch = _host_decisions(pol, view)
        d_expert, d_bits, d_weight, d_fetch = _device_decisions(pol, view, cache, ahead, pos)
        where = f"{name} {knobs}, trace {seed}"
        assert torch.equal(h_bits, d_bits), where
        assert torch.equal(h_expert, d_expert), where
        assert torch.equal(h_weight, d_weight), where
        if name != "eap":  # EAP predicts on the host half from the routing alone (log_layer = prefetch)
            assert h_fetch == d_fetch, where
        decisions += int((h_bits > 0).sum()) + len(h_fetch)
    assert decisions > 40  # the traces ran experts and fetched, not only skipped


def test_eap_host_half_is_its_prefetch():
    """EAP's counts and prediction read only the routing: in the captured step they run on the host
    half, one step behind, as `log_layer`, and give what `prefetch` gives on the same routing."""
    ctx = make_ctx(layers=LAYERS, E=E, k=K, cache_bytes=10**9)
    a, b = make_policy("eap", {}, ctx), make_policy("eap", {}, ctx)
    cache = FakeCache({16: 24})
    for seed in range(12):
        idx, weights, *_ = _trace(seed)
        view = make_view(idx.tolist(), cache, pos=seed % len(LAYERS), E=E, weights=weights)
        assert a.prefetch(view) == b.log_layer(view)


def test_rank_and_best_first_follow_the_host_tie_rules():
    idx = torch.tensor([[5, 2, 7, 1]])
    w = torch.tensor([[0.3, 0.3, 0.1, 0.3]])
    run = torch.tensor([[True, True, True, False]])
    # the three running slots by weight, ties to the lower id (2 before 5); the dropped one last
    assert rank_in_token(w, idx, run).tolist() == [[1, 0, 2, 3]]
    score = torch.tensor([0.2, 0.9, 0.9, 0.1, 0.5])
    chosen = torch.tensor([True, True, True, False, True])
    assert best_first(score, chosen, 4).tolist() == [1, 2, 4, 0]
    assert best_first(score, chosen, 6).tolist() == [1, 2, 4, 0, -1]
    scores = torch.tensor([[0.1, 0.5, 0.2, 0.9], [0.4, 0.1, 0.3, 0.2]])
    mask, best = above_percentile(scores, 0.75)
    from moetool.policies.fate import above_percentile as host

    want = host(scores, 0.75)
    assert best_first(best, mask, 4)[: len(want)].tolist() == want


EDGE_TRACES = [  # (routing [1, k], weights [1, k], look-ahead logits [E]): the cases random traces rarely hit
    ([[3]], [[0.7]], [2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]),  # k = 1: t = ceil(r) = 1, always critical
    ([[E, E, E]], [[0.2, 0.2, 0.2]], [0.0] * E),  # every slot dropped: M = 0, t = 0; predicted scores all tied
    ([[5, 2, 7]], [[0.3, 0.3, 0.3]], [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]),  # weights tied: lower id first;
    # four tied top scores: none exceeds Fate's 75th percentile (it equals them), DyMoE's top-t by lower id
    ([[6, E, 1]], [[0.1, 0.5, 0.1]], [0.5, 3.0, 3.0, 0.5, 0.5, 2.0, 0.5, 0.5]),  # a dropped slot among ties
]


@pytest.mark.parametrize("name,knobs", [p for p in POLICIES if p[0] in ("dymoe", "fate")], ids=lambda x: str(x))
def test_in_step_plan_decides_as_the_host_plan_on_edge_traces(name, knobs):
    """k = 1, a token whose every slot is dropped, exact ties in routing weights and in predicted
    scores (at DyMoE's t_l boundary and at Fate's percentile), at every MoE position."""
    for idx, w, ahead_row in EDGE_TRACES:
        k = len(idx[0])
        ctx = make_ctx(layers=LAYERS, E=E, k=k, cache_bytes=10**9, hw=CTX_HW)
        ahead = {layer: torch.tensor([ahead_row]) for layer in LAYERS}
        for pos in range(len(LAYERS)):
            for held in ({}, {4: torch.ones(len(LAYERS), E, dtype=torch.bool)}):  # nothing / everything at 4 bits
                pol = make_policy(name, dict(knobs), ctx)
                cache = _cache(pol, held)
                view = make_view(idx, cache, pos=pos, E=E, weights=torch.tensor(w), predict=lambda later: ahead[later])
                host = _host_decisions(pol, view)
                dev = _device_decisions(pol, view, cache, ahead, pos)
                where = f"{name} {knobs}, routing {idx}, position {pos}, held {sorted(held)}"
                for h, d in zip(host[:3], dev[:3]):
                    assert torch.equal(h, d), where
                assert host[3] == dev[3], where

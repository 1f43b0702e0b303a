"""SMoE's mechanisms: Algorithm 1 decisions, eq. 3 eviction with the shield, prefetch, Algorithm 2 splits."""

import json
from functools import partial

import pytest
import torch

from moetool.policies import make_policy
from moetool.policies.base import Fetch, Phase, Where
from moetool.policies.eviction import EVICTIONS
from moetool.policies.smoe import ScoreEviction
from moetool.policies.smoe import cache_router, cpu_split, thresholds

import policy_fakes
from policy_fakes import FakeCache, load, residency_for

make_ctx = partial(policy_fakes.make_ctx, k=3, cache_bytes=16_000)
make_view = partial(policy_fakes.make_view, weight=0.3)


def mask(E, *experts):
    m = torch.zeros(E, dtype=torch.bool)
    m[list(experts)] = True
    return m


# One token, k = 3, alpha = 0.3. Active: 0 (.30), 7 (.15), 1 (.12); S_{k+1} = .11 (expert 2).
# T = .143: 0 and 7 are top-score, 1 is low-score. Substitutes in [.077, .11]: 2 (.11), 3, 4, 5 (not 6).
SCORES = torch.tensor([[0.30, 0.12, 0.11, 0.10, 0.09, 0.08, 0.05, 0.15]])
IDX = torch.tensor([[0, 7, 1]])


def test_thresholds():
    hi, lo, low = thresholds(SCORES, 3, 0.3)
    assert (hi.item(), lo.item(), low.item()) == pytest.approx((0.143, 0.11, 0.077))


def test_alg1_enough_substitutes_A_ge_B():
    out = cache_router(SCORES, IDX, mask(8, 3, 5, 6), 0.3)  # A = {3, 5}; 6 scores below R
    assert out.tolist() == [[0, 7, 3]]  # the best substitute replaces the low-score expert


def test_alg1_too_few_substitutes_A_lt_B():
    scores = SCORES.clone()
    scores[0, 7] = 0.13  # now 7 is low-score too: B = {7 (.13), 1 (.12)}
    out = cache_router(scores, IDX, mask(8, 4), 0.3)  # A = {4}
    assert out.tolist() == [[0, 7, 4]]  # keep the top |B| - |A| = 1 of B (7), replace the lowest (1)
    assert cache_router(scores, IDX, mask(8), 0.3).tolist() == [[0, 7, 1]]  # A empty: nothing replaced


def test_alg1_resident_low_score_expert_is_kept():
    assert cache_router(SCORES, IDX, mask(8, 1, 3), 0.3).tolist() == [[0, 7, 1]]


def test_alg1_the_k_plus_1_th_expert_is_a_substitute():
    # Score exactly S_{k+1}: inside E_s's bound (1-a)S < s <= S (the constraint after eq. 2).
    assert cache_router(SCORES, IDX, mask(8, 2), 0.3).tolist() == [[0, 7, 2]]


def test_alg1_other_tokens_top_score_experts_are_substitutes():
    scores = torch.cat([SCORES, torch.tensor([[0.02, 0.02, 0.02, 0.02, 0.02, 0.60, 0.02, 0.28]])])
    idx = torch.tensor([[0, 7, 1], [5, 7, 0]])
    out = cache_router(scores, idx, mask(8), 0.3)  # nothing resident, but 5 is token 1's top-score expert
    assert out[0].tolist() == [0, 7, 5]


def test_alg1_alpha_zero_substitutes_nothing():
    assert cache_router(SCORES, IDX, mask(8, 2, 3, 4, 5), 0.0).tolist() == [[0, 7, 1]]


def test_alg1_alpha_zero_substitutes_nothing_when_the_kth_and_k_plus_1th_scores_tie():
    # k = 2, alpha = 0: S_{k+1} = .2 (expert 2, resident), tied with the routed expert 1. Algorithm 1:
    # T = L = R = .2, so B_t = {e : .2 <= score < .2} is empty and O = the routed experts. (Swapping 1
    # for 2 would be a substitution at alpha = 0, which Table IV's alpha = 0 column does not make.)
    scores = torch.tensor([[0.5, 0.2, 0.2, 0.1]])
    assert cache_router(scores, torch.tensor([[0, 1]]), mask(4, 2), 0.0).tolist() == [[0, 1]]


def test_alg1_a_score_of_exactly_T_is_neither_top_nor_low_score():
    # k = 2, alpha = .5 (binary-exact scores): S_{k+1} = .25 (expert 2), T = .375, R = .125. Expert 1
    # scores exactly T: Algorithm 1 puts into B_t only L <= score < T (and E_l's bound after eq. 2 is
    # score < (1 + alpha) S_{k+1}), so it is not low-score and is not replaced by the resident 2.
    scores = torch.tensor([[0.40, 0.375, 0.25, 0.20, 0.10]])
    idx = torch.tensor([[0, 1]])
    assert cache_router(scores, idx, mask(5, 2), 0.5).tolist() == [[0, 1]]
    scores[0, 1] = 0.3125  # below T: low-score, and the resident 2 (.25, in [R, L]) replaces it
    assert cache_router(scores, idx, mask(5, 2), 0.5).tolist() == [[0, 2]]


def _alg1_token_by_token(scores, idx, resident, alpha):
    """Algorithm 1 written as the paper reads, one token at a time: the reference for the vectorised one."""
    T, k = idx.shape
    E = scores.shape[1]
    out = idx.clone()
    valid = (idx >= 0) & (idx < E)
    hi, lo, low_bound = thresholds(scores, k, alpha)
    sel = scores.gather(1, idx.clamp(0, E - 1))
    top = valid & (sel > hi[:, None])
    in_c = torch.zeros(E, dtype=torch.bool)
    in_c[idx[top]] = True
    usable = resident | in_c
    for t in range(T):
        b = [j for j in range(k) if valid[t, j] and lo[t] <= sel[t, j] < hi[t] and not usable[idx[t, j]]]
        if not b:
            continue
        inactive = torch.ones(E, dtype=torch.bool)
        inactive[idx[t][valid[t]]] = False
        a = (inactive & usable & (scores[t] >= low_bound[t]) & (scores[t] <= lo[t])).nonzero().squeeze(1)
        a = a[torch.argsort(scores[t, a], descending=True, stable=True)].tolist()
        b.sort(key=lambda j: -float(sel[t, j]))
        replaced = b if len(a) >= len(b) else b[len(b) - len(a):]
        for j, e in zip(replaced, a):
            out[t, j] = e
    return out


@pytest.mark.parametrize("seed", range(20))
def test_alg1_vectorised_equals_token_by_token(seed):
    """Random batches with ties, dropped slots and partial residency: every token's substitutions
    are the ones the per-token reading of Algorithm 1 makes."""
    g = torch.Generator().manual_seed(seed)
    T, E, k = 9, 12, 4
    scores = torch.softmax(torch.randn(T, E, generator=g) * 0.3, -1)
    scores = (scores * 200).round() / 200  # ties: equal scores must break the same way
    idx = torch.topk(scores + 1e-6 * torch.arange(E), k).indices
    idx[torch.rand(T, k, generator=g) < 0.1] = E  # dropped slots
    resident = torch.rand(E, generator=g) < 0.4
    for alpha in (0.0, 0.2, 0.5):
        assert torch.equal(cache_router(scores, idx, resident, alpha), _alg1_token_by_token(scores, idx, resident, alpha))


def test_alg2_two_pointer_split():
    # C_load = 2, C_CPU = 1, five misses: load, cpu, cpu, load, cpu -> n_load = 2 (max(4, 3) = 4, eq. 4's optimum)
    assert cpu_split([1.0] * 5, 2.0) == 2
    assert cpu_split([1.0] * 4, 1.0) == 2
    assert cpu_split([1.0], 5.0) == 1  # the first pointer move is always a load
    assert cpu_split([], 1.0) == 0
    # printed Algorithm 2 compares the running totals only, so one expert goes to a slow CPU anyway ...
    assert cpu_split([10.0] * 3, 1.0) == 2
    # ... while eq. 4 itself would load all three: max(3, 0) = 3 < max(2, 10) = 10
    assert cpu_split([10.0] * 3, 1.0, rule="eq4") == 3
    assert cpu_split([1.0] * 5, 2.0, rule="eq4") == 2


# -- eq. 3 eviction with the shield ------------------------------------------------------------------


def test_score_eviction_eq3_window_and_shield():
    order = EVICTIONS["score"](n=2)  # eq. 3 averages iterations j-2 .. j
    assert isinstance(order, ScoreEviction) and order.reads_scores
    for key in [(0, 0), (0, 1), (0, 2)]:
        order.insert(key)
    for s in ([0.0, 0.9, 0.5], [0.1, 0.0, 0.5], [0.1, 0.0, 0.5], [0.9, 0.0, 0.5]):
        order.observe(0, torch.tensor(s))
    # means over the last 3: e0 = .367, e1 = 0, e2 = .5 (the first iteration fell out of the window)
    assert order.victim([(0, 0), (0, 1), (0, 2)]) == (0, 1)
    assert order.victim([(0, 0), (0, 2)]) == (0, 0)  # 1 shielded: the next lowest


def test_score_eviction_without_scores_is_lru():
    order = ScoreEviction()
    for key in [(0, 0), (0, 1), (0, 2)]:
        order.insert(key)
    order.touch((0, 0))
    assert order.victim([(0, 0), (0, 1), (0, 2)]) == (0, 1)


def test_smoe_admission_uses_scores_and_shield():
    pol = make_policy("smoe", {"cpu_assist": "false", "prefetcher": "none", "window": "2"},
                      make_ctx(layers=(0,), cache_bytes=4800))
    res = residency_for(pol)  # 3 slots at 16 bits, per layer, ranked by eq. 3
    assert [(p.slots, p.eviction, p.eviction_options) for p in pol.pools()] == [(3, "score", {"n": 2})]
    scores = torch.tensor([0.05, 0.30, 0.10, 0.20, 0.05, 0.05, 0.05, 0.20])
    assert res.wants_scores()
    res.observe(0, scores)  # what the engine does with each layer's router scores
    for e in (1, 2, 3):
        load(pol, res, Fetch(0, e, 16))
    assert res.order(16, 0).n == 2
    assert load(pol, res, Fetch(0, 7, 16)) == [Fetch(0, 2, 16)]  # lowest mean score
    # 3 and 7 tie at 0.20 and 3 is older; with 3 in use this layer, 7 goes instead
    assert pol.admit(Fetch(0, 4, 16), res, {(0, 3)}, True) == [Fetch(0, 7, 16)]


# -- plan and prefetch -------------------------------------------------------------------------------


def test_plan_substitutes_keep_the_slot_weight_and_split_misses():
    hw = {"t_load": {16: 2.0}, "c_cpu": 1.0}
    pol = make_policy("smoe", {"alpha": "0.3"}, make_ctx(E=8, k=3, hw=hw))
    cache = FakeCache(pol.pools())
    cache.put(0, 3, 16)
    w = torch.tensor([[0.5, 0.3, 0.2]])
    plan = pol.plan(make_view(IDX.tolist(), cache, logits=SCORES.log(), weights=w))
    assert plan.expert.tolist() == [[0, 7, 3]]
    assert torch.equal(plan.weight, w)  # 3 runs with 1's weight
    # misses 0 (.30) and 7 (.15): Algorithm 2 loads the higher-scored, computes the other on the CPU
    assert plan.where.tolist() == [[Where.GPU, Where.CPU, Where.GPU]]
    cache.put(0, 7, 16, loading=True)  # a prefetch in flight stays on the device
    plan = pol.plan(make_view(IDX.tolist(), cache, logits=SCORES.log(), weights=w))
    assert plan.where.tolist() == [[Where.GPU, Where.GPU, Where.GPU]]


def test_plan_without_timings_loads_every_miss():
    pol = make_policy("smoe", {}, make_ctx())
    plan = pol.plan(make_view(IDX.tolist(), FakeCache(pol.pools()), logits=SCORES.log()))
    assert (plan.where == Where.GPU).all()
    assert not pol.describe()["cpu_assist_active"]


def test_top_score_prefetch_uses_the_next_router():
    pol = make_policy("smoe", {"alpha": "0.3"}, make_ctx())
    cache = FakeCache(pol.pools())
    cache.put(1, 7, 16)
    view = make_view(IDX.tolist(), cache, logits=SCORES.log(),
                     predict=lambda later: SCORES.log() if later == 1 else None)
    assert pol.prefetch(view) == [Fetch(1, 0, 16)]  # top-score predicted: 0 and 7; 7 is resident


def test_prefetcher_knob_composes_fates_prefetcher():
    logits = SCORES.log()
    for name, expected in (("fate", [Fetch(1, 0, 16), Fetch(1, 7, 16)]), ("none", [])):
        pol = make_policy("smoe", {"prefetcher": name}, make_ctx(k=3))
        view = make_view(IDX.tolist(), FakeCache(pol.pools()), logits=logits, predict=lambda later: logits)
        assert pol.prefetch(view) == expected  # fate: above the 75th percentile, n = k = 3 cap
    json.dumps(pol.describe())


def test_dropped_slots_are_not_run():
    pol = make_policy("smoe", {}, make_ctx())
    plan = pol.plan(make_view([[0, 8, 1]], FakeCache(pol.pools()), logits=SCORES.log()))
    assert plan.where[0, 1] == Where.SKIP and plan.running().tolist() == [[True, False, True]]


# -- the in-step half on edge traces ------------------------------------------------------------------

# (routing [T][k], router scores [T, E], resident experts of layer 0, predicted scores of layer 1 [T, E])
EDGE_TRACES = [
    # k = 1: the only routed expert is low-score (.3 < 1.3 * .25), the resident 2 (.25 = S_{k+1}) replaces it
    ([[1]], [[0.05, 0.30, 0.25, 0.20, 0.05, 0.05, 0.05, 0.05]], (2,), [0.4, 0.3, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0]),
    # the k-th and (k+1)-th scores tie (expert 2 resident): nothing at alpha 0, a swap above it
    ([[0, 1]], [[0.4, 0.2, 0.2, 0.05, 0.05, 0.05, 0.05, 0.0]], (2,), [0.05, 0.35, 0.35, 0.1, 0.1, 0.05, 0.0, 0.0]),
    # expert 7 is low-score but resident (kept), 1 is low-score: its substitute cannot be 7, routed
    # in the same token; in the second token 7 is inactive and may substitute; a dropped slot in the third
    ([[0, 7, 1], [5, 3, 7], [0, 8, 2]],
     [[0.30, 0.12, 0.11, 0.10, 0.09, 0.08, 0.05, 0.15], [0.01, 0.01, 0.01, 0.14, 0.01, 0.60, 0.09, 0.13],
      [0.40, 0.04, 0.20, 0.18, 0.01, 0.01, 0.005, 0.155]], (3, 7),
     [0.3, 0.3, 0.3, 0.1, 0.0, 0.0, 0.0, 0.0]),
]


@pytest.mark.parametrize("alpha", ["0", "0.3", "0.99"])
@pytest.mark.parametrize("trace", range(len(EDGE_TRACES)))
def test_in_step_plan_decides_as_the_host_plan_on_edge_traces(trace, alpha):
    """k = 1, ties at S_{k+1}, a resident low-score expert routed in the same token, a dropped slot,
    several tokens (another token's top-score expert as a substitute) and tied predicted scores:
    `plan_step` runs and weights the experts `plan` does, and prefetches what `prefetch` does."""
    from moetool.policies.device import DeviceView

    idx, scores, held, ahead = EDGE_TRACES[trace]
    k, scores, ahead = len(idx[0]), torch.tensor(scores), torch.tensor([ahead] * len(idx))
    pol = make_policy("smoe", {"alpha": alpha, "cpu_assist": "false"}, make_ctx(layers=(0, 1), k=k))
    cache = FakeCache(pol.pools())
    for e in held:
        cache.put(0, e, 16)
    w = torch.rand(len(idx), k, generator=torch.Generator().manual_seed(trace))
    view = make_view(idx, cache, logits=scores.log(), weights=w, predict=lambda later: ahead.log())
    host, fetches = pol.plan(view), pol.prefetch(view)
    dview = DeviceView(layer=0, moe_pos=0, num_experts=8, top_k_index=view.top_k_index, top_k_weights=w,
                       router_logits=scores.log(), predict=lambda later: ahead.log(),
                       resident=lambda layer, bits: torch.tensor([bits in cache.resident_bits(layer, e)
                                                                  for e in range(8)]))
    dev = pol.plan_step(dview)
    run = host.running()
    assert torch.equal(dev.bits > 0, run)
    assert torch.equal(torch.where(run, dev.expert, -1), torch.where(run, host.expert, -1))
    assert torch.equal(torch.where(run, dev.weight, 0.0), torch.where(run, host.routing_weight(), 0.0))
    assert [f.expert for f in fetches] == [e for e in dev.prefetch.tolist() if e >= 0]
    if trace == 2 and alpha == "0.3":  # by hand. Token 1: S_{k+1} = .09, T = .117, all three top-score,
        # so C = {0, 7 (token 0), 5, 3, 7}. Token 0: 7 low-score but resident (kept), 1 low-score; A =
        # {3 (.10), 5 (.08, in C)}, not 7 (routed here): 1 -> 3. Token 2 (slot 1 dropped): S_{k+1} = .155,
        # T = .2015: 2 (.20) is low-score; A = {7 (.155, resident)}, not 3 (.18 > L): 2 -> 7.
        assert host.expert.tolist() == [[0, 7, 3], [5, 3, 7], [0, 8, 7]]


# -- CPU-assisted experts in the engine --------------------------------------------------------------


def test_cpu_assisted_experts_give_the_models_logits_and_start_after_the_device_experts_are_queued(
        tiny_ckpt, monkeypatch):
    """alpha = 0 (no substitution): SMoE runs exactly the routed experts, misses split between loads
    and the host (Algorithm 2). The logits are transformers' bit for bit, some experts did run on
    the host, and in every layer that has both, every device GEMM was issued before the host's
    first expert: the host computes while the device does, not before it is given work."""
    from moetool.engine import build_engine, runtime
    from moetool.engine.store import HostStore
    from moetool.model import load_model, load_reference

    path = tiny_ckpt("qwen2_moe")
    ids = torch.tensor([[5, 17, 33, 2, 9, 100, 45, 7]])
    lm = load_model(path)
    engine, _ = build_engine(lm, HostStore.from_experts(lm.experts, torch.float32), "smoe",
                             settings={"alpha": "0"}, budget="10%")
    # What each layer call did, in order: "host" when a CPU-assisted expert reads its host weights
    # (the next compute is that expert's), "compute" for every expert MLP or grouped GEMM.
    calls: list[list[str]] = []
    run_layer, host_blob = engine.run_layer, engine.store.host
    grouped, forward = runtime.grouped_mlp, runtime.EngineExperts.expert_forward

    def layer_call(*a, **kw):
        calls.append([])
        return run_layer(*a, **kw)

    def logged(kind, fn):
        def call(*a, **kw):
            calls[-1].append(kind)
            return fn(*a, **kw)
        return call

    monkeypatch.setattr(engine, "run_layer", layer_call)
    monkeypatch.setattr(engine.store, "host", logged("host", host_blob))
    monkeypatch.setattr(runtime, "grouped_mlp", logged("compute", grouped))
    monkeypatch.setattr(runtime.EngineExperts, "expert_forward", logged("compute", forward))
    gen = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    got = lm.model.generate(ids, **gen)
    want = load_reference(path).generate(ids, **gen)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):  # prefill and every decode step
        assert torch.equal(a, b)
    assert engine.stats.summary()["cpu_experts"] > 0
    both = 0
    for ops in calls:
        if "host" not in ops:
            continue
        first_host = ops.index("host")
        device = [i for i, op in enumerate(ops) if op == "compute" and (i == 0 or ops[i - 1] != "host")]
        both += bool(device)
        assert all(i < first_host for i in device), ops
    assert both > 0


@pytest.mark.parametrize("measured", [None, 2e-4])
def test_algorithm_2_weighs_a_cpu_expert_as_the_clock_charges_it(measured):
    """§V-A treats C_CPU as "a constant due to stable CPU times across low-batch sizes" (Fig. 8), and the
    engine's cost model charges a CPU expert its weights' read until the tokens' arithmetic outweighs it.
    Algorithm 2 multiplied the one-token C_CPU by the tokens an expert serves: at batch 3 it sent a third
    as many experts to the CPU as the costs the run is charged with would (a measured C_CPU is per token
    in both). The engine also charges each CPU expert its rows' copy back to the device, whose latency
    is what counts at a few tokens."""
    from moetool.engine.clock import CostModel, HwProfile

    hw = HwProfile(name="t", h2d_gbps=10.0, gpu_tflops=100.0, gpu_mem_gbps=1000.0, cpu_tflops=1.0, cpu_mem_gbps=10.0,
                   c_cpu_s=measured)
    cost = CostModel(hw=hw, expert_bytes={16: 10**6}, expert_flops_per_token=2e7, reference_bytes=10**6,
                     dense_bytes_per_layer=0.0, dense_flops_per_token_per_layer=0.0)
    pol = make_policy("smoe", {}, make_ctx(E=8, k=2, hw=cost.policy_view()))
    for n in (1, 2, 3, 16, 64, 4096):
        assert pol.c_cpu_of(n) == pytest.approx(cost.c_cpu(n) + hw.copy_latency_s)
    if measured is None:
        assert pol.c_cpu_of(3) == pol.c_cpu_of(1)  # the read bounds it at low batch


def test_a_batchs_left_padding_neither_substitutes_nor_is_substituted():
    """Algorithm 1's C (top-score experts) was gathered over every row, a batch's pad rows included: a
    pad row's top-score expert replaced a real token's low-score one, so a prompt's text depended on
    how much padding its batch gave it. C is the requests' now; a pad row runs as routed."""
    import dataclasses

    ctx = make_ctx(layers=(0, 1), E=8, k=2)
    pol = make_policy("smoe", {"alpha": "0.3", "cpu_assist": "false"}, ctx)
    cache = FakeCache(pol.pools())  # nothing resident
    pad = torch.tensor([0.02, 0.02, 0.02, 0.02, 0.02, 0.60, 0.28, 0.02])  # routes 5 (top-score), 6
    real = torch.tensor([0.30, 0.20, 0.06, 0.06, 0.06, 0.18, 0.07, 0.07])  # routes 0, 1 (low-score); S_3 = e5's
    alone = pol.plan(make_view([[0, 1]], cache, logits=real[None].log(), phase=Phase.PREFILL))
    view = dataclasses.replace(make_view([[5, 6], [0, 1]], cache, logits=torch.stack([pad, real]).log(),
                                         phase=Phase.PREFILL), real_rows=torch.tensor([False, True]))
    batched = pol.plan(view)
    assert alone.expert.tolist() == [[0, 1]]
    assert batched.expert.tolist() == [[5, 6], [0, 1]]  # was [[5, 6], [0, 5]]: e5 was in C through the pad row
    both = pol.plan(dataclasses.replace(view, real_rows=None))  # the same rows, both real: §VI-B's shared C
    assert both.expert.tolist() == [[5, 6], [0, 5]]

"""The engine: lossless policies reproduce transformers exactly; budgets hold; the sim clock adds up."""

import copy
import types

import pytest
import torch

from moetool.engine import build_engine, split_budget_for
from moetool.engine.clock import CostModel, HwProfile, SimClock
from moetool.engine.residency import Residency, State
from moetool.engine.store import HostStore
from moetool.errors import MoetoolError, size_text
from moetool.model import load_model, load_reference
from moetool.policies.base import Fetch, Phase, Pool
from policy_fakes import make_ctx, residency_for
from tiny import TINY_CONFIGS

IDS = torch.tensor([[5, 17, 33, 2, 9, 100, 45, 7], [1, 2, 3, 4, 5, 6, 7, 8]])


def _engine(path, policy, budget, clock="sim", batch=None, experts_impl="grouped_mm", **settings):
    lm = load_model(path)
    engine, plan = build_engine(lm, HostStore.from_experts(lm.experts, torch.float32), policy,
                                settings={k: str(v) for k, v in settings.items()}, budget=budget, clock=clock,
                                batch=batch or IDS.shape[0],  # the KV margin is planned for the widest forward
                                experts_impl=experts_impl)
    return lm, engine, plan


@pytest.fixture(scope="module")
def expected(tiny_ckpt):
    cache = {}

    def get(arch, impl="grouped_mm"):
        if (arch, impl) not in cache:
            ref = load_reference(tiny_ckpt(arch), experts_impl=impl)
            cache[arch, impl] = ref.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=10,
                                             do_sample=False)
        return cache[arch, impl]
    return get


@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("policy,budget", [("resident", "100%"), ("lod", "10%"), ("lru", "10%"), ("lru", "50%"),
                                           ("eap", "25%"), ("eap", "100%")])
def test_lossless_policies_generate_the_same_tokens(tiny_ckpt, expected, arch, policy, budget, impl):
    """Each compute path against the transformers kernel it matches: grouped GEMMs against
    `grouped_mm`, one expert at a time against the eager loop."""
    lm, engine, plan = _engine(tiny_ckpt(arch), policy, budget, experts_impl=impl)
    got = lm.model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=10, do_sample=False)
    assert torch.equal(got, expected(arch, impl))
    s = engine.stats.summary()
    assert s["peak_device_bytes"] <= plan.total_bytes
    if policy == "resident":
        assert s["hit_rate"] == 1.0 and s["bytes_h2d"] == 0
    if policy == "lod":
        assert s["hit_rate"] == 0.0 and s["bytes_h2d"] > 0


@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_prefill_logits_match_transformers_bit_for_bit(tiny_ckpt, arch, impl):
    """Every architecture, a batch-2 prefill: resident (all hits) and lru at 25% (hits, misses and
    evictions in one layer) give transformers' logits bit for bit, except where the checkpoint stores
    its experts transposed (gpt_oss): the engine keeps one [out, in] layout, so the GEMM reads the
    same numbers in the other memory order and rounds differently (stated tolerance 1e-6).

    Two intra-op threads, as a run uses them: a multi-threaded CPU GEMM splits its rows between
    threads, so a row's result depends on its position and the row order inside a group matters."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check_prefill_logits(tiny_ckpt(arch), impl)
    finally:
        torch.set_num_threads(threads)


def _check_prefill_logits(path, impl):
    ref = load_reference(path, experts_impl=impl)
    with torch.no_grad():
        want = ref(IDS).logits
    for policy, budget in (("resident", "100%"), ("lru", "25%")):
        lm, engine, _ = _engine(path, policy, budget, experts_impl=impl)
        with torch.no_grad():
            got = lm.model(IDS).logits
        if any(g.transposed for g in lm.geometry.layers):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        else:
            assert torch.equal(got, want), f"{path.name} {impl} {policy}: max diff {(got - want).abs().max():.3g}"
        if policy == "lru":
            assert engine.stats.summary()["bytes_h2d"] > 0  # the misses really went through loads


def test_lru_reuses_and_lod_does_not(tiny_ckpt):
    _, lod, _ = _engine(tiny_ckpt("qwen2_moe"), "lod", "50%")
    lm, lru, _ = _engine(tiny_ckpt("qwen2_moe"), "lru", "50%")
    for engine in (lod, lru):
        engine.lm.model.generate(IDS[:1], max_new_tokens=12, do_sample=False)
    a, b = lod.stats.summary(), lru.stats.summary()
    assert b["hit_rate"] > 0 and b["bytes_h2d"] < a["bytes_h2d"]
    assert b["tpot_s"]["mean"] < a["tpot_s"]["mean"]  # sim clock: fewer transfers, fewer stalls


@pytest.mark.parametrize("policy", ["lod", "lru", "eap"])
def test_random_routing_traces_never_exceed_the_budget(tiny_ckpt, policy):
    """1,000 steps of random routing straight into the engine: occupancy and budget always hold."""
    lm, engine, plan = _engine(tiny_ckpt("qwen2_moe"), policy, "30%")
    g0 = lm.geometry.layers[0]
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, g0.hidden_size, generator=gen)
    for step in range(1000):
        engine.begin_step(Phase.DECODE, 3)
        for g in lm.geometry.layers:
            module = lm.model.get_submodule(f"{g.path}.experts")
            idx = torch.stack([torch.randperm(g.num_experts, generator=gen)[: g.top_k] for _ in range(3)])  # [3, k]
            engine._logits[g.index] = torch.randn(3, g.num_experts, generator=gen)
            module(hidden, idx, torch.full((3, g.top_k), 1.0 / g.top_k))
            for bits, pool in engine.residency.pools.items():
                assert len(engine.residency.residents(bits)) <= pool.slots.shape[0]
                assert len(pool.free) + len(pool.holders) == pool.spec.slots
            assert engine.residency.budget.used <= plan.total_bytes
        engine.end_step()
    assert engine.residency.budget.peak <= plan.total_bytes
    assert engine.stats.summary()["peak_device_bytes"] <= plan.total_bytes


def _admit(res, want, shield=(), demand=False, publish=True):
    """What the engine does with the generic rule: make room, take the slot, publish once landed."""
    victims = res.make_room(want, set(shield), demand)
    if victims is not None:
        res.begin_load(want, victims, prefetched=not demand)
        if publish:
            res.publish(want.layer, want.expert, want.bits)
    return victims


@pytest.mark.parametrize("eviction", ["lru", "arc", "lfu"])
def test_a_copy_in_flight_is_never_an_eviction_victim(eviction):
    """A full layer quota whose oldest holder is still being copied: the next admission takes the
    resident one; with every holder in flight it is refused (a demand load then streams through a
    staging buffer), the pool unchanged; once the copy is published it may go."""
    res = residency_for(types.SimpleNamespace(ctx=make_ctx()), [Pool(16, 2, quota={0: 2, 1: 2}, eviction=eviction)])
    _admit(res, Fetch(0, 0, 16), publish=False)  # a prefetch still in flight, the order's oldest
    _admit(res, Fetch(0, 1, 16))
    assert res.make_room(Fetch(0, 2, 16), set(), demand=True) == [Fetch(0, 1, 16)]
    res.begin_load(Fetch(0, 2, 16), [Fetch(0, 1, 16)])  # in flight too: layer 0 holds only copies in flight
    assert res.loading_bits(0, 0) == (16,) and res.loading_bits(0, 2) == (16,)
    order = res.order(16, 0)
    before = copy.deepcopy(vars(order))
    assert res.make_room(Fetch(0, 3, 16), set(), demand=True) is None
    assert res.make_room(Fetch(0, 3, 16), set(), demand=False) is None
    assert set(res.residents(16)) == {(0, 0), (0, 2)} and res.free(16) == 0
    assert vars(order) == before  # a refused miss is not told to the order (ARC would adapt p to it)
    res.publish(0, 0, 16)
    assert res.make_room(Fetch(0, 3, 16), set(), demand=True) == [Fetch(0, 0, 16)]


def test_a_layer_under_its_quota_does_not_take_another_layers_copy_in_flight():
    """A full pool, layer 0 under its quota: the victim comes from another layer, never its copy in flight."""
    res = residency_for(types.SimpleNamespace(ctx=make_ctx()), [Pool(16, 2, quota={0: 2, 1: 2}, eviction="lru")])
    _admit(res, Fetch(1, 0, 16), publish=False)  # first in admission order: what an unknown order falls back to
    _admit(res, Fetch(1, 1, 16))
    assert res.make_room(Fetch(0, 0, 16), set(), demand=True) == [Fetch(1, 1, 16)]
    res.begin_load(Fetch(0, 0, 16), [Fetch(1, 1, 16)])
    assert res.make_room(Fetch(0, 1, 16), set(), demand=True) is None  # (1, 0) and (0, 0) both in flight


@pytest.mark.parametrize("clock", ["sim", "wall"])
@pytest.mark.parametrize("policy,settings", [("eap", {}), ("smoe", {}), ("dymoe", {"config": "16/0"})])
def test_prefetches_and_demand_loads_never_evict_a_copy_in_flight(tiny_ckpt, monkeypatch, policy, settings, clock):
    """Random routing through the host path: a layer's prefetches beyond its quota used to evict the
    ones issued just before them (and, on the sim clock, copies not yet landed), throwing away their
    bytes. Every eviction now takes a published copy."""
    lm, engine, plan = _engine(tiny_ckpt("qwen2_moe"), policy, "30%", clock=clock, batch=1, **settings)
    evicted, in_flight = [], []
    evict = Residency.evict

    def recording(self, layer, expert, bits):
        h = self.table.get((layer, expert, bits))
        (in_flight if h is not None and h.state == State.LOADING else evicted).append((layer, expert, bits))
        evict(self, layer, expert, bits)

    monkeypatch.setattr(Residency, "evict", recording)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, lm.geometry.layers[0].hidden_size, generator=gen)
    for step in range(100):
        engine.begin_step(Phase.DECODE, 1)
        for g in lm.geometry.layers:
            idx = torch.randperm(g.num_experts, generator=gen)[: g.top_k].view(1, -1)
            engine._logits[g.index] = torch.randn(1, g.num_experts, generator=gen)
            lm.model.get_submodule(f"{g.path}.experts")(hidden, idx, torch.full((1, g.top_k), 1.0 / g.top_k))
        engine.end_step()
    s = engine.stats.summary()
    assert in_flight == []
    assert evicted and s["prefetch_issued"] > 0  # the cache did turn over, prefetches included
    assert s["peak_device_bytes"] <= plan.total_bytes


def test_staged_misses_beyond_two_buffers_stay_correct(tiny_ckpt):
    """lod streams every expert through two staging buffers: 4+ experts in one layer must not clobber."""
    lm, engine, _ = _engine(tiny_ckpt("qwen2_moe"), "lod", "0%")
    ref = load_model(tiny_ckpt("qwen2_moe"))
    g = lm.geometry.layers[0]
    hidden = torch.randn(4, g.hidden_size)
    idx = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]])
    w = torch.rand(4, 2)
    engine.begin_step(Phase.PREFILL, 4)
    got = lm.model.get_submodule(f"{g.path}.experts")(hidden, idx, w)
    want = ref.model.get_submodule(f"{g.path}.experts")(hidden, idx, w)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_budget_below_non_expert_weights_names_the_minimum(tiny_ckpt):
    lm = load_model(tiny_ckpt("qwen2_moe"))
    store = HostStore.from_experts(lm.experts, torch.float32)
    with pytest.raises(MoetoolError, match=r"below the minimum of [0-9.]+ MiB \([0-9,]+ B: non-expert weights"):
        split_budget_for("10KiB", lm, store)
    p = split_budget_for("25%", lm, store)
    assert p.cache_bytes == int(0.25 * p.expert_bytes_reference)
    assert p.total_bytes == p.non_expert_bytes + p.margin_bytes + p.staging_bytes + p.cache_bytes
    # the minimum is rounded up: a budget a little under it was "16.1MiB is below the minimum of 16.1 MiB"
    fixed = p.total_bytes - p.cache_bytes
    with pytest.raises(MoetoolError) as e:
        split_budget_for(f"{(fixed - 1000) / 2**20:.2f}MiB", lm, store)
    shown = str(e.value).split("minimum of ")[1].split(" (")[0]
    assert float(shown.split()[0]) * 2**20 >= fixed, shown
    # `--budget 0.25` meant a quarter of the experts; it was 0 bytes, refused as below the minimum
    with pytest.raises(MoetoolError, match=r"--budget '0.25' has no unit, and a bare number is bytes; write a size "
                                           r"like 500MB or 12GiB, 25% for a share of the experts."):
        split_budget_for("0.25", lm, store)


def _unit_clock(cpu_mem_gbps: float = 1.0) -> SimClock:
    """A sim clock at the start of a step on a machine of round numbers: a 1 GB blob crosses the link
    in 1 s, with no latency and no launch cost."""
    hw = HwProfile(name="t", h2d_gbps=1.0, gpu_tflops=1.0, gpu_mem_gbps=1.0, cpu_tflops=1.0,
                   cpu_mem_gbps=cpu_mem_gbps, kernel_s=0.0, copy_latency_s=0.0)
    clock = SimClock(CostModel(hw=hw, expert_bytes={16: 10**9}, expert_flops_per_token=0.0, reference_bytes=0,
                               dense_bytes_per_layer=0.0, dense_flops_per_token_per_layer=0.0))
    clock.begin_step()
    return clock


def test_sim_clock_overlap_arithmetic_on_a_hand_made_timeline():
    clock = _unit_clock()
    prefetch = clock.copy(10**9)  # issued at t=0 on an idle link: ready at 1.0
    clock.compute(0.6)  # attention runs while the prefetch is in flight
    demand = clock.copy(10**9)  # link busy until 1.0, so this one completes at 2.0
    assert prefetch == pytest.approx(1.0) and demand == pytest.approx(2.0)
    assert clock.wait(prefetch) == pytest.approx(0.4)  # only the part not hidden by compute stalls
    clock.compute(0.5)  # now 1.5
    assert clock.wait(demand) == pytest.approx(0.5)
    cpu_done = clock.cpu(0.25)  # host compute starts now (2.0)
    assert cpu_done == pytest.approx(2.25)
    assert clock.wait(1.0) == 0.0  # waiting for something already done costs nothing
    assert clock.end_step() == pytest.approx(2.0)


def test_a_blob_staged_through_the_ring_pays_the_host_copy_before_its_transfer():
    """A blob outside the pinned tier is first copied on the host into a staging-ring slot (read and
    written at the host's memory bandwidth), so its transfer starts only after that, on the cpu
    timeline; a pinned blob's transfer starts at once."""
    clock = _unit_clock(cpu_mem_gbps=4.0)
    assert clock.copy(10**9, staged=True) == pytest.approx(0.5 + 1.0)  # 2 GB of memcpy at 4 GB/s, then the link
    assert clock.cpu_free == pytest.approx(0.5)
    assert clock.copy(10**9) == pytest.approx(2.5)  # pinned: queued behind the first on the link only
    assert clock.copy(10**9, staged=True) == pytest.approx(3.5)  # its memcpy (0.5 to 1.0) hid behind the link
    assert clock.cpu_free == pytest.approx(1.0)


@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
@pytest.mark.parametrize("policy,budget", [("resident", "100%"), ("lru", "25%"), ("lod", "10%")])
def test_wide_top_k_batches_match_transformers_bit_for_bit(tmp_path, policy, budget, impl):
    """top-8 of 16: a token's 8 expert outputs must be summed as transformers sums them (slot order
    for grouped_mm, ascending expert order for the eager loop), and each expert's rows must reach
    its GEMM in the same order.

    With k = 2 any order gives the same fp32 sum; with k = 8 it does not, and misses arrive after
    hits, so only a summation order independent of arrival keeps a lossless policy exact.
    """
    from tiny import save_tiny

    path = save_tiny("qwen2_moe", tmp_path / "wide", hidden_size=64, num_experts=16, num_experts_per_tok=8)
    ids = torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = load_reference(path, experts_impl=impl)(ids).logits
        lm, engine, _ = _engine(path, policy, budget, batch=ids.shape[0], experts_impl=impl)
        got = lm.model(ids).logits
    assert torch.equal(got, ref)
    if policy != "resident":
        assert engine.stats.summary()["hit_rate"] < 1.0  # misses were loaded after hits computed


def test_a_sequence_longer_than_the_plan_is_refused_in_one_sentence(tiny_ckpt):
    """The KV margin is reserved for max_tokens x batch: a longer or wider forward is refused, not run."""
    lm = load_model(tiny_ckpt("qwen2_moe"))
    store = HostStore.from_experts(lm.experts, torch.float32)
    engine, split = build_engine(lm, store, "lru", budget="50%", clock="sim", max_tokens=10, batch=1)
    lm.model.generate(IDS[:1, :6], max_new_tokens=4, do_sample=False)  # 6 + 4 = 10 tokens: inside the plan
    with pytest.raises(MoetoolError, match="1 sequence.* of 11 tokens exceeds the KV/activation margin"):
        lm.model.generate(IDS[:1, :6], max_new_tokens=6, do_sample=False)
    with pytest.raises(MoetoolError, match="2 sequence"):
        lm.model(IDS[:, :4])
    embeds = lm.model.get_input_embeddings()(IDS[:1]).repeat(1, 2, 1)  # 16 positions given as embeddings
    with pytest.raises(MoetoolError, match="1 sequence.* of 16 tokens exceeds"):
        lm.model(inputs_embeds=embeds)
    wider = split_budget_for("50%", lm, store, max_tokens=40, batch=2)
    assert wider.margin_bytes > split.margin_bytes and wider.cache_bytes == split.cache_bytes  # a share: cache fixed
    assert engine.stats.summary()["peak_allocated_bytes"] is None  # measured on CUDA only


def test_a_run_plans_its_kv_margin_for_its_own_prompt_and_refuses_a_budget_too_small(tiny_ckpt):
    """`run` sizes the margin for its longest prompt plus its new tokens: a prompt longer than a plan
    made for short ones is planned for, and a size budget that cannot hold its KV is one sentence."""
    from moetool.run import RunConfig, run

    path = str(tiny_ckpt("qwen2_moe"))
    short, long_ = "abcd", "x" * 100  # tokenizer-less: one token per byte
    runs = {p: run(RunConfig(model=path, policy="lru", budget="50%", clock="sim", prompts=(p,), max_new_tokens=8))
            for p in (short, long_)}
    assert len(runs[long_].tokens[0]) == 8  # generated in full: the 108-token sequence was planned for
    per_token = (runs[long_].budget["margin_bytes"] - runs[short].budget["margin_bytes"]) / (len(long_) - len(short))
    assert per_token > 0 and runs[long_].budget["cache_bytes"] == runs[short].budget["cache_bytes"]  # a share
    lm = load_model(path)
    split = split_budget_for("50%", lm, HostStore.from_experts(lm.experts, torch.float32), max_tokens=len(long_) + 8)
    assert runs[long_].budget["margin_bytes"] == split.margin_bytes
    fits_short = runs[short].budget["total_bytes"]  # a size budget that holds the short run exactly
    with pytest.raises(MoetoolError, match="below the minimum"):
        run(RunConfig(model=path, policy="lru", budget=f"{fits_short - runs[short].budget['cache_bytes']}B",
                      clock="sim", prompts=(long_,), max_new_tokens=8))


def test_a_run_reports_progress_per_generated_token(tiny_ckpt):
    """Three prompts in batches of two, five tokens each: progress counts generated tokens (a long
    generation is not silent until its prompt ends), rising to the total, the prompts' steps summed."""
    from moetool.run import RunConfig, run

    seen = []
    result = run(RunConfig(model=str(tiny_ckpt("qwen2_moe")), policy="lru", budget="50%", prompts=("ab", "cde", "f"),
                           max_new_tokens=5, batch_size=2), progress=lambda done, total: seen.append((done, total)))
    assert all(len(t) == 5 for t in result.tokens)
    assert result.batch_size == 2  # recorded: hits and TPOT depend on it, and the artifact did not say
    assert result.summary["host_threads"] == torch.get_num_threads()  # a CPU's wall-clock time is per thread count
    assert [d for d, _ in seen] == [2, 4, 6, 8, 10, 11, 12, 13, 14, 15] and {t for _, t in seen} == {15}


def test_dymoe_heavy_hitters_carry_over_layers_without_softmax_attention(tmp_path):
    """A hybrid (linear attention, softmax attention, linear attention): DyMoE eq. 1's scores come
    from the softmax layer; the linear layer after it reads them, the one before it has none (eq. 2
    then counts every token). A decode step through the hybrid cache plans as decode."""
    from tiny import save_tiny

    path = save_tiny("qwen3_next", tmp_path / "hybrid", num_hidden_layers=3,
                     layer_types=["linear_attention", "full_attention", "linear_attention"])
    lm, engine, _ = _engine(path, "dymoe", "50%", high_bits=16, low_bits=0)  # 16/0: the checkpoint suffices
    seen, view = {}, engine._view

    def spy(g, *args, **kwargs):
        v = view(g, *args, **kwargs)
        seen[g.index, v.step.phase] = v.token_importance
        return v

    engine._view = spy
    lm.model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=2, do_sample=False)
    assert seen[0, Phase.PREFILL] is None
    assert seen[1, Phase.PREFILL] is not None and seen[1, Phase.PREFILL].numel() == IDS.numel()
    assert torch.equal(seen[2, Phase.PREFILL], seen[1, Phase.PREFILL])
    assert (2, Phase.DECODE) in seen  # the second forward was read as a decode step


@pytest.mark.parametrize("arch,bias", [("minimax_m2", "e_score_correction_bias"), ("lfm2_moe", "expert_bias")])
def test_look_ahead_replays_a_router_that_takes_its_blocks_inputs(tiny_ckpt, arch, bias):
    """Routers that take their block's selection bias besides the hidden states (MiniMax-M2: a
    required parameter; LFM2-MoE: an optional one, None by default): the engine's cross-layer
    prediction and the profile's routing pass it, as the block does."""
    from moetool.profile.trace import route

    lm, engine, _ = _engine(tiny_ckpt(arch), "lru", "50%")
    g = lm.geometry.layers[-1]
    block = lm.model.get_submodule(g.path)
    getattr(block, bias)[1] = 10.0  # expert 1 always chosen, though its score stays a sigmoid < 1
    h = torch.randn(5, g.hidden_size, generator=torch.Generator().manual_seed(0))
    want = torch.nn.functional.linear(h, block.get_submodule(g.router).weight)
    assert torch.equal(engine._predict(g.index, h), want)
    logits, top_k = route(lm, g.index, h)
    assert torch.equal(logits, want) and (top_k == 1).any(-1).all()


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_resident_decodes_without_reading_the_routing_on_the_host(tiny_ckpt, expected, monkeypatch, arch):
    """A policy that never reads the routing (resident) runs every layer after the prefill as
    transformers' grouped_mm does, on the device's own routing: the same tokens on every
    architecture, no layer view (the host sync on a GPU) after the prefill, and every routed expert
    still counted."""
    lm, engine, _ = _engine(tiny_ckpt(arch), "resident", "100%", clock="wall")  # sim charges each expert
    views = []
    view = engine._view
    monkeypatch.setattr(engine, "_view", lambda g, *rest: views.append(g.index) or view(g, *rest))
    kw = dict(attention_mask=torch.ones_like(IDS), max_new_tokens=10, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    got = lm.model.generate(IDS, **kw)
    assert torch.equal(got.sequences, expected(arch))
    want = load_reference(tiny_ckpt(arch), experts_impl="grouped_mm").generate(IDS, **kw).logits
    for step, (a, b) in enumerate(zip(got.logits, want)):  # decode steps: the device-side layers
        if any(g.transposed for g in lm.geometry.layers):  # [out, in] kept: other memory order (see above)
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        else:
            assert torch.equal(a, b), f"{arch} step {step}: max diff {(a - b).abs().max():.3g}"
    assert sorted(views) == [g.index for g in lm.geometry.layers]  # the prefill's, once per layer
    assert all(stack is not None for stack in engine.device_layers.stacks.values())
    s = engine.stats.summary()
    k = lm.geometry.layers[0].top_k
    assert s["hit_rate"] == 1.0 and s["precision_mix"] == {"16": len(lm.geometry.layers) * IDS.shape[0] * k * (8 + 9)}
    decode_hits = sum(st.hits[16] for st in engine.stats.layers.values())
    assert decode_hits >= len(lm.geometry.layers) * 10  # each layer ran >= 1 expert per forward


def test_mixed_head_sizes_plan_their_kv_per_layer_and_decode_as_transformers(tmp_path):
    """Gemma 4 (sliding layers of head_dim 8, full-attention ones of 16; the config refuses a global
    head_dim): the KV margin adds the layers up, and an offloading run gives transformers' tokens."""
    from moetool.engine.budget import ACTIVATION_MARGIN, kv_margin
    from tiny import save_tiny, tiny_config

    path = save_tiny("gemma4_text", tmp_path / "g4")
    cfg = tiny_config("gemma4_text")
    per_token = (kv_margin(cfg, 10, 1, torch.float32) - ACTIVATION_MARGIN) // 10
    heads = [view.num_key_value_heads for view in cfg.per_layer_config]
    uniform = {d: 2 * sum(heads) * d * 4 for d in (8, 16)}  # every layer at one head size, fp32 K and V
    assert uniform[8] < per_token < uniform[16]
    ref = load_reference(path).generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=10, do_sample=False)
    lm, engine, plan = _engine(path, "lru", "50%")
    got = lm.model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=10, do_sample=False)
    assert torch.equal(got, ref)
    assert engine.stats.summary()["peak_device_bytes"] <= plan.total_bytes


@pytest.mark.parametrize("swa", [False, True])
def test_the_kv_margin_counts_the_cache_layers_a_looped_model_builds(tmp_path, swa):
    """Inkling2-Loop runs its core layers once a pass and appends a cache layer per extra pass; its
    sliding layers may have KV heads and head sizes of their own (swa_*). The margin counted one
    cache layer a decoder layer, at the global shape: half the default config's KV. Checked against
    the cache transformers fills; the captured step, which logs one pass a MoE layer, is refused."""
    from transformers import DynamicCache

    from moetool.engine.budget import ACTIVATION_MARGIN, kv_margin
    from moetool.engine.decode import unavailable
    from moetool.inference import with_cache
    from moetool.profile import ProfileConfig, profile
    from tiny import save_tiny

    extra = dict(swa_num_key_value_heads=1, swa_head_dim=16) if swa else {}
    path = save_tiny("inkling2_loop_text", tmp_path / "loop", num_hidden_layers=4, n_layers_per_attn_res_block=1,
                     loop_layer_index_start=1, loop_layer_index_end=3, loop_num_passes=3, **extra)
    ref = load_reference(path)
    cache = DynamicCache(config=ref.config)
    ref(IDS[:1], use_cache=True, **with_cache(ref, cache))
    held = sum(layer.keys.shape[1] * layer.keys.shape[3] + layer.values.shape[1] * layer.values.shape[3]
               for layer in cache.layers)  # K and V values per token
    assert len(cache.layers) == 4 + 2 * 2
    assert (kv_margin(ref.config, 10, 1, torch.float32) - ACTIVATION_MARGIN) // 10 == held * 4
    lm = load_model(path)
    engine, _ = build_engine(lm, HostStore.from_experts(lm.experts, torch.float32), "lru", budget="100%", captured=True)
    assert "runs decoder layers 1-2 3 times a token (a looped model)" in unavailable(engine)
    with pytest.raises(MoetoolError, match="runs MoE layer 1 more than once a token"):
        profile(ProfileConfig(model=str(path), what=("routing",), data=("heldout",), seqs_per_data=1, seq_len=8,
                              decode_tokens=1))


def test_a_router_with_a_skip_class_that_reads_batched_states_serves_every_look_ahead_policy(tmp_path):
    """ZAYA's router scores E + 1 classes (a skip expert after the real ones), reads [B, T, H] and
    takes a state from the layer before: policies read E scores, and the look-ahead calls it batched."""
    from moetool.inference import call_router, router_logits
    from tiny import save_tiny

    path = save_tiny("zaya", tmp_path / "zaya")
    lm = load_model(path)
    g = lm.geometry.layers[-1]
    out = call_router(lm, g.index, torch.randn(5, lm.model.config.hidden_size))
    assert out is not None and out[0].shape[-1] == g.num_experts + 1
    assert router_logits(out, g.num_experts).shape == (5, g.num_experts)
    # The host store holds 16-bit experts only: each paper's mechanism at that precision.
    for policy, settings in (("fate", {"cache_bits": 16, "low_bits": 16}), ("dymoe", {"config": "16/0"}),
                             ("smoe", {"alpha": "0.3"})):
        lm, engine, plan = _engine(path, policy, "25%", **settings)
        lm.model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=4, do_sample=False)
        s = engine.stats.summary()
        assert s["peak_device_bytes"] <= plan.total_bytes
        later = engine._predict(g.index, torch.randn(3, lm.model.config.hidden_size))  # the look-ahead
        assert later is not None and later.shape == (3, g.num_experts)


def test_an_expert_computed_on_the_host_is_a_device_cache_miss_in_the_hit_rate():
    """SMoE's CPU-assisted experts were neither hits nor misses, so the hit rate rose as Algorithm 2 sent
    more misses to the CPU (0.500 -> 0.667 on one trace) where SMoE's "GPU expert cache hit ratio" falls."""
    from moetool.engine.stats import Stats

    stats = Stats(moe_layers=(0,))
    st = stats.layer(0)
    st.hits[16] += 2
    st.misses[16] += 1
    st.cpu_experts += 1
    assert st.to_json()["hit_rate"] == 0.5 and stats.summary()["hit_rate"] == 0.5


def test_a_batchs_left_padding_is_no_request_in_what_policies_count(tiny_ckpt, bundle, monkeypatch):
    """A batch's prompts are left-padded to one length; the pad rows routed like tokens, so DynaExq's
    hotness counted them as selections and toward T_u, SMoE's score window averaged them, Fate and DyMoE
    ranked experts by them (26 pads of 60 rows changed every layer's high-precision set)."""
    from moetool.inference import real_rows
    from moetool.policies.dynaexq import DynaExq
    from moetool.run import RunConfig, run

    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert real_rows(mask, torch.zeros(2, 4)).tolist() == [False, False, True, True, True, True, True, True]
    assert real_rows(torch.ones(2, 4), torch.zeros(2, 4)) is None and real_rows(None, torch.zeros(2, 4)) is None
    seen, counts = [], []
    plan = DynaExq.plan

    def spy(self, view):
        seen.append((view.step.phase.name, view.step.num_tokens, None if view.real_rows is None else
                     view.real_rows.tolist(), view.top_k_index.shape[0]))
        before = self.hotness.count[view.moe_pos].sum().item()
        out = plan(self, view)
        counts.append(self.hotness.count[view.moe_pos].sum().item() - before)
        return out

    monkeypatch.setattr(DynaExq, "plan", spy)
    run(RunConfig(model=str(tiny_ckpt("qwen2_moe")), bundle=bundle, policy="dynaexq", budget="100%", clock="sim",
                  prompts=("abcdef", "ab"), max_new_tokens=2, batch_size=2))
    phase, tokens, real, rows = seen[0]
    assert phase == "PREFILL" and rows == 12 and tokens == 8 and real == [True] * 6 + [False] * 4 + [True] * 2
    k = 2  # the tiny qwen2_moe's top-k: only the 8 real tokens' selections are counted
    assert counts[0] == 8 * k
    assert all(r is None and t == 2 for p, t, r, _ in seen[1:] if p == "DECODE")



@pytest.mark.parametrize("policy,budget,clock", [("lru", "25%", "sim"), ("resident", "100%", "sim"),
                                                 ("resident", "100%", "wall")])
def test_a_batchs_left_padding_is_no_use_in_the_precision_mix(tiny_ckpt, policy, budget, clock):
    """The precision mix counts (token, slot) uses of requests' tokens, as bytes per token counts
    their tokens; a batch's pad rows were counted too (18 of 216 uses on a helper's run), on every
    path: the general one (lru), the all-resident shortcut (sim) and the device-side layers (wall)."""
    from moetool.run import RunConfig, run

    ckpt = tiny_ckpt("qwen2_moe")
    got = run(RunConfig(model=str(ckpt), policy=policy, budget=budget, clock=clock, prompts=("abcdef", "ab"),
                        max_new_tokens=3, batch_size=2, decode="host"))
    lm = load_model(ckpt)
    layers, k = len(lm.geometry.layers), lm.geometry.layers[0].top_k
    uses = (6 + 2 + 2 * 2) * layers * k  # the real prompt tokens, then two decode steps of both prompts
    assert sum(got.summary["precision_mix"].values()) == uses


@pytest.mark.parametrize("policy,budget", [("lod", "0%"), ("lru", "100%")])
def test_an_expert_only_a_batchs_padding_routes_to_is_not_loaded_or_counted(tiny_ckpt, monkeypatch, policy, budget):
    """A batch's left-pad rows loaded the experts only they routed to: a third of a helper's bytes moved,
    counted as misses (load on demand) or hits (a cache), none of it a request's. Tokens stay
    transformers' (`test_wide_top_k_batches_match_transformers_bit_for_bit`)."""
    from moetool.engine.runtime import Engine
    from moetool.run import RunConfig, run

    routed: dict[int, set[int]] = {}
    view = Engine._view

    def spy(self, g, *args):
        v = view(self, g, *args)
        if v.step.phase.name == "PREFILL":
            idx = v.top_k_index if v.real_rows is None else v.top_k_index[v.real_rows]
            routed[g.index] = set(idx.flatten().tolist())
        return v

    monkeypatch.setattr(Engine, "_view", spy)
    got = run(RunConfig(model=str(tiny_ckpt("mixtral")), policy=policy, budget=budget, clock="sim",
                        prompts=("z", "zzzzzzzzzzzz"), max_new_tokens=1, batch_size=2, decode="host"))
    assert routed
    for layer, experts in routed.items():
        counts = got.layers[str(layer)]
        assert sum(counts["hits"].values()) + sum(counts["misses"].values()) == len(experts), (layer, counts)


def test_a_tokenizer_with_neither_pad_nor_eos_token_runs_one_prompt_and_pads_a_batch(tmp_path):
    """`run` padded even a single prompt, with the end-of-sequence token as pad: a tokenizer with neither
    was transformers' "Asking to pad but the tokenizer does not have a padding token" traceback. A batch
    pads with the vocabulary's first token (the mask hides it): each prompt decodes its tokens alone."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from moetool.run import RunConfig, run
    from tiny import save_tiny

    path = save_tiny("qwen2_moe", tmp_path / "m")
    vocab = {"<unk>": 0, **{chr(i): i - 31 for i in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"), decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)
    prompts = ("Hello", "A longer prompt here")
    alone = [run(RunConfig(model=str(path), policy="resident", budget="100%", clock="sim", prompts=(p,),
                           max_new_tokens=3)).tokens[0] for p in prompts]
    batched = run(RunConfig(model=str(path), policy="resident", budget="100%", clock="sim", prompts=prompts,
                            max_new_tokens=3, batch_size=2))
    assert batched.tokens == alone


def test_a_budget_that_leaves_moe_layers_without_a_slot_says_so(tiny_ckpt):
    """Under one expert a layer, an even split leaves the deepest MoE layers no slot: they load every
    expert anew, and only Fate said so (its §4.4 note). Every policy's run says it now, once."""
    lm = load_model(tiny_ckpt("qwen2_moe"))
    store = HostStore.from_experts(lm.experts, torch.float32)
    layers = [g.index for g in lm.geometry.layers]
    engine, split = build_engine(lm, store, "lru", budget="15%", clock="sim")  # one slot of eight experts
    assert engine.residency.pools[16].spec.quota == {layers[0]: 1, layers[1]: 0}
    assert [n for n in engine.policy.notes if "no slot" in n] == [
        f"the expert cache of {size_text(split.cache_bytes)} gives MoE layer {layers[1]} no slot, so it loads "
        "every expert it runs anew; raise --budget for a slot a layer."]
    fate, _ = build_engine(lm, store, "fate", settings={"cache_bits": "16", "p": "0"}, budget="15%", clock="sim")
    assert sum("caches none" in n for n in fate.policy.notes) == 1 and not any("no slot" in n for n in fate.policy.notes)
    roomy, _ = build_engine(lm, store, "lru", budget="50%", clock="sim")
    assert not roomy.policy.notes
    # Under one expert in all (0.1% of 256 experts is a quarter of one): every caching policy ran as lod, unsaid
    for policy in ("lru", "eap", "smoe"):
        none, split = build_engine(lm, store, policy, budget="5%", clock="sim")
        assert all(p.slots.shape[0] == 0 for p in none.residency.pools.values())
        assert [n for n in none.policy.notes if "no slot" in n] == [
            f"the expert cache of {size_text(split.cache_bytes)} gives every MoE layer no slot, so they load every "
            "expert they run anew; raise --budget for a slot a layer."], policy
    lod, _ = build_engine(lm, store, "lod", budget="5%", clock="sim")  # no cache by design: nothing to raise
    assert not any("no slot" in n for n in lod.policy.notes)


def test_layers_are_named_as_runs():
    from moetool.engine import spans

    assert spans([1, 2, 3, 5, 7, 8]) == "1-3, 5, 7-8" and spans([4]) == "4" and spans([]) == ""


def test_the_sim_clock_charges_a_cpu_expert_its_rows_round_trip(tiny_ckpt):
    """SMoE's CPU-assisted expert used to cost only its compute on the sim clock, so on a model of small
    experts a run at 25% beat every expert resident on TTFT. The rows cross to the host once a layer
    and each expert's result comes back: both are copies, latency included."""
    from moetool.engine.clock import SimClock, cpu_experts_ready

    lm = load_model(tiny_ckpt("qwen2_moe"))
    engine, _ = build_engine(lm, HostStore.from_experts(lm.experts, torch.float32), "smoe", budget="50%", clock="sim")
    cost = engine.cost
    hidden = torch.zeros(3, lm.geometry.layers[0].hidden_size)
    row = hidden.shape[1] * hidden.element_size()
    ready = cpu_experts_ready(SimClock(cost), cost, hidden, [2, 1])  # two CPU experts serving 2 and 1 rows
    want = cost.t_copy(3 * row) + cost.c_cpu(2) + cost.t_copy(2 * row) + cost.c_cpu(1) + cost.t_copy(row)
    assert ready == pytest.approx(want)
    assert ready > cost.c_cpu(2) + cost.c_cpu(1) + 3 * cost.hw.copy_latency_s

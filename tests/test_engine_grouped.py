"""The engine's grouped path: vectorised grouping in the kernel's row order, one grouped GEMM per
precision, and quantized experts bit-exact against transformers' grouped_mm on the dequantized weights."""

import pytest
import torch

import moetool.engine.runtime as runtime
from moetool.engine import build_engine
from moetool.engine.budget import decode_workspace, expert_params, kv_margin
from moetool.engine.stats import LayerStats
from moetool.engine.store import HostStore
from moetool.engine.weights import PoolWeights
from moetool.errors import MoetoolError
from moetool.model import load_model, load_reference
from moetool.policies.base import LayerPlan, LayerView, Phase, Step, Where
from moetool.quant.bundle import Bundle
from moetool.quant.quantize import QuantizeConfig, quantize
from moetool.run import RunConfig, prepare
from moetool.spec import EngineSpec

IDS = torch.tensor([[5, 17, 33, 2, 9, 100, 45, 7], [1, 2, 3, 4, 5, 6, 7, 8]])


def _python_groups(plan: LayerPlan, idx: torch.Tensor, slot_major: bool, real=None, E: int = 4):
    """The grouping written out as loops: {(where, bits, expert): [(token, slot), ...]} in kernel order:
    slot-major for the eager loop; for grouped_mm, the order its own `torch.sort` of the flattened
    experts gives (transformers' `grouped_mm_experts_forward`), which is not always token-major. Skips,
    substitutions and the GPU rows (the precision mix) are counted over a request's token (`real`) and
    a slot the router routed: a dropped one (id E) is no policy's skip."""
    T, k = plan.expert.shape
    if slot_major:
        pairs = [(t, s) for s in range(k) for t in range(T)]
    else:
        pairs = [divmod(int(p), k) for p in torch.sort(plan.expert.reshape(-1)).indices]
    groups, skips, subs, mix = {}, 0, 0, 0
    for t, s in pairs:
        w, b, e = int(plan.where[t, s]), int(plan.bits[t, s]), int(plan.expert[t, s])
        counted = (real is None or bool(real[t])) and 0 <= int(idx[t, s]) < E
        if w == Where.SKIP:
            skips += counted
            continue
        subs += counted and e != int(idx[t, s])
        mix += counted and w == Where.GPU
        groups.setdefault((w, b, e), []).append((t, s))
    # an expert only a batch's left padding routes to is not run (`groups._requested`)
    groups = {key: rows for key, rows in groups.items() if real is None or any(bool(real[t]) for t, _ in rows)}
    return groups, skips, subs, mix


@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
@pytest.mark.parametrize("seed", range(5))
def test_vectorised_grouping_equals_the_loop_in_the_kernels_row_order(tiny_ckpt, impl, seed):
    lm = load_model(tiny_ckpt("qwen2_moe"))
    engine, _ = build_engine(lm, HostStore.from_experts(lm.experts, torch.float32), "resident", budget="100%",
                             batch=2, experts_impl=impl)
    engine._stored = frozenset({16, 4, 2})  # the plan's precisions: grouped here, never run (the store holds 16)
    g = torch.Generator().manual_seed(seed)
    T, k, E = 7, 3, 4
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # [T, k] distinct per token
    expert = torch.where(torch.rand(T, k, generator=g) < 0.2, torch.randint(0, E, (T, k), generator=g), idx)
    plan = LayerPlan(expert=expert, bits=torch.tensor([16, 4, 2])[torch.randint(0, 3, (T, k), generator=g)],
                     where=torch.randint(0, 3, (T, k), generator=g), weight=torch.rand(T, k, generator=g))
    if seed % 2:  # a batch's left padding, and slots the router dropped
        idx[torch.rand(T, k, generator=g) < 0.2] = E
    real = torch.rand(T, generator=g) < 0.6 if seed % 2 else None
    st = LayerStats()
    groups = engine._group(plan, idx, E, st, real=real)
    want, skips, subs, mix = _python_groups(plan, idx, slot_major=impl == "eager", real=real, E=E)
    got = {(int(x.where), x.bits, x.expert): list(zip(x.tok_host.tolist(), x.slot_host.tolist())) for x in groups}
    assert got == want
    assert [x.pos.tolist() for x in groups] == [[t * k + s for t, s in want[int(x.where), x.bits, x.expert]]
                                                for x in groups]
    assert (st.skips, st.substitutions, sum(st.precision_mix.values())) == (skips, subs, mix)


def _routed_view(idx: torch.Tensor, E: int, weight: torch.Tensor) -> LayerView:
    return LayerView(layer=0, moe_pos=0, num_experts=E, step=Step(0, Phase.PREFILL, idx.shape[0]), top_k_index=idx,
                     top_k_weights=weight, router_logits=torch.empty(0), residency=None, predict=lambda later: None)


@pytest.mark.parametrize("dropped", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_an_untouched_routed_plan_groups_as_its_arrays_do(tiny_ckpt, dropped, seed):
    """The routed plan's shortcut (transformers' own sort, no arrays made) gives the groups, rows and
    counts the general path gives for the same plan written out; a slot the router marked dropped
    (id E) sends the layer down the general path, which skips it."""
    lm = load_model(tiny_ckpt("qwen2_moe"))
    engine, _ = build_engine(lm, HostStore.from_experts(lm.experts, torch.float32), "resident", budget="100%", batch=2)
    g = torch.Generator().manual_seed(seed)
    T, k, E = 9, 3, 4
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # experts repeat across tokens
    if dropped:
        idx[torch.rand(T, k, generator=g) < 0.2] = E
    weight = torch.rand(T, k, generator=g)
    routed = LayerPlan.routed(_routed_view(idx, E, weight), 16)
    assert routed.uniform_bits() == 16
    written = LayerPlan(expert=idx.clone(), bits=torch.full((T, k), 16), where=torch.where(idx < E, 0, 2),
                        weight=weight.clone())
    got, want = LayerStats(), LayerStats()
    a, b = engine._group(routed, idx, E, got), engine._group(written, idx, E, want)
    rows = lambda groups: [(int(x.where), x.bits, x.expert, x.tok_host.tolist(), x.slot_host.tolist(),  # noqa: E731
                            x.pos.tolist()) for x in groups]
    assert rows(a) == rows(b)
    assert (got.skips, got.substitutions, dict(got.precision_mix)) == \
        (want.skips, want.substitutions, dict(want.precision_mix))
    assert got.skips == 0 and sum(got.precision_mix.values()) == int((idx < E).sum())  # a dropped slot: no skip


def test_a_policy_that_touches_a_routed_plan_gets_its_own_arrays():
    idx, weight = torch.tensor([[2, 0, 3], [1, 2, 4]]), torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]])
    view = _routed_view(idx, 4, weight.clone())
    plan = LayerPlan.routed(view, 4)
    assert torch.equal(plan.routing_weight(), view.top_k_weights)  # untouched: the router's own, no copy
    plan.weight[0, 0] = 0.0  # a policy changing its plan must not change what the router said
    assert torch.equal(view.top_k_weights, weight) and plan.routing_weight()[0, 0] == 0
    assert plan.uniform_bits() == 4  # weights do not change the grouping: the shortcut stays
    assert plan.bits.tolist() == [[4] * 3] * 2 and plan.where.tolist() == [[0, 0, 0], [0, 0, 2]]  # id 4 = E: dropped
    assert plan.uniform_bits() == 4  # read, not changed: the shortcut stays (Fate reads `running()` every step)
    plan.expert[1, 0] = 3
    assert view.top_k_index[1, 0] == 1  # a changed expert is the policy's copy
    assert plan.uniform_bits() is None  # changed in place: the general path runs it
    again = LayerPlan.routed(view, 4)
    again.where[0, 1] = 2  # a skip written in place
    assert again.uniform_bits() is None
    assigned = LayerPlan.routed(view, 4)
    assigned.expert = idx.clone()  # assigned without reading, but the router's own experts
    assert assigned.uniform_bits() == 4


def test_static_low_bits_equal_grouped_mm_on_the_dequantized_weights_bit_for_bit(tiny_ckpt, bundle):
    """Quantized experts through the grouped path: the batched decode, then transformers' own grouped GEMM.
    Loaded into a plain transformers model, the same dequantized weights give the same logits exactly."""
    path = str(tiny_ckpt("qwen2_moe"))
    for bits in (4, 2):
        ready = prepare(RunConfig(model=path, bundle=bundle, policy="static", settings={"bits": str(bits)},
                                  budget="100%", batch_size=2))
        opened = Bundle.open(bundle, model=ready.lm.fingerprint)
        ref = load_reference(path, experts_impl="grouped_mm")
        for g in ready.lm.geometry.layers:
            experts = ref.get_submodule(g.path).experts
            for e in range(g.num_experts):
                w = opened.dequantize(g.index, e, bits, torch.float32)
                experts.gate_up_proj.data[e] = w.gate_up
                experts.down_proj.data[e] = w.down
        with torch.no_grad():
            assert torch.equal(ready.lm.model(IDS).logits, ref(IDS).logits)


def test_one_grouped_gemm_per_precision_and_layer_and_no_per_expert_decode(tiny_ckpt, bundle, monkeypatch):
    calls, decodes = [], []
    real_mlp, real_decode = runtime.grouped_mlp, HostStore.decode
    monkeypatch.setattr(runtime, "grouped_mlp", lambda *a: calls.append(a[2].gate_up.shape[0]) or real_mlp(*a))
    monkeypatch.setattr(HostStore, "decode", lambda self, *a: decodes.append(a[1:]) or real_decode(self, *a))
    ready = prepare(RunConfig(model=str(tiny_ckpt("qwen2_moe")), bundle=bundle, policy="dymoe",
                              settings={"high_bits": "4", "low_bits": "2"}, budget="100%", batch_size=2))
    with torch.no_grad():
        ready.lm.model(IDS)
    n_layers = len(ready.lm.geometry.layers)
    used = {b for g in ready.lm.geometry.layers for b, n in ready.engine.stats.layer(g.index).precision_mix.items() if n}
    assert used == {4, 2}  # both precisions ran
    assert decodes == []  # every expert came out of a batched decode
    # every expert in exactly one grouped GEMM, several a call: per precision, status (hits, copies in
    # flight, misses) and chunk of decoded experts (`decode_chunk`, the budget's workspace), not per expert
    ran = sum(ready.engine.stats.layer(g.index).needed for g in ready.lm.geometry.layers)
    assert sum(calls) == ran and n_layers < len(calls) < ran


def test_grouped_and_eager_paths_agree_on_a_mixed_precision_policy(tiny_ckpt, bundle):
    """Different GEMM kernels (grouped vs one F.linear per expert), so equal within fp32 rounding."""
    logits = {}
    for impl in ("grouped_mm", "eager"):
        ready = prepare(RunConfig(model=str(tiny_ckpt("qwen2_moe")), bundle=bundle, policy="dymoe",
                                  settings={"high_bits": "4", "low_bits": "2"}, budget="50%", batch_size=2, experts_impl=impl))
        with torch.no_grad():
            logits[impl] = ready.lm.model(IDS).logits
    torch.testing.assert_close(logits["grouped_mm"], logits["eager"], rtol=0, atol=1e-5)


def test_bf16_blobs_under_fp32_compute_are_cast_straight_into_the_stack(tiny_ckpt, tmp_path, monkeypatch):
    """A bf16 bundle computed in fp32 at a budget that leaves gaps in the pool: the grouped path
    casts each gathered expert into its stack (no view, no gather-then-cast) and agrees with the
    eager path, which casts each expert into its scratch, within fp32 rounding."""
    out = tmp_path / "b"
    quantize(QuantizeConfig(model=str(tiny_ckpt("qwen2_moe")), out=out, bits=(16,), dtype="bfloat16"))
    stacks, decoded = [], []  # (bits, stack dtype) of each grouped stack; bits of each decode_stack call
    for_slots, decode_stack = PoolWeights.for_slots, HostStore.decode_stack
    monkeypatch.setattr(PoolWeights, "for_slots", lambda self, layer, bits, *a: stacks.append(
        (bits, (r := for_slots(self, layer, bits, *a))[0].gate_up.dtype)) or r)
    monkeypatch.setattr(HostStore, "decode_stack", lambda self, parts, layer, bits: decoded.append(bits) or
                        decode_stack(self, parts, layer, bits))
    logits = {}
    for impl in ("grouped_mm", "eager"):
        ready = prepare(RunConfig(model=str(tiny_ckpt("qwen2_moe")), bundle=out, policy="lru", budget="60%",
                                  batch_size=2, experts_impl=impl))
        assert ready.engine.store.compute_dtype == torch.float32
        with torch.no_grad():
            logits[impl] = ready.lm.model(IDS).logits
    # The grouped path stacked 16-bit experts in fp32 without the gather-then-decode route.
    assert [dtype for bits, dtype in stacks if bits == 16] and all(dtype == torch.float32 for _, dtype in stacks)
    assert 16 not in decoded
    torch.testing.assert_close(logits["grouped_mm"], logits["eager"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("policy,settings,budget", [("resident", {}, "100%"), ("static", {"bits": "2"}, "100%"),
                                                    ("lru", {}, "60%"), ("eap", {}, "60%")])
def test_the_steady_state_shortcut_keeps_every_counter_of_the_general_path(tiny_ckpt, bundle, monkeypatch, policy,
                                                                           settings, budget):
    """Layers whose routed experts are all resident run whole in `_run_resident` (no per-expert
    objects). With it and without it (the general path for every layer): the same logits bit for
    bit, and the same counters (hits, misses, precision mix, prefetch use, bytes moved)."""
    real, taken = runtime.Engine._run_resident, []
    results = {}
    for shortcut in (True, False):
        monkeypatch.setattr(runtime.Engine, "_run_resident",
                            (lambda self, *a: taken.append(r := real(self, *a)) or r) if shortcut else
                            (lambda self, *a: None))
        ready = prepare(RunConfig(model=str(tiny_ckpt("qwen2_moe")), bundle=bundle, policy=policy, settings=settings,
                                  budget=budget, batch_size=1, max_new_tokens=12))
        with torch.no_grad():
            out = ready.lm.model.generate(IDS[:1], max_new_tokens=12, do_sample=False, output_logits=True,
                                          return_dict_in_generate=True)
        stats = {layer: (dict(s.hits), dict(s.misses), dict(s.precision_mix), s.needed, s.prefetch_issued,
                         s.prefetch_used, s.bytes_h2d) for layer, s in ready.engine.stats.layers.items()}
        results[shortcut] = (torch.stack(out.logits), stats)
    assert any(r is not None for r in taken)  # the shortcut ran
    assert torch.equal(results[True][0], results[False][0])
    assert results[True][1] == results[False][1]


def test_decoded_experts_stay_within_the_workspace_the_budget_plans(tiny_ckpt, bundle, monkeypatch):
    """The grouped path decodes at most `decode_chunk` experts at once (a larger prefill batch runs in
    chunks, with the same result bit for bit), and the budget's margin holds that workspace."""
    ready = prepare(RunConfig(model=str(tiny_ckpt("qwen2_moe")), bundle=bundle, policy="static", settings={"bits": "4"},
                              budget="100%", batch_size=2))
    engine, g = ready.engine, ready.lm.geometry.layers[0]
    assert ready.budget.margin_bytes == kv_margin(ready.lm.model.config, engine.plan_tokens, 2, torch.float32, g.top_k) \
        + decode_workspace(expert_params(g), torch.float32, g.top_k)
    with torch.no_grad():
        whole = ready.lm.model(IDS).logits
    sizes, real = [], runtime.grouped_mlp
    monkeypatch.setattr(runtime, "grouped_mlp", lambda *a: sizes.append(a[2].gate_up.shape[0]) or real(*a))
    engine.decode_chunk = 1
    with torch.no_grad():
        chunked = ready.lm.model(IDS).logits
    assert max(sizes) == 1 and len(sizes) > len(ready.lm.geometry.layers)  # one expert decoded at a time
    assert torch.equal(chunked, whole)


def test_an_unknown_experts_impl_is_refused_in_one_sentence():
    with pytest.raises(MoetoolError, match="--experts-impl must be grouped_mm or eager"):
        EngineSpec(experts_impl="fast").check()


def test_a_layers_prefetch_starts_before_its_experts_compute(tiny_ckpt, bundle):
    """Fate's n = T / t_expert counts the layer's own t_moe in the window its copies overlap (§4.3, "at the
    beginning of gate in the i-th block"), and DyMoE fetches "before the computation of the current layer
    is complete" (§4.4.1). The engine asked for prefetches only after the layer's experts had run, so on
    the sim clock every copy started after them and n copies stalled the next layer."""
    ready = prepare(RunConfig(model=str(tiny_ckpt("qwen2_moe")), bundle=bundle, policy="dymoe", clock="sim",
                              settings={"config": "4/2"}, budget="100%"))
    engine, events = ready.engine, []
    compute, prefetch = engine._compute_on_device, engine.policy.prefetch
    engine._compute_on_device = lambda module, *a: events.append(("compute", module.layer.index)) or compute(module, *a)

    def spied(view):
        fetches = prefetch(view)
        events.append(("prefetch", view.layer, len(fetches)))
        return fetches

    engine.policy.prefetch = spied
    with torch.no_grad():
        ready.lm.model(IDS[:1])
    first = ready.lm.geometry.layers[0].index
    order = [e[0] for e in events if e[1] == first]
    assert order == ["prefetch", "compute"], events
    assert any(e[0] == "prefetch" and e[2] for e in events)  # the look-ahead did fetch something

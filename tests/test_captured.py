"""The captured decode step (engine/decode.py): every policy compiles with `fullgraph=True` (a graph
break fails), lossless policies give plain transformers' greedy tokens through it, nothing in a step
reads the device from the host, and what the step cannot take falls back to the host path in the
open.

Most tests compile with dynamo's "eager" backend: `fullgraph=True` fails on the same graph breaks as
with inductor (host reads, data-dependent shapes, Python branches on tensors) at a fraction of the
compile time; one test compiles with inductor, the CPU default."""

from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import copy, save_char_tokenizer
from tiny import MORE_CONFIGS, RELEASES, TINY_CONFIGS, save_tiny, save_tiny_release

from moetool.engine import build_engine
from moetool.engine.decode import DIFFERENT_MODEL_TYPES, VERIFIED_MODEL_TYPES, DecodeProgram, choose_path
from moetool.engine.store import HostStore
from moetool.errors import MoetoolError
from moetool.model import load_model, load_reference
from moetool.policies import POLICIES as REGISTRY
from moetool.policies.base import Fetch, LayerPlan, Policy, Where, register
from moetool.policies.common import predicted_scores
from moetool.policies.base import Params as BaseParams
from moetool.quant.bundle import load_bundle_model
from moetool.quant.quantize import QuantizeConfig, quantize

IDS = torch.tensor([[5, 17, 33, 2, 9, 100, 45, 7]])
NEW = 8
ARCHS = ["qwen2_moe", "deepseek_v3", "qwen3_next"]  # qwen3_next: a hybrid (gated-DeltaNet linear attention)

# (policy, knobs, budget, lossless); every registered policy appears (checked below).
CASES = [
    ("resident", {}, "100%", True),
    ("lod", {}, "10%", True),
    ("lru", {}, "25%", True),
    ("eap", {}, "50%", True),
    ("fate", {"cache_bits": "16", "p": "0"}, "50%", True),
    ("static", {"bits": "4"}, "100%", False),
    ("fate", {}, "25%", False),
    ("dymoe", {"config": "4/0"}, "30%", False),
    ("dymoe", {"config": "4/2"}, "30%", False),
    ("smoe", {"cpu_assist": "false"}, "30%", False),
    ("dynaexq", {"config": "16/4"}, "80%", False),
]


def _shipped():
    return {name for name, cls in REGISTRY.items() if cls.__module__.startswith("moetool.policies")}


def test_every_shipped_policy_is_covered():
    assert {c[0] for c in CASES} == _shipped()


@pytest.fixture(scope="module")
def quantized(tiny_ckpt, tmp_path_factory):
    """Per architecture, a bundle at 16, 4 and 2 bits (group 16), quantized once."""
    made = {}

    def get(arch):
        if arch not in made:
            out = tmp_path_factory.mktemp(f"captured-{arch}") / "b"
            quantize(QuantizeConfig(model=str(tiny_ckpt(arch)), out=out, bits=(16, 4, 2), group_size=16,
                                    dtype="float32", hqq_optimize=False))
            made[arch] = out
        return made[arch]
    return get


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    """Plain transformers' greedy tokens (its batched_mm experts, which the captured step computes
    as, row for row)."""
    made = {}

    def get(arch):
        if arch not in made:
            ref = load_reference(tiny_ckpt(arch), experts_impl="batched_mm")
            made[arch] = ref.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=NEW,
                                      do_sample=False)[0, IDS.shape[1]:].tolist()
        return made[arch]
    return get


def _program(lm, store, policy, knobs, budget, backend="eager"):
    engine, plan = build_engine(lm, store, policy, settings=knobs, budget=budget, captured=True, max_tokens=32)
    return engine, plan, DecodeProgram(engine, max_tokens=32, backend=backend)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("policy,knobs,budget,lossless", CASES, ids=lambda x: str(x))
def test_every_policy_compiles_fullgraph_and_lossless_ones_give_transformers_tokens(
        tiny_ckpt, quantized, reference, arch, policy, knobs, budget, lossless):
    if lossless:  # the checkpoint's own fp32 experts: exact against fp32 transformers
        lm = load_model(tiny_ckpt(arch))
        store = HostStore.from_experts(lm.experts, torch.float32)
    else:
        lm = load_bundle_model(quantized(arch))
        store = HostStore.from_bundle(lm.bundle, torch.float32)
    engine, plan, program = _program(lm, store, policy, knobs, budget)
    tokens = program.generate(IDS, NEW)
    assert len(tokens) == NEW and program.steps == NEW - 1
    assert program.mirrors.nbytes == 0  # on a CPU the host mirrors are views (the mapped bundle, the store's rows)
    s = engine.stats.summary()
    assert s["peak_device_bytes"] <= plan.total_bytes
    assert len(engine.stats.steps) == NEW  # the prefill and every captured step, timed
    if lossless:
        assert tokens == reference(arch)
    if policy in ("resident", "static"):
        assert s["hit_rate"] == 1.0 and s["bytes_h2d"] == 0
    if policy == "lod":  # nothing is kept: every routed expert of every captured step is read in place
        blob = sum(store.layout(g.index, 16).nbytes * g.top_k for g in lm.geometry.layers)
        assert s["hit_rate"] == 0.0 and program.zero_copy_bytes == (NEW - 1) * blob


def test_inductor_compiles_the_step_and_keeps_the_tokens(tiny_ckpt, reference):
    """The CPU default backend: inductor's generated code, same greedy tokens for a caching policy."""
    lm = load_model(tiny_ckpt("qwen2_moe"))
    engine, _, program = _program(lm, HostStore.from_experts(lm.experts, torch.float32), "lru", {}, "50%",
                                  backend="inductor")
    assert program.generate(IDS, NEW) == reference("qwen2_moe")


class HostReads(TorchDispatchMode):
    """Records every op that reads device data on the host or makes a shape from data: what breaks a
    CUDA graph capture. `.tolist()` and `.numpy()` dispatch no op, so they are wrapped while active."""

    FORBIDDEN = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
                 "aten._unique2.default", "aten.unique_consecutive.default", "aten.unique_dim.default",
                 "aten.bincount.default", "aten.repeat_interleave.Tensor"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in self.FORBIDDEN:
            self.seen.append(name)
        if name in ("aten.index.Tensor", "aten.index_put.default", "aten.index_put_.default") and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in _flat(args[1])):
            self.seen.append(name + " (boolean mask)")  # a mask as an index: its shape is data
        if name in ("aten._to_copy.default", "aten.copy_.default"):
            src = args[1] if name == "aten.copy_.default" else args[0]
            to = args[0].device if name == "aten.copy_.default" else (kwargs or {}).get("device", src.device)
            if src.device.type != "cpu" and torch.device(to).type == "cpu":
                self.seen.append(name + " (device to host)")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._saved = torch.Tensor.tolist, torch.Tensor.numpy
        seen = self.seen

        def tolist(t, *a, **k):
            seen.append("Tensor.tolist")
            return self._saved[0](t, *a, **k)

        def numpy(t, *a, **k):
            seen.append("Tensor.numpy")
            return self._saved[1](t, *a, **k)

        torch.Tensor.tolist, torch.Tensor.numpy = tolist, numpy
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.numpy = self._saved
        return super().__exit__(*exc)


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


def _one_step_reads(program) -> list[str]:
    engine = program.engine
    program.cache.reset()
    engine.capturing = True
    try:
        with torch.no_grad(), HostReads() as mode:
            program._step()
    finally:
        engine.capturing = False
    return mode.seen


@pytest.mark.parametrize("policy,knobs,budget", [(c[0], c[1], c[2]) for c in CASES if c[0] != "static"],
                         ids=lambda x: str(x))
def test_no_host_read_inside_a_decode_step(tiny_ckpt, quantized, policy, knobs, budget):
    lm = load_bundle_model(quantized("qwen2_moe"))
    _, _, program = _program(lm, HostStore.from_bundle(lm.bundle, torch.float32), policy, knobs, budget)
    assert _one_step_reads(program) == []


def test_the_host_read_detector_catches_one(tiny_ckpt, quantized):
    """The detector is not blind: a plan that reads an expert id on the host is flagged."""
    lm = load_bundle_model(quantized("qwen2_moe"))
    _, _, program = _program(lm, HostStore.from_bundle(lm.bundle, torch.float32), "lru", {}, "25%")
    plan_step = program.engine.policy.plan_step

    def peeking(view):
        int(view.top_k_index[0, 0])  # a host read of device data
        view.top_k_index.tolist()
        return plan_step(view)

    program.engine.policy.plan_step = peeking
    seen = _one_step_reads(program)
    assert "aten._local_scalar_dense.default" in seen and "Tensor.tolist" in seen


class HostOnlySkip(Policy):
    """A policy written with `plan` alone: skip light slots (the policies README's example shape)."""

    @dataclass(frozen=True)
    class Params(BaseParams):
        bits: int = 16

    def plan(self, view):
        plan = LayerPlan.routed(view, 16)
        plan.where[plan.weight < 0.05] = Where.SKIP
        return plan


class HostOnlyAhead(Policy):
    """A policy whose rule is its host `prefetch` alone (the next layer's predicted experts): the
    captured step never calls `prefetch`, and it ran there as plain routing with no word."""

    def prefetch(self, view):
        ahead = predicted_scores(view, self.ctx)
        return [] if ahead is None else [Fetch(ahead[0], int(ahead[1][-1].argmax()), 16)]


def test_a_policy_without_an_in_step_plan_falls_back_in_the_open(tiny_ckpt):
    """A policy written with `plan` alone (the policies README's example shape) has no in-step form:
    `run --decode captured` runs it on the host path and says why; so does SMoE's CPU assistance and
    a batch of several sequences."""
    from moetool.run import RunConfig, run

    for name, cls in (("host-only-skip", HostOnlySkip), ("host-only-ahead", HostOnlyAhead)):
        if name not in REGISTRY:
            register(name)(cls)
    path = tiny_ckpt("qwen2_moe")
    for policy, knobs, batch, why in [("host-only-skip", {}, 1, "no in-step plan"),
                                      ("host-only-ahead", {}, 1, "prefetches on the host only"),
                                      ("smoe", {}, 1, "Algorithm 2"),
                                      ("lru", {}, 2, "one sequence at a time")]:
        result = run(RunConfig(model=str(path), policy=policy, settings=knobs, budget="50%", decode="captured",
                               prompts=("ab", "cd"), max_new_tokens=3, batch_size=batch))
        assert result.summary["path"] == "host" and why in result.summary["path_reason"]
        assert len(result.tokens) == 2 and all(len(t) == 3 for t in result.tokens)


def test_a_budget_the_host_path_holds_and_the_captured_step_does_not_falls_back(tiny_ckpt):
    """The captured step plans its gather workspace beside the KV margin: a size budget between the two
    minimums ran on the host path and was refused with --decode captured (and would be with auto on a
    GPU), where anything the step cannot take falls back in the open."""
    from moetool.engine import split_budget_for
    from moetool.run import RunConfig, _sequence_tokens, run

    path = tiny_ckpt("qwen2_moe")
    lm = load_model(path)
    store = HostStore.from_experts(lm.experts, torch.float32)
    tokens = _sequence_tokens(lm, ["ab"], 3)
    host, captured = (split_budget_for("0%", lm, store, tokens, 1, "cpu", c).total_bytes for c in (False, True))
    assert host < captured
    got = run(RunConfig(model=str(path), policy="lru", budget=f"{(host + captured) // 2}b", decode="captured",
                        prompts=("ab",), max_new_tokens=3, clock="sim"))
    assert got.summary["path"] == "host" and got.summary["path_reason"].startswith("the captured step fell back: --budget")
    assert got.budget_bytes == (host + captured) // 2 and len(got.tokens[0]) == 3
    one = run(RunConfig(model=str(path), policy="lru", budget="50%", decode="captured", prompts=("ab",),
                        max_new_tokens=1, clock="sim"))  # the step was compiled, and never ran
    assert one.summary["path"] == "host" and "no decode step to capture" in one.summary["path_reason"]


@pytest.mark.parametrize("ks", [[2, 1], [1, 2]])
def test_a_top_k_per_layer_falls_back_in_the_open_and_plans_the_widest(tmp_path, ks):
    """HunYuan routes each layer to its own count (`moe_topk` a list). The step's log is one [layers, k]
    array sized by the first layer: [2, 1] counted layer 1's one expert twice (7 misses too many, 64% more
    bytes), and [1, 2] fell back with a raw shape error. The budget's margin plans the widest layer."""
    from moetool.engine.budget import kv_margin, plan_margin
    from moetool.run import RunConfig, run

    path = save_tiny("hunyuan_v1_moe", tmp_path / "hy", moe_topk=ks)
    save_char_tokenizer(path)
    lm = load_model(str(path))
    assert [g.top_k for g in lm.geometry.layers] == ks
    margin = plan_margin(lm.model.config, lm.geometry.layers, 64, 1, torch.float32, decoded=False)
    assert margin == kv_margin(lm.model.config, 64, 1, torch.float32, top_k=2)
    got = {d: run(RunConfig(model=str(path), policy="lod", budget="10%", decode=d, prompts=("The quick brown fox",),
                            max_new_tokens=5, clock="sim")) for d in ("host", "captured")}
    assert got["captured"].summary["path"] == "host"
    assert got["captured"].summary["path_reason"] == (
        "the captured step fell back: this model's MoE layers differ in expert count or top-k (4 experts top-1, "
        "4 experts top-2), and the step logs one of each")
    assert got["captured"].tokens == got["host"].tokens and got["captured"].layers == got["host"].layers


def test_a_model_that_refuses_a_static_cache_is_said_to_at_its_first_step(tiny_ckpt):
    """MiniMax's model refuses transformers' StaticCache in the step's first, uncompiled run: the reason
    said "compiling the decode step failed", sending a reader to the compiler."""
    from moetool.run import RunConfig, run

    got = run(RunConfig(model=str(tiny_ckpt("minimax")), policy="lru", budget="50%", decode="captured",
                        prompts=("ab",), max_new_tokens=3, clock="sim"))
    assert got.summary["path"] == "host"
    assert got.summary["path_reason"].startswith("the captured step fell back: running the decode step once, "
                                                 "uncompiled, over transformers' StaticCache failed (ValueError: MiniMax")


def test_a_step_that_does_not_compile_names_the_line_of_the_models_code(tmp_path):
    """Phi-3.5-MoE's release uses longrope, whose rotary embedding picks its factors with a Python
    branch on the position: the fallback said "Data-dependent branching" and not where; it names the
    line of transformers' code now, and the host path's tokens are plain transformers' greedy ones."""
    from tiny import save_tiny

    from moetool.run import RunConfig, run

    rope = {"rope_type": "longrope", "original_max_position_embeddings": 32, "rope_theta": 10000.0,
            "short_factor": [1.0] * 4, "long_factor": [1.0, 2.0, 8.0, 32.0], "short_mscale": 1.0, "long_mscale": 1.3}
    path = save_tiny("phimoe", tmp_path / "phimoe", rope_parameters=rope)
    got = run(RunConfig(model=str(path), policy="resident", budget="100%", decode="captured", prompts=("ab",),
                        max_new_tokens=3))
    reason = got.summary["path_reason"]
    assert got.summary["path"] == "host" and "compiling the decode step failed" in reason, reason
    assert " at transformers/models/phimoe/modeling_phimoe.py:" in reason and "rope_type" in reason, reason
    ref = load_reference(path)
    ids = torch.tensor([[b % ref.config.vocab_size for b in b"ab"]])
    want = ref.generate(ids, do_sample=False, max_new_tokens=3, min_new_tokens=3)[0, 2:].tolist()
    assert got.tokens[0] == want


def test_run_records_the_captured_path_and_its_tokens_equal_the_host_paths(tiny_ckpt):
    from moetool.run import RunConfig, run

    path = tiny_ckpt("qwen2_moe")
    common = dict(model=str(path), policy="lru", budget="25%", prompts=("hello", "world"), max_new_tokens=5)
    captured = run(RunConfig(**common, decode="captured"))
    host = run(RunConfig(**common, decode="host"))
    assert captured.summary["path"] == "captured" and captured.summary["compile_s"] > 0
    assert captured.summary["captured_steps"] == 2 * 4
    assert host.summary["path"] == "host"
    assert captured.tokens == host.tokens
    assert captured.tpot_s["n"] == host.tpot_s["n"] == 2 * 4


@pytest.mark.parametrize("policy,knobs", [("fate", {"cache_bits": "16", "p": "0"}),
                                          ("dymoe", {"config": "16/0", "r": "1"}), ("resident", {})])
def test_the_sim_clock_charges_a_look_ahead_router_on_both_paths(tiny_ckpt, monkeypatch, policy, knobs):
    """Every expert resident, nothing moved: the two paths do the same work a step. The captured step ran
    each layer's look-ahead router in-step uncharged, so Fate and DyMoE modelled faster there by one
    kernel per MoE layer, a gap larger than the captured step's modelled gain it was read as."""
    from moetool.engine.decode import DecodeProgram
    from moetool.run import RunConfig, run

    init = DecodeProgram.__init__
    monkeypatch.setattr(DecodeProgram, "__init__", lambda self, *a, backend=None, **k: init(self, *a, backend="eager",
                                                                                          **k))
    common = dict(model=str(tiny_ckpt("qwen2_moe")), policy=policy, settings=knobs, budget="100%", clock="sim",
                  prompts=("hello",), max_new_tokens=5)
    host, captured = (run(RunConfig(**common, decode=d)) for d in ("host", "captured"))
    assert captured.summary["path"] == "captured" and host.tokens == captured.tokens
    assert captured.tpot_s["p50"] == pytest.approx(host.tpot_s["p50"], rel=1e-9)


def test_the_sim_clock_carries_in_place_reads_and_fills_on_one_link(tmp_path, monkeypatch):
    """A miss the captured step reads in place is copied into its slot after: its bytes cross the link
    twice. The sim clock had charged the reads on the compute timeline and the fills on the link's, both
    at full rate at once: LRU at 25% modelled its decode steps in 0.9x the time the link needs for them."""
    from moetool.engine.clock import SimClock
    from moetool.engine.decode import ZERO_COPY_SHARE, DecodeProgram
    from moetool.run import RunConfig, run

    path = save_tiny("qwen2_moe", tmp_path / "big", hidden_size=256, moe_intermediate_size=512,
                     shared_expert_intermediate_size=256, num_experts=8, num_experts_per_tok=2, num_hidden_layers=4)
    init, half, copy_ = DecodeProgram.__init__, DecodeProgram._host_half, SimClock.copy
    seen = {"link_s": 0.0, "steps_s": 0.0, "in_step": False, "tail_s": 0.0}

    def host_half(self, host, done, past=0):
        clock, read0 = self.engine.clock, self.zero_copy_bytes
        now0, seen["in_step"] = clock.now, True
        token = half(self, host, done, past)
        seen["in_step"] = False
        hw = self.engine.cost.hw
        seen["link_s"] += (self.zero_copy_bytes - read0) / (hw.h2d_gbps * 1e9 * ZERO_COPY_SHARE)
        seen["steps_s"] += clock.now - now0
        seen["tail_s"] = max(0.0, clock.copy_free - clock.now)  # fills still on the link when the run ends
        return token

    def fill(self, nbytes, staged=False):
        if seen["in_step"]:
            seen["link_s"] += self.cost.t_copy(nbytes)
        return copy_(self, nbytes, staged)

    monkeypatch.setattr(DecodeProgram, "__init__", lambda self, *a, backend=None, **k: init(self, *a, backend="eager",
                                                                                          **k))
    monkeypatch.setattr(DecodeProgram, "_host_half", host_half)
    monkeypatch.setattr(SimClock, "copy", fill)
    got = run(RunConfig(model=str(path), policy="lru", budget="25%", clock="sim", hw="rtx3090", decode="captured",
                        prompts=("hello world again",), max_new_tokens=12))
    assert got.summary["path"] == "captured" and got.hit_rate < 0.9  # misses crossed the link
    assert seen["link_s"] > 0.5 * seen["steps_s"]  # a run the link bounds, not one that hides the question
    assert seen["link_s"] <= seen["steps_s"] + seen["tail_s"] + 1e-12


def _with_generation_config(src, dst, **fields):
    """A copy of checkpoint `src` whose generation_config.json sets `fields` (as a real checkpoint's does)."""
    from transformers import GenerationConfig

    copy(src, dst)
    GenerationConfig(**fields).save_pretrained(dst)
    return dst


def test_the_captured_step_never_picks_an_end_of_sequence_id_as_the_host_path_never_does(tiny_ckpt, tmp_path):
    """A run decodes all of --max-new-tokens: the host path's generate suppresses the checkpoint's eos
    ids (min_new_tokens), and so must the captured step's argmax, or the two runs part at the first
    step whose greedy token is an eos id. Here eos is the plain argmax of the third new token."""
    from moetool.run import RunConfig, run

    free = run(RunConfig(model=str(tiny_ckpt("qwen2_moe")), policy="resident", budget="100%", prompts=("hello",), max_new_tokens=6,
                         decode="host")).tokens[0]
    path = _with_generation_config(tiny_ckpt("qwen2_moe"), tmp_path / "m", eos_token_id=[free[2], 100000])
    common = dict(model=str(path), policy="lru", budget="50%", prompts=("hello",), max_new_tokens=6)
    captured, host = run(RunConfig(**common, decode="captured")), run(RunConfig(**common, decode="host"))
    assert captured.summary["path"] == "captured"
    assert captured.tokens == host.tokens
    assert captured.tokens[0][:2] == free[:2] and free[2] not in captured.tokens[0]


def test_a_generation_config_the_captured_step_does_not_apply_falls_back_in_the_open(tiny_ckpt, tmp_path):
    from moetool.run import RunConfig, run

    path = _with_generation_config(tiny_ckpt("qwen2_moe"), tmp_path / "m", repetition_penalty=1.3)
    common = dict(model=str(path), policy="lru", budget="50%", prompts=("hello",), max_new_tokens=4)
    captured, host = run(RunConfig(**common, decode="captured")), run(RunConfig(**common, decode="host"))
    assert captured.summary["path"] == "host"
    assert "RepetitionPenaltyLogitsProcessor" in captured.summary["path_reason"]
    assert captured.tokens == host.tokens


@pytest.mark.parametrize("arch", ["afmoe", "zaya"])
def test_a_look_ahead_through_a_batched_router_compiles_in_a_fresh_process(tmp_path, monkeypatch, arch):
    """afmoe's and ZAYA's routers read [1, T, H]. The captured step's look-ahead calls a later
    layer's router in traced code, which cannot try a shape and catch: the form is found before the
    compile, also where no host-path call found it first (a fresh process: the cache emptied)."""
    from moetool import inference

    monkeypatch.setattr(inference, "_ROUTER_FORM", {})
    ckpt = tmp_path / arch
    save_tiny_release(arch, ckpt) if arch in RELEASES else save_tiny(arch, ckpt)
    ref = load_reference(ckpt, experts_impl="batched_mm")
    want = ref.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=NEW, min_new_tokens=NEW,
                        do_sample=False)[0, IDS.shape[1]:].tolist()
    lm = load_model(ckpt)
    engine, _, program = _program(lm, HostStore.from_experts(lm.experts, torch.float32), "fate",
                                  {"cache_bits": "16", "p": "0"}, "50%")
    assert program.layers.routers and all(batched for _, _, batched in program.layers.routers.values())
    assert program.generate(IDS, NEW) == want
    first = min(program.layers.layers)
    assert program.layers.prefetch_bits.get(first) == 16  # the first layer's look-ahead ran in the step


ALL_ARCHS = sorted({*TINY_CONFIGS, *MORE_CONFIGS, *RELEASES})  # a release's text type is its _text's


def test_the_captured_architecture_lists_name_real_model_types():
    assert VERIFIED_MODEL_TYPES <= set(ALL_ARCHS) and set(DIFFERENT_MODEL_TYPES) <= set(ALL_ARCHS)
    assert not VERIFIED_MODEL_TYPES & set(DIFFERENT_MODEL_TYPES)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_every_architecture_decodes_transformers_tokens_or_falls_back(tmp_path, arch):
    """Every fused-experts architecture of transformers: a verified model type's captured step
    decodes plain transformers' greedy tokens (over its default dynamic cache, with a run's
    min_new_tokens); any other falls back with one reason, never a traceback, even when asked for;
    and a type listed as different does differ (else it belongs among the verified)."""
    ckpt = tmp_path / arch
    save_tiny_release(arch, ckpt) if arch in RELEASES else save_tiny(arch, ckpt)
    ref = load_reference(ckpt, experts_impl="batched_mm")
    want = ref.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=NEW, min_new_tokens=NEW,
                        do_sample=False)[0, IDS.shape[1]:].tolist()
    lm = load_model(ckpt)
    engine, _ = build_engine(lm, HostStore.from_experts(lm.experts, torch.float32), "lru", budget="50%",
                             captured=True, max_tokens=32)
    model_type = lm.model.config.model_type
    try:
        program = DecodeProgram(engine, max_tokens=32, backend="eager", unverified_ok=True)
    except MoetoolError as e:
        assert model_type not in VERIFIED_MODEL_TYPES, e
        assert "\n" not in str(e) and engine.captured is None
        if model_type in DIFFERENT_MODEL_TYPES:  # refused before any work: check the claim with the bare step
            assert str(e) == DIFFERENT_MODEL_TYPES[model_type]
            static = ref.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=NEW, min_new_tokens=NEW,
                                  do_sample=False, cache_implementation="static")[0, IDS.shape[1]:].tolist()
            assert static != want
        return
    assert model_type in VERIFIED_MODEL_TYPES, f"{model_type} decodes through the captured step: verify it"
    assert program.generate(IDS, NEW) == want


def test_auto_is_the_host_path_on_a_cpu_and_the_captured_step_on_cuda():
    assert choose_path("auto", torch.device("cpu"), 1, "grouped_mm")[0] == "host"
    assert choose_path("auto", torch.device("cuda"), 1, "grouped_mm")[0] == "captured"
    assert choose_path("auto", torch.device("cuda"), 4, "grouped_mm")[0] == "host"
    assert choose_path("captured", torch.device("cpu"), 1, "eager")[0] == "host"


def test_a_prompt_past_the_static_cache_is_one_sentence(tiny_ckpt):
    lm = load_model(tiny_ckpt("qwen2_moe"))
    _, _, program = _program(lm, HostStore.from_experts(lm.experts, torch.float32), "lru", {}, "50%")
    with pytest.raises(MoetoolError, match="static cache of 32 tokens"):
        program.generate(torch.zeros(1, 30, dtype=torch.long), 8)


def test_zero_copy_rows_kernel_reads_only_the_marked_rows(monkeypatch):
    """The Triton kernel that reads missed experts in place (on CUDA over the bus), run here by the
    interpreter on CPU tensors: marked rows are copied, -1 rows are zeros."""
    from moetool.engine import zero_copy

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    src = torch.randint(0, 255, (6, 128 + 64), dtype=torch.uint8)[:, :128]  # strided rows, as a shard's
    index = torch.tensor([4, -1, 0, 4])
    out = zero_copy.rows_with_triton(src, index, torch.full((4, 128), 7, dtype=torch.uint8), block=8,
                                     interpret=True)
    assert torch.equal(out[0], src[4]) and torch.equal(out[2], src[0]) and torch.equal(out[3], src[4])
    assert torch.equal(out[1], torch.zeros(128, dtype=torch.uint8))
    cpu = zero_copy.host_rows(src, index)  # the op's CPU path: the same rows
    assert torch.equal(cpu, out)
    # For a fused kernel's pool (`missed_rows`), a row marked -1 is not written at all: no zeros over a blob
    # the kernel never reads.
    kept = zero_copy.rows_with_triton(src, index, torch.full((4, 128), 7, dtype=torch.uint8), block=8,
                                      interpret=True, blank=False)
    assert torch.equal(kept[[0, 2, 3]], out[[0, 2, 3]]) and bool((kept[1] == 7).all())
    assert torch.equal(zero_copy.missed_rows(src, index), cpu)  # on a CPU: host_rows's rows


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo model, a bundle of it at 16, 4 and 2 bits (round to nearest: quick), a prompt and
    plain transformers' greedy tokens."""
    from moetool.source import resolve_source

    path = resolve_source("demo")
    lm = load_model(path)
    ids = lm.tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = tmp_path_factory.mktemp("captured-demo") / "b"
    quantize(QuantizeConfig(model=path, out=out, bits=(16, 4, 2), dtype="float32", hqq_optimize=False))
    ref = load_reference(path, experts_impl="batched_mm")
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    return path, out, ids, want[0, ids.shape[1]:].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("policy,knobs,budget,lossless", CASES, ids=lambda x: str(x))
def test_every_policy_compiles_fullgraph_on_the_demo_model(demo, policy, knobs, budget, lossless):
    """The demo MoE (30 layers, 3 dense; 24 experts, top-6; shared experts): the whole step compiles
    for every policy, and lossless ones keep plain transformers' greedy tokens."""
    path, bundle_dir, ids, want = demo
    if lossless:
        lm = load_model(path)
        store = HostStore.from_experts(lm.experts, torch.float32)
    else:
        lm = load_bundle_model(bundle_dir)
        store = HostStore.from_bundle(lm.bundle, torch.float32)
    engine, plan = build_engine(lm, store, policy, settings=knobs, budget=budget, captured=True, max_tokens=24)
    program = DecodeProgram(engine, max_tokens=24, backend="eager")
    tokens = program.generate(ids, 6)
    assert len(tokens) == 6 and program.steps == 5
    assert engine.stats.summary()["peak_device_bytes"] <= plan.total_bytes
    if lossless:
        assert tokens == want


def test_blob_rows_reads_each_row_from_its_slot_or_its_host_row(monkeypatch):
    """The gather of a precision whose experts can miss: a miss's row from the host mirror, a hit's
    from its pool slot (slots wider than this layer's blob), neither: zeros. The op's CPU path and the
    Triton kernel (on CUDA it reads the pool on the device and the mirror over the bus), interpreted."""
    from moetool.engine import zero_copy

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 255, (6, 256), dtype=torch.uint8, generator=gen)[:, :192]  # strided rows, as a shard's
    pool = torch.randint(0, 255, (4, 256), dtype=torch.uint8, generator=gen)
    slot = torch.tensor([2, -1, -1, 0, 3, -1])
    index = torch.tensor([-1, 5, -1, -1, 1, 0])  # row 4 marked in both: the host row (a miss) wins
    zero = torch.zeros(192, dtype=torch.uint8)
    want = torch.stack([pool[2, :192], src[5], zero, pool[0, :192], src[1], src[0]])
    assert torch.equal(zero_copy.blob_rows(pool, slot, src, index), want)
    out = zero_copy.rows_with_triton(src, index, torch.full((6, 192), 7, dtype=torch.uint8), block=16,
                                     interpret=True, pool=pool, slot=slot)  # 24 words: a partial second block
    assert torch.equal(out, want)


def _old_gather(layers, layer, bits, slot, missed):
    """The gather as it was: every row from the pool, every row from the host mirror, then merged."""
    from moetool.engine.zero_copy import host_rows
    from moetool.quant.format import stack_views

    rows = stack_views(host_rows(layers.host_rows[layer, bits], missed), layers.store.layout(layer, bits))
    return {n: torch.where((missed < 0).view(-1, *([1] * (v.dim() - 1))), v.index_select(0, slot.clamp(min=0)),
                           rows[n]) for n, v in layers.pool_parts[layer, bits].items()}


@pytest.mark.parametrize("policy,knobs,budget,lossless", [("lru", {}, "25%", True),
                                                          ("dymoe", {"config": "4/2"}, "30%", False)],
                         ids=lambda x: str(x))
def test_a_caching_policys_gather_reads_hits_from_slots_and_misses_from_host_rows(
        tiny_ckpt, quantized, reference, policy, knobs, budget, lossless):
    """A caching policy's steps hit and miss; the step decodes transformers' tokens where lossless;
    and the gather of a mix of hits, misses and rows at other bits gives each used row its expert's
    blob (the mirror's bytes, which its slot holds too), as the gather that read every row twice did."""
    from moetool.quant.format import stack_views

    if lossless:
        lm = load_model(tiny_ckpt("qwen2_moe"))
        store = HostStore.from_experts(lm.experts, torch.float32)
    else:
        lm = load_bundle_model(quantized("qwen2_moe"))
        store = HostStore.from_bundle(lm.bundle, torch.float32)
    engine, _, program = _program(lm, store, policy, knobs, budget)
    tokens = program.generate(IDS, NEW)
    assert 0 < engine.stats.summary()["hit_rate"] < 1
    if lossless:
        assert tokens == reference("qwen2_moe")
    layers, checked = program.layers, 0
    layers.table.sync()  # the host half's last fills and evictions, as the next step would see them
    for layer, bits in layers.host_rows.keys() & layers.pool_parts.keys():
        table = layers.table.device_table[layers.table.pos[layer], :, layers.table.pidx[bits]].long()  # [E]
        held, free = (table >= 0).nonzero().flatten(), (table < 0).nonzero().flatten()
        if not len(held) or not len(free):
            continue
        # Rows: a hit, a miss, a row at other bits (neither), a hit, a miss.
        expert = torch.stack([held[0], free[0], free[0], held[-1], free[-1]])
        is_hit = torch.tensor([True, False, False, True, False])
        is_miss = torch.tensor([False, True, False, False, True])
        slot, missed, used = torch.where(is_hit, table[expert], -1), torch.where(is_miss, expert, -1), is_hit | is_miss
        got = layers._gather(layer, bits, slot, missed)
        blobs = torch.where(used[:, None], layers.host_rows[layer, bits][expert], 0)
        want, old = stack_views(blobs, store.layout(layer, bits)), _old_gather(layers, layer, bits, slot, missed)
        for name, part in got.items():
            assert torch.equal(part, want[name]) and torch.equal(part[used], old[name][used])
        checked += 1
    assert checked


@pytest.mark.parametrize("arch", ["gpt_oss", "cohere2_moe", "gemma4_text"])
def test_a_sliding_window_model_decodes_past_its_window_through_one_program(tmp_path, arch):
    """transformers' static sliding-window layer keeps its fill as a Python int, which a compiled step
    freezes: a captured program would attend every token as at the position it was captured at. The
    step keeps such layers whole (`whole_windows`), compiles once, and decodes past the window (16
    here) transformers' own greedy tokens; a step that would compile again is refused at build."""
    ckpt = save_tiny(arch, tmp_path / arch)
    new = 24  # 8 prompt tokens + 24 > the window of 16
    ref = load_reference(ckpt, experts_impl="batched_mm")
    want = ref.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=new, min_new_tokens=new,
                        do_sample=False)[0, IDS.shape[1]:].tolist()
    lm = load_model(ckpt)
    engine, _ = build_engine(lm, HostStore.from_experts(lm.experts, torch.float32), "resident", budget="100%",
                             captured=True, max_tokens=40)
    program = DecodeProgram(engine, max_tokens=40, backend="eager")
    assert not any(getattr(layer, "is_sliding", False) for layer in program.cache.layers)
    with torch.compiler.set_stance("fail_on_recompile"):  # one program for every position
        assert program.generate(IDS, new) == want


def test_dymoe_heavy_hitters_read_the_prompts_own_keys_over_the_static_cache(tiny_ckpt, quantized, monkeypatch):
    """The captured path prefills over transformers' StaticCache, whose attention probabilities run
    over every slot of the cache: eq. 1's s_i must still be one per prompt token, or DyMoE's eq. 2
    falls back to the plain token load. Both paths rank the prompt's critical experts alike."""
    from moetool.policies import dymoe

    seen = []
    original = dymoe.prefill_importance

    def spy(idx, s, num_experts, hh_ratio):
        seen.append((idx.shape[0], None if s is None else s.numel()))
        return original(idx, s, num_experts, hh_ratio)

    monkeypatch.setattr(dymoe, "prefill_importance", spy)
    lm = load_bundle_model(quantized("qwen2_moe"))
    store = HostStore.from_bundle(lm.bundle, torch.float32)
    engine, _, program = _program(lm, store, "dymoe", {"config": "4/0"}, "100%")
    program.generate(IDS, 1)
    assert seen and all(s == T for T, s in seen), seen  # [T] scores: eq. 2 ran, not its fallback
    captured = engine.stats.summary()
    host, _ = build_engine(load_bundle_model(quantized("qwen2_moe")), store, "dymoe", settings={"config": "4/0"},
                           budget="100%", max_tokens=32)
    seen.clear()
    host.lm.model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=1, do_sample=False)
    assert seen and all(s == T for T, s in seen)
    assert host.stats.summary()["skips"] == captured["skips"] and host.stats.summary()["precision_mix"] == captured["precision_mix"]


def test_a_precision_held_whole_for_the_engines_life_is_never_pinned(tiny_ckpt):
    """`resident` pinned every expert in host memory for the captured step, which never reads them:
    on a host with less memory than the experts the fastest captured policy fell back. A lifelong
    precision's mirror is a view (nothing pinned, nothing to fit in --host-budget)."""
    from moetool.engine.mirror import host_mirrors

    lm = load_model(tiny_ckpt("qwen2_moe"))
    store = HostStore.from_experts(lm.experts, torch.float32)
    cuda = torch.device("cuda")  # planned for, not touched: nothing is pinned
    refused = host_mirrors(lm, store, (16,), cuda, host_budget=1)
    assert isinstance(refused, str) and "exceeds --host-budget" in refused
    mirrors = host_mirrors(lm, store, (16,), cuda, host_budget=1, lifelong=(16,))
    assert not isinstance(mirrors, str) and not mirrors.pinned and mirrors.nbytes == 0
    g = lm.geometry.layers[0]
    assert torch.equal(mirrors.rows(g.index, 16)[1], store.host(g.index, 1, 16)[:store.layout(g.index, 16).nbytes])


def test_without_host_tiers_a_copy_reads_a_pinned_copy_made_elsewhere(tiny_ckpt):
    """A captured engine has no host tiers: its prefill and fills copied from the mapped bundle
    (pageable: a blocking copy on CUDA) while the step's mirrors held the same bytes page-locked."""
    lm = load_model(tiny_ckpt("qwen2_moe"))
    store = HostStore.from_experts(lm.experts, torch.float32)
    g = lm.geometry.layers[0]
    plain, _ = store.source(g.index, 1, 16)
    copy = plain.clone()
    store.pinned_elsewhere = lambda layer, e, b: copy if (layer, e, b) == (g.index, 1, 16) else None
    assert store.source(g.index, 1, 16)[0] is copy
    assert torch.equal(store.source(g.index, 2, 16)[0], store.host(g.index, 2, 16))  # none made: the blob itself


def test_a_host_budget_the_captured_step_does_not_read_is_said(tiny_ckpt):
    """On a CPU the captured step's host mirrors are views (nothing pinned) and a captured engine has no
    host tiers: --host-budget bounds nothing there, so the run says so instead of taking it silently;
    the host path reads it (its tiers hold the experts within it)."""
    from moetool.options import engine_notes
    from moetool.run import RunConfig, run

    common = dict(model=str(tiny_ckpt("qwen2_moe")), policy="lru", budget="25%", prompts=("hello",),
                  max_new_tokens=3, host_budget="64MiB")
    captured = run(RunConfig(**common, decode="captured"))
    assert captured.summary["path"] == "captured" and not captured.summary["host_tiers"]
    assert "--host-budget was not read" in captured.summary["host_budget_unread"]
    assert any("--host-budget was not read" in n for n in engine_notes(False, "rtx3090", None, "lru", captured.summary))
    host = run(RunConfig(**common, decode="host"))
    assert host.summary["host_tiers"] and "host_budget_unread" not in host.summary

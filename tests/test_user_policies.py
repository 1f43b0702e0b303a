"""A researcher's own policy, written as `moetool/policies/README.md` says, with the mistakes such code
makes: a plan with a `Where` that is none of the three, an expert past the layer or a precision the
store lacks; an `admit` that evicts an expert the layer is using, or makes no room; an eviction order
that picks outside its candidates. Each was run as something else without a word (where=7 as a skip,
-1 computed uncounted, a shielded victim's slot refilled before the layer read it: other tokens) or
died inside the engine as a moetool bug. Each is now one sentence naming the policy and the hook."""

from __future__ import annotations

import pytest

from moetool.errors import MoetoolError
from moetool.policies import POLICIES
from moetool.policies.base import Fetch, LayerPlan, Policy, Pool, Where, register
from moetool.policies.common import even_quota
from moetool.policies.eviction import EVICTIONS, LRU, register_eviction
from moetool.run import RunConfig, run


class _Planned(Policy):
    """Every routed expert at 16 bits, through the general path (its plan is changed, so it is grouped)."""

    change: tuple[str, int] = ("where", int(Where.GPU))

    def plan(self, view):
        plan = LayerPlan.routed(view, 16)
        field, value = self.change
        getattr(plan, field)[:, 0] = value
        return plan


class _Where7(_Planned):
    change = ("where", 7)


class _WhereNegative(_Planned):
    change = ("where", -1)


class _ExpertPast(_Planned):
    change = ("expert", 64)


class _BitsNotStored(_Planned):
    change = ("bits", 8)


class _ReturnsNone(Policy):
    def plan(self, view):
        return None


class _Narrow(Policy):
    def plan(self, view):
        plan = LayerPlan.routed(view, 16)
        plan.expert = plan.expert[:, :-1].clone()
        return plan


class _FloatIds(Policy):
    def plan(self, view):
        plan = LayerPlan.routed(view, 16)
        plan.expert = plan.expert.float()
        return plan


class _FetchesNowhere(Policy):
    def prefetch(self, view):
        return [Fetch(999, 0, 16)]


class _StepPastTheExperts(Policy):
    """An in-step plan whose substitute is one past the layer's experts (an off-by-one): the captured
    step clamped it to the last expert, ran it and counted a substitution, without a word."""

    def plan_step(self, view):
        from moetool.policies.device import DevicePlan

        plan = DevicePlan.of_router(view, 16)
        expert = plan.expert.clone()
        expert[:, 0] = view.num_experts
        return DevicePlan(expert=expert, bits=plan.bits, weight=plan.weight)


class _Cached(Policy):
    """A per-layer cache of two slots a layer (LRU), whose `admit` the subclasses get wrong."""

    eviction = "lru"

    def pools(self):
        n = 2 * len(self.ctx.moe_layers)
        return [Pool(16, n, quota=even_quota(self.ctx.moe_layers, n), eviction=self.eviction)]


class _EvictsTheShield(_Cached):
    def admit(self, want, residency, shield, demand):
        victims = residency.make_room(want, shield, demand)
        held = [k for k in shield if residency.resident_bits(*k)]
        return [Fetch(*held[0], 16)] if victims and held else victims


class _NoRoom(_Cached):
    def admit(self, want, residency, shield, demand):
        return []  # "cache it" without a victim, whether or not a slot is free


class _Careless(LRU):
    def victim(self, candidates):  # its own order first, forgetting to keep to the candidates
        return next((k for k in self.order if k not in candidates), candidates[0])


class _CarelessCached(_Cached):
    eviction = "careless-lru"


class _TooBig(_Cached):
    def pools(self):
        return [Pool(16, 64, eviction="lru")]


_MINE = {"t-where-7": _Where7, "t-where-neg": _WhereNegative, "t-expert-past": _ExpertPast,
         "t-bits-not-stored": _BitsNotStored, "t-evicts-shield": _EvictsTheShield, "t-no-room": _NoRoom,
         "t-careless": _CarelessCached, "t-too-big": _TooBig, "t-returns-none": _ReturnsNone, "t-narrow": _Narrow,
         "t-float-ids": _FloatIds, "t-fetches-nowhere": _FetchesNowhere, "t-step-past": _StepPastTheExperts}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    for name, cls in _MINE.items():
        if name not in POLICIES:
            register(name)(cls)
    if "careless-lru" not in EVICTIONS:
        register_eviction("careless-lru")(_Careless)


@pytest.mark.parametrize("policy,said", [
    ("t-where-7", "policy 't-where-7' planned where=7 at layer 0 (Where is GPU 0, CPU 1 or SKIP 2)"),
    ("t-where-neg", "policy 't-where-neg' planned where=-1 at layer 0"),
    ("t-expert-past", "policy 't-expert-past' planned expert 64 to run at layer 0, and the layer has experts 0 to 3"),
    ("t-bits-not-stored", "policy 't-bits-not-stored' planned an expert at 8 bits at layer 0, and the store holds 16"),
    ("t-evicts-shield", "an expert the layer is using now (in the shield): a bug in its admit()"),
    ("t-no-room", "policy 't-no-room' admitted"),
    ("t-careless", "eviction order 'careless-lru' chose"),
    ("t-too-big", "the policy's 16-bit pool of 64 slots needs"),
    ("t-returns-none", "policy 't-returns-none' plan() returned NoneType, not a LayerPlan"),
    ("t-narrow", "policy 't-narrow' plan() gave its expert as (22, 1) torch.int64, where the layer's routing is (22, 2)"),
    ("t-float-ids", "policy 't-float-ids' plan() gave its expert as (22, 2) torch.float32"),
    ("t-fetches-nowhere", "policy 't-fetches-nowhere' asked to load expert 0 of layer 999 at 16 bits"),
])
@pytest.mark.parametrize("decode", ["host", "captured"])
def test_a_policy_that_breaks_the_contract_is_named_not_run_as_something_else(tiny_ckpt, policy, said, decode):
    cfg = RunConfig(model=str(tiny_ckpt("qwen2_moe")), policy=policy, budget="50%", decode=decode,
                    prompts=("the cat sat on the mat",), max_new_tokens=6, clock="sim")
    with pytest.raises(MoetoolError) as e:
        run(cfg)
    assert said in str(e.value), str(e.value)


POLICY_FILE = '''
from moetool.policies.base import LayerPlan, Policy, Where, register


@register("t-skip-light")
class SkipLight(Policy):
    """The README's example shape: skip the light slots."""

    def plan(self, view):
        plan = LayerPlan.routed(view, 16)
        plan.where[plan.weight < 0.3] = Where.SKIP
        return plan
'''


def test_a_policy_module_named_in_moetool_policies_answers_to_policy_and_a_shipped_name_is_not_taken(
        tiny_ckpt, tmp_path, monkeypatch):
    """No option, entry point or variable imported a researcher's module: `--policy NAME` said "unknown
    policy" to every command (and to every cell of a sweep on Ray), whatever the README's "works once the
    module is imported". And a subclass of `lru` registered as "lru" ran a lossy rule recorded as the
    lossless baseline."""
    import json

    from typer.testing import CliRunner

    from moetool.cli import app
    from moetool.policies.baselines import LRUCache

    (tmp_path / "skip_light.py").write_text(POLICY_FILE)
    monkeypatch.setenv("MOETOOL_POLICIES", str(tmp_path / "skip_light.py"))
    out = tmp_path / "r.json"
    done = CliRunner().invoke(app, ["run", "--model", str(tiny_ckpt("qwen2_moe")), "--policy", "t-skip-light",
                                    "--max-new-tokens", "3", "--clock", "sim", "--out", str(out)])
    assert done.exit_code == 0, done.output
    assert json.loads(out.read_text())["policy"] == "t-skip-light"
    monkeypatch.setenv("MOETOOL_POLICIES", str(tmp_path / "nowhere.py"))
    done = CliRunner().invoke(app, ["run", "--model", str(tiny_ckpt("qwen2_moe")), "--policy", "t-other"])
    assert done.exit_code == 1 and "MOETOOL_POLICIES names" in done.stderr and "nowhere.py" in done.stderr, done.output
    with pytest.raises(MoetoolError, match="the policy name 'lru' is taken"):
        register("lru")(type("LossyLRU", (LRUCache,), {}))
    assert POLICIES["lru"] is LRUCache
    with pytest.raises(MoetoolError, match="the policy name 'lru' is taken"):  # a shipped class's own name too
        register("lru")(type("LRUCache", (Policy,), {"__module__": LRUCache.__module__}))


def test_a_notebook_cell_that_defines_a_policy_runs_again():
    """A researcher edits the cell that defines their policy and runs it again: the same class, defined
    again where it was, replaces itself (it was "the policy name is taken", until the kernel restarted);
    another class of that name elsewhere is still refused."""
    cell = POLICY_FILE.replace("t-skip-light", "t-cell-policy")
    first, second = {"__name__": "notebook_cell"}, {"__name__": "notebook_cell"}
    try:
        exec(compile(cell, "cell", "exec"), first)
        exec(compile(cell.replace("0.3", "0.2"), "cell", "exec"), second)
        assert POLICIES["t-cell-policy"] is second["SkipLight"] is not first["SkipLight"]
        with pytest.raises(MoetoolError, match="the policy name 't-cell-policy' is taken"):
            exec(compile(cell, "cell", "exec"), {"__name__": "another_module"})
        assert POLICIES["t-cell-policy"] is second["SkipLight"]
    finally:
        POLICIES.pop("t-cell-policy", None)  # other tests list every registered policy


def test_settings_that_differ_in_a_knob_beyond_the_papers_headline_ones_are_told_apart():
    """`report` labelled a setting by a fixed list of the shipped knobs: LRU with eviction=arc and with
    lru, SMoE at window 3 and 16, DyMoE at lam 0.3 and 0.6, and a researcher's own knob were each one
    label, one row of the quality table ("Evals of one setting") and one colour."""
    from moetool.figures import setting_label

    assert setting_label("lru", {"bits": 16, "eviction": "lru"}) == "lru bits=16"
    assert setting_label("lru", {"bits": 16, "eviction": "arc"}) == "lru bits=16 eviction=arc"
    smoe = {"alpha": 0.3, "window": 3, "bits": 16, "eviction": "score", "prefetcher": "smoe", "cpu_assist": True,
            "cpu_rule": "alg2"}
    assert setting_label("smoe", smoe) == "smoe bits=16 alpha=0.3 prefetcher=smoe"
    assert setting_label("smoe", {**smoe, "window": 16}) == "smoe bits=16 alpha=0.3 prefetcher=smoe window=16"
    dymoe = {"r": 0.9, "lam": -1.0, "high_bits": 4, "low_bits": 0, "config": "4/0", "hh_ratio": 0.2, "eviction": "lru",
             "prefetcher": "dymoe", "precisions": {"high": 4, "low": 0}}
    assert setting_label("dymoe", dymoe) == "dymoe config=4/0 r=0.9 prefetcher=dymoe"  # the tiers are config's
    assert setting_label("not-registered-here", {"bits": 16, "tau": 0.1, "precisions": {}}) == \
        "not-registered-here bits=16 tau=0.1"


def test_an_error_raised_in_a_researchers_policy_is_named_as_theirs_not_moetools(tiny_ckpt, tmp_path, monkeypatch):
    """The traceback (which points at their line) was followed by "this is a bug in moetool ... please
    report it"; it is followed by the policy's name and the line now."""
    from typer.testing import CliRunner

    from moetool.cli import app

    source = tmp_path / "raises.py"
    source.write_text("from moetool.policies.base import Policy, register\n\n\n@register('t-raises')\n"
                      "class Raises(Policy):\n    def plan(self, view):\n        return {}['missing']\n")
    monkeypatch.setenv("MOETOOL_POLICIES", str(source))
    done = CliRunner().invoke(app, ["run", "--model", str(tiny_ckpt("qwen2_moe")), "--policy", "t-raises",
                                    "--max-new-tokens", "2", "--decode", "host"])
    assert done.exit_code == 1 and "KeyError: 'missing'" in done.stderr, done.output
    assert done.stderr.strip().splitlines()[-1] == (f"error: the error above was raised in policy 't-raises' ({source}:7), "
                                                    "the policy's own code, not moetool's."), done.stderr


def test_an_in_step_plan_past_the_experts_is_named_not_clamped(tiny_ckpt):
    """The captured step clamps an id into the layer's experts (a skipped slot reads expert 0): an
    off-by-one substitute ran as the last expert, counted as a substitution, with a hit rate of 0. The
    host half reads the step's log one step behind and names it; the host path runs `plan`, which is
    the router's here, so its tokens are plain routing's."""
    cfg = RunConfig(model=str(tiny_ckpt("qwen2_moe")), policy="t-step-past", budget="50%", decode="captured",
                    prompts=("the cat sat on the mat",), max_new_tokens=4, clock="sim")
    with pytest.raises(MoetoolError, match="policy 't-step-past' planned expert 4 to run at layer 0, and the layer has "
                                           r"experts 0 to 3: a bug in its plan_step\(\)"):
        run(cfg)
    import dataclasses

    assert run(dataclasses.replace(cfg, decode="host")).summary["path"] == "host"


def test_a_fit_hook_that_gives_a_value_run_would_refuse_is_refused_when_fitted(tmp_path):
    """`fit` wrote a researcher's fitted knob as its hook gave it ("fast", for a float knob), and every
    `run --fit` over the artifact then refused it: the fit is refused now, naming the policy."""
    from dataclasses import dataclass

    from helpers import synthetic_profile

    from moetool.fit import FitConfig, fit
    from moetool.policies.base import Params as BaseParams
    from moetool.policies.stages import Fitted

    class BadFit(Policy):
        @dataclass(frozen=True)
        class Params(BaseParams):
            tau: float = 0.1

        @classmethod
        def fit(cls, inputs):
            return Fitted(knobs={"tau": "fast"})

    if "t-bad-fit" not in POLICIES:
        register("t-bad-fit")(BadFit)
    try:
        with pytest.raises(MoetoolError, match="policy 't-bad-fit' fit\\(\\) gave a knob `run --fit` would refuse: knob "
                                               "'tau' of policy 't-bad-fit' takes a float"):
            fit(FitConfig(profile=synthetic_profile().save(tmp_path / "s.profile.json")))
    finally:
        POLICIES.pop("t-bad-fit")  # its fit would be asked by every later fit in this process

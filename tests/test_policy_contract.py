"""A new policy is one small file: the example of policies/README.md, executed, registered, run, fitted and reported."""

import re
from pathlib import Path

import pytest
import torch

import moetool.policies
from moetool.engine import build_engine
from moetool.engine.store import HostStore
from moetool.model import load_model, load_reference
from moetool.policies.base import POLICIES
from helpers import synthetic_profile

README = Path(moetool.policies.__file__).parent / "README.md"
IDS = torch.tensor([[5, 17, 33, 2, 9, 100, 45, 7]])


@pytest.fixture(scope="module")
def skip_light():
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    assert len(code.strip().splitlines()) < 60  # the whole policy, imports included
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)  # registers "skip-light"
    yield POLICIES["skip-light"]
    POLICIES.pop("skip-light")


def _run(path, tau, budget="50%"):
    lm = load_model(path)
    engine, split = build_engine(lm, HostStore.from_experts(lm.experts, torch.float32), "skip-light",
                                settings={"tau": str(tau)}, budget=budget, clock="sim")
    out = lm.model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=8, do_sample=False)
    return out, engine, split


def test_the_readme_policy_registers_and_runs_exactly_at_tau_0(tiny_ckpt, skip_light):
    path = tiny_ckpt("qwen2_moe")
    ref = load_reference(path).generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=8, do_sample=False)
    out, engine, split = _run(path, tau=0.0)
    assert torch.equal(out, ref)  # nothing skipped: the engine's plan is the model's routing
    s = engine.stats.summary()
    assert s["skips"] == 0 and 0 < s["hit_rate"] < 1  # its per-layer LRU pool reuses experts across tokens
    [pool] = engine.residency.pools.values()
    assert pool.spec.eviction == "lru" and sum(pool.spec.quota.values()) == pool.spec.slots
    assert s["peak_device_bytes"] <= split.total_bytes


def test_the_readme_policy_skips_light_slots(tiny_ckpt, skip_light):
    path = tiny_ckpt("qwen2_moe")
    _, engine, _ = _run(path, tau=1.01)  # every routing weight is below 1.01: nothing runs
    lm = engine.lm
    slots = (IDS.shape[1] + 7) * lm.geometry.layers[0].top_k * len(lm.geometry.layers)  # 8 prompt + 7 decode tokens
    s = engine.stats.summary()
    assert s["skips"] == slots and s["hit_rate"] is None and s["bytes_h2d"] == 0
    _, engine, _ = _run(path, tau=0.6)  # top-2 weights: at most one slot of a token is >= 0.6
    s = engine.stats.summary()
    assert slots // 2 <= s["skips"] < slots
    assert isinstance(engine.policy, skip_light) and engine.policy.params.tau == 0.6


def test_the_readme_policy_is_fitted_run_and_reported_from_its_own_file(tiny_ckpt, skip_light, tmp_path):
    """profile -> fit -> run -> report with nothing registered but the README's block: the fit stage
    finds its `fit`, the run takes the fitted tau, the report places its table."""
    from moetool.fit_artifact import Fit
    from moetool.fit import FitConfig, fit
    from moetool.profile import ProfileConfig, profile
    from moetool.report import report
    from moetool.run import RunConfig, run

    path = str(tiny_ckpt("qwen2_moe"))
    prof = profile(ProfileConfig(model=path, data=("heldout",), seqs_per_data=1, seq_len=8, decode_tokens=2,
                                 what=("routing",)))
    prof_path = prof.save(tmp_path / "art" / "t.profile.json")
    fitted = fit(FitConfig(profile=prof_path))
    r = prof.routing
    tau = sum(layer.mean_sorted_score[r.top_k - 1] for layer in r.layers) / len(r.layers) / 2
    assert 0 < tau < 0.5 and fitted.params["skip-light"] == {"tau": round(tau, 4)}
    kth = [layer.mean_sorted_score[r.top_k - 1] for layer in r.layers]
    assert fitted.evidence["skip-light"]["tau"]["kth_score"] == kth
    fit_path = fitted.save(tmp_path / "art" / "t.fit.json")
    assert Fit.load(fit_path).params["skip-light"]["tau"] == round(tau, 4)
    without = fit(FitConfig(profile=synthetic_profile().save(tmp_path / "other" / "s.profile.json")))
    assert "skip-light" not in without.params and "routing" in without.evidence["skipped"]["skip-light.tau"]  # and why

    done = run(RunConfig(model=path, policy="skip-light", fit=fit_path, budget="50%", clock="sim",
                         prompts=("The capital of France is",), max_new_tokens=4))
    assert done.params["tau"] == round(tau, 4)  # the fitted knob, as the run recorded it
    done.save(tmp_path / "art" / "skip.run.json")
    md = (report([tmp_path / "art"], tmp_path / "rep")[-1]).read_text()
    section = md[md.index("## skip-light"):]
    assert "| skip.run.json | " + f"{round(tau, 4):.5g} | {done.summary['skips']} |" in section
    assert "| skip-light | tau |" in md  # the general fit table lists its knob beside the papers'


"""A new policy is one small file: the example of policies/README.md, executed, registered and run."""

import re
from pathlib import Path

import pytest
import torch

import moetool.policies
from moetool.engine import build_engine
from moetool.engine.store import HostStore
from moetool.model import load_model, load_reference
from moetool.policies.base import POLICIES

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
    engine, plan = build_engine(lm, HostStore.from_experts(lm.experts, torch.float32), "skip-light",
                                settings={"tau": str(tau)}, budget=budget, clock="sim")
    out = lm.model.generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=8, do_sample=False)
    return out, engine, plan


def test_the_readme_policy_registers_and_runs_exactly_at_tau_0(tiny_ckpt, skip_light):
    path = tiny_ckpt("qwen2_moe")
    ref = load_reference(path).generate(IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=8, do_sample=False)
    out, engine, plan = _run(path, tau=0.0)
    assert torch.equal(out, ref)  # nothing skipped: the engine's plan is the model's routing
    s = engine.stats.summary()
    assert s["skips"] == 0 and 0 < s["hit_rate"] < 1  # its per-layer LRU pool reuses experts across tokens
    [pool] = engine.residency.pools.values()
    assert pool.spec.eviction == "lru" and sum(pool.spec.quota.values()) == pool.spec.slots
    assert s["peak_device_bytes"] <= plan.total_bytes


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

"""The engine on the demo model (a real pretrained MoE): lossless policies and the sim clock."""

import pytest
import torch

from moetool.engine import build_engine
from moetool.engine.store import HostStore
from moetool.model import load_model, load_reference
from moetool.source import resolve_source

pytestmark = pytest.mark.slow

PROMPT = "The king said to his daughter that"


@pytest.fixture(scope="module")
def demo():
    """The demo model and, per transformers experts kernel, its greedy tokens and their logits."""
    path = resolve_source("demo")
    tok = load_model(path).tokenizer
    ids = tok(PROMPT, return_tensors="pt").input_ids
    cache = {}

    def reference(impl):
        if impl not in cache:
            ref = load_reference(path, experts_impl=impl)
            want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
            with torch.no_grad():
                cache[impl] = want, ref(want).logits
        return cache[impl]
    return path, ids, reference


@pytest.mark.parametrize("policy,budget,knobs,impl", [
    ("lod", "10%", {}, "grouped_mm"), ("lru", "25%", {}, "grouped_mm"), ("eap", "50%", {}, "grouped_mm"),
    ("resident", "100%", {}, "grouped_mm"),
    ("fate", "25%", {"cache_bits": "16", "low_bits": "16"}, "grouped_mm"),  # Fate's mechanisms without its quantization
    ("lru", "25%", {}, "eager"), ("resident", "100%", {}, "eager"),
])
def test_lossless_policies_match_transformers_on_the_demo_model(demo, policy, budget, knobs, impl):
    """Same tokens and bit-identical logits against the transformers kernel each path matches: top-16
    routing with misses arriving after hits."""
    path, ids, reference = demo
    want, logits = reference(impl)
    lm = load_model(path)
    engine, plan = build_engine(lm, HostStore.from_experts(lm.experts, torch.float32), policy, settings=knobs,
                                budget=budget, clock="sim", experts_impl=impl)
    got = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)
    with torch.no_grad():
        assert torch.equal(lm.model(want).logits, logits)
    assert engine.stats.summary()["peak_device_bytes"] <= plan.total_bytes


def test_sim_clock_lod_is_slower_than_lru_at_a_quarter_budget(demo):
    path, ids, _ = demo
    tpot, hit = {}, {}
    for policy in ("lod", "lru"):
        lm = load_model(path)
        engine, _ = build_engine(lm, HostStore.from_experts(lm.experts, torch.float32), policy, budget="25%",
                                 clock="sim", hw="rtx3090")
        lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        s = engine.stats.summary()
        tpot[policy], hit[policy] = s["tpot_s"]["mean"], s["hit_rate"]
    assert hit["lod"] == 0.0 and hit["lru"] > 0.0
    assert tpot["lod"] > tpot["lru"]

"""The engine on the demo model (a real pretrained MoE): lossless policies and the sim clock."""

import pytest
import torch

from moetool.engine import build_engine
from moetool.engine.store import HostStore
from moetool.model import load_model, load_reference, resolve_source

pytestmark = pytest.mark.slow

PROMPT = "The king said to his daughter that"


@pytest.fixture(scope="module")
def demo():
    path = resolve_source("demo")
    ref = load_reference(path)
    tok = load_model(path).tokenizer
    ids = tok(PROMPT, return_tensors="pt").input_ids
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    with torch.no_grad():
        logits = ref(want).logits
    return path, ids, want, logits


@pytest.mark.parametrize("policy,budget,knobs", [
    ("lod", "10%", {}), ("lru", "25%", {}), ("eap", "50%", {}), ("resident", "100%", {}),
    ("fate", "25%", {"cache_bits": "16", "low_bits": "16"}),  # Fate's mechanisms without its quantization
])
def test_lossless_policies_match_transformers_on_the_demo_model(demo, policy, budget, knobs):
    """Same tokens and bit-identical logits: top-16 routing with misses arriving after hits."""
    path, ids, want, logits = demo
    lm = load_model(path)
    engine, plan = build_engine(lm, HostStore.from_experts(lm.experts, torch.float32), policy, settings=knobs,
                                budget=budget, clock="sim")
    got = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)
    with torch.no_grad():
        assert torch.equal(lm.model(want).logits, logits)
    assert engine.stats.summary()["peak_device_bytes"] <= plan.total_bytes


def test_sim_clock_lod_is_slower_than_lru_at_a_quarter_budget(demo):
    path, ids, _, _ = demo
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

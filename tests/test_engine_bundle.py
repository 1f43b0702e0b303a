"""The engine over a quantized bundle: static INT4 equals a model built from the dequantized weights."""

import pytest
import torch

from moetool.model import load_model
from moetool.quant.bundle import Bundle
from moetool.run import RunConfig, prepare, run
from tiny import DequantProvider

IDS = torch.tensor([[5, 17, 33, 2, 9, 100, 45, 7]])


@pytest.mark.parametrize("bits,budget,policy", [(4, "100%", "static"), (2, "100%", "static"), (16, "30%", "lru")])
def test_engine_over_bundle_matches_dequantized_model(tiny_ckpt, bundle, bits, budget, policy):
    path = str(tiny_ckpt("qwen2_moe"))
    ready = prepare(RunConfig(model=path, bundle=bundle, policy=policy, settings={"bits": str(bits)}, budget=budget))
    opened = Bundle.open(bundle, model=ready.lm.fingerprint)
    ref = load_model(path, provider=DequantProvider(opened, bits))
    with torch.no_grad():
        got, want = ready.lm.model(IDS).logits, ref.model(IDS).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_quantized_bits_change_the_output_and_move_fewer_bytes(tiny_ckpt, bundle):
    path = str(tiny_ckpt("qwen2_moe"))
    runs = {b: run(RunConfig(model=path, bundle=bundle, policy="lod", settings={"bits": str(b)}, budget="0%",
                             clock="sim", prompts=("abcdefgh",), max_new_tokens=6)) for b in (16, 4, 2)}
    assert runs[2].bytes_h2d < runs[4].bytes_h2d < runs[16].bytes_h2d
    assert runs[2].tpot_s["mean"] < runs[16].tpot_s["mean"]  # fewer bytes over the simulated link


def test_bundle_of_another_model_is_refused(tiny_ckpt, bundle):
    from moetool.errors import MoetoolError

    with pytest.raises(MoetoolError, match="was made for model"):
        prepare(RunConfig(model=str(tiny_ckpt("mixtral")), bundle=bundle, policy="lru"))

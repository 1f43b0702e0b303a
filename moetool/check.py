"""`moetool check`: moetool's experts module against plain transformers, in fp32 on CPU.

Both models see the same prompt; hooks on every experts module record the routing (top-k index)
and the experts' output, so a disagreement is located to a layer.

    report = check_model("path/to/ckpt")
    report.passed, report.max_abs_diff
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from torch import nn

from moetool.artifacts import CheckReport, LayerCheck
from moetool.errors import MoetoolError
from moetool.inference import vocab_size
from moetool.model import find_experts_modules, load_model, load_reference
from moetool.source import resolve_source
from moetool.tokenizer import encode

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. Mixture-of-Experts models route each token to"


def _record(experts: dict[str, nn.Module], log: dict[str, dict[str, torch.Tensor]]) -> list:
    """Hooks that keep each experts module's routing and output of the last forward."""

    def hook(name: str) -> Callable:
        def fn(module, args, output):
            log[name] = {"index": args[1].detach().clone(), "out": output.detach().clone()}
        return fn

    return [m.register_forward_hook(hook(name)) for name, m in experts.items()]


@torch.no_grad()
def check_model(source: str | Path, prompt: str = DEFAULT_PROMPT, tolerance: float = 1e-5) -> CheckReport:
    """Run `prompt` through plain transformers and through moetool's experts module; compare."""
    src = resolve_source(source)
    ref = load_reference(src, dtype=torch.float32)
    ours = load_model(src, device="cpu", dtype=torch.float32)
    ids = encode(ours.tokenizer, prompt, vocab_size(ours.model))[None]  # [1, T]

    ref_log: dict[str, dict[str, torch.Tensor]] = {}
    our_log: dict[str, dict[str, torch.Tensor]] = {}
    hooks = _record(find_experts_modules(ref), ref_log)
    hooks += _record({f"{g.path}.experts": ours.model.get_submodule(f"{g.path}.experts")
                      for g in ours.geometry.layers}, our_log)
    try:
        try:
            ref_logits = ref(ids).logits.float()
        except Exception as e:  # noqa: BLE001 - transformers' own model, before any moetool code runs
            # Nothing of moetool's is in this forward: the checkpoint (its config.json) or this
            # transformers release is at fault, and there is nothing to compare against.
            cause = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise MoetoolError(f"plain transformers {transformers.__version__} cannot run {source} "
                               f"({type(e).__name__}: {cause}); check its config.json") from e
        if ref_logits.isnan().any() or ref_logits.isposinf().any():  # NaN != NaN: "FAIL, nan" would blame moetool
            raise MoetoolError(f"plain transformers {transformers.__version__} computes NaN or infinite logits for "
                               f"{source} on this prompt, so there is nothing to compare; its config.json (e.g. "
                               "rms_norm_eps, rope_theta) or its weights make it so.")
        our_logits = ours.model(ids).logits.float()
    finally:
        for h in hooks:
            h.remove()

    layers = []
    for g in ours.geometry.layers:
        name = f"{g.path}.experts"
        a, b = ref_log[name], our_log[name]
        agree = (a["index"] == b["index"]).float().mean().item()
        layers.append(LayerCheck(layer=g.index, routing_agreement=agree,
                                 max_abs_diff=(a["out"] - b["out"]).abs().max().item()))
    diff = (ref_logits - our_logits).abs().max().item()
    passed = diff <= tolerance and all(lc.routing_agreement == 1.0 for lc in layers)
    return CheckReport(model=ours.fingerprint, inputs={}, prompt=prompt, passed=passed, max_abs_diff=diff,
                       layers=tuple(layers), tolerance=tolerance)

"""Calibration for GPTQ and calibrated HQQ: the token sequences, and one layer-sequential forward
that hands each MoE layer its own inputs when the hidden states reach it.

    ids = calibration_ids(lm, cfg)                     # [n_seq, seq_len]
    calibrate_layer_by_layer(lm, ids, {3, 4}, lambda layer, inputs: ...)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from moetool.errors import MoetoolError
from moetool.inference import context_length, nonfinite_sentence, vocab_size
from moetool.model import LoadedModel, MoeLayer
from moetool.tokenizer import encode, unknown_tokens


class CalibrationSettings(Protocol):
    """What calibration reads of a `QuantizeConfig`."""

    calib_text: Path | None  # UTF-8 text; None: moetool's shipped training text
    calib_tokens: int
    calib_seq_len: int
    seed: int  # random ids for a tokenizer-less checkpoint


def calibration_length(lm: LoadedModel, cfg: CalibrationSettings) -> int:
    """Tokens a calibration sequence holds: `calib_seq_len`, within the model's positions. Past them HQQ's
    output error and GPTQ's Hessians would come from hidden states the model never computes in use (as
    `eval ppl` refuses windows longer than the model's context)."""
    return min(cfg.calib_seq_len, context_length(lm.model) or cfg.calib_seq_len)


def calibration_ids(lm: LoadedModel, cfg: CalibrationSettings) -> torch.Tensor:
    """[n_seq, seq_len] token ids from the calibration text (a file, else moetool's shipped training
    text); seeded random ids for tokenizer-less test checkpoints."""
    seq_len = cfg.calib_seq_len
    n_seq = max(1, cfg.calib_tokens // seq_len)
    if lm.tokenizer is None:
        if cfg.calib_text is not None:
            raise MoetoolError(f"{lm.fingerprint.source} has no tokenizer to read calibration text with.")
        generator = torch.Generator().manual_seed(cfg.seed)
        return torch.randint(0, vocab_size(lm.model), (n_seq, seq_len), generator=generator)
    if cfg.calib_text is not None:
        from moetool.datasets import read_text_file

        text, where = read_text_file(Path(cfg.calib_text), "--calib-text", "calibration reads"), str(cfg.calib_text)
    else:
        from moetool.datasets import train_text  # lazy: reads the packaged text only when calibrating

        text, where = train_text(), "moetool's training text"
    # Tokenize a generous prefix first: the shipped text is ~4.9 MB and a few thousand tokens suffice.
    # `encode` takes a long text a piece at a time, to one call's ids (a --calib-text may be 256 MiB).
    prefix = text[:16 * n_seq * seq_len]
    ids = encode(lm.tokenizer, prefix, vocab_size(lm.model), unknown_ok=True)
    unknown, content = unknown_tokens(ids, lm.tokenizer, prefix)
    if len(ids) < n_seq * seq_len or (content and unknown == content):  # short, or a head the vocabulary lacks
        ids = encode(lm.tokenizer, text, vocab_size(lm.model), what=f"--calib-text {where}" if cfg.calib_text else where)
    if len(ids) < seq_len:
        raise MoetoolError(f"{where} holds {len(ids)} token{'' if len(ids) == 1 else 's'}, fewer than one "
                           f"calibration sequence ({seq_len} tokens); give more text.")
    n_seq = min(n_seq, len(ids) // seq_len)
    return ids[:n_seq * seq_len].view(n_seq, seq_len)


def calibrate_layer_by_layer(lm: LoadedModel, ids: torch.Tensor, layers: set[int],
                             on_layer: Callable[[MoeLayer, tuple[torch.Tensor, torch.Tensor]], None]) -> None:
    """One batched forward over the calibration sequences; when the hidden states reach a MoE layer
    in `layers`, `on_layer(layer, (hidden [T, H], top_k_index [T, k]))` quantizes it there.

    The forward itself advances through one decoder layer at a time with the layer's reference
    experts (read from the checkpoint when reached, dropped after), so calibration needs one
    layer's experts in memory, as GPTQ tools' layer-sequential loop does.
    """
    hooks = []
    for layer in lm.geometry.layers:
        if layer.index not in layers:
            continue

        def grab(module, args, kwargs, layer=layer):  # noqa: ANN001 - torch hook signature
            hidden = args[0] if args else kwargs["hidden_states"]  # [T, H]
            top_k = args[1] if len(args) > 1 else kwargs["top_k_index"]  # [T, k]
            if not bool(hidden.isfinite().all()):  # an error measured (or a GPTQ Hessian) on NaN is NaN
                raise MoetoolError(nonfinite_sentence(f"in the hidden states reaching MoE layer {layer.index} on the "
                                                      "calibration text", lm.fingerprint.source, "numbers"))
            on_layer(layer, (hidden.detach().float().cpu(), top_k.detach().cpu()))

        module = lm.model.get_submodule(layer.path).experts
        hooks.append(module.register_forward_pre_hook(grab, with_kwargs=True))
    try:
        with torch.no_grad():  # not inference_mode: the quantizers run inside the hooks
            lm.model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()

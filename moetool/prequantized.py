"""Checkpoints released only in a low-bit format, read as the numbers they stand for: block-scaled FP8
(DeepSeek-V3, MiniMax-M2, the Qwen3 and GLM FP8 releases) and MXFP4 (gpt-oss). The experts reach
`moetool quantize` (and a run without a bundle) dequantized, as the loader streams them; a bundle
holds the dequantized model, and `check` compares with transformers running the same numbers.

- FP8: moetool dequantizes each weight itself, by DeepSeek-V3's rule (its `weight_dequant`): a scale
  per `weight_block_size` block of a ceil-divided grid, so a weight the block does not divide (V3's
  576-row `kv_a_proj_with_mqa`) is read right. transformers' own FP8 dequantize (5.24) takes the
  block from the scale grid (rows // grid rows) and so refuses or, where the grid divides the rows
  (192 rows, 2 blocks of 128), scales the wrong rows.
- MXFP4: transformers' quantizer dequantizes on load (blocks of 32 along the input, always whole).

Other pre-quantized formats (GPTQ, AWQ, bitsandbytes, ...) are refused by `source.load_config`.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch

from moetool.errors import MoetoolError

DEQUANTIZED = ("fp8", "mxfp4")  # quant_method values read dequantized
# An FP8 weight `X.weight`'s scale, by release: `X.weight_scale_inv` (DeepSeek, Qwen, GLM, MiniMax),
# `X.scale` (DeepSeek-V4-Flash), `X.qscale_weight` (Mistral Large 4), `X.weight_scale` (per tensor).
_SCALES = ("weight_scale_inv", "scale", "qscale_weight", "weight_scale")
_ACTIVATION_SCALES = ("input_scale", "activation_scale", "qscale_act")  # static activation quantization: unused


def quant_method(config: Any) -> str | None:
    """The config's `quantization_config.quant_method` ("" for one without a method), None if unquantized."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return str(getattr(method, "value", method) or "")


def _field(config: Any, name: str) -> Any:
    quant = config.quantization_config
    return quant.get(name) if isinstance(quant, dict) else getattr(quant, name, None)


def check(config: Any, source: str) -> None:
    """One sentence for an FP8 / MXFP4 quantization_config moetool cannot read as written."""
    method = quant_method(config)
    if method == "fp8":
        block = _field(config, "weight_block_size")
        if block is not None and not (isinstance(block, (list, tuple)) and len(block) == 2
                                      and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise MoetoolError(f"the quantization_config of '{source}' gives weight_block_size = {block!r}; an FP8 "
                               "checkpoint's blocks are two positive integers (e.g. [128, 128]).")
    elif method == "mxfp4":
        dequantizer(config)


def without_quantization(config: Any) -> Any:
    """A copy of `config` for the model once dequantized (what a bundle's `model/` holds)."""
    config = copy.deepcopy(config)
    if quant_method(config) is not None:
        del config.quantization_config
    return config


# -- FP8 ---------------------------------------------------------------------------------------------


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """FP8 codes [..., rows, cols] times their scales, in float32: one scale per block x block tile of
    a ceil-divided grid ([..., ceil(rows / b0), ceil(cols / b1)]), or one for the whole tensor.
    ue8m0 scales stored as bytes are powers of two, 2^(byte - 127)."""
    s = (scale.float() - 127.0).exp2() if scale.dtype == torch.uint8 else scale.float()
    w = codes.float()
    if s.numel() == 1:
        return w * s.reshape(())
    if block is None:
        raise ValueError(f"its scales are a {tuple(s.shape)} grid, but the quantization_config gives no weight_block_size")
    rows, cols = w.shape[-2:]
    if s.shape[-2:] != (math.ceil(rows / block[0]), math.ceil(cols / block[1])):
        raise ValueError(f"scale grid {tuple(s.shape[-2:])} is not that of a {rows} x {cols} weight in "
                         f"{block[0]} x {block[1]} blocks")
    s = s.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return w * s


class Fp8Weight:
    """A lazily read FP8 weight with its scales: what the loader reads is the dequantized tensor
    (a slice on the first dimension reads only those experts of a fused one)."""

    def __init__(self, key: str, codes: Any, scale: Any, block: tuple[int, int] | None):
        self.key, self.codes, self.scale, self.block = key, codes, scale, block

    def get_dtype(self) -> str:
        return "F8_SCALED"  # an FP8 code times a float32 scale: `quant.notes` says a bundle rounds it

    def __getitem__(self, index: Any) -> torch.Tensor:
        lead = isinstance(index, slice) and len(self.codes.get_shape()) > 2 and len(self.scale.get_shape()) > 2
        codes, scale = (self.codes[index], self.scale[index]) if lead else (self.codes[:], self.scale[:])
        try:
            w = dequantize_fp8(codes, scale, self.block)
        except ValueError as e:
            raise MoetoolError(f"the FP8 weight {self.key} cannot be dequantized: {e}.") from None
        return w if lead else w[index]


def read_fp8(entries: dict[str, tuple[Any, str, Path]], config: Any, directory: Path) -> dict[str, tuple[Any, str, Path]]:
    """`entries` (key -> (lazy slice, safetensors dtype, shard)) with each FP8 weight and its scale
    made one dequantized `Fp8Weight` ("F32"), and activation scales dropped. An FP8 weight without a
    scale is refused: transformers would load its raw codes as the weights, silently."""
    block = _field(config, "weight_block_size")
    block = tuple(block) if block is not None else None
    used = set()  # the scales an FP8 weight takes; any other is the model's own (a norm's `scale`) or unused
    out = {}
    for key, (tensor, dtype, path) in entries.items():
        if key.rpartition(".")[2] in _ACTIVATION_SCALES:
            continue
        if dtype.startswith("F8") and key.endswith(".weight"):
            prefix = key[:-len("weight")]
            scale = next((prefix + s for s in _SCALES if prefix + s in entries), None)
            if scale is None:
                raise MoetoolError(f"the checkpoint in {directory} stores {key} in FP8 without its scales, so its values "
                                   "are unknown: it is incomplete or damaged.")
            used.add(scale)
            tensor, dtype = Fp8Weight(key, tensor, entries[scale][0], block), "F32"
        out[key] = (tensor, dtype, path)
    return {k: v for k, v in out.items() if k not in used}


# -- MXFP4 -------------------------------------------------------------------------------------------


def dequantizer(config: Any) -> Any | None:
    """transformers' quantizer that dequantizes an MXFP4 checkpoint's experts as they load; None for
    any other checkpoint (FP8 is dequantized by `read_fp8`)."""
    if quant_method(config) != "mxfp4":
        return None
    from transformers.quantizers import AutoHfQuantizer
    from transformers.quantizers.auto import AutoQuantizationConfig

    quant = config.quantization_config
    fields = dict(quant) if isinstance(quant, dict) else quant.to_dict()
    fields["dequantize"] = True
    try:
        return AutoHfQuantizer.from_config(AutoQuantizationConfig.from_dict(fields), pre_quantized=True)
    except Exception as e:  # noqa: BLE001 - a config.json's quantization_config is user input
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MoetoolError(f"the quantization_config of this MXFP4 checkpoint is not one transformers reads: "
                           f"{reason}.") from None


def unscaled_blocks(stored: dict[str, str]) -> str | None:
    """The first MXFP4 `*_blocks` tensor stored without its `*_scales`, or None."""
    return next((k for k in stored if k.endswith("_blocks") and k[:-len("blocks")] + "scales" not in stored), None)

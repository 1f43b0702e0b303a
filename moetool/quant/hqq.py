"""HQQ backend: calibration-free half-quadratic quantization, done by hqq's own `Quantizer`.

    q = quantize_expert(weights, Bits.INT4, group_size=64)   # {"gate_up": QTensor, "down": QTensor}

hqq's optimizer refines each group's zero point by a proximal solver (lp_norm 0.7, 20 iterations
with early stop) in fp32 on the CPU and fp16 on CUDA; `device` picks where it runs. `optimize=False`
keeps hqq's grid without the solver (round to nearest): an order of magnitude faster on a CPU, for
when a model's size matters more than the last bit of accuracy.
"""

from __future__ import annotations

import torch
from hqq.core.quantize import Quantizer

from moetool.model import ExpertWeights
from moetool.quant.format import PROJECTIONS, Bits, QTensor


def quantize_weight(weight: torch.Tensor, bits: Bits | int, group_size: int = 64, axis: int = 1,
                    device: str | torch.device = "cpu", optimize: bool = True) -> QTensor:
    """One weight matrix [out, in] on hqq's affine grid (codes unpacked, scale not inverted)."""
    w = weight.detach().to(device=device, dtype=torch.float32)  # [out, in]
    # bitpack=False keeps the codes as floats in hqq's grouped shape; packing is the format's job.
    codes, meta = Quantizer.quantize(w, nbits=int(bits), channel_wise=True, group_size=group_size, optimize=optimize,
                                     round_zero=False, axis=axis, bitpack=False, compute_dtype=torch.float32,
                                     device=str(device))
    return QTensor(codes=codes.to(device="cpu", dtype=torch.uint8),  # [G, gs] or [gs, G]
                   scale=meta["scale"].to(device="cpu", dtype=torch.float32),  # [G, 1] or [1, G], already 1/inv
                   zero=meta["zero"].to(device="cpu", dtype=torch.float32))


def quantize_expert(weights: ExpertWeights, bits: Bits | int, group_size: int = 64, axis: int = 1,
                    device: str | torch.device = "cpu", optimize: bool = True) -> dict[str, QTensor]:
    return {name: quantize_weight(getattr(weights, name), bits, group_size, axis, device, optimize)
            for name in PROJECTIONS}

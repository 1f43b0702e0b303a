"""GPTQ backend: Hessian-aware rounding calibrated on the tokens each expert actually receives.

    q = quantize_expert(weights, Bits.INT4, group_size=64, inputs=x, act=act)   # x: [n, H] routed tokens

The column-by-column solver is gptqmodel's own `GPTQ` (optional extra `moetool[gptq]`), run on one
`nn.Linear` at a time, asymmetric, natural column order (no act-order, so groups stay consecutive
input columns and the result lands on exactly the grid HQQ uses: (q - zero) * scale per group of
`group_size` columns, hqq axis 1). gate_up is calibrated on the routed hidden states; down on the
activations that the already-quantized gate_up produces (GPTQ's sequential order).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from moetool.errors import MoetoolError
from moetool.model import ExpertWeights
from moetool.quant.format import Bits, QTensor

DAMP_PERCENT = 0.05  # gptqmodel's default dampening of the Hessian diagonal
MSE_NORM = 2.0  # search each group's clipping range for the least squared error (gptqmodel: off by default)


def available() -> bool:
    return importlib.util.find_spec("gptqmodel") is not None


def load_gptqmodel() -> tuple[Any, Any]:
    """gptqmodel's two classes. Its import prints a banner, a version table and a GIL warning (a
    dozen lines on the terminal of every GPTQ quantize), and sets environment variables for the
    whole process: HF_HOME and the hub caches under /tmp (where a later load would look for a hub
    model), the CUDA allocator's settings and device order. The lines are kept out of sight and
    the environment is put back as it was."""
    before = dict(os.environ)
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            from gptqmodel.quantization.config import QuantizeConfig
            from gptqmodel.quantization.gptq import GPTQ
    except ImportError as e:
        raise MoetoolError(f"--method gptq needs the optional gptqmodel package ({e.name or e} is missing); "
                           "install it with pip install 'moetool[gptq]' or use --method hqq.") from None
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        os.environ.update(before)
    return QuantizeConfig, GPTQ


def quantize_weight(weight: torch.Tensor, inputs: torch.Tensor, bits: Bits | int, group_size: int = 64,
                    damp: float = DAMP_PERCENT) -> QTensor:
    """GPTQ one weight [out, in] given the inputs [n, in] it sees; grouped like hqq axis 1."""
    QuantizeConfig, GPTQ = load_gptqmodel()
    rows, cols = weight.shape
    linear = nn.Linear(cols, rows, bias=False)
    linear.weight.data = weight.detach().float().clone()  # [out, in]; GPTQ updates a copy of it
    try:
        qcfg = QuantizeConfig(bits=int(bits), group_size=group_size, desc_act=False, sym=False, damp_percent=damp,
                              offload_to_disk=False, fallback=None, mse=MSE_NORM)
    except ValueError as e:
        raise MoetoolError(f"gptqmodel refuses these settings: {str(e).strip().splitlines()[0]}") from None
    with contextlib.redirect_stdout(sys.stderr):
        solver = GPTQ(linear, qcfg)
        solver.quantizer.configure(perchannel=True)
        solver.add_batch(inputs.detach().float(), None)
        fake, scale, zero = solver.quantize()[:3]  # [out, in] dequantized; [out, in/gs] twice
        solver.free()
    groups = cols // group_size
    scale = scale.float().reshape(rows * groups, 1)  # row-major (row, group): hqq axis 1's group order
    zero = zero.float().reshape(rows * groups, 1)
    # GPTQ hands back W_hat = (q - zero) * scale; the integer codes are recovered exactly.
    codes = torch.round(fake.float().reshape(rows * groups, group_size) / scale + zero)  # [G, gs]
    codes = codes.clamp_(0, (1 << int(bits)) - 1).to(torch.uint8)
    return QTensor(codes=codes, scale=scale, zero=zero)


def quantize_expert(weights: ExpertWeights, bits: Bits | int, group_size: int, inputs: torch.Tensor,
                    act: Callable[[torch.Tensor], torch.Tensor], dequant: Callable[[str, QTensor], torch.Tensor],
                    damp: float = DAMP_PERCENT) -> dict[str, QTensor]:
    """GPTQ both projections of one expert on its routed tokens `inputs` [n, H].

    `act` maps gate_up's output [n, 2I] to down's input [n, I] (the model's own gate); `dequant`
    turns a projection's QTensor back into the weight the engine will compute with, so down is
    calibrated on what the quantized gate_up really feeds it.
    """
    gate_up = quantize_weight(weights.gate_up, inputs, bits, group_size, damp)
    w_gate_up = dequant("gate_up", gate_up)  # [2I, H]
    bias = None if weights.gate_up_bias is None else weights.gate_up_bias.float()
    hidden = act(nn.functional.linear(inputs.float(), w_gate_up, bias))  # [n, I]
    down = quantize_weight(weights.down, hidden, bits, group_size, damp)
    return {"gate_up": gate_up, "down": down}

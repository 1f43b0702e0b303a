"""Which activation a MoE block's experts use, as the fused kernel computes it, read off the block itself.

transformers' experts modules apply `_apply_gate` (gated: act(gate) * up, or gpt_oss's clamped
SwiGLU) or `act_fn` (ungated) between the two projections. The kernel computes a few of these
in its epilogue; `activation_of` names which one a block uses by the identity of its functions
(never by the model's name), then checks the name numerically against the block's own function on
a probe. Anything it does not recognise, or a recognised one that disagrees on the probe, is
`Act.NONE`: the kernel then writes gate_up's raw output and the block's own function runs between
the two launches, so an unknown activation costs a launch or two, never a wrong result.

    spec = activation_of(block.experts)      # block.experts: a ProviderExperts (or EngineExperts)
    spec.kind, spec.gated, spec.interleaved  # Act.SILU, True, False for Qwen/Mixtral/OLMoE
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

import torch
import torch.nn.functional as F
from torch import nn


class Act(IntEnum):
    """What the kernel's gate_up epilogue computes (the integer is the kernel's constexpr)."""

    NONE = 0  # nothing: gate_up's raw output is written, the block's own function runs after
    SILU = 1
    GELU = 2  # exact (erf)
    GELU_TANH = 3  # tanh approximation (gelu_new, gelu_pytorch_tanh, gelu_fast)
    RELU = 4
    CLAMPED_SWIGLU = 5  # gpt_oss: gate clamped above, up clamped both sides, (up + 1) * gate * sigmoid(alpha * gate)
    RELU2 = 6  # relu(x)^2 (transformers' "relu2", nemotron_h's ungated experts)


@dataclass(frozen=True)
class Activation:
    """An experts block's activation: what the kernel computes, and the block's own function.

    `gated`: gate_up has 2I rows, gate and up (else I rows, act alone). `interleaved`: gate and up
    rows alternate (gpt_oss) instead of [gate; up]. `alpha`/`limit`: CLAMPED_SWIGLU's constants.
    `fn`: the block's own function on gate_up's output ([n, 2I] -> [n, I]), what `Act.NONE` runs.
    """

    kind: Act
    gated: bool
    interleaved: bool = False
    alpha: float = 0.0
    limit: float = 0.0
    fn: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False, repr=False)

    def out_width(self, rows: int) -> int:
        """Columns of the kernel's first output for a gate_up of `rows` rows: the activation's
        width, or all of gate_up's rows where the block's own function runs after the kernel."""
        return rows // 2 if self.gated and self.kind != Act.NONE else rows


def reference(spec: Activation, h: torch.Tensor) -> torch.Tensor:
    """`spec` in torch, on gate_up's output `h` [n, rows]: what the kernel's epilogue computes."""
    if spec.kind == Act.NONE:
        return spec.fn(h)
    if spec.gated:
        gate, up = (h[..., ::2], h[..., 1::2]) if spec.interleaved else h.chunk(2, dim=-1)
    else:
        gate, up = h, None
    if spec.kind == Act.CLAMPED_SWIGLU:
        gate = gate.clamp(max=spec.limit)
        return (up.clamp(-spec.limit, spec.limit) + 1) * gate * torch.sigmoid(gate * spec.alpha)
    a = _ELEMENTWISE[spec.kind](gate)
    return a * up if spec.gated else a


_ELEMENTWISE: dict[Act, Callable[[torch.Tensor], torch.Tensor]] = {
    Act.SILU: F.silu,
    Act.GELU: F.gelu,
    Act.GELU_TANH: lambda x: F.gelu(x, approximate="tanh"),
    Act.RELU: F.relu,
    Act.RELU2: lambda x: F.relu(x).square(),
}

# torch functions a block may keep as its `act_fn` instead of a module (lfm2_moe's F.silu), by identity.
_FUNCTIONS: tuple[tuple[Callable, Act], ...] = ((F.silu, Act.SILU), (F.gelu, Act.GELU), (F.relu, Act.RELU),
                                                (torch.relu, Act.RELU))


def _elementwise_kind(act_fn: object) -> Act:
    """The kernel's name for a module's `act_fn`, by its class or, for a plain torch function, by
    identity (Act.NONE if not one it computes)."""
    from transformers import activations as A

    if isinstance(act_fn, (nn.SiLU, A.SiLUActivation)):
        return Act.SILU
    if isinstance(act_fn, nn.GELU):
        return Act.GELU_TANH if act_fn.approximate == "tanh" else Act.GELU
    if isinstance(act_fn, A.GELUActivation):  # erf GELU, torch's or its python copy
        return Act.GELU
    if isinstance(act_fn, (A.GELUTanh, A.NewGELUActivation, A.FastGELUActivation)):
        return Act.GELU_TANH
    if isinstance(act_fn, nn.ReLU):
        return Act.RELU
    if isinstance(act_fn, A.ReLUSquaredActivation):
        return Act.RELU2
    return next((kind for f, kind in _FUNCTIONS if act_fn is f), Act.NONE)


def _function_name(f: object) -> str:
    f = getattr(f, "__func__", f)
    return f"{getattr(f, '__module__', '')}.{getattr(f, '__qualname__', '')}"


# Gates other than transformers' default act(gate) * up, by the qualified name of the block's
# `_apply_gate`: how to read their constants off the block. A look-alike under another name
# (e.g. a copy that casts to fp32 first) is not listed, and runs as Act.NONE.
_CLAMPED_GATES: dict[str, Callable[[nn.Module], tuple[bool, float, float]]] = {  # -> (interleaved, alpha, limit)
    "transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts._apply_gate":
        lambda m: (True, float(m.alpha), float(m.limit)),
    "transformers.models.minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLExperts._apply_gate":
        lambda m: (False, float(m.swiglu_alpha), float(m.swiglu_limit)),
}


def _named(impl: nn.Module, gated: bool) -> Activation:
    """What the block's functions are by name, before the probe."""
    if not gated:
        return Activation(_elementwise_kind(getattr(impl, "act_fn", None)), gated=False)
    from transformers.integrations.moe import _default_apply_gate

    gate = getattr(type(impl), "_apply_gate", None)
    if gate is _default_apply_gate:
        if not getattr(impl, "is_concatenated", True):  # the default gate chunks [gate; up]
            return Activation(Act.NONE, gated=True)
        return Activation(_elementwise_kind(getattr(impl, "act_fn", None)), gated=True)
    constants = _CLAMPED_GATES.get(_function_name(gate))
    if constants is None:
        return Activation(Act.NONE, gated=True)
    interleaved, alpha, limit = constants(impl)
    return Activation(Act.CLAMPED_SWIGLU, gated=True, interleaved=interleaved, alpha=alpha, limit=limit)


def _probe(rows: int, limit: float) -> torch.Tensor:
    """[8, rows] fp32 values from -3 * scale to 3 * scale (scale: a clamp limit where there is one),
    so the probe crosses zero, the clamps and the activations' curved parts."""
    scale = limit if limit > 0 else 4.0
    return torch.linspace(-3.0 * scale, 3.0 * scale, 8 * rows).view(rows, 8).t().contiguous()


def activation_of(experts: nn.Module, probe_tol: float = 1e-5) -> Activation:
    """The activation of an experts module that wraps the model's own (`ProviderExperts`: `.impl`,
    `.layer.gated`, `.activation`), as the kernel computes it, or `Act.NONE` with the block's own
    function where the name is unknown or the probe disagrees (relative error over `probe_tol`)."""
    fn = experts.activation
    spec = _named(experts.impl, experts.layer.gated)
    if spec.kind != Act.NONE:
        rows = 2 * 16 if spec.gated else 16
        h = _probe(rows, spec.limit)
        with torch.no_grad():
            want, got = fn(h).float(), reference(spec, h).float()
        scale = want.abs().max().item() or 1.0
        if want.shape != got.shape or not math.isfinite(scale) or (want - got).abs().max().item() > probe_tol * scale:
            spec = Activation(Act.NONE, gated=spec.gated)
    return Activation(spec.kind, spec.gated, spec.interleaved, spec.alpha, spec.limit, fn=fn)

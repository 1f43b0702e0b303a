"""The policy contract: what the engine tells a policy, and what a policy may decide.

Per MoE layer the engine builds one `LayerView` (host tensors, gathered once per layer) and asks
`plan` which expert each (token, slot) runs, at what precision and where; it then asks `prefetch`
what to fetch ahead for later layers. Residency is the engine's: a policy reads it through
`CacheView` and says what to evict through `make_room`. Knobs are a frozen dataclass per policy,
named as in the paper, settable from `--set key=value` and from a fit artifact.

    policy = make_policy("lru", {"bits": 16}, ctx)
    plan = policy.plan(view)            # LayerPlan of [T, k] tensors
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Callable, ClassVar, Protocol

import torch

from moetool.errors import MoetoolError

Key = tuple[int, int]  # (decoder layer index, expert)


class Phase(IntEnum):
    PREFILL = 0
    DECODE = 1


class Where(IntEnum):
    """Where one (token, slot) of a layer's routing is executed."""

    GPU = 0  # on the compute device, from a resident or just-loaded copy
    CPU = 1  # on the host, from the host store (SMoE Algorithm 2, CPU-assisted compute)
    SKIP = 2  # not at all: a "0-bit" expert (DyMoE 4/0); its routing weight is dropped


@dataclass(frozen=True)
class Step:
    """One forward pass of the model: a prefill over a prompt, or one decode token."""

    index: int
    phase: Phase
    num_tokens: int  # tokens in this forward (batch x new positions)


@dataclass(frozen=True)
class Fetch:
    """A request to make (layer, expert) resident at `bits` ahead of use."""

    layer: int
    expert: int
    bits: int


class CacheView(Protocol):
    """Read-only residency, as the engine sees it now."""

    def resident_bits(self, layer: int, expert: int) -> tuple[int, ...]: ...  # bits with a usable copy
    def loading_bits(self, layer: int, expert: int) -> tuple[int, ...]: ...  # bits with a copy in flight
    def residents(self, bits: int) -> list[Key]: ...  # every (layer, expert) held at `bits`
    def capacity(self, bits: int) -> int: ...  # slots of that precision
    def free(self, bits: int) -> int: ...


@dataclass
class LayerView:
    """What a policy sees of one MoE layer in one forward pass. Tensors are on the host."""

    layer: int  # decoder layer index
    moe_pos: int  # position among MoE layers (0 = shallowest)
    num_moe_layers: int
    num_experts: int
    step: Step
    top_k_index: torch.Tensor  # [T, k] int64: the model's own routing
    top_k_weights: torch.Tensor  # [T, k] float32: the model's own routing weights
    router_logits: torch.Tensor  # [T, E] float32: full router logits (scores of unselected experts too)
    cache: CacheView
    # Cross-layer look-ahead: router logits [T, E] of a later MoE layer applied to this layer's gate
    # input (Fate position 2, DyMoE eq. 6, SMoE's top-score prefetch). None at the last MoE layer.
    predict: Callable[[int], torch.Tensor | None]
    token_importance: torch.Tensor | None = None  # [T] heavy-hitter scores s_i (DyMoE eq. 1), prefill only


@dataclass
class LayerPlan:
    """Per (token, slot): which expert runs (-1: none), at which bits, where, with which weight."""

    expert: torch.Tensor  # [T, k] int64
    bits: torch.Tensor  # [T, k] int64
    where: torch.Tensor  # [T, k] int64 (Where)
    weight: torch.Tensor  # [T, k] float32

    @classmethod
    def identity(cls, view: LayerView, bits: int) -> "LayerPlan":
        """Run every selected expert as routed, on the device, at `bits`."""
        idx = view.top_k_index
        return cls(expert=idx.clone(), bits=torch.full_like(idx, bits), where=torch.zeros_like(idx),
                   weight=view.top_k_weights.clone())


@dataclass(frozen=True)
class EngineContext:
    """What a policy may know of the engine when it is built."""

    moe_layers: tuple[int, ...]  # decoder indices of MoE layers, shallow to deep
    num_experts: int
    top_k: int
    expert_bytes: dict[int, int]  # bits -> bytes of one expert's blob
    cache_bytes: int  # device bytes for expert slots (the budget minus non-expert weights and margin)
    available_bits: tuple[int, ...]  # precisions present in the bundle
    hw: dict[str, Any] = field(default_factory=dict)  # hardware profile (timings) for cost-aware policies


@dataclass(frozen=True)
class Params:
    """Base of each policy's knobs; subclasses add fields named as in the paper."""


class Policy:
    """Base policy. Subclasses set `name`, `Params`, and override what they decide.

    The defaults describe an offloading policy without reuse decisions: run every routed expert
    at `params.bits` on the device, prefetch nothing, admit nothing into the cache.
    """

    name: ClassVar[str] = "base"
    Params: ClassVar[type[Params]] = Params
    # Ask the engine for DyMoE's heavy-hitter token scores in prefill (needs eager attention weights).
    needs_token_importance: ClassVar[bool] = False
    # knob -> the knobs it is derived from: a fitted value of the former is dropped when `--set`
    # gives one of the latter (a fit's DyMoE lam was solved for the fit's r, not for the r asked for).
    derived: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __init__(self, params: Params, ctx: EngineContext):
        self.params = params
        self.ctx = ctx

    # -- the cache --------------------------------------------------------------------------
    def pools(self) -> dict[int, int]:
        """Slots per precision, carved from `ctx.cache_bytes` once at start (no churn later)."""
        return {}

    def bits_in_use(self) -> tuple[int, ...]:
        """Precisions this policy may ask the engine for: the host store pins only these.

        Its pools' precisions and every precision knob (`bits`, `*_bits`, DynaExq's `b_hi`/`b_lo`);
        a policy that picks precisions another way overrides this.
        """
        knobs = {v for k, v in dataclasses.asdict(self.params).items()
                 if (k == "bits" or k.endswith("_bits") or k in ("b_hi", "b_lo")) and isinstance(v, int)}
        wanted = set(self.pools()) | knobs
        return tuple(sorted((b for b in wanted if b in self.ctx.available_bits), reverse=True))

    def warm(self) -> list[Fetch]:
        """Experts to load before the first step (e.g. all of them for `resident`); not counted per token."""
        return []

    def make_room(self, want: Fetch, cache: CacheView, shield: set[Key], demand: bool) -> list[Fetch] | None:
        """Victims to evict so `want` fits (a list, possibly empty), or None to not cache it.

        `shield` holds experts in use by the current layer (SMoE's in-use shield): never victims.
        A demand load that is not admitted is streamed through a staging buffer and dropped.
        """
        return None

    def on_use(self, layer: int, experts: list[tuple[int, int, bool]]) -> None:
        """After a layer ran: (expert, bits, was_hit) of every expert it used on the device."""

    # -- per step and per layer ---------------------------------------------------------------
    def begin_step(self, step: Step) -> None:
        pass

    def plan(self, view: LayerView) -> LayerPlan:
        return LayerPlan.identity(view, getattr(self.params, "bits", max(self.ctx.available_bits)))

    def prefetch(self, view: LayerView) -> list[Fetch]:
        return []

    def end_step(self, step: Step) -> list[Fetch]:
        """Background migrations to start now (e.g. DynaExq promotions); the forward never waits on them."""
        return []

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self.params)


POLICIES: dict[str, type[Policy]] = {}


def register(name: str) -> Callable[[type[Policy]], type[Policy]]:
    def deco(cls: type[Policy]) -> type[Policy]:
        if name in POLICIES:
            raise ValueError(f"policy {name!r} registered twice")
        cls.name = name
        POLICIES[name] = cls
        return cls
    return deco


def parse_params(cls: type[Policy], settings: dict[str, str], fitted: dict[str, Any] | None = None) -> Params:
    """Build `cls.Params` from fitted values overridden by `--set key=value` strings."""
    fields = {f.name: f for f in dataclasses.fields(cls.Params)}
    values: dict[str, Any] = {}
    fitted = {k: v for k, v in (fitted or {}).items()
              if not (k in cls.derived and any(d in settings for d in cls.derived[k]) and k not in settings)}
    for source, items in (("fit", fitted), ("--set", settings)):
        for key, raw in items.items():
            if key not in fields:
                known = ", ".join(sorted(fields)) or "none"
                if source == "fit":
                    continue  # a fit artifact carries knobs for several policies
                raise MoetoolError(f"policy '{cls.name}' has no knob '{key}' (its knobs: {known}).")
            values[key] = _coerce(cls.name, key, fields[key].type, raw)
    try:
        return cls.Params(**values)
    except (TypeError, ValueError) as e:
        raise MoetoolError(f"invalid knobs for policy '{cls.name}': {e}") from None


def _coerce(policy: str, key: str, tp: Any, raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    name = tp if isinstance(tp, str) else getattr(tp, "__name__", str(tp))
    try:
        if name == "bool":
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if name == "int":
            return int(raw)
        if name == "float":
            return float(raw)
    except ValueError:
        raise MoetoolError(f"knob '{key}' of policy '{policy}' takes a {name}, not '{raw}'.") from None
    return raw


def make_policy(name: str, settings: dict[str, str], ctx: EngineContext,
                fitted: dict[str, Any] | None = None) -> Policy:
    if name not in POLICIES:
        raise MoetoolError(f"unknown policy '{name}' (known: {', '.join(sorted(POLICIES))}).")
    cls = POLICIES[name]
    return cls(parse_params(cls, settings, fitted), ctx)

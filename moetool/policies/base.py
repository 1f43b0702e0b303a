"""The policy contract: what the engine tells a policy, and what a policy may decide.

A policy declares its device pools once (`pools`: bits, slots, per-layer quota, eviction order)
and then, per MoE layer, answers with a `LayerPlan` (which expert each (token, slot) runs, at what
precision and where) and, after the layer ran, with what to fetch ahead (`prefetch`). Residency is
the engine's (`engine/residency.py`: slots, quotas and eviction orders in one place); a policy reads
it through `ResidencyView` and overrides `admit` only where its paper has an admission rule. Knobs
are a frozen dataclass per policy, named as in the paper, settable from `--set key=value` and from a
fit artifact; they, the registry and the fit and report hooks are the torch-free half of the contract
(`knobs.py`), which `Policy` extends. `policies/README.md` walks through writing one.

    policy = make_policy("lru", {"bits": "16"}, ctx)
    plan = policy.plan(view)            # LayerPlan of [T, k] tensors
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol

import numpy as np
import torch

from moetool.errors import MoetoolError
from moetool.router_scores import ScoreRules
from moetool.policies.knobs import POLICIES, Knobs, Params, parse_params, register, resolved  # noqa: F401 (the contract's other half)

if TYPE_CHECKING:
    from moetool.policies.device import DevicePlan, DeviceView

Key = tuple[int, int]  # (decoder layer index, expert)
SIGNALS = ("token_importance", "router_logits")  # what `Policy.signals` may name


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
    num_tokens: int  # real tokens in this forward (batch x new positions, less a batch's left padding)


@dataclass(frozen=True)
class Fetch:
    """One (layer, expert) copy at `bits`: a request to make it resident, or a victim to evict."""

    layer: int
    expert: int
    bits: int


@dataclass(frozen=True)
class Pool:
    """Device slots for one precision, carved from the expert budget once at start (no churn later).

    `quota` limits each MoE layer's share (per-layer scope, as mixtral-offloading and Fate); None
    makes the pool one global cache. `eviction` names an order in `EVICTIONS` that picks victims
    when a layer (or the pool) is full; None admits into free slots only (a pool sized to hold
    everything, or one whose policy decides victims itself in `admit`). With
    `prefetch_is_reference`, a copy brought in ahead of use is referenced once by its admission, not
    again by its first use (what ARC's frequency list needs); off, its first use is a reference too
    (plain LRU recency).
    """

    bits: int
    slots: int
    quota: dict[int, int] | None = None
    eviction: str | None = "lru"
    eviction_options: dict[str, Any] = field(default_factory=dict)
    prefetch_is_reference: bool = True


def bare_layers(pools: list[Pool], layers: tuple[int, ...]) -> list[int]:
    """MoE layers no pool gives a slot (each per-layer quota 0): every expert they run is loaded anew."""
    if any(p.slots > 0 and p.quota is None for p in pools):
        return []  # a global pool serves every layer
    return [layer for layer in layers if not any(p.slots > 0 and (p.quota or {}).get(layer, 0) > 0 for p in pools)]


class ResidencyView(Protocol):
    """Read-only residency, as the engine sees it now."""

    def resident_bits(self, layer: int, expert: int) -> tuple[int, ...]: ...  # bits with a usable copy
    def loading_bits(self, layer: int, expert: int) -> tuple[int, ...]: ...  # bits with a copy in flight
    def residents(self, bits: int, layer: int | None = None) -> list[Key]: ...  # (layer, expert)s held at `bits`
    def capacity(self, bits: int) -> int: ...  # slots of that precision
    def free(self, bits: int) -> int: ...
    def make_room(self, want: Fetch, shield: set[Key], demand: bool) -> list[Fetch] | None: ...  # the generic rule


@dataclass
class LayerView:
    """What a policy sees of one MoE layer in one forward pass. Tensors are on the host."""

    layer: int  # decoder layer index
    moe_pos: int  # position among MoE layers (0 = shallowest)
    num_experts: int
    step: Step
    top_k_index: torch.Tensor  # [T, k] int64: the model's own routing
    top_k_weights: torch.Tensor  # [T, k] float32: the model's own routing weights
    router_logits: torch.Tensor  # [T, E] float32: full router logits (scores of unselected experts too)
    residency: ResidencyView
    # Cross-layer look-ahead: router logits [T, E] of a later MoE layer applied to this layer's gate
    # input (Fate position 2, DyMoE eq. 6, SMoE's top-score prefetch). None at the last MoE layer.
    predict: Callable[[int], torch.Tensor | None]
    token_importance: torch.Tensor | None = None  # [T] heavy-hitter scores s_i (DyMoE eq. 1), prefill only
    # [T] bool: the rows of real tokens, None when every row is one. A batch's prompts are left-padded to
    # one length; the pad rows are computed (as transformers computes them) but are no request's
    # tokens, so no statistic a paper keeps of its requests counts them (`common.counted`).
    real_rows: torch.Tensor | None = None


def valid_slots(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, k] bool: routing slots that name a real expert (some routers mark dropped slots with E or -1)."""
    if idx.device.type == "cpu":  # numpy: a few calls on a small array cost a tenth of torch's
        a = idx.numpy()
        return torch.from_numpy((a >= 0) & (a < num_experts))
    return (idx >= 0) & (idx < num_experts)


class _Made:
    """A `LayerPlan` array made from the router's view on first access (`make(view, plan)`), then the
    plan's own: a policy may change it in place or assign another. What it was made as is kept
    (`LayerPlan._made`), so the engine can tell a plan a policy changed from one it only read."""

    def __init__(self, make: Callable[["LayerView", "LayerPlan"], np.ndarray]):
        self.make = make

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, plan: "LayerPlan | None", owner: type | None = None):
        if plan is None:
            return self
        value = getattr(plan, self.slot)
        if value is None:
            made = self.make(plan._view, plan)
            value = torch.from_numpy(made.copy())
            setattr(plan, self.slot, value)
            if plan._view is not None:
                plan._made[self.name] = made
        return value

    def __set__(self, plan: "LayerPlan", value: torch.Tensor) -> None:
        setattr(plan, self.slot, value)

    def changed(self, plan: "LayerPlan") -> bool:
        """Whether the plan's array differs from what the router's view makes (never made: unchanged)."""
        value = getattr(plan, self.slot)
        if value is None:
            return False
        made = plan._made.get(self.name)
        if made is None:  # assigned without being read: compare with what it would have been made as
            made = plan._made[self.name] = self.make(plan._view, plan)
        return not np.array_equal(value.numpy(), made)


def _valid_or_skip(view: "LayerView", plan: "LayerPlan") -> np.ndarray:
    idx = view.top_k_index.numpy()
    return np.where((idx >= 0) & (idx < view.num_experts), int(Where.GPU), int(Where.SKIP))  # [T, k]


class LayerPlan:
    """Per (token, slot): which expert runs, at which bits, where, with which weight.

    expert [T, k] int64, bits [T, k] int64, where [T, k] int64 (`Where`), weight [T, k] float32. A
    slot that runs nothing is `where == Where.SKIP` (its `expert` is then meaningless).

    `routed` makes its arrays on first access: a policy that reads or changes one gets its own
    copy, and one that never touches them (every lossless policy, static precision) costs the hot
    path nothing. Either way the engine asks `uniform_bits` whether the plan is still the router's
    at one precision: what a policy *changed* decides it, not what it read (a policy may read
    `running()` every step and change nothing).
    """

    __slots__ = ("_expert", "_bits", "_where", "_weight", "_view", "_uniform", "_made")

    # numpy on the host arrays: a torch call on a [1, k] tensor costs more than the numpy work.
    expert = _Made(lambda view, plan: view.top_k_index.numpy().copy())
    bits = _Made(lambda view, plan: np.full(tuple(view.top_k_index.shape), plan._uniform, np.int64))
    where = _Made(_valid_or_skip)
    weight = _Made(lambda view, plan: view.top_k_weights.numpy().copy())

    def __init__(self, expert: torch.Tensor, bits: torch.Tensor, where: torch.Tensor, weight: torch.Tensor):
        self._expert, self._bits, self._where, self._weight = expert, bits, where, weight
        self._view: LayerView | None = None
        self._uniform: int | None = None
        self._made: dict[str, np.ndarray] = {}

    @classmethod
    def routed(cls, view: LayerView, bits: int) -> "LayerPlan":
        """Run every selected expert as routed, on the device, at `bits`; dropped slots are skipped."""
        plan = cls.__new__(cls)
        plan._expert = plan._bits = plan._where = plan._weight = None
        plan._view, plan._uniform, plan._made = view, bits, {}
        return plan

    def running(self) -> torch.Tensor:
        """[T, k] bool: the slots that run an expert somewhere."""
        return self.where != Where.SKIP

    # -- what the engine reads (without making copies) --------------------------------------------
    def uniform_bits(self) -> int | None:
        """The one precision every routed slot runs at, on the device, as routed, if no policy
        changed the routed plan's experts, bits or placement (reading them changes nothing); else
        None. (A slot the router marked dropped is still skipped: the engine checks the experts' range.)"""
        if self._uniform is None:
            return None
        cls = type(self)
        if any(getattr(cls, name).changed(self) for name in ("expert", "bits", "where")):
            return None
        return self._uniform

    def routing_weight(self) -> torch.Tensor:
        """`weight`, or the router's own weights when no policy touched them (no copy)."""
        return self._weight if self._weight is not None else self._view.top_k_weights


@dataclass(frozen=True)
class EngineContext:
    """What a policy may know of the engine when it is built."""

    moe_layers: tuple[int, ...]  # decoder indices of MoE layers, shallow to deep
    num_experts: int
    top_k: int  # the most experts a MoE layer routes a token to (HunYuan gives each layer its own count)
    expert_bytes: dict[int, int]  # bits -> bytes of one expert's blob
    cache_bytes: int  # device bytes for expert slots (the budget minus non-expert weights and margin)
    available_bits: tuple[int, ...]  # precisions present in the bundle
    hw: dict[str, Any] = field(default_factory=dict)  # hardware profile (timings) for cost-aware policies
    # How each MoE layer's router scores its experts (`router_scores`): what a rule that reads scores
    # (SMoE's thresholds and window, Fate's percentile, DyMoE's eq. 6) takes in place of softmax(logits).
    routers: ScoreRules = field(default_factory=ScoreRules)


class Policy(Knobs):
    """Base policy. Subclasses set `name`, `Params`, and override what they decide.

    The defaults describe an offloading policy without reuse: run every routed expert at
    `params.bits` on the device, hold nothing, prefetch nothing. Per MoE layer the engine calls
    `plan`, then `admit` for each copy it must load, then `prefetch`; per step, `end_step`. Two
    optional classmethods carry the paper beyond the run (`Knobs`): `fit` (its knobs from a profile,
    runs and evals) and `report` (its tables, figures and claims), found through the registry by the stages.
    """

    # Signals the policy reads, by name, that the engine computes only when asked (`SIGNALS`):
    # "token_importance" (heavy-hitter scores s_i of prefill tokens; needs eager attention weights),
    # "router_logits" (a layer's full router logits inside the captured step).
    signals: ClassVar[frozenset[str]] = frozenset()
    # Whether `plan`/`prefetch` read a layer's routing on the host. A policy whose plan is the
    # router's own and whose experts are all resident (resident, static) sets it False: the engine
    # then runs its layers on the device as transformers does, without waiting for the routing.
    host_routing: ClassVar[bool] = True
    # Whether a rule reads the routers' per-expert scores (`ctx.routers`), not only their choice: SMoE's
    # thresholds, Fate's percentile, DyMoE's look-ahead. The run then says where they are approximated.
    reads_scores: ClassVar[bool] = False

    def __init__(self, params: Params, ctx: EngineContext):
        self.params = params
        self.ctx = ctx
        self.clamped: dict[str, str] = {}  # knob -> why its default was clamped (`check_at_most`)
        # what the run should say of how a knob ran (DyMoE's r reached in a step above it): recorded
        # under summary.policy_notes and printed after the work
        self.notes: list[str] = []
        # whether `notes` already says which MoE layers the pools leave without a slot (Fate's §4.4
        # note); otherwise the engine says it (`bare_layers`)
        self.says_bare_layers = False
        if isinstance(getattr(params, "bits", None), int):
            check_bits(self.name, ctx, params.bits)

    # -- once, at start ------------------------------------------------------------------------
    def pools(self) -> list[Pool]:
        """The device pools, carved from `ctx.cache_bytes` once (no churn later)."""
        return []

    def precisions(self) -> tuple[int, int]:
        """(high, low) bits this policy runs experts at (low = high for a single precision; 0 = skipped)."""
        bits = getattr(self.params, "bits", max(self.ctx.available_bits))
        return bits, bits

    def bits_in_use(self) -> tuple[int, ...]:
        """Precisions this policy may ask the engine for (its pools' and `precisions()`): the host
        store pins only these."""
        wanted = {p.bits for p in self.pools()} | set(self.precisions())
        return tuple(sorted((b for b in wanted if b in self.ctx.available_bits), reverse=True))

    def warm(self) -> list[Fetch]:
        """Experts to load before the first step (e.g. all of them for `resident`); not counted per token."""
        return []

    # -- per layer and per step ------------------------------------------------------------------
    def plan(self, view: LayerView) -> LayerPlan:
        return LayerPlan.routed(view, self.precisions()[0])

    def admit(self, want: Fetch, residency: ResidencyView, shield: set[Key], demand: bool) -> list[Fetch] | None:
        """Victims to evict so `want` is cached ([] if it fits), or None to not cache it.

        The default is the residency's generic rule (quota, then the pool's eviction order); a
        policy overrides it only where its paper has an admission rule. `shield` holds the experts
        the current layer uses (SMoE's in-use shield): never victims. A demand load that is not
        admitted streams through a staging buffer and is dropped after use.
        """
        return residency.make_room(want, shield, demand)

    def prefetch(self, view: LayerView) -> list[Fetch]:
        """What to fetch ahead, asked after the layer ran (so it sees the residency its loads left)."""
        return []

    def end_step(self, step: Step, residency: ResidencyView) -> list[Fetch]:
        """Background migrations to start now (e.g. DynaExq promotions); the forward never waits on them."""
        return []

    # -- the captured decode step (`policies/device.py`) -------------------------------------------
    def plan_step(self, view: "DeviceView") -> "DevicePlan":
        """The in-step plan: `plan`'s decision for a decode token, in tensor operations on the device
        (no host read, no routing-dependent shape, no Python branch on a tensor). The default is the
        default `plan`'s: every routed expert at `precisions()[0]`."""
        from moetool.policies.device import DevicePlan

        return DevicePlan.of_router(view, self.precisions()[0])

    def log_layer(self, view: LayerView) -> list[Fetch]:
        """The host half of a captured step, one step behind, per MoE layer: the layer's routing as it
        ran (`view`, rebuilt from the step's log: no look-ahead) for bookkeeping `plan` does on the
        host path (DynaExq's hotness counters); returns fetches to start (EAP's co-activation prefetch)."""
        return []

    def captured_unsupported(self) -> str | None:
        """Why this policy cannot run in the captured step (its decision has no in-step form), or None.
        A policy that overrides `plan` but not `plan_step` has none: its rule exists only on the host.
        Nor has one that overrides `prefetch` alone: the captured step never calls it (its look-ahead is
        `plan_step`'s prefetch, or fetches `log_layer` returns one step behind), so it would run without
        the prefetch that may be its whole rule."""
        cls = type(self)
        if cls.plan is not Policy.plan and cls.plan_step is Policy.plan_step:
            return f"policy '{self.name}' has no in-step plan (plan_step)"
        if cls.prefetch is not Policy.prefetch and cls.plan_step is Policy.plan_step \
                and cls.log_layer is Policy.log_layer:
            return (f"policy '{self.name}' prefetches on the host only (prefetch), with no in-step form "
                    f"(plan_step's prefetch, or fetches from log_layer)")
        return None

    def device_misses(self, bits: int) -> bool:
        """Whether an expert this policy runs at `bits` in the captured step can lack a device copy (then
        the step reads it from host memory). False where the plan picks `bits` only for resident copies."""
        return True

    def describe(self) -> dict[str, Any]:
        """The knobs as the policy runs them, for the record: a shorthand's tiers in place of the knobs
        it sets (`config=4/2` records b_hi=4, b_lo=2, not the defaults it overrode)."""
        high, low = self.precisions()
        return {**resolved(type(self), self.params), "precisions": {"high": high, "low": low}}


def check_bits(policy: str, ctx: EngineContext, *bits: int) -> None:
    """One sentence when a policy wants a precision the bundle lacks, or one no bundle stores."""
    from moetool.bits import Bits

    for b in bits:
        if b not in {int(x) for x in Bits}:  # no `quantize --bits` makes it: say so, not where to get it
            raise MoetoolError(f"policy '{policy}' wants {b}-bit experts, and moetool stores experts at "
                               f"{', '.join(str(int(x)) for x in Bits)} bits only.")
        if b not in ctx.available_bits:
            raise MoetoolError(f"policy '{policy}' wants {b}-bit experts, but the experts it runs from are stored "
                               f"at {list(ctx.available_bits)} bits only (a checkpoint without --bundle holds its "
                               f"own precision); give a --bundle made with `moetool quantize --bits {b}`.")


def check_at_most(policy: Policy, key: str, most: int, unit: str) -> None:
    """One sentence when a count knob asked for exceeds what the model has (e.g. Fate's L over its
    MoE layers): clamping it silently would run, and record, a setting other than the one asked
    for. The knob's default is the paper's value for its model and is clamped (Fate's L = 3 on a
    two-layer model caches both layers whole), in `policy.params` too, so the run records the value
    it ran with (L = 2), not the one it could not."""
    value = getattr(policy.params, key)
    default = next(f.default for f in dataclasses.fields(policy.Params) if f.name == key)
    if value <= most:
        return
    if most == 1:  # "1 expert per layer", "1 MoE layer"
        unit = unit.replace("experts", "expert", 1).replace("layers", "layer", 1)
    why = f"knob '{key}' of policy '{policy.name}' is {value}, but the model has {most} {unit}."
    if value != default:
        raise MoetoolError(why)
    # the default, or the default's value given: `make_policy` refuses the latter (`--set L=3` is asked for)
    policy.clamped[key] = why
    policy.params = dataclasses.replace(policy.params, **{key: most})

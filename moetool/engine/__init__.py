"""Assemble an engine: budget -> policy -> pools -> residency -> clock, installed into a loaded model.

    lm = load_model(path)
    engine, split = build_engine(lm, HostStore.from_experts(lm.experts, torch.float32), "lru", budget="25%")
    lm.model.generate(ids, max_new_tokens=8, do_sample=False)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from moetool.engine.budget import (PLAN_TOKENS, Budget, BudgetSplit, capture_workspace, device_workspace, expert_params, kv_margin,  # noqa: F401 (API)
                                   attention_layers, parse_budget, parse_size, plan_margin, split_budget)
from moetool.engine.captured import captured_workspace
from moetool.engine.residency import Residency
from moetool.engine.clock import CostModel, SimClock, WallClock, load_hw
from moetool.engine.runtime import EXPERTS_IMPLS, Engine  # noqa: F401 (API)
from moetool.engine.store import HostStore
from moetool.defaults import DEFAULT_HW
from moetool.errors import MoetoolError, size_text
from moetool.model import LoadedModel, available_memory
from moetool.policies import POLICIES, make_policy
from moetool.router_scores import score_rules
from moetool.policies.knobs import Sizing, stale_fitted
from moetool.policies.base import EngineContext, Policy, bare_layers

def split_budget_for(spec: str, lm: LoadedModel, store: HostStore, max_tokens: int = PLAN_TOKENS, batch: int = 1,
                     device: str | torch.device = "cpu", captured: bool = False,
                     staged: tuple[int, ...] | None = None) -> BudgetSplit:
    """`12GiB` is the whole device budget; `25%` is the expert cache as a share of the 16-bit experts
    (the store's: bf16 from a bundle, the compute dtype from a checkpoint). On a
    GPU the margin also holds the GEMM libraries' workspaces (`device_workspace`); for the captured
    decode step, its gather workspace (`captured_workspace`) and what its compile and capture take
    (`capture_workspace`)."""
    n_experts = sum(layer.num_experts for layer in lm.geometry.layers)
    # Some stored precision decoded rather than read in place: the decode workspace is device memory too.
    decoded = any(not store.stack_is_view(layer.index, b) for layer in lm.geometry.layers for b in store.bits)
    margin = plan_margin(lm.model.config, lm.geometry.layers, max_tokens, batch, store.compute_dtype, decoded)
    if captured:
        margin += captured_workspace(lm.geometry.layers, store) + capture_workspace(torch.device(device))
    return split_budget(spec, n_experts=n_experts, expert_bytes={b: store.slot_bytes(b) for b in store.bits},
                        non_expert_bytes=lm.non_expert_bytes(),
                        margin_bytes=margin + device_workspace(torch.device(device)), staged=staged)


def cost_model(lm: LoadedModel, store: HostStore, hw: str) -> tuple[CostModel, dict]:
    profile, raw = load_hw(hw)
    timed = any(raw.get(k) is not None for k in ("t_dense_s", "t_dense_captured_s", "t_expert_s", "c_cpu_s"))
    whose = None
    if isinstance(raw.get("model"), dict) and raw["model"] != measured_on(lm):
        whose = f"were measured on another model ({raw['model']})"
    elif timed and "base" in raw and not isinstance(raw.get("model"), dict):
        # written by `profile --what timing` (it sets `base`) before profiles recorded their model: whose
        # times they are is unknown, and taken as this model's they put another model's TPOT on it unsaid
        whose = "record no model they were measured on (the profile was written by an earlier moetool)"
    if whose is not None:
        # Times of another model's layers and experts: this model is charged its own estimates from the
        # throughputs, and the run says so.
        profile = dataclasses.replace(profile, t_dense_s=None, t_dense_captured_s=None, t_expert_s=None, c_cpu_s=None)
        raw = {**raw, "measured_elsewhere": f"hardware profile {profile.name}'s per-layer and per-expert times {whose}; "
                                            "this one is charged estimates from its throughputs"}
    g = lm.geometry.layers[0]
    params = expert_params(g)
    ref_bytes = params * 2  # bf16, what a dequantizing kernel writes and a bf16 expert reads
    dense_params = lm.non_expert_bytes() / next(lm.model.parameters()).element_size()
    n_moe = len(lm.geometry.layers)
    shape = dict(expert_bytes={b: store.slot_bytes(b) for b in store.bits}, expert_flops_per_token=2.0 * params,
                 reference_bytes=ref_bytes, dense_bytes_per_layer=dense_params * 2 / n_moe,
                 dense_flops_per_token_per_layer=2.0 * dense_params / n_moe,
                 attention=attention_layers(lm.model.config, store.compute_dtype), moe_layers=n_moe)
    cost = CostModel(hw=profile, **shape)
    if odd := _implausible(cost, CostModel(hw=dataclasses.replace(
            profile, t_dense_s=None, t_dense_captured_s=None, t_expert_s=None), **shape)):
        raw = {**raw, "measured_implausible": odd}
    return cost, raw


def _implausible(cost: CostModel, estimated: CostModel) -> str | None:
    """A measured time a thousand times off what the profile's throughputs give for this model: a profile
    written by hand in microseconds or milliseconds (the units `profile` prints) passed the plausible ranges,
    and every TPOT was 10^3-10^6 off."""
    hw = cost.hw
    pairs = [(f"t_expert_s[{b}]", t, estimated.t_expert(b, 1)) for b, t in (hw.t_expert_s or {}).items()
             if b in cost.expert_bytes]
    pairs += [(k, getattr(hw, k), estimated.t_dense(1)) for k in ("t_dense_s", "t_dense_captured_s")
              if getattr(hw, k) is not None]
    for name, measured, guess in pairs:
        if not 1e-3 <= measured / guess <= 1e3:
            return (f"hardware profile {hw.name}'s {name} = {measured:.3g} s is {measured / guess:.0e} times what its "
                    f"throughputs give for this model ({guess:.3g} s): its times are in seconds, not micro- or "
                    "milliseconds?")
    return None


def measured_on(lm: LoadedModel) -> dict[str, Any]:
    """What a measured hardware profile's layer and expert times hold for: the geometry of one MoE layer
    (a layer's and an expert's times do not depend on how many layers the model has)."""
    g = lm.geometry.layers[0]
    return {"model_type": lm.geometry.model_type, "hidden_size": g.hidden_size, "intermediate_size": g.intermediate_size,
            "num_experts": g.num_experts, "top_k": g.top_k}


def default_host_budget() -> int:
    """What the machine has available now, less a margin for everything else (10%, at least 1 GiB)."""
    free = available_memory()
    return max(0, free - max(1 << 30, free // 10))


def spans(numbers: list[int]) -> str:
    """Sorted numbers as runs: [1, 2, 3, 5] -> "1-3, 5" (a note had listed 57 layers one by one)."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _fresh_fit(policy: str, settings: dict[str, str], fitted: dict[str, Any] | None,
               sizing: dict[str, Sizing] | None, budget: str, ctx: EngineContext,
               path: str = "host") -> tuple[dict[str, Any] | None, dict[str, str]]:
    """The fitted knobs this run takes, and those it drops with why: sized for another --budget (compared
    as read: `25%` and `25.0%` are one budget; a size fitted from runs, which record no --budget, by the
    expert cache it left), other tiers or knobs, or another machine's costs than the
    ones the policy decides with here (`ctx.hw`), or not read beside the others (`knobs.stale_fitted`)."""
    if not fitted or policy not in POLICIES:
        return fitted, {}
    mine = parse_budget(budget)

    def same(other: str) -> bool:
        try:
            return parse_budget(other) == mine
        except MoetoolError:  # a hand-edited fit's budget no budget parser reads: not this one
            return False

    costs = {f"t_load.{b}": t for b, t in (ctx.hw.get("t_load") or {}).items()}
    drops = stale_fitted(POLICIES[policy], settings, fitted, sizing or {}, same, budget, costs, ctx.hw.get("name", ""),
                         ctx.cache_bytes, path)
    mine = {k: v for k, v in fitted.items() if k not in settings and k not in drops}
    drops.update(POLICIES[policy].fitted_disagree(mine, len(ctx.moe_layers), ctx.top_k))
    return {k: v for k, v in fitted.items() if k not in drops}, drops


def build_engine(lm: LoadedModel, store: HostStore, policy: str, *, settings: dict[str, str] | None = None,
                 fitted: dict[str, Any] | None = None, budget: str = "100%", clock: str = "wall",
                 hw: str = DEFAULT_HW, device: str | torch.device = "cpu", max_tokens: int = PLAN_TOKENS,
                 batch: int = 1, host_budget: int | None = None, host_tiers: bool | None = None,
                 experts_impl: str = "grouped_mm", kernels: bool = True, captured: bool = False,
                 fit_sizing: dict[str, Sizing] | None = None) -> tuple[Engine, BudgetSplit]:
    """Build the policy and the engine over `store` and install it in `lm`.

    `host_tiers` (default: on CUDA, or wherever a `host_budget` is given) keeps the policy's
    precisions in host memory (pinned on CUDA) within `host_budget` bytes (default:
    `default_host_budget()`) and stages the rest through a ring; off, blobs are copied straight
    from where they lie (the memory-mapped bundle). `experts_impl` picks the compute path:
    "grouped_mm" (grouped GEMMs, bit-exact against transformers' default kernel) or "eager" (one
    expert at a time, bit-exact against transformers' eager loop). `kernels` lets the grouped path
    run low-bit experts through torch's CPU kernels where they apply (bf16 or fp32 compute on a CPU;
    INT4 and INT2 in groups of 32+ through the packed-int4 matmul, per-channel INT8 through the int8
    weight-only one; `moetool.quant.kernels`); off, they are dequantized per batch as every other
    precision. `captured` plans the engine for the captured decode step (`engine/decode.py`): its
    workspace in the budget, slots in the bundle's own layout (no CPU kernels), and on CUDA the host
    mirrors as the pinned tier (the store's own tiers off). `fit_sizing` says what each `fitted` knob was sized
    for (`Fit.sizing`: budget, tiers, costs); those that do not hold here are dropped (`engine.fit_dropped`).
    """
    if clock not in ("wall", "sim"):
        raise MoetoolError(f"--clock must be 'wall' or 'sim', not '{clock}'.")
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        # Triton launches on the current device, not its tensors', and a bare torch.cuda.Event() records
        # on the current device's stream: `--device cuda:1` must be the current device for both.
        torch.cuda.set_device(device)
    if captured:
        kernels, host_tiers = False, False
    cost, raw = cost_model(lm, store, hw)
    elsewhere = {f"hw_{k}": raw[k] for k in ("measured_elsewhere", "measured_implausible") if k in raw}
    # What cost-aware policies read (Fate's n, SMoE's load-or-compute): the sim clock's machine, and on
    # the wall clock the machine the run is on. `--hw` names the sim clock's; left at its default on a
    # CUDA device that a shipped preset is made for, the wall clock's policies read that preset, not
    # an RTX 3090's (a wall run on an H100 sized Fate's prefetch for a 3090).
    policy_cost = cost
    if clock == "wall" and device.type == "cuda" and hw == DEFAULT_HW:
        from moetool.engine.clock import preset_for_device

        matched = preset_for_device(torch.cuda.get_device_name(device))
        if matched is not None:
            policy_cost, _ = cost_model(lm, store, matched)
    ctx = EngineContext(moe_layers=tuple(g.index for g in lm.geometry.layers),
                        num_experts=lm.geometry.layers[0].num_experts, top_k=max(g.top_k for g in lm.geometry.layers),
                        expert_bytes={b: store.slot_bytes(b) for b in store.bits}, cache_bytes=0,
                        available_bits=store.bits, hw=policy_cost.policy_view(captured), routers=score_rules(lm).place(device))

    def made(split: BudgetSplit) -> tuple[Policy, EngineContext, dict[str, str]]:
        here = dataclasses.replace(ctx, cache_bytes=split.cache_bytes)
        mine, dropped = _fresh_fit(policy, settings or {}, fitted, fit_sizing, budget, here,
                                   "captured" if captured else "host")
        try:
            return make_policy(policy, settings or {}, here, mine), here, dropped
        except MoetoolError as e:
            # a fitted knob this run cannot take (DynaExq's n_hi past what a cache within the sizing's
            # tolerance holds): the policy's defaults run and the run says why; a refusal without the fit stands
            if not mine:
                raise
            return (make_policy(policy, settings or {}, here, None), here,
                    {**dropped, **{k: f"refused here: {str(e).rstrip('.')}" for k in mine}})

    # Staging buffers for the precisions the policy loads, not every one the bundle stores (a 16-bit LRU
    # over a 16/8/4/2 bundle left a third of its staging unused). Which those are can depend on the cache
    # (Fate's unquantized cache where every expert fits), so the policy is made at the cache left
    # without staging, then at the cache left by its own precisions' staging; every stored precision is
    # staged where the second asks for one the first did not.
    try:
        staged = made(split_budget_for(budget, lm, store, max_tokens, batch, device, captured, staged=()))[0].bits_in_use()
    except MoetoolError:  # refused even so: refused below with this run's own figures
        staged = store.bits
    split = split_budget_for(budget, lm, store, max_tokens, batch, device, captured, staged=staged)
    pol, ctx, dropped = made(split)
    if not set(pol.bits_in_use()) <= set(staged):
        staged = store.bits
        split = split_budget_for(budget, lm, store, max_tokens, batch, device, captured, staged=staged)
        pol, ctx, dropped = made(split)
    if host_tiers if host_tiers is not None else device.type == "cuda" or host_budget is not None:
        store.configure_host(bits=pol.bits_in_use(), host_budget=default_host_budget() if host_budget is None
                             else host_budget, ring_slots=ctx.top_k, page_lock=device.type == "cuda")
    pools = pol.pools()
    if any(p.slots < 0 for p in pools):
        raise MoetoolError(f"policy '{pol.name}' asks for a pool of {min(p.slots for p in pools)} slots in its pools(): "
                           "a pool holds 0 slots or more.")
    # No pool (lod) is no cache to raise; pools the budget sized to nothing are (0.1% of 256 experts is a
    # quarter of one: every caching policy had run as lod, unsaid)
    bare = bare_layers(pools, ctx.moe_layers) if pools else []
    if bare and not pol.says_bare_layers:  # a budget under one expert a layer: the tail layers cache nothing
        many = len(bare) > 1
        which = "every MoE layer" if len(bare) == len(ctx.moe_layers) and many else \
            f"MoE layer{'s' if many else ''} {spans(bare)}"
        pol.notes.append(f"the expert cache of {size_text(split.cache_bytes)} gives {which} no slot, so "
                         f"{'they load' if many else 'it loads'} every expert {'they run' if many else 'it runs'} "
                         f"anew; raise --budget for a slot a layer.")
    budget_tracker = Budget(split.total_bytes)
    budget_tracker.reserve(split.non_expert_bytes + split.margin_bytes, "non-expert weights and the KV margin")
    residency = Residency(store, pools, budget_tracker, device, staged)
    clk = SimClock(cost) if clock == "sim" else WallClock(device)
    foreign = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)  # the run's real peak, not the loading's
        # What the process already holds on the device besides this model's weights (another model,
        # an earlier engine not yet collected, a caller's tensors) is no part of this run's budget:
        # it is taken off the allocator's peak so that the peak compares with the split's total.
        foreign = max(0, torch.cuda.memory_allocated(device) - lm.non_expert_bytes())
    engine = Engine(lm, store, pol, residency, clk, cost, device, experts_impl, kernels)
    engine.stats.foreign_bytes = foreign
    engine.fit_dropped = dropped
    engine.plan_tokens, engine.plan_batch = max_tokens, batch
    engine.planned_captured = captured  # the budget holds the captured step's workspace
    dtype = str(store.compute_dtype).removeprefix("torch.")
    kernel_layers = {str(bits): len(layers) for bits, layers in engine.kernel_layers.items()}
    policy_hw = policy_cost.hw.name  # recorded: which machine's costs the policy's decisions assumed
    # How the routers score their experts where it is not the papers' softmax (`router_scores`): what
    # SMoE's thresholds, Fate's percentile and DyMoE's look-ahead read on this model.
    scoring = {"router_scores": ctx.routers.kinds()} if ctx.routers.kinds() else {}
    if ctx.routers.unmatched and (pol.reads_scores or residency.wants_scores()):  # said where it matters
        scoring["router_scores_unmatched"] = list(ctx.routers.unmatched)
    engine.stats.context = lambda: {"dtype": dtype, "kernel_layers": kernel_layers, "policy_hw": policy_hw, **scoring,
                                    **elsewhere, **store.host_stats()}
    return engine, split

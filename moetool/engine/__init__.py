"""Assemble an engine: budget -> policy -> pools -> cache -> clock, installed into a loaded model.

    lm = load_model(path)
    engine, plan = build_engine(lm, HostStore.from_experts(lm.experts, torch.float32), "lru", budget="25%")
    lm.model.generate(ids, max_new_tokens=8, do_sample=False)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from moetool.engine.cache import Budget, DeviceCache, STAGING_SLOTS
from moetool.engine.clock import CostModel, SimClock, WallClock, load_hw
from moetool.engine.runtime import Engine
from moetool.engine.store import REFERENCE_BITS, HostStore
from moetool.errors import MoetoolError
from moetool.model import LoadedModel, available_memory
from moetool.policies import make_policy
from moetool.policies.base import EngineContext

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
ACTIVATION_MARGIN = 16 * 2**20  # bytes for activations and workspace beside the KV cache


@dataclass(frozen=True)
class BudgetPlan:
    """How the device budget is spent."""

    total_bytes: int
    non_expert_bytes: int
    margin_bytes: int  # KV cache for the longest sequence + activations
    staging_bytes: int
    cache_bytes: int  # what policies may carve into expert slots
    expert_bytes_reference: int  # all experts at the reference precision (what a percentage refers to)


def parse_size(text: str, option: str = "--budget") -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        share = " or a percentage like 25%" if option == "--budget" else ""
        raise MoetoolError(f"{option} '{text}' is not a size like 12GiB / 500MB{share}.")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def kv_margin(config: Any, max_tokens: int, batch: int, dtype: torch.dtype, top_k: int = 0) -> int:
    """Bytes of a KV cache for `batch` sequences of `max_tokens`, plus activations.

    The activations are a fixed workspace margin plus the engine's per-layer expert outputs, held
    for a prefill of `max_tokens` until they are summed in expert order (T * top_k rows of H).
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    item = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * cfg.num_hidden_layers * heads * head_dim * item + top_k * cfg.hidden_size * item
    return per_token * max_tokens * batch + ACTIVATION_MARGIN


def plan_budget(spec: str, lm: LoadedModel, store: HostStore, max_tokens: int = 2048, batch: int = 1) -> BudgetPlan:
    """`12GiB` is the whole device budget; `25%` is the expert cache as a share of bf16 experts."""
    n_experts = sum(g.num_experts for g in lm.geometry.layers)
    ref = n_experts * store.slot_bytes(REFERENCE_BITS) if REFERENCE_BITS in store.bits else \
        n_experts * store.slot_bytes(max(store.bits)) * 16 // max(store.bits)
    non_expert = lm.non_expert_bytes()
    margin = kv_margin(lm.model.config, max_tokens, batch, store.compute_dtype, lm.geometry.layers[0].top_k)
    staging = STAGING_SLOTS * sum(store.slot_bytes(b) for b in store.bits)
    fixed = non_expert + margin + staging
    text = spec.strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100
        except ValueError:
            raise MoetoolError(f"--budget '{spec}' is not a percentage like 25%.") from None
        if not 0 <= share <= 10:
            raise MoetoolError(f"--budget '{spec}' must be between 0% and 1000% of the bf16 expert bytes.")
        cache = int(share * ref)
        total = fixed + cache
    else:
        total = parse_size(text)
        cache = total - fixed
        if cache < 0:
            raise MoetoolError(f"--budget {spec} is below the minimum of {fixed / 2**20:.1f} MiB (non-expert weights "
                               f"{non_expert / 2**20:.1f} MiB + KV/activation margin {margin / 2**20:.1f} MiB + "
                               f"staging {staging / 2**20:.1f} MiB).")
    return BudgetPlan(total_bytes=total, non_expert_bytes=non_expert, margin_bytes=margin, staging_bytes=staging,
                      cache_bytes=cache, expert_bytes_reference=ref)


def cost_model(lm: LoadedModel, store: HostStore, hw: str) -> tuple[CostModel, dict]:
    profile, raw = load_hw(hw)
    g = lm.geometry.layers[0]
    expert_params = g.hidden_size * g.intermediate_size * (3 if g.gated else 2)
    ref_bytes = expert_params * 2  # bf16, what a dequantizing kernel writes and a bf16 expert reads
    dense_params = lm.non_expert_bytes() / next(lm.model.parameters()).element_size()
    n_moe = len(lm.geometry.layers)
    cost = CostModel(hw=profile, expert_bytes={b: store.slot_bytes(b) for b in store.bits},
                     expert_flops_per_token=2.0 * expert_params, reference_bytes=ref_bytes,
                     dense_bytes_per_layer=dense_params * 2 / n_moe,
                     dense_flops_per_token_per_layer=2.0 * dense_params / n_moe)
    return cost, raw


def default_host_budget() -> int:
    """What the machine has available now, less a margin for everything else (10%, at least 1 GiB)."""
    free = available_memory()
    return max(0, free - max(1 << 30, free // 10))


def build_engine(lm: LoadedModel, store: HostStore, policy: str, *, settings: dict[str, str] | None = None,
                 fitted: dict[str, Any] | None = None, budget: str = "100%", clock: str = "wall",
                 hw: str = "rtx3090", device: str | torch.device = "cpu", max_tokens: int = 2048,
                 batch: int = 1, host_budget: int | None = None, host_tiers: bool | None = None) -> tuple[Engine, BudgetPlan]:
    """Build the policy and the engine over `store` and install it in `lm`.

    `host_tiers` (default: on CUDA, or wherever a `host_budget` is given) keeps the policy's
    precisions in host memory (pinned on CUDA) within `host_budget` bytes (default:
    `default_host_budget()`) and stages the rest through a ring; off, blobs are copied straight
    from where they lie (the memory-mapped bundle).
    """
    if clock not in ("wall", "sim"):
        raise MoetoolError(f"--clock must be 'wall' or 'sim', not '{clock}'.")
    device = torch.device(device)
    plan = plan_budget(budget, lm, store, max_tokens, batch)
    cost, _ = cost_model(lm, store, hw)
    ctx = EngineContext(moe_layers=tuple(g.index for g in lm.geometry.layers),
                        num_experts=lm.geometry.layers[0].num_experts, top_k=lm.geometry.layers[0].top_k,
                        expert_bytes={b: store.slot_bytes(b) for b in store.bits}, cache_bytes=plan.cache_bytes,
                        available_bits=store.bits, hw=cost.policy_view())
    pol = make_policy(policy, settings or {}, ctx, fitted)
    if host_tiers if host_tiers is not None else device.type == "cuda" or host_budget is not None:
        store.configure_host(bits=pol.bits_in_use(), host_budget=default_host_budget() if host_budget is None
                             else host_budget, ring_slots=ctx.top_k, page_lock=device.type == "cuda")
    budget_tracker = Budget(plan.total_bytes)
    budget_tracker.reserve(plan.non_expert_bytes + plan.margin_bytes, "non-expert weights and the KV margin")
    cache = DeviceCache(store, pol.pools(), budget_tracker, device)
    clk = SimClock(cost) if clock == "sim" else WallClock(device)
    engine = Engine(lm, store, pol, cache, clk, cost, device)
    dtype = str(store.compute_dtype).removeprefix("torch.")
    engine.stats.context = lambda: {"dtype": dtype, **store.host_stats()}
    return engine, plan

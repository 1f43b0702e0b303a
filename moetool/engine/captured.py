"""The MoE layers of the captured decode step: device-side residency, the policy's in-step plan, and
the experts computed from their device slots or, for a miss, straight from host memory.

Inside the step nothing reads the device from the host and no shape depends on the routing:

- the slot table, [MoE layers, experts, precisions] int32 on the device (-1: no usable copy), is the
  residency's view, written by the host between steps (`SlotTable.sync`); the pools never move, so
  a slot id is an address;
- per layer the policy's `plan_step` says, per (token, slot), which expert runs, at which bits (0:
  skipped) and with which weight; the table turns (expert, bits) into a slot;
- each routed expert's weights are gathered by index, gpt-fast's `w1[expert_indices]` (transformers'
  `batched_mm`), from its pool slot, or, where the table has no copy, from the host mirror's row
  (`engine/mirror.py`: zero-copy, the miss costs no round trip); then the expert MLP per row as
  `batched_mm` computes it, the routing weights, and the sum over k;
- what the layer did (its routing, the plan, which rows hit, the look-ahead's prefetch, the router
  scores a score window reads) goes into the step's log, preallocated, for the host half to read one
  step behind (`engine/decode.py`).

    layers = CapturedLayers(engine, mirrors)
    out = layers.run(module, hidden, top_k_index, top_k_weights)   # inside the compiled step
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.integrations.moe import _batched_linear  # what transformers' batched_mm experts call

from moetool.engine.mirror import Mirrors
from moetool.engine.signals import mean_scores
from moetool.engine.zero_copy import blob_rows, host_rows, missed_rows
from moetool.inference import _router_extra_args, router_logits
from moetool.policies.device import DevicePlan, DeviceView
from moetool.quant.format import dequantize_parts, stack_views


def captured_workspace(layers: Any, store: Any) -> int:
    """Device bytes the captured step gathers and decodes into per layer, beside the pools: for each of
    a token's top-k rows, its blob (gathered once, from its slot or from host memory; at most the
    largest stored precision's) and the expert's weights in the compute dtype; or, through the fused
    kernels, which read slots in place, the rows read from host memory at every precision at once."""
    from moetool.engine.budget import expert_params

    k = max(g.top_k for g in layers)
    weights = max(expert_params(g) for g in layers) * store.compute_dtype.itemsize
    gathered = max(store.slot_bytes(b) for b in store.bits) + weights
    fused = sum(store.slot_bytes(b) for b in store.bits)
    return k * max(gathered, fused)


class SlotTable:
    """The residency's slot of every (MoE layer, expert, precision) as a device tensor (-1: none
    usable), kept in step with the residency's change log, written to the device between steps."""

    def __init__(self, residency: Any, layers: tuple[int, ...], num_experts: int, bits: tuple[int, ...],
                 device: torch.device):
        self.residency, self.device = residency, device
        self.pos = {layer: i for i, layer in enumerate(layers)}
        self.pidx = {b: i for i, b in enumerate(bits)}
        self.host = np.full((len(layers), num_experts, len(bits)), -1, dtype=np.int32)  # [L, E, P]
        for (layer, expert, b), h in residency.table.items():
            if h.state.name == "RESIDENT" and h.slot is not None and b in self.pidx:
                self.host[self.pos[layer], expert, self.pidx[b]] = h.slot
        residency.changes = []
        self.device_table = torch.from_numpy(self.host.copy()).to(device)  # [L, E, P] int32

    def sync(self) -> bool:
        """Apply the residency's changes since the last sync and write the table to the device (queued
        on the compute stream, so the next step reads it and the running one does not). Whether
        anything changed."""
        changes, self.residency.changes = self.residency.changes, []
        if not changes:
            return False
        for layer, expert, b, slot in changes:
            if b in self.pidx:
                self.host[self.pos[layer], expert, self.pidx[b]] = slot
        # A fresh pinned copy each time: torch keeps it until the queued copy has read it.
        table = torch.from_numpy(self.host.copy())
        self.device_table.copy_(table.pin_memory() if self.device.type == "cuda" else table, non_blocking=True)
        return True


class StepLog:
    """What one captured step did, preallocated on the device and written in place by the step."""

    def __init__(self, n_layers: int, rows: int, num_experts: int, device: torch.device, scores: bool):
        L, S, E = n_layers, rows, num_experts
        self.routed = torch.zeros(L, S, dtype=torch.long, device=device)  # [L, T*k] the router's experts
        self.weight = torch.zeros(L, S, dtype=torch.float32, device=device)  # [L, T*k] the router's weights
        self.expert = torch.zeros(L, S, dtype=torch.long, device=device)  # [L, T*k] the plan's experts
        self.bits = torch.zeros(L, S, dtype=torch.long, device=device)  # [L, T*k] 0: skipped
        self.hit = torch.zeros(L, S, dtype=torch.bool, device=device)  # [L, T*k] read from a device slot
        self.prefetch = torch.full((L, E), -1, dtype=torch.long, device=device)  # [L, E] next layer's wishes
        self.scores = torch.zeros(L, E if scores else 0, dtype=torch.float32, device=device)  # [L, E] mean scores
        self.token = torch.zeros(1, dtype=torch.long, device=device)  # the token the step chose

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}


def held_for_life(residency: Any, bits: int, experts: int) -> bool:
    """Whether the pool at `bits` holds all `experts` for the engine's life (no eviction, a slot each):
    nothing at `bits` is ever missed or copied in after the engine is warmed."""
    pool = residency.pools.get(bits)
    return pool is not None and pool.spec.slots >= experts and pool.spec.eviction is None


class CapturedLayers:
    """The engine's MoE layers inside the captured step (see the module docstring)."""

    def __init__(self, engine: Any, mirrors: Mirrors, kernels: bool | None = None):
        self.engine, self.mirrors = engine, mirrors
        self.policy, self.residency, self.store = engine.policy, engine.residency, engine.store
        self.device = engine.device
        self.layers = tuple(g.index for g in engine.layers)
        self.num_experts = engine.layers[0].num_experts
        self.top_k = engine.layers[0].top_k
        self.bits = self.policy.bits_in_use()  # precisions the plan may name, highest first
        self.table = SlotTable(self.residency, self.layers, self.num_experts, self.bits, self.device)
        self.dtype = self.store.compute_dtype
        # Per (layer, bits): typed views of the pool's slots and of the mirror's rows (made once).
        self.pool_parts = {(g.index, b): stack_views(self.residency.pool_bytes(b), self.store.layout(g.index, b))
                           for g in engine.layers for b in self.bits if b in self.residency.pools}
        self.host_rows = {(g.index, b): mirrors.rows(g.index, b) for g in engine.layers for b in self.bits
                          if self._misses(b)}
        # MoE position -> look-ahead routers its plan runs a step (set as the step is traced, so as static as the
        # graph): the sim clock charges each as the host path charges `Engine._predict`, one kernel.
        self.lookahead: dict[int, int] = {}
        self._predicted = 0
        self.wants_logits = "router_logits" in self.policy.signals or self.residency.wants_scores()
        self.logits_box: list[torch.Tensor | None] = [None] * len(self.layers)
        self.log = StepLog(len(self.layers), self.top_k, self.num_experts, self.device, self.residency.wants_scores())
        self.prefetch_bits: dict[int, int] = {}  # layer -> bits of its logged prefetch (static per layer)
        self.routers: dict[int, tuple[Any, dict, bool]] = {}
        # layer -> its block's activation where the fused Triton kernels (`moetool.kernels`) take every
        # precision of the policy: on CUDA, all of a layer's experts in three launches, reading each slot
        # as stored; elsewhere (a CPU, a layout they refuse) the gather-by-index path below.
        self.kernel_acts: dict[int, Any] = {}
        if kernels if kernels is not None else self.device.type == "cuda":  # forced on a CPU: tests, interpreted
            from moetool.kernels import activation_of, supported

            for g in engine.layers:
                act = activation_of(engine.lm.model.get_submodule(g.path).experts)
                if all(supported(self.store.layout(g.index, b), act, self.device) is None for b in self.bits):
                    self.kernel_acts[g.index] = act

    def _misses(self, bits: int) -> bool:
        """Whether a row at `bits` can lack a device copy: no pool, or a pool that cannot hold every
        expert, unless the policy picks `bits` only for resident copies."""
        if held_for_life(self.residency, bits, len(self.layers) * self.num_experts):
            return False  # every expert resident for the engine's life (resident, static, DynaExq's b_lo)
        return self.policy.device_misses(bits)

    def prepare(self) -> None:
        """Before the first compile: each router's call outside its block, as the host path makes it
        (`inference.call_router`: which extra arguments, flat or batched hidden states, found here
        for a router class the process has not called yet)."""
        from moetool.inference import router_form

        lm = self.engine.lm
        for g in lm.geometry.layers:
            block = lm.model.get_submodule(g.path)
            router = block.get_submodule(g.router)
            params = _router_extra_args(type(router))
            if params is None or any(req and not hasattr(block, n) for n, req in params):
                continue
            extra = {name: getattr(block, name) for name, _ in params if hasattr(block, name)}
            param = next(router.parameters(), None)
            probe = torch.zeros(1, g.hidden_size, device=self.device,
                                dtype=param.dtype if param is not None else torch.float32)
            form = router_form(router, extra, probe)  # found here: the traced step cannot try one and catch
            if form != "none":
                self.routers[g.index] = (router, extra, form == "batched")

    # -- inside the step -------------------------------------------------------------------------------
    def router_output(self, layer: int, output: Any) -> None:
        """The router's output of a layer in the step (its forward is wrapped by the engine)."""
        if self.wants_logits:
            self.logits_box[self.engine.moe_index[layer]] = router_logits(output, self.num_experts).float()

    def resident(self, layer: int, bits: int) -> torch.Tensor:
        """[E] bool: experts of `layer` with a usable copy at `bits` (the table as the host last wrote it)."""
        p = self.table.pidx.get(bits)
        if p is None:
            return torch.zeros(self.num_experts, dtype=torch.bool, device=self.device)
        return self.table.device_table[self.table.pos[layer], :, p] >= 0

    def predict(self, later: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """A later MoE layer's router logits [T, E] on this layer's gate input (its class's own forward,
        not the engine's wrapper: nothing is logged for the later layer)."""
        found = self.routers.get(later)
        if found is None:
            return None
        router, extra, batched = found
        self._predicted += 1
        param = next(router.parameters(), None)
        x = hidden.to(param.dtype) if param is not None else hidden
        out = type(router).forward(router, x[None] if batched else x, **extra)
        return router_logits(out, self.num_experts).float()

    def run(self, module: Any, hidden: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor) -> torch.Tensor:
        """One MoE layer of the captured step: plan, resolve, compute, log. [T, H] -> [T, H]."""
        layer = module.layer.index
        pos = self.engine.moe_index[layer]
        logits = self.logits_box[pos]
        self.logits_box[pos] = None
        view = DeviceView(layer=layer, moe_pos=pos, num_experts=self.num_experts, top_k_index=top_k_index.long(),
                          top_k_weights=top_k_weights, router_logits=logits, resident=self.resident,
                          predict=lambda later: self.predict(later, hidden))
        self._predicted = 0
        plan = self.policy.plan_step(view)
        self.lookahead[pos] = self._predicted
        out, hit = self.experts(module, hidden, plan)
        self._log(pos, layer, view, plan, hit, logits)
        return out

    def experts(self, module: Any, hidden: torch.Tensor, plan: DevicePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The plan's experts on `hidden` [T, H], as transformers' `batched_mm` computes them (one row per
        (token, slot), gathered weights, then the weighted sum over slots); and which rows hit [T*k]."""
        layer, E = module.layer.index, self.num_experts
        T, k = plan.expert.shape
        expert = plan.expert.reshape(-1).clamp(0, E - 1)  # [S] (a skipped row reads expert 0, then drops it)
        bits = plan.bits.reshape(-1)  # [S]
        slots = self.table.device_table[self.table.pos[layer]].index_select(0, expert)  # [S, P] int32
        if layer in self.kernel_acts:
            return self._fused(layer, hidden, plan, expert, bits, slots)
        x = hidden.repeat_interleave(k, dim=0)  # [S, H]
        y = torch.zeros_like(x, dtype=self.dtype)
        hit = torch.zeros_like(bits, dtype=torch.bool)
        for p, b in enumerate(self.bits):
            if (layer, b) not in self.pool_parts and (layer, b) not in self.host_rows:
                continue  # no pool and never missed: the plan cannot run this precision (DynaExq's b_hi at n_hi = 0)
            use = bits == b  # [S]
            slot = slots[:, p].long()  # [S]
            here = use & (slot >= 0)
            hit = hit | here
            parts = self._gather(layer, b, torch.where(here, slot, -1), torch.where(use & ~here, expert, -1))
            stack = dequantize_parts(parts, self.store.layout(layer, b), self.dtype)
            h = _batched_linear(x.to(self.dtype), stack.gate_up, stack.gate_up_bias)  # [S, 2I]
            h = module.activation(h)  # [S, I]
            y_b = _batched_linear(h, stack.down, stack.down_bias)  # [S, H]
            y = torch.where(use[:, None], y_b, y)
        w = torch.where(bits > 0, plan.weight.reshape(-1).to(y.dtype), torch.zeros((), dtype=y.dtype, device=y.device))
        out = (y * w[:, None]).view(T, k, -1).sum(dim=1)
        return out.to(hidden.dtype), hit

    def _fused(self, layer: int, hidden: torch.Tensor, plan: DevicePlan, expert: torch.Tensor, bits: torch.Tensor,
               slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused Triton kernels over every precision's pool and, for the rows that missed, the blobs
        read from host memory in place (`zero_copy.host_rows`, into rows of their own): one call."""
        from moetool.kernels import SlotPool, experts_forward

        T, k = plan.expert.shape
        rows = torch.arange(T * k, device=expert.device)  # [S]
        pools, hit = [], torch.zeros_like(bits, dtype=torch.bool)
        for p, b in enumerate(self.bits):
            if (layer, b) not in self.pool_parts and (layer, b) not in self.host_rows:
                continue
            use, slot = bits == b, slots[:, p].long()  # [S]
            here = use & (slot >= 0)
            hit = hit | here
            layout = self.store.layout(layer, b)
            if (layer, b) in self.pool_parts:
                pools.append(SlotPool(self.residency.pool_bytes(b), layout,
                                      torch.where(here, slot, -1).view(T, k).to(torch.int32)))
            if (layer, b) in self.host_rows:
                missed = use & ~here
                read = missed_rows(self.host_rows[layer, b], torch.where(missed, expert, -1))  # [S, nbytes]
                pools.append(SlotPool(read, layout, torch.where(missed, rows, -1).view(T, k).to(torch.int32)))
        w = torch.where(plan.bits > 0, plan.weight, torch.zeros_like(plan.weight))
        return experts_forward(hidden, w, pools, self.kernel_acts[layer]), hit

    def _gather(self, layer: int, bits: int, slot: torch.Tensor, missed: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each row's blob parts: from its pool slot (`slot` [S], -1 where it has none at `bits`), or, for
        a row whose expert has no device copy (`missed` [S]: its expert, -1 elsewhere), from the host
        mirror in place (`zero_copy`). Each row's bytes are read once; a row with neither is zeros."""
        layout = self.store.layout(layer, bits)
        host = self.host_rows.get((layer, bits))
        if host is None:  # never missed: the pool's typed views, gathered part by part
            return {n: v.index_select(0, slot.clamp(min=0)) for n, v in self.pool_parts[layer, bits].items()}
        if (layer, bits) not in self.pool_parts:  # no pool at `bits`: every row it runs is a miss
            return stack_views(host_rows(host, missed), layout)
        # A hit's blob from its slot, a miss's from its host row, in one op: [S, nbytes], then its typed views.
        return stack_views(blob_rows(self.residency.pool_bytes(bits), slot, host, missed), layout)

    def _log(self, pos: int, layer: int, view: DeviceView, plan: DevicePlan, hit: torch.Tensor,
             logits: torch.Tensor | None) -> None:
        log = self.log
        log.routed[pos].copy_(view.top_k_index.reshape(-1))
        log.weight[pos].copy_(view.top_k_weights.reshape(-1).float())
        log.expert[pos].copy_(plan.expert.reshape(-1))
        log.bits[pos].copy_(plan.bits.reshape(-1))
        log.hit[pos].copy_(hit)
        if plan.prefetch is not None:
            n = plan.prefetch.shape[0]
            log.prefetch[pos, :n].copy_(plan.prefetch)
            log.prefetch[pos, n:].fill_(-1)
            self.prefetch_bits[layer] = plan.prefetch_bits
        if log.scores.shape[1] and logits is not None:
            log.scores[pos].copy_(mean_scores(self.policy.ctx.routers.scores(layer, logits)))

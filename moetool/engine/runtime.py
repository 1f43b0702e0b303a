"""The engine: per MoE layer, route -> plan -> group -> schedule -> compute (hits, then in flight,
then misses; one grouped GEMM per precision and batch, or one expert at a time with
`experts_impl="eager"`) -> combine -> prefetch. The steady state (a routed plan no policy changed,
every expert resident at its one precision) skips the per-expert steps: `_run_resident`; a policy
that never reads the routing (resident, static) skips the host entirely: `device_layers`.

`Engine` owns the host store, the residency, the copier, the clock, the stats and the policy, and installs
an `EngineExperts` module in every MoE block. Hooks on the model's forward delimit steps, so plain
`model.generate` (or lm-eval) drives the engine unchanged.

    engine = Engine(lm, store, policy, residency, clock, cost, device=torch.device("cpu"))
    lm.model.generate(ids, max_new_tokens=8, do_sample=False); engine.stats.summary()
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import numpy as np
import torch
from torch import nn

from moetool.defaults import EXPERTS_IMPLS
from moetool.engine.budget import check_plan
from moetool.engine.clock import CostModel, SimClock, WallClock, cpu_experts_ready
from moetool.engine.device_layers import DeviceLayers
from moetool.engine.groups import Combine, Group, Routed, Rows, Status, group_plan, grouped_mlp, routed_rows, taken_plan
from moetool.engine.loads import Loads
from moetool.engine.residency import Residency, State
from moetool.engine.signals import mean_scores, token_importance
from moetool.engine.stats import LayerStats, Stats, StepRecord
from moetool.engine.store import HostStore
from moetool.engine.transfer import Copier, HostRows, routing_to_host, rows_to_host, upload
from moetool.engine.weights import PoolWeights
from moetool.errors import MoetoolError
from moetool.inference import call_router, past_tokens, real_rows, router_logits
from moetool.model import LoadedModel, MoeLayer, ProviderExperts
from moetool.policies.base import Fetch, LayerPlan, LayerView, Phase, Policy, Step, Where
from moetool.quant.kernels import MODULES as KERNELS
from moetool.quant.kernels import layers_on_kernel

# Rows up to which low-bit experts take the Triton kernels on CUDA: they read an expert once per row
# (decode sizes); a prefill's rows take grouped GEMMs, which read it once.
TRITON_ROWS = 16


class EngineExperts(ProviderExperts):
    """The experts module the engine installs: same call as the model's, computed by the engine."""

    def __init__(self, original: nn.Module, layer: MoeLayer, engine: "Engine"):
        super().__init__(original, layer, provider=None)  # type: ignore[arg-type]
        self.__dict__["engine"] = engine  # not a submodule: the engine is not part of the model

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.engine.capturing:  # inside the captured decode step (`engine/decode.py`)
            return self.engine.captured.run(self, hidden_states, top_k_index, top_k_weights)
        return self.engine.run_layer(self, hidden_states, top_k_index, top_k_weights)


class Engine(Loads):
    def __init__(self, lm: LoadedModel, store: HostStore, policy: Policy, residency: Residency,
                 clock: SimClock | WallClock, cost: CostModel, device: torch.device,
                 experts_impl: str = "grouped_mm", kernels: bool = True):
        if experts_impl not in EXPERTS_IMPLS:
            raise MoetoolError(f"--experts-impl must be one of {', '.join(EXPERTS_IMPLS)}, not '{experts_impl}'.")
        self.grouped = experts_impl == "grouped_mm"  # else eager: one expert at a time, as its loop
        self.lm, self.store, self.policy, self.residency = lm, store, policy, residency
        self.clock, self.cost, self.device = clock, cost, torch.device(device)
        self.simulated = clock.kind == "sim"  # the cost model is read only by the simulated clock
        self.weights = PoolWeights(store, residency, self.device)  # what grouped GEMMs read from the pools
        self.decode_chunk = max(g.top_k for g in lm.geometry.layers)  # experts decoded at once (budget.decode_workspace)
        self.copier, self.layers = Copier(self.device), lm.geometry.layers
        self._max_bits, self._stored = max(int(b) for b in store.bits), frozenset(int(b) for b in store.bits)
        self.moe_index = {g.index: i for i, g in enumerate(self.layers)}
        self.stats = Stats(tuple(g.index for g in self.layers))
        self.step, self._step_count = None, 0  # the current Step, and how many have begun
        self._logits: dict[int, torch.Tensor] = {}
        # [T] heavy-hitter scores (DyMoE eq. 1) of this prefill's latest softmax-attention layer: a MoE
        # layer after another mixer (Mamba, linear attention) reads the nearest one before it (dymoe.py).
        self._importance: torch.Tensor | None = None
        self._real_rows: torch.Tensor | None = None  # [B*T] bool: this prefill's real tokens (left padding not)
        self._past, self._sequences = 0, 1  # this forward's cached positions and sequences: its attention's cost
        self._predicting = False
        # The captured decode step's layers (`engine/captured.py`), and whether a forward now is one of
        # its steps: then the hooks below stand aside (a step is the program's, not the host's).
        self.captured: Any = None
        self.capturing = False
        self.planned_captured = False  # whether the budget holds the captured step's workspace (build_engine)
        self.fit_dropped: dict[str, str] = {}  # fitted knobs that do not hold for this run -> why (build_engine)
        self.decode_info: dict[str, Any] = {"path": "host", "path_reason": "the host-driven engine (model forward calls)"}
        # The sequence length and batch the budget's KV margin was planned for (0: not checked).
        self.plan_tokens, self.plan_batch = 0, 1
        self._hooks, self._routers = [], []  # forward hooks; routers whose forward it wraps (`_install`)
        # bits -> layers whose experts at those bits run through one of torch's low-bit kernels
        # (converted once, in their slot, as they load; `quant.kernels`): INT4 and INT2 through the
        # packed-int4 one, per-channel INT8 through the int8 one; on a CPU, grouped path, shapes they
        # take. Of those, `fused_layers`: where a single token's experts run together (`fused_forward`).
        self.kernel_layers, self.fused_layers = layers_on_kernel(
            store, self.layers, self.device, next(lm.model.parameters()).dtype) if kernels and self.grouped else ({}, {})
        self.weights.kernel = {(layer, bits) for bits, layers in self.kernel_layers.items() for layer in layers}
        # Not under the sim clock (it charges each expert) nor beside CPU low-bit kernels (own path).
        self.device_layers = DeviceLayers(self.weights, policy.precisions()[0], not policy.host_routing and
                                          self.grouped and not self.simulated and not self.kernel_layers)
        self._install()
        # (layer, bits) -> the block's activation, where low-bit experts run through the fused Triton kernels on
        # CUDA at decode sizes (`moetool.kernels`, slots as stored); the reference keeps grouped_mm, bit for bit.
        self.triton_layers: dict[tuple[int, int], Any] = {}
        if self.device.type == "cuda":  # the kernels' tuned configs (either decode path) refused now, not mid-run
            from moetool.kernels.config import check_tuned
            try:
                check_tuned(self.device)
            except ValueError as e:
                raise MoetoolError(f"{e}.") from None
        if kernels and self.grouped and self.device.type == "cuda":
            from moetool.kernels import activation_of, supported
            for g in self.layers:
                act = activation_of(self.lm.model.get_submodule(g.path).experts)
                self.triton_layers.update({(g.index, b): act for b in store.bits if b != 16 and
                                           supported(store.layout(g.index, b), act, self.device) is None})
        self.warm_bytes = self._warm()

    def on_kernel(self, layer: int, bits: int) -> bool:
        """Whether `layer`'s experts at `bits` run through a low-bit kernel (their slots hold its layout)."""
        return layer in self.kernel_layers.get(bits, ())

    # -- wiring ----------------------------------------------------------------------------------
    def _install(self) -> None:
        model = self.lm.model
        for g in self.layers:
            block = model.get_submodule(g.path)
            block.experts = EngineExperts(block.experts.impl, g, self)
            router = block.get_submodule(g.router)
            # An instance attribute, not a forward hook: a module with hooks takes nn.Module's slow call
            # path, ~40 us a layer on the CI machine (1-2% of a demo decode step, bench_engine.py p1).
            router.forward = self._router_capture(g.index, router.forward)
            self._routers.append(router)
        if "token_importance" in self.policy.signals:
            # DyMoE eq. 1 needs attention probabilities, which only the eager kernel returns. A model
            # without softmax attention layers (or an eager kernel) gets none: eq. 2 then counts every token.
            try:
                model.set_attn_implementation("eager")
            except (ValueError, NotImplementedError):
                pass
            for g in self.layers:
                attn = getattr(model.get_submodule(g.path.rsplit(".", 1)[0]), "self_attn", None)
                if isinstance(attn, nn.Module):
                    self._hooks.append(attn.register_forward_hook(self._attention_hook()))
        self._hooks.append(model.register_forward_pre_hook(self._before_forward, with_kwargs=True))
        self._hooks.append(model.register_forward_hook(self._after_forward))

    def _router_capture(self, layer: int, forward):
        experts = self.lm.geometry.layer(layer).num_experts

        def capture(*args, **kwargs):
            output = forward(*args, **kwargs)
            if self.capturing:
                self.captured.router_output(layer, output)
            elif not self._predicting:
                self._logits[layer] = router_logits(output, experts)  # [T, E]
            return output
        return capture

    def _attention_hook(self):
        def hook(module, args, output):
            if self.capturing:
                return
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None  # [B, H, Tq, Tk]
            if isinstance(weights, torch.Tensor) and weights.dim() == 4 and self.step is not None \
                    and self.step.phase == Phase.PREFILL:
                # A prefill's keys are its own queries; a static cache's further slots are empty (eq. 1 per token)
                self._importance = token_importance(weights[..., :weights.shape[-2]]).cpu()  # [B*T] DyMoE eq. 1
        return hook

    def _before_forward(self, module, args, kwargs):
        if self.capturing:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None and kwargs.get("inputs_embeds") is not None:  # [B, T, H]: its tokens count the same
            ids = kwargs["inputs_embeds"][..., 0]
        self._importance = None  # this forward's attention layers set it again
        past = past_tokens(kwargs)
        if ids is not None and self.plan_tokens:
            check_plan(past + ids.shape[-1], ids.shape[0] if ids.dim() > 1 else 1, self.plan_tokens, self.plan_batch)
        self._real_rows = real_rows(kwargs.get("attention_mask"), ids) if past == 0 else None
        tokens = int(ids.numel()) if ids is not None else 1
        self._past, self._sequences = past, (ids.shape[0] if ids is not None and ids.dim() > 1 else 1)
        self.begin_step(Phase.PREFILL if past == 0 else Phase.DECODE,
                        tokens if self._real_rows is None else int(self._real_rows.sum()))

    def _after_forward(self, module, args, output):
        if not self.capturing:
            self.end_step()

    # -- steps -----------------------------------------------------------------------------------
    def begin_step(self, phase: Phase, num_tokens: int) -> None:
        self.step = Step(index=self._step_count, phase=phase, num_tokens=num_tokens)
        self._step_count += 1
        self.clock.begin_step()

    def end_step(self) -> None:
        seconds = self.clock.end_step()
        self.device_layers.end_step()
        self.copier.settle()
        self.stats.steps.append(StepRecord("prefill" if self.step.phase == Phase.PREFILL else "decode",
                                           self.step.num_tokens, seconds))
        for f in self.policy.end_step(self.step, self.residency):  # background migrations: never waited for
            self._start_load(f, shield=set())
        self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, self.residency.budget.peak)
        if self.device.type == "cuda":  # what the allocator really held, beside what the budget reserved
            self.stats.peak_allocated_bytes = max(self.stats.peak_allocated_bytes or 0,
                                                  torch.cuda.max_memory_allocated(self.device) - self.stats.foreign_bytes)

    # -- one MoE layer -----------------------------------------------------------------------------
    def run_layer(self, module: EngineExperts, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
        g = module.layer
        st = self.stats.layer(g.index)
        if self.device_layers.stacks:  # a layer whose routing never leaves the device (`device_layers`)
            out = self.device_layers.run(module, hidden, top_k_index, top_k_weights, st, self._real(hidden.shape[0]))
            if out is not None:
                self._logits.pop(g.index, None)
                return out
        if self.simulated:
            self.clock.compute(self.cost.t_dense(hidden.shape[0], past=self._past, sequences=self._sequences))
        self._publish_ready()
        view = self._view(g, hidden, top_k_index, top_k_weights)  # the layer's one host sync
        plan = taken_plan(self.policy.plan(view), self.policy.name, view)
        weight = plan.routing_weight().to(hidden.device, hidden.dtype, non_blocking=True)  # [T, k]
        out = Combine(hidden, weight, grouped=self.grouped)
        routed = routed_rows(plan, view.top_k_index, g.num_experts, self.device) if self.grouped else None
        on_device = self._run_resident(module, hidden, routed, st, out, view.real_rows) if routed is not None else None
        fetched = False
        if on_device is None:  # anything but the steady state: group, schedule, load, compute
            groups = self._group(plan, view.top_k_index, g.num_experts, st, routed, view.real_rows)
            on_host = [x for x in groups if x.where == Where.CPU]
            on_device, staged = self._schedule(g.index, [x for x in groups if x.where == Where.GPU] if on_host else groups)
            if not staged:
                # Later layers' copies start while this layer computes, behind its own demand copies on
                # the one copy stream: Fate's n = T / t_expert counts this layer's t_moe in the window T
                # (§4.3, "at the beginning of gate in the i-th block"), DyMoE identifies them "before the
                # computation of the current layer is complete" (§4.4.1). Staged demand copies are
                # issued during the compute, so with any left the prefetch waits for the layer's end.
                self._prefetch(view, {(g.index, x.expert) for x in on_device})
                fetched = True
            # SMoE's CPU-assisted experts start with the layer; rows to the host before device work is queued
            cpu_ready = cpu_experts_ready(self.clock, self.cost, hidden, [len(x) for x in on_host])
            host_rows = rows_to_host(hidden) if on_host else None
            self._compute_on_device(module, hidden, on_device, staged, st, out)
            self._compute_on_host(module, host_rows, on_host, st, out)
            st.needed += len(on_device)
            st.stall_s += self.clock.wait(cpu_ready)
            if self.residency.tracks_use():
                self.residency.used(g.index, [(x.expert, x.bits, x.status != Status.MISS) for x in on_device])
            on_device = [x.expert for x in on_device]
        self.device_layers.learn(g.index, g.num_experts)
        if not fetched:  # the steady state (every expert resident, nothing to copy) or staged demand copies
            self._prefetch(view, {(g.index, e) for e in on_device})
        return out.result()

    def _real(self, rows: int) -> torch.Tensor | None:  # [rows] bool: this prefill's requests' tokens, not pads
        return self._real_rows if self._real_rows is not None and self._real_rows.numel() == rows else None

    def _view(self, g: MoeLayer, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> LayerView:
        """Routing and router logits on the host for the policy (one device-to-host sync)."""
        index, weights, logits = routing_to_host(top_k_index, top_k_weights, self._logits.pop(g.index, None))
        logits = logits if logits is not None else torch.empty(0)  # [T, E]
        real = self._real(index.shape[0])
        if logits.numel() and self.residency.wants_scores():  # a score window's iteration (SMoE eq. 3)
            scores = self.policy.ctx.routers.scores(g.index, logits if real is None else logits[real])
            self.residency.observe(g.index, mean_scores(scores))
        return LayerView(
            layer=g.index, moe_pos=self.moe_index[g.index], num_experts=g.num_experts, step=self.step,
            top_k_index=index, top_k_weights=weights, router_logits=logits, residency=self.residency,
            predict=lambda later: self._predict(later, hidden), token_importance=self._importance, real_rows=real)

    def _group(self, plan: LayerPlan, idx: torch.Tensor, num_experts: int, st: LayerStats,
               routed: Routed | None = None, real: torch.Tensor | None = None) -> list[Group]:
        return group_plan(plan, idx, num_experts, st, grouped=self.grouped, max_bits=self._max_bits,
                          device=self.device, routed=routed, real=real, checked=(self.policy.name, self._stored))

    def _run_resident(self, module: EngineExperts, hidden: torch.Tensor, routed: Routed, st: LayerStats,
                      out: Combine, real: torch.Tensor | None = None) -> list[int] | None:
        """The steady state whole: every routed expert resident at the plan's one precision. One
        grouped GEMM over the pool, no per-expert objects, nothing to load or wait for. Returns the
        experts it ran, or None (nothing done) where that does not hold: the general path runs."""
        layer, bits = module.layer.index, routed.bits
        if self.simulated or (self.on_kernel(layer, bits) and hidden.shape[0] == 1) or real is not None:
            return None  # the sim clock charges each expert; one token's kernel experts run fused; pads (group_plan)
        get = self.residency.table.get
        handles = [get((layer, e, bits)) for e in routed.experts]
        if not all(h is not None and h.state == State.RESIDENT for h in handles):
            return None
        slots = []
        for h in handles:
            if h.prefetched:  # its first use: counted for prefetch precision
                st.prefetch_used += 1
                h.prefetched = False
            slots.append(h.slot)
        n = len(slots)
        st.hits[bits] += n
        st.needed += n
        k = routed.rows.pos.numel() // hidden.shape[0]  # every slot routed: k a row, of the requests' rows
        st.precision_mix[bits] += k * (hidden.shape[0] if real is None else int(real.sum()))
        if self.residency.tracks_use():
            self.residency.used(layer, [(e, bits, True) for e in routed.experts])
        starts = list(accumulate(routed.counts, initial=0))
        self._gemm(module, hidden, bits, slots, list(zip(starts, starts[1:])), routed.rows, out)
        return routed.experts

    def _schedule(self, layer: int, groups: list[Group]) -> tuple[list[Group], list[Group]]:
        """Each device group's copy: a hit, a prefetch in flight, or a demand load started now.

        Demand loads start before any compute so their copies overlap with the hits'. Loads the
        policy did not admit stream through the two staging buffers, the first issued now and each
        next one while the previous computes. Returns the groups in compute order (hits, in flight
        in the order their copies were issued, cached misses, staged misses) and the staged ones whose
        copies are still to be issued. Copies land in issue order (one stream), so an expert in flight
        is computed as soon as its copy can have landed, not after a later one (Fate Fig. 6: "prefetched
        2, 4; loading 3, 1, 5" runs 2, 4, 3, 1, 5, not 1, 3, 5 by expert id)."""
        get, misses, all_hit = self.residency.table.get, [], True  # the table itself: one dict lookup a group
        for x in groups:
            x.handle = h = get((layer, x.expert, x.bits))
            if h is None:
                x.status = Status.MISS
                misses.append(x)
            elif h.state != State.RESIDENT:
                x.status = Status.IN_FLIGHT
            else:
                continue
            all_hit = False
        if all_hit:  # the common decode step once the cache is warm: nothing to order or stage
            return groups, []
        shield = {(layer, x.expert) for x in groups}
        for x in misses:
            x.handle = self._start_load(Fetch(layer, x.expert, x.bits), shield, demand=True)
        groups = sorted(groups, key=lambda x: (x.status, x.handle.staged, x.handle.seq))
        staged = [x for x in groups if x.handle.staged]
        if staged:
            self._copy_staged(layer, staged.pop(0))
        return groups, staged

    def _compute_on_host(self, module: EngineExperts, rows: HostRows | None, groups: list[Group],
                         st: LayerStats, out: Combine) -> None:
        """SMoE Algorithm 2's CPU-assisted experts on the host `rows` (the device computes meanwhile)."""
        hidden = rows.wait() if groups else None  # this copy only; results go back pinned, without a sync
        for x in groups:
            w = self.store.decode(self.store.host(module.layer.index, x.expert, x.bits), module.layer.index,
                                  x.expert, x.bits)
            y = module.expert_forward(hidden.index_select(0, x.tok_host).to(w.gate_up.device), w)  # [n, H]
            out.add(upload(y, out.hidden.device), x.pos, x.tok, x.slot, x.expert, x.bits)
            st.cpu_experts += 1

    def _compute_on_device(self, module: EngineExperts, hidden: torch.Tensor, groups: list[Group],
                           staged: list[Group], st: LayerStats, out: Combine) -> None:
        """Device groups in schedule order: hits, then copies in flight, then cached misses, each batch
        waiting only for its own copies; staged misses one at a time behind their streamed copies.

        The grouped path (default) runs each batch as one grouped GEMM per precision; the eager path
        (`experts_impl="eager"`) one expert at a time, as transformers' eager loop."""
        layer = module.layer.index
        single = hidden.shape[0] == 1  # one token: low-bit kernels' experts run fused in _per_group
        kernel_here = single and any(layer in layers for layers in self.kernel_layers.values())
        if groups and groups[-1].status == Status.HIT:  # all hits (the schedule puts them first)
            batches = [groups]
        else:
            batches = [[x for x in groups if x.status == s and not x.handle.staged] for s in Status]
            batches.append([x for x in groups if x.handle.staged])
        for batch in batches:
            if not batch:
                continue
            per_expert = not self.grouped or batch[0].handle.staged  # staged copies come one at a time
            if batch[0].status == Status.HIT and not (per_expert or self.simulated or kernel_here):
                for x in batch:  # resident copies, one grouped GEMM: only the prefetch accounting per expert
                    if x.handle.prefetched:
                        st.prefetch_used += 1
                        x.handle.prefetched = False
            else:
                self._per_group(module, hidden, batch, staged, per_expert, st, out)
            counter = st.misses if batch[0].status == Status.MISS else st.hits  # a batch has one status
            for bits in sorted({x.bits for x in batch}, reverse=True):
                same = [x for x in batch if x.bits == bits]
                counter[bits] += len(same)
                if not per_expert and not (single and self.on_kernel(layer, bits)):
                    self._grouped(module, hidden, same, bits, out)

    def _per_group(self, module: EngineExperts, hidden: torch.Tensor, batch: list[Group], staged: list[Group],
                   per_expert: bool, st: LayerStats, out: Combine) -> None:
        """A batch's groups one by one: wait for each copy, account for it, and compute the experts
        that do not join a grouped GEMM (eager, staged, torch's low-bit kernels). For a single token,
        a kernel's experts in pool slots run together after the loop (`fused_forward`)."""
        layer = module.layer.index
        fused: dict[int, list[Group]] = {}
        single = hidden.shape[0] == 1
        for x in batch:
            h = x.handle
            if h.state == State.LOADING or h.staged:
                self._await(layer, x, staged, st)
            if h.prefetched:
                st.prefetch_used += 1
                h.prefetched = False
            if self.simulated:
                self.clock.compute(self.cost.t_expert(x.bits, len(x)))
            if self.on_kernel(layer, x.bits):  # its slot holds the kernel's layout
                if single and not h.staged and layer in self.fused_layers[x.bits]:
                    fused.setdefault(x.bits, []).append(x)  # run together after the loop
                elif single or per_expert:
                    y = KERNELS[x.bits].expert_forward(hidden.index_select(0, x.tok),
                                                       self.weights.kernel_weights(layer, x.bits, self.residency.data(x.bits, h)),
                                                       module.activation)
                    out.add(y, x.pos, x.tok, x.slot, x.expert, x.bits)
                # else several tokens, in a pool slot: decoded with its batch for one grouped GEMM (caller)
            elif per_expert:
                w = self.store.decode(self.residency.data(x.bits, h), layer, x.expert, x.bits)
                y = module.expert_forward(hidden.index_select(0, x.tok), w)
                out.add(y, x.pos, x.tok, x.slot, x.expert, x.bits)
        for bits, xs in fused.items():
            slots = [x.handle.slot for x in xs]
            gate_up, down = self.weights.int8_stack(layer, slots) if bits == 8 else \
                self.weights.kernel_stack(layer, bits, slots)
            pos = xs[0].pos if len(xs) == 1 else torch.cat([x.pos for x in xs])
            out.add_sum(KERNELS[bits].fused_forward(hidden, gate_up, down, out.flat_weight.index_select(0, pos),
                                                    module.activation))

    def _await(self, layer: int, x: Group, staged: list[Group], st: LayerStats) -> None:
        """Before a group computes: issue the next staged copy (it loads while this one computes),
        then wait for this group's own copy and publish it if it is cached."""
        h = x.handle
        if h.staged and staged:
            self._copy_staged(layer, staged.pop(0))
        if h.state == State.LOADING:
            self.copier.wait(h.event, st if self.clock.kind == "wall" else None)  # CUDA: timed on the device
            st.stall_s += self.clock.wait(h.ready_at)
            if not h.staged:
                self.residency.publish(layer, x.expert, x.bits)

    def _grouped(self, module: EngineExperts, hidden: torch.Tensor, batch: list[Group], bits: int,
                 out: Combine) -> None:
        """One grouped GEMM per projection over `batch` (same precision, all in pool slots)."""
        self._gemm(module, hidden, bits, [x.handle.slot for x in batch], [(x.start, x.end) for x in batch],
                   batch[0].rows, out)

    def _gemm(self, module: EngineExperts, hidden: torch.Tensor, bits: int, slots: list[int],
              ranges: list[tuple[int, int]], rows: Rows, out: Combine) -> None:
        """Experts in pool `slots` at `bits`, group i on rows `ranges[i]` of `rows`: one grouped GEMM per
        projection, weights from the pool without a per-expert call (`PoolWeights`). Per-group
        bookkeeping is Python over at most E groups a layer; per-row work is one torch call each."""
        layer, n = module.layer.index, len(slots)
        act = self.triton_layers.get((layer, bits))
        if act is not None and hidden.shape[0] <= TRITON_ROWS:
            from moetool.kernels import SlotPool, experts_forward
            ids = np.full(out.weight.numel(), -1, dtype=np.int32)  # [T*k]: the pool slot of each (token, slot) here
            for s, (a, b) in zip(slots, ranges):
                ids[rows.pos_host[a:b].numpy()] = s
            pool = SlotPool(self.residency.pool_bytes(bits), self.store.layout(layer, bits),
                            upload(ids.reshape(out.weight.shape), hidden.device, torch.int32))
            out.add_sum(experts_forward(hidden, out.weight, [pool], act))  # [T, H], weighted and summed
            return
        if n > self.decode_chunk and not self.weights.in_place(layer, bits, slots):
            # Decoded experts live in a workspace the budget sized for `decode_chunk` of them (a token's
            # top-k): a larger batch (prefill) runs in chunks. Each group's GEMM is its own: same result.
            for i in range(0, n, self.decode_chunk):
                self._gemm(module, hidden, bits, slots[i:i + self.decode_chunk], ranges[i:i + self.decode_chunk],
                           rows, out)
            return
        stack, sizes, order = self.weights.for_slots(layer, bits, slots, [b - a for a, b in ranges])
        if order is None and ranges[0][0] == 0 and ranges[-1][1] == rows.tok.shape[0] and \
                all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])):
            tok, pos = rows.tok, rows.pos  # every row of the layer, in their own order: no gather
        else:  # the groups' row ranges, concatenated in the order the stack holds them
            sel = np.concatenate([np.arange(*ranges[i]) for i in (order or range(len(ranges)))])
            sel = upload(sel, rows.tok.device)
            tok, pos = rows.tok.index_select(0, sel), rows.pos.index_select(0, sel)
        offs = upload(list(accumulate(sizes)), hidden.device, torch.int32)
        # index_select: a quarter of the cost of `hidden[tok]` (advanced indexing) per call
        out.add(grouped_mlp(module, hidden.index_select(0, tok), stack, offs, sizes), pos)

    @torch.no_grad()
    def _predict(self, later: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """A later MoE layer's router logits on this layer's gate input (cross-layer look-ahead)."""
        if later not in self.moe_index:
            return None
        self._predicting = True
        try:
            out = call_router(self.lm, later, hidden)
        finally:
            self._predicting = False
        if out is None:  # a router that cannot run alone: no look-ahead for this layer
            return None
        self.clock.compute(self.cost.hw.kernel_s)
        return router_logits(out, self.lm.geometry.layer(later).num_experts).to("cpu", torch.float32)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for router in self._routers:
            del router.forward  # the class's own forward again
        self._routers.clear()

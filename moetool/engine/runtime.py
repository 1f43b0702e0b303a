"""The engine: per MoE layer, route -> plan -> schedule -> compute (hits, then in flight, then
misses) -> combine -> prefetch.

`Engine` owns the host store, the residency (device slots, quotas, eviction orders), the copier,
the clock, the stats and the policy, and installs an `EngineExperts` module in every MoE block.
Steps are delimited by hooks on the model's forward, so plain `model.generate` (or lm-eval)
drives the engine unchanged.

    engine = Engine(lm, store, policy, residency, clock, cost, device=torch.device("cpu"))
    lm.model.generate(ids, max_new_tokens=8, do_sample=False); engine.stats.summary()
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch
from torch import nn

from moetool.engine.clock import CostModel, SimClock, WallClock
from moetool.engine.residency import Handle, Residency, State
from moetool.engine.stats import LayerStats, Stats, StepRecord
from moetool.engine.store import HostStore
from moetool.engine.transfer import Copier
from moetool.errors import MoetoolError
from moetool.model import LoadedModel, MoeLayer, ProviderExperts
from moetool.policies.base import Fetch, LayerPlan, LayerView, Phase, Policy, Step, Where
from moetool.policies.dymoe import token_importance


class Status(IntEnum):
    """Where a device-side group's expert copy stands when the layer is scheduled (the compute order)."""

    HIT = 0  # resident: computes first
    IN_FLIGHT = 1  # a prefetch still copying: computes when its own copy lands
    MISS = 2  # a demand load started now: into a cached slot, or streamed through a staging buffer


@dataclass
class Group:
    """The (token, slot) pairs of one layer that run one expert at one precision in one place."""

    expert: int
    bits: int
    where: Where
    tok: torch.Tensor  # [n] token rows, on the compute device
    slot: torch.Tensor  # [n] routing slots, on the compute device
    tok_host: torch.Tensor  # [n] the same rows on the host (a CPU-assisted expert indexes host tensors)
    slot_host: torch.Tensor
    status: Status = Status.HIT
    handle: Handle | None = None


@dataclass
class Output:
    """One group's routing-weighted expert output, held until the layer's sum in expert order."""

    expert: int
    bits: int
    tok: torch.Tensor  # [n] token rows, on hidden's device
    y: torch.Tensor  # [n, H]


class EngineExperts(ProviderExperts):
    """The experts module the engine installs: same call as the model's, computed by the engine."""

    def __init__(self, original: nn.Module, layer: MoeLayer, engine: "Engine"):
        super().__init__(original, layer, provider=None)  # type: ignore[arg-type]
        self.__dict__["engine"] = engine  # not a submodule: the engine is not part of the model

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.engine.run_layer(self, hidden_states, top_k_index, top_k_weights)


class Engine:
    def __init__(self, lm: LoadedModel, store: HostStore, policy: Policy, residency: Residency,
                 clock: SimClock | WallClock, cost: CostModel, device: torch.device):
        self.lm, self.store, self.policy, self.residency = lm, store, policy, residency
        self.clock, self.cost, self.device = clock, cost, torch.device(device)
        self.copier = Copier(self.device)
        self.layers = lm.geometry.layers
        self.moe_index = {g.index: i for i, g in enumerate(self.layers)}
        self.stats = Stats(tuple(g.index for g in self.layers))
        self.step: Step | None = None
        self._step_count = 0
        self._logits: dict[int, torch.Tensor] = {}
        self._importance: dict[int, torch.Tensor] = {}  # layer -> [T] heavy-hitter scores, prefill only
        self._predicting = False
        # The sequence length and batch the budget's KV margin was planned for (0: not checked).
        self.plan_tokens, self.plan_batch = 0, 1
        self._hooks: list[Any] = []
        self._install()
        self.warm_bytes = self._warm()

    def _warm(self) -> int:
        """Load the policy's start-up set and wait for it; its bytes are reported apart from per-token
        traffic and take no time on the clock."""
        moved = 0
        for f in self.policy.warm():
            victims = self.policy.admit(f, self.residency, set(), False)
            if victims is None or self.residency.get(f.layer, f.expert, f.bits) is not None:
                continue
            handle, dst = self.residency.begin_load(f, victims)
            event, nbytes = self._copy_in(f, dst)
            self.copier.wait(event)
            self.residency.publish(f.layer, f.expert, f.bits)
            moved += nbytes
        return moved

    # -- wiring ----------------------------------------------------------------------------------
    def _install(self) -> None:
        model = self.lm.model
        for g in self.layers:
            block = model.get_submodule(g.path)
            block.experts = EngineExperts(block.experts.impl, g, self)
            router = block.get_submodule(g.router)
            self._hooks.append(router.register_forward_hook(self._router_hook(g.index)))
        if self.policy.needs_token_importance:
            # DyMoE eq. 1 needs attention probabilities, which only the eager kernel returns.
            model.set_attn_implementation("eager")
            for g in self.layers:
                attn = model.get_submodule(g.path.rsplit(".", 1)[0]).get_submodule("self_attn")
                self._hooks.append(attn.register_forward_hook(self._attention_hook(g.index)))
        self._hooks.append(model.register_forward_pre_hook(self._before_forward, with_kwargs=True))
        self._hooks.append(model.register_forward_hook(self._after_forward))

    def _router_hook(self, layer: int):
        def hook(module, args, output):
            if not self._predicting:
                self._logits[layer] = output[0] if isinstance(output, tuple) else output  # [T, E]
        return hook

    def _attention_hook(self, layer: int):
        def hook(module, args, output):
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None  # [B, H, Tq, Tk]
            if weights is not None and self.step is not None and self.step.phase == Phase.PREFILL:
                self._importance[layer] = token_importance(weights).cpu()  # [B*Tk] DyMoE eq. 1
        return hook

    def _before_forward(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("past_key_values")
        past = cache.get_seq_length() if cache is not None else 0
        if ids is not None and self.plan_tokens:
            self._check_plan(past + ids.shape[-1], ids.shape[0] if ids.dim() > 1 else 1)
        self.begin_step(Phase.PREFILL if past == 0 else Phase.DECODE, int(ids.numel()) if ids is not None else 1)

    def _check_plan(self, length: int, batch: int) -> None:
        """The budget's KV/activation margin holds `plan_batch` sequences of `plan_tokens`: a longer
        or wider forward would use device memory the budget never reserved, so it is refused."""
        if length > self.plan_tokens or batch > self.plan_batch:
            raise MoetoolError(f"a forward of {batch} sequence(s) of {length} tokens exceeds the KV/activation margin "
                               f"the budget was planned for ({self.plan_batch} of {self.plan_tokens} tokens); plan "
                               "the engine for the longer sequences (build_engine's max_tokens and batch).")

    def _after_forward(self, module, args, output):
        self.end_step()

    # -- steps -----------------------------------------------------------------------------------
    def begin_step(self, phase: Phase, num_tokens: int) -> None:
        self.step = Step(index=self._step_count, phase=phase, num_tokens=num_tokens)
        self._step_count += 1
        self.clock.begin_step()

    def end_step(self) -> None:
        seconds = self.clock.end_step()
        self.stats.steps.append(StepRecord("prefill" if self.step.phase == Phase.PREFILL else "decode",
                                           self.step.num_tokens, seconds))
        for f in self.policy.end_step(self.step, self.residency):  # background migrations: never waited for
            self._start_load(f, shield=set())
        self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, self.residency.budget.peak)
        if self.device.type == "cuda":  # what the allocator really held, beside what the budget reserved
            self.stats.peak_allocated_bytes = max(self.stats.peak_allocated_bytes or 0,
                                                  torch.cuda.max_memory_allocated(self.device))

    # -- one MoE layer -----------------------------------------------------------------------------
    def run_layer(self, module: EngineExperts, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
        g = module.layer
        st = self.stats.layer(g.index)
        self.clock.compute(self.cost.t_dense(hidden.shape[0]))
        self._publish_ready()
        view = self._view(g, hidden, top_k_index, top_k_weights)  # the layer's one host sync
        plan = self.policy.plan(view)
        groups = self._group(plan, view.top_k_index, st)
        weight = plan.weight.to(hidden.device, hidden.dtype, non_blocking=True)  # [T, k]
        on_host = [x for x in groups if x.where == Where.CPU]
        on_device, staged = self._schedule(g.index, [x for x in groups if x.where == Where.GPU])
        shield = {(g.index, x.expert) for x in on_device}
        cpu_ready, outputs = self._compute_on_host(module, hidden, weight, on_host, st)
        outputs += self._compute_on_device(module, hidden, weight, on_device, staged, st)
        out = self._combine(hidden, outputs)
        st.needed += len(on_device)
        st.stall_s += self.clock.wait(cpu_ready)
        self.residency.used(g.index, [(x.expert, x.bits, x.status != Status.MISS) for x in on_device])
        # Asked after the layer ran, so the policy sees the residency this layer's loads left.
        for f in self.policy.prefetch(view):
            if self._start_load(f, shield, prefetched=True) is not None:
                self.stats.layer(f.layer).prefetch_issued += 1  # counted where the copy will be used
        return out

    def _view(self, g: MoeLayer, hidden: torch.Tensor, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor) -> LayerView:
        """Routing and router logits on the host for the policy (one device-to-host sync)."""
        logits = self._logits.pop(g.index, None)
        logits = logits.to("cpu", torch.float32) if logits is not None else torch.empty(0)  # [T, E]
        if logits.numel() and self.residency.wants_scores():
            self.residency.observe(g.index, torch.softmax(logits, -1).mean(0))  # SMoE eq. 3's iteration scores
        return LayerView(
            layer=g.index, moe_pos=self.moe_index[g.index], num_experts=g.num_experts, step=self.step,
            top_k_index=top_k_index.to("cpu", torch.int64), top_k_weights=top_k_weights.to("cpu", torch.float32),
            router_logits=logits, residency=self.residency, predict=lambda later: self._predict(later, hidden),
            token_importance=self._importance.pop(g.index, None))

    def _group(self, plan: LayerPlan, idx: torch.Tensor, st: LayerStats) -> list[Group]:
        """The plan's (token, slot) pairs grouped by (expert, bits, where), counting skips, substitutions
        and the precision mix.

        Plain Python over `tolist()`: for decode-sized plans (a few tokens x k) this is several times
        cheaper than a chain of small torch ops, and it stays linear for prefill.
        """
        skip, on_device = int(Where.SKIP), int(Where.GPU)
        pairs: dict[tuple[int, int, int], tuple[list[int], list[int]]] = {}
        # Slot-major, token-minor, as transformers' eager loop: each expert's rows reach the GEMM in
        # the same order, so a lossless policy matches the reference bit for bit.
        for s in range(plan.expert.shape[1]):
            cols = zip(*(c.tolist() for c in (plan.expert[:, s], plan.bits[:, s], plan.where[:, s], idx[:, s])))
            for t, (e, b, w, i) in enumerate(cols):
                if w == skip:
                    st.skips += 1
                    continue
                if e != i:
                    st.substitutions += 1
                if w == on_device:
                    st.precision_mix[b] += 1
                tok, slot = pairs.setdefault((e, b, w), ([], []))
                tok.append(t)
                slot.append(s)
        if not pairs:
            return []
        # One index tensor for the whole layer, moved to the device once; groups are slices of it.
        flat_tok = torch.tensor([t for tok, _ in pairs.values() for t in tok])  # [n]
        flat_slot = torch.tensor([s for _, slot in pairs.values() for s in slot])  # [n]
        on_cpu = self.device.type == "cpu"
        tok_d = flat_tok if on_cpu else flat_tok.to(self.device, non_blocking=True)
        slot_d = flat_slot if on_cpu else flat_slot.to(self.device, non_blocking=True)
        groups, start = [], 0
        for (e, b, w), (tok, _) in pairs.items():
            end = start + len(tok)
            groups.append(Group(e, b, Where(w), tok_d[start:end], slot_d[start:end], flat_tok[start:end],
                                flat_slot[start:end]))
            start = end
        return groups

    def _schedule(self, layer: int, groups: list[Group]) -> tuple[list[Group], list[Group]]:
        """Each device group's copy: a hit, a prefetch in flight, or a demand load started now.

        Demand loads start before any compute so their copies overlap with the hits'. Loads the
        policy did not admit stream through the two staging buffers, the first issued now and each
        next one while the previous computes. Returns the groups in compute order (hits, in flight,
        cached misses, staged misses) and the staged ones whose copies are still to be issued.
        """
        shield = {(layer, x.expert) for x in groups}
        for x in groups:
            x.handle = self.residency.get(layer, x.expert, x.bits)
            x.status = Status.MISS if x.handle is None else \
                Status.HIT if x.handle.state == State.RESIDENT else Status.IN_FLIGHT
        for x in groups:
            if x.status == Status.MISS:
                x.handle = self._start_load(Fetch(layer, x.expert, x.bits), shield, demand=True)
        groups = sorted(groups, key=lambda x: (x.status, x.handle.staged))
        staged = [x for x in groups if x.handle.staged]
        if staged:
            self._copy_staged(layer, staged.pop(0))
        return groups, staged

    def _compute_on_host(self, module: EngineExperts, hidden: torch.Tensor, weight: torch.Tensor,
                         groups: list[Group], st: LayerStats) -> tuple[float, list[Output]]:
        """SMoE Algorithm 2's CPU-assisted experts: run on the host, concurrently with the device."""
        ready, outputs = 0.0, []
        for x in groups:
            ready = max(ready, self.clock.cpu(self.cost.c_cpu(len(x.tok_host))))
            w = self.store.decode(self.store.host(module.layer.index, x.expert, x.bits), module.layer.index,
                                  x.expert, x.bits)
            outputs.append(self._expert_out(module, hidden, w, x, weight, host=True))
            st.cpu_experts += 1
        return ready, outputs

    def _compute_on_device(self, module: EngineExperts, hidden: torch.Tensor, weight: torch.Tensor,
                           groups: list[Group], staged: list[Group], st: LayerStats) -> list[Output]:
        """Device groups in schedule order, each waiting only for its own copy."""
        layer, outputs = module.layer.index, []
        for x in groups:
            h = x.handle
            if h.staged and staged:
                self._copy_staged(layer, staged.pop(0))  # the next staged expert loads while this one computes
            if h.state == State.LOADING:
                self.copier.wait(h.event)
                st.stall_s += self.clock.wait(h.ready_at)
                if not h.staged:
                    self.residency.publish(layer, x.expert, x.bits)
            if h.prefetched:
                st.prefetch_used += 1
                h.prefetched = False
            (st.misses if x.status == Status.MISS else st.hits)[x.bits] += 1
            w = self.store.decode(self.residency.data(x.bits, h), layer, x.expert, x.bits)
            self.clock.compute(self.cost.t_expert(x.bits, len(x.tok)))
            outputs.append(self._expert_out(module, hidden, w, x, weight, host=False))
        return outputs

    @staticmethod
    def _combine(hidden: torch.Tensor, outputs: list[Output]) -> torch.Tensor:
        """Sum the outputs into [T, H] in ascending (expert, bits) order, whatever order they computed in.

        fp32 addition is not associative, and with k = 16 a different order moves logits by ~1e-5,
        enough to flip a near-tied routing decision downstream; transformers' eager loop sums in
        expert order. Holding the [n, H] outputs until here costs T*k*H activations, which the
        budget's margin counts (`kv_margin`).
        """
        out = torch.zeros_like(hidden)  # [T, H]
        for o in sorted(outputs, key=lambda o: (o.expert, o.bits)):
            out.index_add_(0, o.tok, o.y)
        return out

    @staticmethod
    def _expert_out(module: EngineExperts, hidden: torch.Tensor, w, x: Group, weight: torch.Tensor,
                    host: bool) -> Output:
        """One group's routing-weighted expert output [n, H], on hidden's device."""
        tok, slot = (x.tok_host, x.slot_host) if host else (x.tok, x.slot)
        if tok.device != hidden.device:  # a CPU-assisted expert: host indices and weights, result moved back
            xs = hidden[tok.to(hidden.device)].to(w.gate_up.device)
            y = module.expert_forward(xs, w).to(hidden.device)  # [n, H]
            tok, slot = tok.to(hidden.device), slot.to(hidden.device)
        else:
            y = module.expert_forward(hidden[tok], w)  # [n, H]
        return Output(x.expert, x.bits, tok, (y * weight[tok, slot, None]).to(hidden.dtype))

    # -- loads -------------------------------------------------------------------------------------
    def _start_load(self, want: Fetch, shield: set, *, demand: bool = False, prefetched: bool = False) -> Handle | None:
        """Admit (policy + residency), take a slot, start the copy. A demand load the policy does not
        admit gets a staged handle, copied when its turn comes (`_copy_staged`); another load that
        is not admitted, or whose copy exists already, returns None."""
        if not demand and self.residency.get(want.layer, want.expert, want.bits) is not None:
            return None
        victims = self.policy.admit(want, self.residency, shield, demand)
        if victims is None:
            return Handle(slot=None) if demand else None
        handle, dst = self.residency.begin_load(want, victims, prefetched=prefetched)
        self._copy(handle, dst, want, demand)
        return handle

    def _copy_staged(self, layer: int, x: Group) -> None:
        x.handle.data = self.residency.staging_slot(x.bits)
        self._copy(x.handle, x.handle.data, Fetch(layer, x.expert, x.bits), demand=True)

    def _copy_in(self, want: Fetch, dst: torch.Tensor) -> tuple[Any, int]:
        """Start copying `want`'s blob into `dst`: (the copy's event, its bytes)."""
        src, ring_slot = self.store.source(want.layer, want.expert, want.bits)
        event = self.copier.copy(dst[: src.numel()], src)
        self.store.release(ring_slot, event)
        return event, src.numel()

    def _copy(self, handle: Handle, dst: torch.Tensor, want: Fetch, demand: bool) -> None:
        t0 = time.perf_counter()
        handle.event, nbytes = self._copy_in(want, dst)
        if handle.staged:
            handle.data = dst[:nbytes]
        st = self.stats.layer(want.layer)
        if demand and self.device.type == "cpu" and self.clock.kind == "wall":
            st.stall_s += time.perf_counter() - t0  # a synchronous copy blocks compute: it is a stall
        handle.ready_at = self.clock.copy(nbytes)
        st.bytes_h2d += nbytes

    def _publish_ready(self) -> None:
        """Publish copies that have completed, without waiting for any (background migrations)."""
        for key, h in self.residency.loading():
            if self.copier.done(h.event) and self.clock.ready(h.ready_at):
                self.residency.publish(*key)

    def _predict(self, later: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """A later MoE layer's router logits on this layer's gate input (cross-layer look-ahead)."""
        if later not in self.moe_index:
            return None
        g = self.layers[self.moe_index[later]]
        router = self.lm.model.get_submodule(f"{g.path}.{g.router}")
        self._predicting = True
        try:
            with torch.no_grad():
                out = router(hidden)
        finally:
            self._predicting = False
        self.clock.compute(self.cost.hw.kernel_s)
        return (out[0] if isinstance(out, tuple) else out).to("cpu", torch.float32)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

"""The engine: per MoE layer, route -> plan -> group -> schedule -> compute (hits, then in flight,
then misses; one grouped GEMM per precision and batch, or one expert at a time with
`experts_impl="eager"`) -> combine -> prefetch.

`Engine` owns the host store, the residency (device slots, quotas, eviction orders), the copier,
the clock, the stats and the policy, and installs an `EngineExperts` module in every MoE block.
Steps are delimited by hooks on the model's forward, so plain `model.generate` (or lm-eval)
drives the engine unchanged.

    engine = Engine(lm, store, policy, residency, clock, cost, device=torch.device("cpu"))
    lm.model.generate(ids, max_new_tokens=8, do_sample=False); engine.stats.summary()
"""

from __future__ import annotations

import time
from itertools import accumulate
from typing import Any

import numpy as np
import torch
from torch import nn

from moetool.engine.clock import CostModel, SimClock, WallClock
from moetool.engine.groups import _WHERE, Combine, Group, Rows, Status, grouped_mlp
from moetool.engine.residency import Handle, Residency, State
from moetool.engine.stats import LayerStats, Stats, StepRecord
from moetool.engine.store import HostStore
from moetool.engine.transfer import Copier
from moetool.defaults import EXPERTS_IMPLS
from moetool.errors import MoetoolError
from moetool.model import LoadedModel, MoeLayer, ProviderExperts
from moetool.policies.base import Fetch, LayerPlan, LayerView, Phase, Policy, Step, Where
from moetool.policies.dymoe import token_importance
from moetool.quant import int4_kernel


VIEW_CACHE = 4096  # entries in each small per-engine memo (pool views, offsets) before it is reset


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
                 clock: SimClock | WallClock, cost: CostModel, device: torch.device,
                 experts_impl: str = "grouped_mm", int4_kernel: bool = True):
        if experts_impl not in EXPERTS_IMPLS:
            raise MoetoolError(f"--experts-impl must be one of {', '.join(EXPERTS_IMPLS)}, not '{experts_impl}'.")
        # grouped_mm: one grouped GEMM per precision and batch (bit-exact against transformers'
        # grouped_mm experts); eager: one expert at a time (bit-exact against its eager loop).
        self.grouped = experts_impl == "grouped_mm"
        self.lm, self.store, self.policy, self.residency = lm, store, policy, residency
        self.clock, self.cost, self.device = clock, cost, torch.device(device)
        self.simulated = clock.kind == "sim"  # the cost model is read only by the simulated clock
        self._views: dict[tuple[int, int, int, int], Any] = {}  # (layer, bits, first slot, span) -> ExpertStack
        self._offs: dict[tuple[int, ...], torch.Tensor] = {}  # group sizes -> grouped_mm offsets
        self._kviews: dict[tuple[int, int], Any] = {}  # (layer, slot address) -> int4 kernel views
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
        # Layers whose INT4 experts run through torch's packed-int4 kernel (converted once, in their
        # slot, as they load): bf16 compute on a CPU, grouped path, shapes the kernel takes.
        self.int4_kernel_layers = self._int4_kernel_layers() if int4_kernel and self.grouped else frozenset()
        self._install()
        self.warm_bytes = self._warm()

    def _int4_kernel_layers(self) -> frozenset[int]:
        if 4 not in self.store.bits:
            return frozenset()
        dtype = next(self.lm.model.parameters()).dtype
        return frozenset(g.index for g in self.layers
                         if int4_kernel.unsupported(self.store.layout(g.index, 4), self.device, dtype) is None)

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
        if ids is None and kwargs.get("inputs_embeds") is not None:  # [B, T, H]: its tokens count the same
            ids = kwargs["inputs_embeds"][..., 0]
        # transformers >= 5.24 passes the KV cache as `cache`; earlier releases (and callers that still
        # pass it by its old name) as `past_key_values`.
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None:
            past = cache.get_seq_length()
        else:  # no cache object under a name we know: the first position says prefill (0) or decode
            pos = kwargs.get("position_ids")
            past = int(pos[..., 0].min()) if pos is not None and pos.numel() else 0
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
        if self.simulated:
            self.clock.compute(self.cost.t_dense(hidden.shape[0]))
        self._publish_ready()
        view = self._view(g, hidden, top_k_index, top_k_weights)  # the layer's one host sync
        plan = self.policy.plan(view)
        groups = self._group(plan, view.top_k_index, g.num_experts, st)
        weight = plan.weight.to(hidden.device, hidden.dtype, non_blocking=True)  # [T, k]
        on_host = [x for x in groups if x.where == Where.CPU]
        on_device, staged = self._schedule(g.index, [x for x in groups if x.where == Where.GPU])
        shield = {(g.index, x.expert) for x in on_device}
        out = Combine(hidden, weight, grouped=self.grouped)
        cpu_ready = self._compute_on_host(module, hidden, on_host, st, out)
        self._compute_on_device(module, hidden, on_device, staged, st, out)
        st.needed += len(on_device)
        st.stall_s += self.clock.wait(cpu_ready)
        self.residency.used(g.index, [(x.expert, x.bits, x.status != Status.MISS) for x in on_device])
        # Asked after the layer ran, so the policy sees the residency this layer's loads left.
        for f in self.policy.prefetch(view):
            if self._start_load(f, shield, prefetched=True) is not None:
                self.stats.layer(f.layer).prefetch_issued += 1  # counted where the copy will be used
        return out.result()

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

    def _group(self, plan: LayerPlan, idx: torch.Tensor, num_experts: int, st: LayerStats) -> list[Group]:
        """The plan's running (token, slot) pairs grouped by (where, bits, expert), counting skips,
        substitutions and the precision mix. Vectorised (numpy on the host arrays, a constant number
        of calls whatever T x k is); one index upload for the layer.

        Within a group, rows keep the order the matching transformers kernel gives them, so a
        lossless policy matches it bit for bit: `grouped_mm`'s own `torch.sort` of the flattened
        experts (not a stable sort: a CPU GEMM's result for a row depends on where the row sits in
        its tile, so the order inside a group matters), slot-major as the eager loop.
        """
        T, k = plan.expert.shape
        arrays = [t.numpy() for t in (plan.expert, plan.bits, plan.where, idx)]
        pos = np.arange(T * k).reshape(T, k)  # flat position t * k + s of every (token, slot)
        if not self.grouped:
            arrays, pos = [a.T for a in arrays], pos.T  # slot-major, token-minor
        expert, bits, where, routed, pos = (a.reshape(-1) for a in (*arrays, pos))
        if self.grouped:
            first = torch.sort(torch.from_numpy(expert.astype(np.int64))).indices.numpy()
            expert, bits, where, routed, pos = (a[first] for a in (expert, bits, where, routed, pos))
        on_device = int(Where.GPU)
        run = where != int(Where.SKIP)
        st.skips += int(run.size - np.count_nonzero(run))
        expert, bits, where, routed, pos = expert[run], bits[run], where[run], routed[run], pos[run]
        st.substitutions += int(np.count_nonzero(expert != routed))
        key = (where * (max(int(b) for b in self.store.bits) + 1) + bits) * num_experts + expert
        order = np.argsort(key, kind="stable")  # stable: each group's rows keep the order above
        key, pos = key[order], pos[order]
        if not key.size:
            return []
        bounds = [0, *(np.flatnonzero(key[1:] != key[:-1]) + 1).tolist(), int(key.size)]
        tok, slot = np.divmod(pos, k)
        host = [torch.from_numpy(a) for a in (tok, slot, pos)]
        if self.device.type == "cpu":
            rows = Rows(*host, *host)
        else:
            both = torch.stack(host).to(self.device, non_blocking=True)  # one upload for the layer
            rows = Rows(*host, both[0], both[1], both[2])
        firsts = order[bounds[:-1]]
        groups = []
        for e, b, w, start, end in zip(expert[firsts].tolist(), bits[firsts].tolist(), where[firsts].tolist(),
                                       bounds[:-1], bounds[1:]):
            if w == on_device:
                st.precision_mix[b] += end - start
            groups.append(Group(e, b, _WHERE[w], rows, start, end))
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
        if any(x.status != Status.HIT for x in groups):
            groups = sorted(groups, key=lambda x: (x.status, x.handle.staged))
        staged = [x for x in groups if x.handle.staged]
        if staged:
            self._copy_staged(layer, staged.pop(0))
        return groups, staged

    def _compute_on_host(self, module: EngineExperts, hidden: torch.Tensor, groups: list[Group],
                         st: LayerStats, out: "Combine") -> float:
        """SMoE Algorithm 2's CPU-assisted experts: run on the host, concurrently with the device."""
        ready = 0.0
        for x in groups:
            ready = max(ready, self.clock.cpu(self.cost.c_cpu(len(x))))
            w = self.store.decode(self.store.host(module.layer.index, x.expert, x.bits), module.layer.index,
                                  x.expert, x.bits)
            y = module.expert_forward(hidden[x.tok].to(w.gate_up.device), w).to(hidden.device)  # [n, H]
            out.add(y, x.pos, x.tok, x.slot, x.expert, x.bits)
            st.cpu_experts += 1
        return ready

    def _compute_on_device(self, module: EngineExperts, hidden: torch.Tensor, groups: list[Group],
                           staged: list[Group], st: LayerStats, out: "Combine") -> None:
        """Device groups in schedule order: hits, then copies in flight, then cached misses, each batch
        waiting only for its own copies; staged misses one at a time behind their streamed copies.

        The grouped path (default) runs each batch as one grouped GEMM per precision; the eager path
        (`experts_impl="eager"`) one expert at a time, as transformers' eager loop.
        """
        layer = module.layer.index
        batches = [[x for x in groups if x.status == s and not x.handle.staged] for s in Status]
        for batch in (*batches, [x for x in groups if x.handle.staged]):
            for x in batch:
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
                if self.simulated:
                    self.clock.compute(self.cost.t_expert(x.bits, len(x)))
                if x.bits == 4 and layer in self.int4_kernel_layers:  # its slot holds the kernel's layout
                    y = int4_kernel.expert_forward(hidden[x.tok], self._kernel_weights(layer, self.residency.data(4, h)),
                                                   module.activation)
                    out.add(y, x.pos, x.tok, x.slot, x.expert, x.bits)
                elif not self.grouped or h.staged:
                    w = self.store.decode(self.residency.data(x.bits, h), layer, x.expert, x.bits)
                    out.add(module.expert_forward(hidden[x.tok], w), x.pos, x.tok, x.slot, x.expert, x.bits)
            if self.grouped and batch and not batch[0].handle.staged:
                for bits in sorted({x.bits for x in batch} - ({4} if layer in self.int4_kernel_layers else set()),
                                   reverse=True):
                    self._grouped(module, hidden, [x for x in batch if x.bits == bits], bits, out)

    def _grouped(self, module: EngineExperts, hidden: torch.Tensor, batch: list[Group], bits: int,
                 out: "Combine") -> None:
        """One grouped GEMM per projection over `batch` (same precision, all in pool slots).

        Weights come from the pool without a per-expert call: the reference precision in the compute
        dtype is read in place, as a strided [slots, out, in] view over the slot range the batch spans
        (its unused slots are empty groups); anything else, or a range mostly empty on the host where
        each empty group costs a kernel call, is gathered (one index op on the packed bytes) and
        decoded for the n experts at once (`dequantize_stack`).
        """
        layer, rows = module.layer.index, batch[0].rows
        batch = sorted(batch, key=lambda x: x.handle.slot)
        slots = [x.handle.slot for x in batch]
        pool = self.residency.pool_bytes(bits)  # [slots, slot bytes] uint8
        span = slots[-1] - slots[0] + 1
        if self._in_place(layer, bits, span, len(batch)):
            key = (layer, bits, slots[0], span)
            stack = self._views.get(key)
            if stack is None:  # views alias the pool, so a slot range's views serve every later step
                if len(self._views) >= VIEW_CACHE:
                    self._views.clear()
                stack = self._views[key] = self.store.decode_stack(pool[slots[0]:slots[0] + span], layer, bits)
            counts = [0] * span
            for x in batch:
                counts[x.handle.slot - slots[0]] = len(x)
        else:
            blobs = pool.index_select(0, torch.tensor(slots, device=pool.device))
            stack = self.store.decode_stack(blobs, layer, bits)
            counts = [len(x) for x in batch]
        offs = self._offsets(counts, hidden.device)
        if batch[0].start == 0 and batch[-1].end == rows.tok.shape[0] and \
                all(a.end == b.start for a, b in zip(batch, batch[1:])):
            tok, pos = rows.tok, rows.pos  # every row of the layer, in their own order: no gather
        else:
            sel = torch.from_numpy(np.concatenate([np.arange(x.start, x.end) for x in batch]))
            sel = sel.to(rows.tok.device, non_blocking=True)
            tok, pos = rows.tok[sel], rows.pos[sel]
        out.add(grouped_mlp(module, hidden[tok], stack, offs, counts), pos)

    def _kernel_weights(self, layer: int, blob: torch.Tensor) -> int4_kernel.KernelWeights:
        """Views of a converted INT4 slot for torch's int4 kernel; they alias the slot, so each slot's
        are made once."""
        key = (layer, blob.data_ptr())
        w = self._kviews.get(key)
        if w is None:
            if len(self._kviews) >= VIEW_CACHE:
                self._kviews.clear()
            w = self._kviews[key] = int4_kernel.kernel_weights(blob, self.store.layout(layer, 4))
        return w

    def _offsets(self, counts: list[int], device: torch.device) -> torch.Tensor:
        """grouped_mm's group ends (int32, on `device`) for these group sizes; decode steps repeat the
        same few patterns, so they are made once."""
        key = tuple(counts)
        offs = self._offs.get(key)
        if offs is None:
            if len(self._offs) >= VIEW_CACHE:
                self._offs.clear()
            offs = self._offs[key] = torch.tensor(list(accumulate(counts)), dtype=torch.int32).to(device)
        return offs

    def _in_place(self, layer: int, bits: int, span: int, n: int) -> bool:
        """Whether the batch's weights can be read in place from the pool's slot range (else gathered)."""
        if not self.store.stack_is_view(layer, bits):
            return False
        if self.device.type == "cuda":
            return True  # the device kernel skips empty groups within one launch
        # On the host each empty group costs ~2.5 us of kernel overhead and gathering an expert costs
        # its bytes at memory speed (~10 GB/s): measured on the 2-core CI machine, scripts/bench_engine.py.
        return (span - n) * 2.5e-6 <= n * self.store.slot_bytes(bits) / 10e9

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
        if want.bits == 4 and want.layer in self.int4_kernel_layers:
            self.copier.wait(event)  # a CPU copy: already done
            int4_kernel.convert_(dst[: src.numel()], self.store.layout(want.layer, 4))
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

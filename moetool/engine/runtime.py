"""The engine: per MoE layer, route -> plan -> compute (hits, then in flight, then misses) -> prefetch.

`Engine` owns the host store, the device cache, the copier, the clock, the stats and the policy,
and installs an `EngineExperts` module in every MoE block. Steps are delimited by hooks on the
model's forward, so plain `model.generate` (or lm-eval) drives the engine unchanged.

    engine = Engine(lm, store, policy, cache, clock, cost)
    lm.model.generate(ids, max_new_tokens=8, do_sample=False); engine.stats.summary()
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from moetool.engine.cache import DeviceCache, Handle, State
from moetool.engine.clock import CostModel, SimClock, WallClock
from moetool.engine.stats import Stats, StepRecord
from moetool.engine.store import HostStore
from moetool.engine.transfer import Copier
from moetool.model import LoadedModel, MoeLayer, ProviderExperts
from moetool.policies.base import Fetch, LayerPlan, LayerView, Phase, Policy, Step, Where


class EngineExperts(ProviderExperts):
    """The experts module the engine installs: same call as the model's, computed by the engine."""

    def __init__(self, original: nn.Module, layer: MoeLayer, engine: "Engine"):
        super().__init__(original, layer, provider=None)  # type: ignore[arg-type]
        self.__dict__["engine"] = engine  # not a submodule: the engine is not part of the model

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.engine.run_layer(self, hidden_states, top_k_index, top_k_weights)


class Engine:
    def __init__(self, lm: LoadedModel, store: HostStore, policy: Policy, cache: DeviceCache,
                 clock: SimClock | WallClock, cost: CostModel, device: torch.device):
        self.lm, self.store, self.policy, self.cache = lm, store, policy, cache
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
        self._loading: set[tuple[int, int, int]] = set()  # keys whose copies may still be in flight
        self._hooks: list[Any] = []
        self._install()
        self.warm_bytes = self._warm()

    def _warm(self) -> int:
        """Load the policy's start-up set and wait for it; its bytes are reported apart from per-token traffic."""
        moved = 0
        for f in self.policy.warm():
            victims = self.policy.make_room(f, self.cache, set(), False)
            if victims is None or self.cache.get(f.layer, f.expert, f.bits) is not None:
                continue
            for v in victims:
                self.cache.evict(v.layer, v.expert, v.bits)
            handle, dst = self.cache.begin_load(f.layer, f.expert, f.bits)
            src, ring_slot = self.store.source(f.layer, f.expert, f.bits)
            event = self.copier.copy(dst[: src.numel()], src)
            self.store.release(ring_slot, event)
            self.copier.wait(event)
            self.cache.publish(f.layer, f.expert, f.bits)
            moved += src.numel()
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
                # DyMoE eq. 1: s_i = mean over heads of the attention token i receives. We read "the
                # attention score of t_i" as H2O's accumulated score: summed over the query positions.
                self._importance[layer] = weights.float().mean(1).sum(1).reshape(-1).cpu()  # [B*Tk]
        return hook

    def _before_forward(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("past_key_values")
        first = cache is None or cache.get_seq_length() == 0
        self.begin_step(Phase.PREFILL if first else Phase.DECODE, int(ids.numel()) if ids is not None else 1)

    def _after_forward(self, module, args, output):
        self.end_step()

    # -- steps -----------------------------------------------------------------------------------
    def begin_step(self, phase: Phase, num_tokens: int) -> None:
        self.step = Step(index=self._step_count, phase=phase, num_tokens=num_tokens)
        self._step_count += 1
        self.policy.begin_step(self.step)
        self.clock.begin_step()

    def end_step(self) -> None:
        seconds = self.clock.end_step()
        self.stats.steps.append(StepRecord("prefill" if self.step.phase == Phase.PREFILL else "decode",
                                           self.step.num_tokens, seconds))
        for f in self.policy.end_step(self.step):
            self._start_load(f, shield=set(), prefetched=False, background=True)
        self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, self.cache.budget.peak)

    # -- one MoE layer -----------------------------------------------------------------------------
    def run_layer(self, module: EngineExperts, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
        g = module.layer
        st = self.stats.layer(g.index)
        T = hidden.shape[0]
        self.clock.compute(self.cost.t_dense(T))
        self._publish_ready()
        # The one host sync of the layer: routing and logits to the host for the policy.
        idx = top_k_index.to("cpu", torch.int64)  # [T, k]
        logits = self._logits.pop(g.index, None)
        view = LayerView(
            layer=g.index, moe_pos=self.moe_index[g.index], num_moe_layers=len(self.layers),
            num_experts=g.num_experts, step=self.step, top_k_index=idx,
            top_k_weights=top_k_weights.to("cpu", torch.float32),
            router_logits=logits.to("cpu", torch.float32) if logits is not None else torch.empty(0),
            cache=self.cache, predict=lambda later: self._predict(later, hidden),
            token_importance=self._importance.pop(g.index, None))
        plan = self.policy.plan(view)
        groups = self._groups(plan, st, idx)
        shield = {(g.index, e) for (e, b, w) in groups if w == Where.GPU}
        weight = plan.weight.to(hidden.device, hidden.dtype, non_blocking=True)  # [T, k]

        gpu, cpu = [], []
        for (e, b, where), (tok, slot, tok_host, slot_host) in groups.items():
            if where == Where.CPU:
                cpu.append((e, b, tok_host, slot_host))
                continue
            h = self.cache.get(g.index, e, b)
            kind = 0 if h is not None and h.state == State.RESIDENT else 1 if h is not None else 2
            gpu.append((kind, e, b, tok, slot, h))  # kind: 0 hit, 1 in flight (prefetched), 2 miss
        # Demand loads into cache slots start first, so their copies overlap with the hits' compute.
        # Loads the policy did not admit stream through the two staging buffers, issued one ahead.
        gpu = [(kind, e, b, tok, slot, self._start_load(Fetch(g.index, e, b), shield, demand=True) if kind == 2 else h)
               for kind, e, b, tok, slot, h in gpu]
        gpu.sort(key=lambda x: (x[0], x[5].slot < 0))  # hits, in flight, cached misses, staged misses
        staged = [(x[5], Fetch(g.index, x[1], x[2])) for x in gpu if x[5].slot < 0]
        if staged:
            self._copy_staged(*staged.pop(0))
        cpu_ready = 0.0
        parts = []  # (expert, bits, token rows, weighted output), summed in expert order at the end
        for e, b, tok, slot in cpu:  # SMoE Alg. 2: these run on the host, concurrently with the GPU
            cpu_ready = max(cpu_ready, self.clock.cpu(self.cost.c_cpu(len(tok))))
            w = self.store.decode(self.store.host(g.index, e, b), g.index, e, b)
            parts.append((e, b, *self._expert_out(module, hidden, w, tok, slot, weight)))
            st.cpu_experts += 1
        used = []
        for kind, e, b, tok, slot, h in gpu:
            if h.slot < 0 and staged:
                self._copy_staged(*staged.pop(0))  # the next staged expert loads while this one computes
            if h.state == State.LOADING:
                self.copier.wait(h.event)
                st.stall_s += self.clock.wait(h.ready_at)
                if h.staging is None:
                    self._publish(g.index, e, b)
            if h.prefetched:
                st.prefetch_used += 1
                h.prefetched = False
            (st.hits if kind < 2 else st.misses)[b] += 1
            w = self.store.decode(h.staging if h.staging is not None else self.cache.view(b, h), g.index, e, b)
            self.clock.compute(self.cost.t_expert(b, len(tok)))
            parts.append((e, b, *self._expert_out(module, hidden, w, tok, slot, weight)))
            used.append((e, b, kind < 2))
        # Experts compute in arrival order (hits, then copies as they land), but a token's k
        # contributions are summed in ascending expert order, as transformers' eager loop sums them:
        # fp32 addition is not associative, and with k = 16 a different order moves logits by ~1e-5,
        # enough to flip a near-tied routing decision downstream. Holding the [n, H] outputs until
        # here costs T*k*H activations, which the budget's margin counts (`kv_margin`).
        out = torch.zeros_like(hidden)  # [T, H]
        for _, _, tok, y in sorted(parts, key=lambda p: (p[0], p[1])):
            out.index_add_(0, tok, y)
        st.needed += len(used)
        st.stall_s += self.clock.wait(cpu_ready)
        self.policy.on_use(g.index, used)
        for f in self.policy.prefetch(view):
            self._start_load(f, shield, prefetched=True)
        return out

    def _groups(self, plan: LayerPlan, st, idx: torch.Tensor) -> dict[tuple[int, int, int], tuple]:
        """(expert, bits, where) -> token and slot indices (device, then host), from the host plan.

        Plain Python over `tolist()`: for decode-sized plans (a few tokens x k) this is several
        times cheaper than a chain of small torch ops, and it stays linear for prefill.
        """
        skip = int(Where.SKIP)
        lists: dict[tuple[int, int, int], tuple[list[int], list[int]]] = {}
        k = plan.expert.shape[1]
        # Slot-major, token-minor, as transformers' eager loop: each expert's rows reach the GEMM in
        # the same order, so a lossless policy matches the reference bit for bit.
        cols = [(c.tolist() for c in (plan.expert[:, s], plan.bits[:, s], plan.where[:, s], idx[:, s]))
                for s in range(k)]
        for s, (er, br, wr, ir) in enumerate(cols):
            for t, (e, b, w, i) in enumerate(zip(er, br, wr, ir)):
                if e < 0 or w == skip:
                    st.skips += 1
                    continue
                if e != i:
                    st.substitutions += 1
                if w == Where.GPU:
                    st.precision_mix[b] += 1
                tok, slot = lists.setdefault((e, b, w), ([], []))
                tok.append(t)
                slot.append(s)
        if not lists:
            return {}
        # One index tensor for the whole layer, moved to the device once; groups are slices of it.
        flat_tok = torch.tensor([t for tok, _ in lists.values() for t in tok])  # [n]
        flat_slot = torch.tensor([s for _, slot in lists.values() for s in slot])  # [n]
        dev = self.device
        tok_d = flat_tok.to(dev, non_blocking=True) if dev.type != "cpu" else flat_tok
        slot_d = flat_slot.to(dev, non_blocking=True) if dev.type != "cpu" else flat_slot
        groups, start = {}, 0
        for key, (tok, _) in lists.items():
            end = start + len(tok)
            groups[key] = (tok_d[start:end], slot_d[start:end], flat_tok[start:end], flat_slot[start:end])
            start = end
        return groups

    @staticmethod
    def _expert_out(module: EngineExperts, hidden, w, tok, slot, weight) -> tuple[torch.Tensor, torch.Tensor]:
        """(token rows, routing-weighted expert output [n, H]) of one expert group, on hidden's device."""
        if tok.device != hidden.device:  # a CPU-assisted expert: host indices, host weights, result moved back
            x = hidden[tok.to(hidden.device)].to(w.gate_up.device)
            y = module.expert_forward(x, w).to(hidden.device)  # [n, H]
            tok, slot = tok.to(hidden.device), slot.to(hidden.device)
        else:
            y = module.expert_forward(hidden[tok], w)  # [n, H]
        return tok, (y * weight[tok, slot, None]).to(hidden.dtype)

    # -- loads -------------------------------------------------------------------------------------
    def _start_load(self, want: Fetch, shield: set, *, demand: bool = False, prefetched: bool = False,
                    background: bool = False) -> Handle | None:
        """Make room (policy), take a slot (cache), start the copy (copier + clock)."""
        key = (want.layer, want.expert, want.bits)
        st = self.stats.layer(want.layer)
        if not demand and self.cache.get(*key) is not None:
            return None
        victims = self.policy.make_room(want, self.cache, shield, demand)
        if victims is None:
            if not demand:
                return None
            # Not admitted: streamed through a staging buffer when its turn comes (`_copy_staged`).
            return Handle(slot=-1, state=State.LOADING, event=None, ready_at=0.0, prefetched=False, background=False)
        for v in victims:
            self.cache.evict(v.layer, v.expert, v.bits)
            self._loading.discard((v.layer, v.expert, v.bits))
        handle, dst = self.cache.begin_load(*key, prefetched=prefetched, background=background)
        self._loading.add(key)
        self._copy(handle, dst, want, demand)
        if prefetched:
            st.prefetch_issued += 1
        return handle

    def _copy_staged(self, handle: Handle, want: Fetch) -> None:
        handle.staging = self.cache.staging_slot(want.bits)
        self._copy(handle, handle.staging, want, demand=True)

    def _copy(self, handle: Handle, dst: torch.Tensor, want: Fetch, demand: bool) -> None:
        t0 = time.perf_counter()
        src, ring_slot = self.store.source(want.layer, want.expert, want.bits)
        if handle.staging is not None:
            handle.staging = dst = dst[: src.numel()]
        handle.event = self.copier.copy(dst[: src.numel()], src)
        self.store.release(ring_slot, handle.event)
        st = self.stats.layer(want.layer)
        if demand and self.device.type == "cpu" and self.clock.kind == "wall":
            st.stall_s += time.perf_counter() - t0  # a synchronous copy blocks compute: it is a stall
        handle.ready_at = self.clock.copy(src.numel())
        st.bytes_h2d += src.numel()

    def _publish(self, layer: int, expert: int, bits: int) -> None:
        self.cache.publish(layer, expert, bits)
        self._loading.discard((layer, expert, bits))

    def _publish_ready(self) -> None:
        """Publish copies that have completed, without waiting for any (background migrations)."""
        for key in list(self._loading):
            h = self.cache.get(*key)
            if h is None:
                self._loading.discard(key)
            elif h.state == State.LOADING and self.copier.done(h.event) and self.clock.ready(h.ready_at):
                self._publish(*key)

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

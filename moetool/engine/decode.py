"""The captured decode path: a decode step `(token, position) -> next token` over a static KV cache
that runs without the host (one compiled program; one CUDA graph replay on a GPU), and moetool's
own greedy loop around it, with the policy's host half one step behind.

Prefill stays on the host-driven path (`engine/runtime.py`), writing the same static cache. Then
each decode step runs the model with the engine's captured MoE layers (`engine/captured.py`): the
policy's in-step plan, the device slot table, experts read from their slots or, for a miss, from
host memory in place. After launching step t+1 the host reads step t's log and does the policy's
host half (admission and fills, eviction orders, prefetches, promotions: the host path's own
`admit`, `end_step` and eviction orders, and `Policy.log_layer`), so its decisions reach the slot
table before step t+2. On a CPU the same order holds, step by step, so a test there decides what a
GPU run decides.

    program = DecodeProgram(engine, max_tokens=64)
    tokens = program.generate(ids, max_new_tokens=16)        # ids [1, T] -> list of token ids
    program.summary()                                         # {"path": "captured", "compile_s": ...}
"""

from __future__ import annotations

import re
import time
import types
import weakref
from pathlib import Path
from typing import Any

import torch

from moetool.checkpoint import looped_layers
from moetool.defaults import DECODE_PATHS as PATHS
from moetool.engine.captured import CapturedLayers, held_for_life
from moetool.engine.groups import check_plan
from moetool.engine.mirror import host_mirrors
from moetool.engine.step_model import (DIFFERENT_MODEL_TYPES, VERIFIED_MODEL_TYPES, architecture_refusal,  # noqa: F401 (API)
                                       greedy_rule, whole_windows)
from moetool.engine.stats import StepRecord
from moetool.errors import MoetoolError, first_line
from moetool.inference import not_finite, with_cache
from moetool.policies.base import Fetch, LayerView, Phase, Step


# What share of the link's copy-engine bandwidth a kernel's own reads of pinned host memory get: 35.2
# against ~50 GB/s host-to-device on an H100 (nvbandwidth#24's SM-driven vs copy-engine figures;
# gpu-decode-anchors.md §4.2). The simulated clock charges the captured step's zero-copy reads at it.
ZERO_COPY_SHARE = 0.7


def choose_path(requested: str, device: torch.device, batch: int, experts_impl: str) -> tuple[str, str]:
    """The decode path to plan for, and why, from what is known before the engine is built. `auto` is
    the path measured faster on the device: on CUDA the captured step (the host-driven engine is
    host-bound there: docs/bench/gpu), on a CPU the host path (its own step is as fast, and the
    captured one first compiles for minutes: scripts/bench_decode.py). A captured path that the model
    or the policy then cannot take falls back to the host path, with its reason."""
    if requested == "host":
        return "host", "asked for (--decode host)"
    if batch != 1:
        return "host", f"the captured step decodes one sequence at a time, not a batch of {batch}"
    if experts_impl != "grouped_mm":
        return "host", "--experts-impl eager runs one expert at a time on the host path only"
    if requested == "captured":
        return "captured", "asked for (--decode captured)"
    if device.type == "cuda":
        return "captured", "auto: on CUDA the captured step (the host-driven step is host-bound there)"
    return "host", "auto: on a CPU the host path (the captured step's compile costs more than it saves on a short run)"


def unavailable(engine: Any) -> str | None:
    """Why a built `engine` cannot decode on the captured path (checked before any work), or None."""
    if not engine.grouped:
        return "--experts-impl eager runs one expert at a time on the host path only"
    if engine.kernel_layers:
        return "the engine was built with the CPU low-bit kernels, whose slots the captured step does not read"
    reason = engine.policy.captured_unsupported()
    if reason:
        return reason
    shapes = sorted({(g.num_experts, g.top_k) for g in engine.layers})
    if len(shapes) > 1:  # the step's log and slot table are one [layers, k] array: a wider layer would not fit
        return (f"this model's MoE layers differ in expert count or top-k "
                f"({', '.join(f'{e} experts top-{k}' for e, k in shapes)}), and the step logs one of each")
    core, passes = looped_layers(engine.lm.model.config)
    if len(core):  # the step's log holds one row a MoE layer: the other passes' counts and bookkeeping lost
        return (f"the model runs decoder layers {core.start}-{core.stop - 1} {passes} times a token (a looped model), "
                "and the captured step logs one pass a MoE layer")
    if engine.device.type == "cuda":
        from moetool.engine.zero_copy import unavailable as zero_copy_unavailable

        reason = zero_copy_unavailable(engine.device)
        if reason:
            return reason
    return None


def _user_frame(text: str) -> str:
    """Where in the model's code the compiler stopped: the innermost frame of the error's "from user
    code:" trace, as ` at FILE:LINE (`CODE`)` (FILE from the package down), else "". "Data-dependent
    branching" alone did not say it was Phi-3.5-MoE's rotary embedding (longrope picks its factors
    with a Python branch on the position)."""
    if "from user code:" not in text:
        return ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', text.split("from user code:", 1)[1])
    if not frames:
        return ""
    path, line, code = frames[-1]
    parts = Path(path).parts
    tail = next((parts[i:] for i in range(len(parts) - 1, -1, -1) if parts[i] in ("transformers", "moetool")),
                parts[-1:])
    return f" at {'/'.join(tail)}:{line} (`{code.strip()[:100]}`)"


class DecodeProgram:
    """The captured decode step of one engine, its static cache and its loop (see the module docstring).

    Built once (compiled, and captured on CUDA); `generate` runs one prompt. Raises MoetoolError with
    the reason where the model or the policy cannot be captured (the caller falls back to the host path),
    also for a model type outside `VERIFIED_MODEL_TYPES` unless `unverified_ok` (`--decode captured`).
    """

    def __init__(self, engine: Any, max_tokens: int, host_budget: int | None = None,
                 backend: str | None = None, graph: bool | None = None, kernels: bool | None = None,
                 unverified_ok: bool = False):
        self.engine, self.device = engine, engine.device
        self._graph_wanted = graph
        lm = engine.lm
        reason = unavailable(engine)
        if reason:
            raise MoetoolError(reason)
        self.model_type = str(getattr(lm.model.config, "model_type", "") or "")
        reason = architecture_refusal(self.model_type, unverified_ok)
        if reason:
            raise MoetoolError(reason)
        self.verified = self.model_type in VERIFIED_MODEL_TYPES
        self.compile_s = 0.0
        engine.captured = self.layers = None
        try:
            self._prepare(lm, max_tokens, host_budget, kernels)
            t0 = time.perf_counter()
            self._build(backend)
            self.compile_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - whatever the model, the compiler or the capture refuses is a fallback
            engine.captured = None
            engine.capturing = False
            engine.store.pinned_elsewhere = None  # the mirrors go with the step (their pinned memory freed)
            if isinstance(e, MoetoolError):
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise MoetoolError(f"{self._stage} failed ({type(e).__name__}: {first[:200]}){_user_frame(str(e))}") from None

    def _prepare(self, lm: Any, max_tokens: int, host_budget: int | None, kernels: bool | None) -> None:
        """What the step reads, set up before it is compiled: the host mirrors, the captured layers,
        the static cache, the step's inputs and the host's copies of its log."""
        from transformers import StaticCache

        engine = self.engine
        # The cheap refusals first: pinning and checksumming every expert's mirror only to refuse after
        # it would waste the pass, and leave the pinned blocks cached away from the host path's tiers.
        self._check_plan()
        self._stage = "reading the greedy rule of the model's generation config"
        suppressed = greedy_rule(lm.model)
        if isinstance(suppressed, str):
            raise MoetoolError(suppressed)
        self._stage = "setting up the host mirrors"
        if host_budget is None and self.device.type == "cuda":
            from moetool.engine import default_host_budget

            host_budget = default_host_budget()  # what the host tiers would have had (build_engine)
        bits = engine.policy.bits_in_use()
        experts = sum(g.num_experts for g in lm.geometry.layers)
        mirrors = host_mirrors(lm, engine.store, bits, self.device, host_budget,
                               lifelong=tuple(b for b in bits if held_for_life(engine.residency, b, experts)))
        if isinstance(mirrors, str):
            raise MoetoolError(mirrors)
        self.mirrors = mirrors
        # The host path's copies (each prompt's prefill, the fills) read the pinned mirrors where there are:
        # a captured engine has no host tiers of its own, and the mapped bundle is pageable (a blocking copy).
        engine.store.pinned_elsewhere = mirrors.pinned_row if mirrors.pinned_bits else None
        self.layers = CapturedLayers(engine, mirrors, kernels)
        self.layers.prepare()
        self.suppressed = torch.tensor(suppressed, dtype=torch.long, device=self.device) if suppressed else None
        self._stage = "building transformers' StaticCache for the model"
        self.cache = StaticCache(config=lm.model.config, max_cache_len=max_tokens)
        whole_windows(self.cache, max_tokens)
        self._cache_keyword = next(iter(with_cache(lm.model, None)))  # read here, not inside the traced step
        self.max_tokens = max_tokens
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=self.device)  # the step's input token
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)  # its position
        # Set, on the device, by a step whose logits hold a NaN or +inf (`not_finite`); read once a prompt.
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)
        pin = self.device.type == "cuda"
        self.host_logs = [{k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pin) for k, v in
                           self.layers.log.tensors().items()} for _ in range(2)]
        self.graph = self._graph_wanted if self._graph_wanted is not None else self.device.type == "cuda"
        self._cuda_graph = None
        self.steps = 0  # decode steps run, over every prompt
        self.zero_copy_bytes = 0
        engine.captured = self.layers
        self._stage = "running the decode step once, uncompiled, over transformers' StaticCache"

    def _check_plan(self) -> None:
        """The step gathers each routed expert's blob (and, where it may miss, its host row) and
        decodes them: the budget's margin must hold that (`captured_workspace`), planned at build."""
        if not self.engine.planned_captured:
            raise MoetoolError("the engine's budget was not planned for the captured step's workspace; build it "
                               "with build_engine(..., captured=True)")

    # -- the step ----------------------------------------------------------------------------------
    def _step(self) -> None:
        model = self.engine.lm.model
        out = model(input_ids=self.tok, cache_position=self.pos, position_ids=self.pos.view(1, 1), use_cache=True,
                    **{self._cache_keyword: self.cache})
        nxt = self._pick(out.logits[:, -1])  # [1] greedy, on the device
        self.layers.log.token.copy_(nxt)
        self.tok.copy_(nxt.view(1, 1))
        self.pos.add_(1)

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy token of `logits` [1, V] as the host path's `generate` picks it: the argmax, with
        the ids `greedy_rule` names never picked (a run decodes all of --max-new-tokens)."""
        self.nonfinite.logical_or_(not_finite(logits))
        if self.suppressed is not None:
            logits = logits.index_fill(-1, self.suppressed, float("-inf"))
        return logits.argmax(-1)

    def _build(self, backend: str | None) -> None:
        """One eager step (the static cache allocates its tensors outside any graph), the compile, and
        on CUDA the capture; then the cache is cleared for the first prompt."""
        engine = self.engine
        engine.capturing = True
        try:
            with torch.no_grad():
                self._step()  # eager: initializes the cache, and any error here is the model's, not the compiler's
                self._stage = "compiling the decode step"
                step = _own_code(self._step)
                before = {k for k in globals() if k.startswith(_COMPILED)}
                self.compiled = torch.compile(step, fullgraph=True, dynamic=False, backend=backend or "inductor")
                self.compiled()
                weakref.finalize(self, _forget, step.__func__.__code__,
                                 {k for k in globals() if k.startswith(_COMPILED)} - before)
                self._stage = "checking that the step reads no host state that moves with the position"
                try:
                    with torch.compiler.set_stance("fail_on_recompile"):
                        self.compiled()  # the next position: one program must serve it as it is
                except torch._dynamo.exc.RecompileError as e:
                    raise MoetoolError(f"the compiled decode step would compile again at the next position: it reads "
                                       f"host state that changes every token, which one captured program would "
                                       f"freeze ({first_line(e)[:160]})") from None
                self._stage = "capturing the decode step"
                if self.graph:
                    stream = torch.cuda.Stream(self.device)
                    stream.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(stream):
                        for _ in range(2):
                            self.compiled()
                    torch.cuda.current_stream(self.device).wait_stream(stream)
                    self._cuda_graph = torch.cuda.CUDAGraph()
                    # On the warm-up's stream: the capture reuses the GEMM workspaces it took (a new
                    # stream would take its own, inside the graph's pool).
                    with torch.cuda.graph(self._cuda_graph, stream=stream):
                        self.compiled()
        finally:
            engine.capturing = False
        self.cache.reset()
        self._check_peak()

    def _check_peak(self) -> None:
        """On CUDA the budget's margin plans the compile's and the capture's own workspaces
        (`budget.capture_workspace`); what the allocator really held is checked here too, so a build
        that went past the budget is not kept (the caller falls back to the host path and says so)."""
        if self.device.type != "cuda":
            return
        from moetool.errors import size_text

        engine = self.engine
        peak = torch.cuda.max_memory_allocated(self.device) - engine.stats.foreign_bytes
        total = engine.residency.budget.total
        if peak > total:
            self._cuda_graph = self.compiled = None
            raise MoetoolError(f"compiling and capturing the decode step took {size_text(peak - total)} of device "
                               f"memory past the budget of {size_text(total)} (a larger --budget holds it)")

    @torch.no_grad()  # compiled without grad: a call with grad on would recompile (and AOT refuses the in-place updates)
    def _launch(self) -> None:
        if self._cuda_graph is not None:
            self._cuda_graph.replay()
        else:
            self.compiled()

    # -- the loop -------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int, progress: Any = None) -> list[int]:
        """Greedy decoding of one prompt `ids` [1, T]: prefill on the host path, then `max_new_tokens`-1
        captured steps, the host half of step i done after step i+1 is launched. Returns the new tokens
        (`progress(n)` is told each time one is known)."""
        engine, model = self.engine, self.engine.lm.model
        T = ids.shape[1]
        if T + max_new_tokens > self.max_tokens:
            raise MoetoolError(f"a prompt of {T} tokens plus {max_new_tokens} new ones exceeds the static cache of "
                               f"{self.max_tokens} tokens the captured step was built for.")
        self.cache.reset()
        self.nonfinite.zero_()
        logits = model(input_ids=ids.to(self.device), cache_position=torch.arange(T, device=self.device),
                       use_cache=True, **with_cache(model, self.cache)).logits
        first = self._pick(logits[:, -1])  # [1]
        tokens = [int(first)]
        tell = progress or (lambda n: None)
        tell(1)
        self.tok.copy_(first.view(1, 1))
        self.pos.fill_(T)
        engine._publish_ready()
        self.layers.table.sync()
        # events[i]: step i-1 done on the device (events[0]: the prefill). A step reads only its own and
        # the one before, so each is dropped once read: a prompt holds three events, not one a token.
        events = {0: self._record()}
        pending, last = None, time.perf_counter()
        engine.capturing = True
        try:
            for i in range(max_new_tokens - 1):
                self._launch()
                host = self.host_logs[i % 2]
                for name, t in self.layers.log.tensors().items():
                    host[name].copy_(t, non_blocking=True)
                events[i + 1] = self._record()
                if pending is not None:
                    tokens.append(self._host_half(host=self.host_logs[pending % 2], done=events[pending + 1],
                                                  past=T + pending))
                    last = self._time_step(pending, events, last)
                    del events[pending]
                    tell(len(tokens))
                self.layers.table.sync()  # queued behind step i: step i+1 reads it
                pending = i
            if pending is not None:
                tokens.append(self._host_half(host=self.host_logs[pending % 2], done=events[pending + 1],
                                              past=T + pending))
                self._time_step(pending, events, last)
                tell(len(tokens))
        finally:
            engine.capturing = False
        return tokens

    def _record(self) -> Any:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _time_step(self, i: int, events: dict, last: float) -> float:
        """Step i's time: on the sim clock what `_host_half` charged; on the wall clock the device's
        step-to-step time on CUDA, the host's on a CPU (there the host half runs in line, as it does)."""
        now = time.perf_counter()
        if self.engine.clock.kind == "sim":
            seconds = self._sim_seconds
        elif events[i] is not None:
            seconds = events[i].elapsed_time(events[i + 1]) / 1e3
        else:
            seconds = now - last
        self.engine.stats.steps.append(StepRecord("decode", 1, seconds))
        return now

    # -- the host half, one step behind -----------------------------------------------------------------
    def _host_half(self, host: dict[str, torch.Tensor], done: Any, past: int = 0) -> int:
        """Read a finished step's log and do what the host path does per layer and step: count, feed
        the eviction orders and the policy's bookkeeping, admit and fill misses, start prefetches and
        migrations, publish what has landed. Returns the token the step chose (`past`: the positions
        cached before it, whose attention the sim clock charges)."""
        if done is not None:
            done.synchronize()  # this step's log only; the next step is already queued behind it
        engine, res, pol = self.engine, self.engine.residency, self.engine.policy
        clock, cost, stats = engine.clock, engine.cost, engine.stats
        sim = clock.kind == "sim"
        log = {k: v.numpy() for k, v in host.items()}
        step = Step(index=engine._step_count, phase=Phase.DECODE, num_tokens=1)
        engine._step_count += 1
        if sim:
            clock.begin_step()
        for pos, layer in enumerate(self.layers.layers):
            st = stats.layer(layer)
            if sim:
                clock.compute(cost.t_dense(1, captured=True, past=past))
                clock.compute(cost.hw.kernel_s * self.layers.lookahead.get(pos, 0))  # as `Engine._predict` charges
            routed, expert, bits, hit = log["routed"][pos], log["expert"][pos], log["bits"][pos], log["hit"][pos]
            run = bits > 0
            check_plan(expert[run], bits[run], 0 * expert[run], self.layers.num_experts, pol.name,  # the step clamped
                       engine._stored, layer, "plan_step")  # a bad id: said a step late
            st.skips += int((~run & (routed >= 0) & (routed < self.layers.num_experts)).sum())  # a dropped slot: no skip
            st.substitutions += int((run & (expert != routed)).sum())
            used, hit_s, miss_s, read = [], 0.0, 0.0, 0
            for e, b, h in zip(expert[run].tolist(), bits[run].tolist(), hit[run].tolist()):
                st.precision_mix[b] += 1
                if h:
                    st.hits[b] += 1
                    handle = res.get(layer, e, b)
                    if handle is not None and handle.prefetched:
                        st.prefetch_used += 1
                        handle.prefetched = False
                    hit_s += cost.t_expert(b, 1)
                else:
                    st.misses[b] += 1
                    n = self.engine.store.layout(layer, b).nbytes
                    st.bytes_h2d += n
                    read += n
                    self.mirrors.verify(layer, e, b)
                    miss_s += cost.t_expert(b, 1)
                used.append((e, b, h))
            st.needed += len(used)
            self.zero_copy_bytes += read
            if sim:
                # The kernel streams the missed experts' weights over the link as it computes them: the
                # layer's misses take the longer of their reads and their math; the excess is a stall.
                # The reads share the link with the fills in flight (each miss a caching policy keeps
                # crosses twice: read here, copied into its slot), so they wait for it to be free.
                begin = clock.now + hit_s
                end = clock.read_in_place(self._read_s(read), begin) if read else begin
                over = max(0.0, end - begin - miss_s)
                clock.compute(hit_s + miss_s + over)
                st.stall_s += over
            if log["scores"].shape[1]:
                res.observe(layer, torch.from_numpy(log["scores"][pos].copy()))
            view = LayerView(layer=layer, moe_pos=pos, num_experts=self.layers.num_experts, step=step,
                             top_k_index=torch.from_numpy(routed.copy()).view(1, -1),
                             top_k_weights=torch.from_numpy(log["weight"][pos].copy()).view(1, -1),
                             router_logits=torch.empty(0), residency=res, predict=lambda later: None)
            fetches = pol.log_layer(view)
            shield = {(layer, e) for e, _, _ in used}
            for e, b, h in used:
                if not h:
                    self._fill(Fetch(layer, e, b), shield, demand=True)
            if res.tracks_use():
                res.used(layer, used)
            nxt = self.layers.prefetch_bits.get(layer)
            if nxt is not None and pos + 1 < len(self.layers.layers):
                later = self.layers.layers[pos + 1]
                fetches = [Fetch(later, int(e), nxt) for e in log["prefetch"][pos] if e >= 0] + fetches
            for f in fetches:
                if self._fill(f, shield, demand=False, prefetched=True) is not None:
                    stats.layer(f.layer).prefetch_issued += 1
        for f in pol.end_step(step, res):  # background migrations (DynaExq's promotions)
            self._fill(f, set(), demand=False)
        self._sim_seconds = clock.end_step() if sim else 0.0
        engine._publish_ready()
        stats.peak_device_bytes = max(stats.peak_device_bytes, res.budget.peak)
        if self.device.type == "cuda":
            stats.peak_allocated_bytes = max(stats.peak_allocated_bytes or 0,
                                             torch.cuda.max_memory_allocated(self.device) - stats.foreign_bytes)
        self.steps += 1
        return int(log["token"][0])

    def _read_s(self, nbytes: int) -> float:
        """Seconds for a kernel to read `nbytes` of pinned host memory in place: one access latency and
        the link at ZERO_COPY_SHARE of what its copy engines move (a kernel's own reads are slower)."""
        hw = self.engine.cost.hw
        return nbytes / (hw.h2d_gbps * 1e9 * ZERO_COPY_SHARE) + hw.copy_latency_s

    def _fill(self, want: Fetch, shield: set, demand: bool, prefetched: bool = False) -> Any:
        """Admit `want` (the policy's rule) and copy it from its mirror row into the slot it gets (the
        copy waits for the step in flight: its victim may still be read there). None: not admitted, or
        a copy exists already."""
        if want.bits not in self.engine.residency.pools:
            return None
        self.mirrors.verify(want.layer, want.expert, want.bits)
        return self.engine._start_load(want, shield, demand=demand, prefetched=prefetched, staged=False,
                                       source=self.mirrors.rows(want.layer, want.bits)[want.expert])

    def summary(self) -> dict[str, Any]:
        return {"compile_s": self.compile_s, "captured_steps": self.steps, "bytes_zero_copy": self.zero_copy_bytes,
                "cuda_graph": self._cuda_graph is not None, "verified_model_type": self.verified}


def _own_code(method: Any) -> Any:
    """`method` bound to a copy of its code object. The compiler keeps its compiled graphs per code
    object, with at most eight variants: each program (another model, engine or policy) compiles its
    own step, which must not count against the others' (nor keep theirs alive: `_forget`)."""
    fn = method.__func__
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return types.MethodType(own, method.__self__)


_COMPILED = ("__compiled_fn", "__resume")  # the names the compiler gives what it adds to a module's globals


def _forget(code: types.CodeType, names: set[str]) -> None:
    """Drop what compiling a program's step left in the process once the program is gone: the compiler's
    cache entries for its code (their guards hold the graph) and the compiled functions it named in this
    module's globals. A process that ran captured runs one after another (a sweep's cells, a benchmark)
    had grown by a compiled step each time."""
    from torch._dynamo.eval_frame import remove_from_cache

    remove_from_cache(code)
    for name in names:
        globals().pop(name, None)


__all__ = ["DIFFERENT_MODEL_TYPES", "DecodeProgram", "PATHS", "VERIFIED_MODEL_TYPES", "architecture_refusal",
           "choose_path", "greedy_rule", "unavailable"]

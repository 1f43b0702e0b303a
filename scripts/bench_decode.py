"""The decode step, captured against host-driven, against plain transformers, in one run per device.

For each policy and budget: moetool's host-driven engine (`--decode host`), its captured step
(`--decode captured`), and once per model plain transformers, eager (its DynamicCache loop) and with
a StaticCache and `torch.compile(fullgraph=True)` (its batched_mm experts: the honest baseline).
Every row decodes the same prompt greedily for `--tokens` tokens after its own warm-up; the captured
step's compile time is reported apart (`compile_s`), never inside TPOT. Per row: TPOT median and
p99 (ms), ops dispatched per MoE layer per decode step and host syncs per step (torch profiler over
one step after the run: aten ops and inductor's generated kernels; `_local_scalar_dense`, `item`,
stream and device synchronizations), peak resident host memory while the row ran (RSS sampled every
10 ms, over the process's before the row), and whether its tokens equal transformers' eager ones
(lossless policies must; a lossy one's are shown as they come). On CUDA it also measures the
pinned host-to-device bandwidth and the HBM copy bandwidth, and gives each row its roofline: the
bytes its steps moved over the bus at that bandwidth plus the weights a step reads from HBM. With
`--clock sim` the TPOT columns are the simulated clock's (deterministic), which shows what running
a policy's host half one step behind changes against the host path: hit rate, bytes per token,
simulated TPOT and tokens, side by side.

    .venv/bin/python scripts/bench_decode.py                                    # demo, CPU, all policies
    .venv/bin/python scripts/bench_decode.py --policies resident,lru,fate,fate-paper --budgets 100%,25% --tokens 16
    .venv/bin/python scripts/bench_decode.py --device cuda --model /ckpt --bundle /b --json decode.json
    .venv/bin/python scripts/bench_decode.py --clock sim --hw rtx3090 --budgets 25% --bundle out/demo/bundle
    .venv/bin/python scripts/bench_decode.py --device cuda ... --clock sim --hw measured.hw.json --against decode.json

Prints one table and, with --json, writes the rows (fields: device, model, policy, budget, path,
tpot_p50_ms, tpot_p99_ms, compile_s, ops_per_layer_step, syncs_per_step, peak_rss_mib, same_tokens,
hit_rate, bytes_per_token, roofline_ms; with --against, wall_tpot_p50_ms and sim_over_wall).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from moetool.engine import build_engine
from moetool.engine.decode import DecodeProgram
from moetool.engine.store import HostStore
from moetool.model import load_model, load_reference
from moetool.source import resolve_source
from moetool.quant.bundle import load_bundle_model

PROMPT = "The king said to the people of the city that the war was over, and"
POLICIES = {  # name -> knobs: every shipped policy, lossless ones at 16 bits
    "resident": {}, "lod": {}, "lru": {}, "eap": {}, "fate": {"cache_bits": "16", "p": "0"},
    "dymoe": {"config": "4/2"}, "smoe": {"cpu_assist": "false"}, "dynaexq": {"config": "16/4"},
    "static": {"bits": "4"},
}
LOSSLESS = {"resident", "lod", "lru", "eap", "fate"}
# Rows under another name: a policy at its paper's own defaults beside its lossless row (Fate's INT4
# cache and INT2 for unpopular experts: what its speed claim rests on; its tokens differ), and
# DynaExq at 4/2, whose INT2 floor fits a 25% budget where 16/4's INT4 floor of every expert does
# not (the H100 run refused dynaexq 16/4 at 25%: 1.1 GiB of INT4 against 990 MiB).
VARIANTS = {"fate-paper": ("fate", {}), "dynaexq-4/2": ("dynaexq", {"config": "4/2"})}
QUANTIZED = {"dymoe", "dynaexq", "static", "fate-paper", "dynaexq-4/2"}  # need a bundle with 4 and 2 bits


class PeakRss:
    """Peak resident memory of this process while the block runs, over what it held at the start."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def mib(self) -> float:
        return (self.peak - self.base) / 2**20


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _dist(times: list[float]) -> tuple[float, float]:
    s = sorted(times)
    return statistics.median(s) * 1e3, s[min(len(s) - 1, round(0.99 * (len(s) - 1)))] * 1e3


def _profile(fn, device: torch.device, layers: int) -> tuple[float, float]:
    """(ops dispatched per MoE layer, host syncs) in one call of `fn` (a decode step)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for _ in range(2):  # the first under a profiler may recompile a compiled step (its guards see the profiler)
        with profile(activities=acts) as prof:
            fn()
            _sync(device)
    ops = syncs = 0
    for e in prof.events():
        name = e.name
        if not name.startswith(("aten::", "cpp_fused", "triton_", "cudaLaunchKernel", "cudaGraphLaunch")):
            continue
        parent = e.cpu_parent  # an op another op dispatched is that op's own work, not the step's
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None and not name.startswith("cuda"):
            ops += 1
        if name in ("aten::_local_scalar_dense", "aten::item"):
            syncs += 1
    syncs += sum(1 for e in prof.events() if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                        "cudaEventSynchronize"))
    return ops / max(1, layers), syncs - _own_syncs(device)


def _own_syncs(device: torch.device) -> int:
    """The synchronizations `_profile` counts around a call that makes none (its own `_sync` and the
    profiler's): taken off each step's count, so a step that never waits for the device shows 0."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return 0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _sync(device)
    return sum(1 for e in prof.events() if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                       "cudaEventSynchronize"))


def plain_transformers(path: str, ids: torch.Tensor, tokens: int, device: torch.device, compiled: bool) -> dict:
    """Plain transformers, every expert resident: its eager loop, or StaticCache + fullgraph compile."""
    from transformers import DynamicCache, StaticCache

    with PeakRss() as mem:
        model = load_reference(path, dtype=torch.float32 if device.type == "cpu" else torch.bfloat16,
                               experts_impl="batched_mm" if compiled else "grouped_mm").to(device)
        ids = ids.to(device)
        T = ids.shape[1]
        times, out = [], []
        with torch.no_grad():
            cache = StaticCache(config=model.config, max_cache_len=T + tokens + 1) if compiled else DynamicCache()
            logits = model(ids, cache=cache, use_cache=True, cache_position=torch.arange(T, device=device)).logits
            tok = logits[:, -1:].argmax(-1)
            pos = torch.tensor([T], device=device)

            def step():
                nonlocal tok
                logits = model(tok, cache=cache, use_cache=True, cache_position=pos,
                               position_ids=pos.view(1, 1)).logits
                tok = logits[:, -1:].argmax(-1)
                pos.add_(1)
                return tok

            run = torch.compile(step, fullgraph=True) if compiled else step
            t0 = time.perf_counter()
            if compiled:
                run()  # compile (a token we then discard: the cache is rebuilt below)
                cache.reset()
                model(ids, cache=cache, use_cache=True, cache_position=torch.arange(T, device=device))
                pos.fill_(T)
                tok = logits[:, -1:].argmax(-1)
            compile_s = time.perf_counter() - t0 if compiled else 0.0
            out.append(int(tok))
            for _ in range(tokens - 1):
                _sync(device)
                t = time.perf_counter()
                out.append(int(run()))  # the token is read each step, as a generate loop does
                times.append(time.perf_counter() - t)
            layers = sum(1 for n, _ in model.named_modules() if n.endswith(".experts"))
            ops, syncs = _profile(run, device, layers)
    p50, p99 = _dist(times)
    return dict(path="hf-compiled" if compiled else "hf-eager", tpot_p50_ms=p50, tpot_p99_ms=p99, compile_s=compile_s,
                ops_per_layer_step=ops, syncs_per_step=syncs, peak_rss_mib=mem.mib, tokens=out)


def moetool_path(args, path: str, policy: str, budget: str, ids: torch.Tensor, device: torch.device) -> dict:
    """One policy at one budget through the host-driven engine or the captured step."""
    with PeakRss() as mem:
        if args.bundle and (policy in QUANTIZED or args.bundle_all):
            lm = load_bundle_model(args.bundle, device=device, dtype=_dtype(device))
            store = HostStore.from_bundle(lm.bundle, _dtype(device))
        else:
            lm = load_model(args.model, device=device, dtype=_dtype(device))
            store = HostStore.from_experts(lm.experts, _dtype(device))
        captured = path == "captured"
        name, knobs = VARIANTS.get(policy, (policy, POLICIES.get(policy)))
        engine, plan = build_engine(lm, store, name, settings=knobs, budget=budget, device=device,
                                    clock=args.clock, hw=args.hw, max_tokens=ids.shape[1] + args.tokens + 1,
                                    captured=captured)
        compile_s = 0.0
        with torch.no_grad():
            if captured:
                program = DecodeProgram(engine, max_tokens=ids.shape[1] + args.tokens + 1, backend=args.backend)
                compile_s = program.compile_s
                out = program.generate(ids, args.tokens)
                step = program._launch
            else:
                out = lm.model.generate(ids.to(device), max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                        do_sample=False)[0, ids.shape[1]:].tolist()
                step = None
        s = engine.stats.summary()
        decode = [x.seconds for x in engine.stats.steps if x.phase == "decode"]
        if step is not None:
            engine.capturing = True
            try:
                ops, syncs = _profile(step, device, len(lm.geometry.layers))
            finally:
                engine.capturing = False
        else:
            ops, syncs = _profile_host(lm, ids, device)
        engine.close()
    p50, p99 = _dist(decode)
    # The experts a token reads on the device at the precisions it ran them at (the precision mix
    # counts the prompt's rows too, and the last token is never fed back): a low-bit policy's
    # roofline reads its low-bit bytes, not bf16's.
    sizes = {b: store.slot_bytes(b) for b in store.bits}
    read = sum(int(n) * sizes.get(int(b), 0) for b, n in (s.get("precision_mix") or {}).items())
    return dict(path=path, tpot_p50_ms=p50, tpot_p99_ms=p99, compile_s=compile_s, ops_per_layer_step=ops,
                syncs_per_step=syncs, peak_rss_mib=mem.mib, tokens=out, hit_rate=s["hit_rate"],
                bytes_per_token=s["bytes_per_token"], bytes_h2d=s["bytes_h2d"], steps=len(decode),
                policy_hw=s.get("policy_hw"),
                expert_read_bytes=read / (ids.shape[1] + args.tokens - 1),
                path_reason="DecodeProgram, compiled" + (" and captured" if device.type == "cuda" else "") if captured
                else engine.decode_info.get("path_reason"))


def interleaved(args, ids: torch.Tensor, device: torch.device, steps: int = 40) -> tuple[float, float]:
    """Median ms of the captured `resident` step and of plain transformers' static+compiled step, their
    steps alternated in one process: the rows above run one after the other, and on a shared CPU the
    machine's state between them moves a ratio near 1 by several percent."""
    from transformers import StaticCache

    max_tokens = ids.shape[1] + steps + 16
    with torch.no_grad():
        lm = load_model(args.model, device=device, dtype=_dtype(device))
        engine, _ = build_engine(lm, HostStore.from_experts(lm.experts, _dtype(device)), "resident", settings={},
                                 budget="100%", device=device, max_tokens=max_tokens, captured=True)
        program = DecodeProgram(engine, max_tokens=max_tokens, backend=args.backend)
        program.generate(ids, 2)
        engine.capturing = True  # launches alone: the host half has nothing to do for `resident`
        model = load_reference(args.model, dtype=_dtype(device), experts_impl="batched_mm").to(device)
        cache = StaticCache(config=model.config, max_cache_len=max_tokens)
        T = ids.shape[1]
        model(ids.to(device), cache=cache, use_cache=True, cache_position=torch.arange(T, device=device))
        pos, tok = torch.tensor([T], device=device), ids[:, -1:].clone().to(device)

        def step():
            logits = model(tok, cache=cache, use_cache=True, cache_position=pos, position_ids=pos.view(1, 1)).logits
            tok.copy_(logits[:, -1:].argmax(-1))
            pos.add_(1)

        theirs = torch.compile(step, fullgraph=True)
        times: tuple[list, list] = ([], [])
        for i in range(steps + 3):
            for fn, out in ((program._launch, times[0]), (theirs, times[1])):
                _sync(device)
                t = time.perf_counter()
                fn()
                _sync(device)
                if i >= 3:  # after warm-up (and the compile of theirs)
                    out.append(time.perf_counter() - t)
        engine.capturing = False
        engine.close()
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def _profile_host(lm, ids: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """One host-path decode step (a forward with a one-token input and its cache), profiled."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache()
        lm.model(ids.to(device), cache=cache, use_cache=True)
        tok = ids[:, -1:].to(device)
        return _profile(lambda: lm.model(tok, cache=cache, use_cache=True), device, len(lm.geometry.layers))


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def bandwidths(device: torch.device) -> dict:
    """Pinned host-to-device and device-to-device copy bandwidth (GB/s), measured (CUDA only)."""
    if device.type != "cuda":
        return {}
    n = 256 << 20
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dev, dev2 = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    out = {}
    for name, fn in (("h2d_gbps", lambda: dev.copy_(host, non_blocking=True)), ("hbm_gbps", lambda: dev2.copy_(dev))):
        fn()
        _sync(device)
        t = time.perf_counter()
        for _ in range(10):
            fn()
        _sync(device)
        factor = 2 if name == "hbm_gbps" else 1  # a device copy reads and writes every byte
        out[name] = factor * 10 * n / (time.perf_counter() - t) / 1e9
    return out


def roofline_ms(row: dict, dense_bytes: float, bw: dict) -> float | None:
    """The step's floor: what it moved over the bus at the measured pinned bandwidth, plus the bytes a
    step reads from HBM (the non-expert weights, and the routed experts at the precisions they ran at)
    at the measured HBM bandwidth."""
    if not bw or row.get("steps") is None:
        return None
    bus = row["bytes_h2d"] / max(1, row["steps"]) / (bw["h2d_gbps"] * 1e9)
    return (bus + (dense_bytes + row["expert_read_bytes"]) / (bw["hbm_gbps"] * 1e9)) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--bundle", type=Path, help="a bundle (16/4/2 bits) for the quantized policies; else they are skipped")
    ap.add_argument("--bundle-all", action="store_true", help="every policy reads the bundle (not the checkpoint)")
    ap.add_argument("--policies", default=",".join([*POLICIES, *VARIANTS]),
                    help=f"comma list among {', '.join([*POLICIES, *VARIANTS])}")
    ap.add_argument("--budgets", default="100%,25%")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend of the captured step")
    ap.add_argument("--paths", default="host,captured")
    ap.add_argument("--no-plain", action="store_true", help="skip plain transformers")
    ap.add_argument("--clock", default="wall", choices=("wall", "sim"),
                    help="sim: TPOT on the --hw profile's cost model (deterministic; plain transformers skipped)")
    ap.add_argument("--hw", default="rtx3090",
                    help="hardware profile: the sim clock's, and what cost-aware policies (Fate's prefetch "
                         "size, SMoE) read on either clock; set against a wall run, give both the same")
    ap.add_argument("--paper-knobs", action="store_true",
                    help="each paper's own defaults (Fate's INT4 cache and INT2 prefill) instead of lossless 16-bit settings")
    ap.add_argument("--against", type=Path, metavar="WALL_JSON",
                    help="with --clock sim: the --json rows of a wall-clock run on this device; each row gets "
                         "wall_tpot_p50_ms and sim_over_wall (the sim clock's error, per policy, budget and path)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    wall = None
    if args.against is not None:
        if args.clock != "sim":
            print("--against compares the simulated clock with a wall-clock run: give --clock sim", file=sys.stderr)
            return 2
        wall = wall_rows(args.against)
        if wall is None:
            print(f"--against {args.against}: not the --json rows of a bench_decode run", file=sys.stderr)
            return 2
    unknown = [p for p in args.policies.split(",") if p not in POLICIES and p not in VARIANTS]
    if unknown:
        print(f"--policies: {', '.join(unknown)} not among {', '.join([*POLICIES, *VARIANTS])}", file=sys.stderr)
        return 2
    args.model = resolve_source(args.model)
    if args.paper_knobs:
        POLICIES["fate"] = {}
        QUANTIZED.add("fate")
    if device.type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    lm = load_model(args.model)
    ids = lm.tokenizer(PROMPT, return_tensors="pt").input_ids if lm.tokenizer else torch.arange(16).view(1, -1)
    dense_bytes = lm.non_expert_bytes() / 2  # the non-expert bf16 weights a step reads
    del lm
    bw = bandwidths(device)
    rows = []
    if not args.no_plain and args.clock == "wall":
        for compiled in (False, True):
            rows.append(dict(policy="-", budget="-", **plain_transformers(args.model, ids, args.tokens, device, compiled)))
            print(f"{rows[-1]['path']:12s} p50 {rows[-1]['tpot_p50_ms']:.2f} ms", file=sys.stderr, flush=True)
    reference = next((r["tokens"] for r in rows if r["path"] == "hf-eager"), None)
    for policy in args.policies.split(","):
        if policy in QUANTIZED and not args.bundle:
            print(f"{policy}: skipped (needs --bundle with 4 and 2 bits)", file=sys.stderr)
            continue
        # Every expert resident is 100% by definition: the reference row runs once, whatever --budgets lists.
        for budget in ["100%"] if policy in ("resident", "static") else args.budgets.split(","):
            for path in args.paths.split(","):
                try:
                    row = moetool_path(args, path, policy, budget, ids, device)
                except Exception as e:  # noqa: BLE001 - a benchmark row that fails is reported, not fatal
                    print(f"{policy} {budget} {path}: {type(e).__name__}: {e}", file=sys.stderr)
                    continue
                rows.append(dict(policy=policy, budget=budget, roofline_ms=roofline_ms(row, dense_bytes, bw), **row))
                print(f"{policy:10s} {budget:5s} {path:9s} p50 {row['tpot_p50_ms']:.2f} ms", file=sys.stderr, flush=True)
                _write(args.json, rows, device, args.model, bw)  # each row as it comes: a run cut short keeps its rows
    for r in rows:
        r.update(same_tokens=None if reference is None else r["tokens"] == reference)
        if wall is not None and (r["policy"], r["budget"], r["path"]) in wall:
            r["wall_tpot_p50_ms"], wall_hw = wall[r["policy"], r["budget"], r["path"]]
            if wall_hw is not None and r.get("policy_hw") is not None and wall_hw != r["policy_hw"]:
                # A cost-aware policy (Fate's n, SMoE's choice) decided on another machine's costs
                # there: its rows moved other bytes, and their times do not measure the clock.
                r["not_compared"] = (f"the wall run's policy read {wall_hw}'s costs, this one {r['policy_hw']}'s: "
                                     "give both runs the same --hw")
            else:
                r["sim_over_wall"] = r["tpot_p50_ms"] / r["wall_tpot_p50_ms"]
    host = {(r["policy"], r["budget"]): r["tpot_p50_ms"] for r in rows if r["path"] == "host"}
    host_tokens = {(r["policy"], r["budget"]): r["tokens"] for r in rows if r["path"] == "host"}
    print(f"\n{'policy':10s} {'budget':6s} {'path':12s} {'p50 ms':>8s} {'p99 ms':>8s} {'x host':>7s} {'compile s':>9s} "
          f"{'ops/layer':>9s} {'syncs':>6s} {'RSS MiB':>8s} {'hit':>5s} {'MiB/tok':>8s} {'=hf':>5s} {'=host':>5s}")
    for r in rows:
        base = host.get((r["policy"], r["budget"]))
        same_host = host_tokens.get((r["policy"], r["budget"]))
        print(f"{r['policy']:10s} {r['budget']:6s} {r['path']:12s} {r['tpot_p50_ms']:8.3f} {r['tpot_p99_ms']:8.3f} "
              f"{(r['tpot_p50_ms'] / base) if base else float('nan'):7.2f} {r['compile_s']:9.1f} "
              f"{r['ops_per_layer_step']:9.1f} {r['syncs_per_step']:6.0f} {r['peak_rss_mib']:8.0f} "
              f"{r.get('hit_rate') or 0:5.2f} {(r.get('bytes_per_token') or 0) / 2**20:8.3f} "
              f"{str(r['same_tokens'])[:5]:>5s} {str(None if same_host is None else r['tokens'] == same_host)[:5]:>5s}")
    hf = next((r for r in rows if r["path"] == "hf-compiled"), None)
    res = next((r for r in rows if r["policy"] == "resident" and r["path"] == "captured"), None)
    if hf and res:
        print(f"\ncaptured resident / transformers static+compiled: {res['tpot_p50_ms'] / hf['tpot_p50_ms']:.3f}x "
              "(rows measured one after the other)")
        ours, theirs = interleaved(args, ids, device)
        print(f"the same, their steps interleaved in one process: {ours:.2f} / {theirs:.2f} ms = {ours / theirs:.3f}x")
    for r in rows:
        if "not_compared" in r:
            print(f"{r['policy']} {r['budget']} {r['path']}: not set against the wall clock: {r['not_compared']}",
                  file=sys.stderr)
    compared = [r for r in rows if "sim_over_wall" in r]
    if compared:
        print(f"\nsimulated ({args.hw}) against the wall clock of {args.against}:")
        for r in compared:
            print(f"{r['policy']:10s} {r['budget']:6s} {r['path']:12s} sim {r['tpot_p50_ms']:8.3f} ms  "
                  f"wall {r['wall_tpot_p50_ms']:8.3f} ms  sim/wall {r['sim_over_wall']:.2f}")
    if bw:
        print(f"measured: pinned H2D {bw['h2d_gbps']:.1f} GB/s, HBM {bw['hbm_gbps']:.0f} GB/s")
    _write(args.json, rows, device, args.model, bw)
    return 0


def wall_rows(path: Path) -> dict[tuple[str, str, str], tuple[float, str | None]] | None:
    """(policy, budget, path) -> (TPOT p50 ms, the hardware profile its policy read) of a wall-clock
    run's --json rows, or None if it is not one."""
    try:
        rows = json.loads(path.read_text())
        return {(r["policy"], r["budget"], r["path"]): (float(r["tpot_p50_ms"]), r.get("policy_hw")) for r in rows}
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _write(path: Path | None, rows: list[dict], device: torch.device, model: str, bw: dict) -> None:
    """The rows so far as JSON (tokens last in each row), with the device, the model and the measured bandwidths."""
    if path is None:
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = [{"device": name, "model": str(model), **bw, **{k: v for k, v in r.items() if k != "tokens"},
            "tokens": r["tokens"]} for r in rows]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(path)


if __name__ == "__main__":
    raise SystemExit(main())

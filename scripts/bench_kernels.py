"""Benchmark of one MoE layer's experts at batch 1 per stored precision: the fused Triton kernels
(`moetool.kernels`) against the path the engine takes on CUDA today (gather the k experts' blob
parts, dequantize them, grouped GEMMs; bf16 read in place), at two real shapes:
Qwen1.5-MoE-A2.7B (hidden 2048, width 1408, 60 experts, top-4) and Qwen3-30B-A3B (hidden 2048,
width 768, 128 experts, top-8), HQQ groups of 64, random weights (the time does not depend on them).

Per shape, precision and path: microseconds per expert (median over repeats of `--sets` routings
of k distinct experts each, spread over the whole pool so that the experts come from memory, not
from the L2 cache), the expert bytes read per second, and the ratio to the same path's bf16 time.
On CUDA the Triton path is timed twice: inside one CUDA graph (device time, what the captured
decode step pays) and eagerly (launches included); the engine's path eagerly (transformers'
grouped_mm does not capture). Each Triton result is checked against the fp32 dequantize reference
(`max_rel_err`) and the graph's replay against the eager call (`graph_equal`).
On a CPU the Triton kernels cannot be timed (the interpreter checks them; it is no timing): the
engine's dequantize path is timed alone, in fp32 (bf16 on the device).

    python3 scripts/bench_kernels.py --out gpu-out                # rows in gpu-out/bench_kernels.json
    python3 scripts/bench_kernels.py --shapes qwen3-30b-a3b --bits 16 4
    python3 scripts/bench_kernels.py --compile-only 90            # no GPU needed: build for sm_90,
                                                                  # print registers and spills
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers.integrations.moe import _grouped_mm  # what the engine's grouped GEMMs call

from moetool.kernels import Act, Activation, SlotPool, experts_forward
from moetool.kernels import config as kconfig
from moetool.kernels import experts as kexperts
from moetool.kernels.activation import reference
from moetool.model import ExpertWeights
from moetool.quant.format import QTensor, dequantize_parts, encode, make_layout, stack_views

SHAPES = {"qwen1.5-moe-a2.7b": dict(hidden=2048, width=1408, experts=60, top_k=4),
          "qwen3-30b-a3b": dict(hidden=2048, width=768, experts=128, top_k=8),
          "tiny": dict(hidden=128, width=64, experts=8, top_k=2)}  # the interpreter's: checks, not timings
GROUP = 64  # HQQ's group size for every pool; --group sets it (moetool quantize's default is 64)
SILU = Activation(Act.SILU, gated=True)  # both models' experts: SiLU(gate) * up, [gate; up] rows


def make_pool(bits: int, shape: dict, slots: int, device: torch.device, distinct: int = 4) -> SlotPool:
    """`slots` expert blobs at `bits` on `device` (`distinct` random experts repeated: every slot is
    its own bytes in memory), ids left empty."""
    h, i = shape["hidden"], shape["width"]
    layout = make_layout(bits, (2 * i, h), (h, i), has_bias=False, group_size=GROUP)
    gen = torch.Generator().manual_seed(bits)
    blobs = []
    for _ in range(distinct):
        w = ExpertWeights(gate_up=torch.randn(2 * i, h, generator=gen) / h ** 0.5,
                          down=torch.randn(h, i, generator=gen) / i ** 0.5)
        q = None
        if bits != 16:
            q = {}
            for proj in layout.projections:
                g, gs = proj.grouped_shape()
                q[proj.name] = QTensor(torch.randint(0, 1 << bits, (g, gs), generator=gen, dtype=torch.uint8),
                                       torch.full((g, 1), 2.0 / (gs ** 0.5 * (1 << bits))),
                                       torch.full((g, 1), ((1 << bits) - 1) / 2))
        blobs.append(encode(layout, w, q))
    data = torch.stack(blobs).to(device)
    return SlotPool(data.repeat((slots + distinct - 1) // distinct, 1)[:slots].contiguous(), layout,
                    torch.empty(0, dtype=torch.int32))


def expert_bytes(pool: SlotPool) -> int:
    """Bytes one expert's computation reads: every part of its blob (padding excluded)."""
    return sum(p.nbytes for p in pool.layout.parts)


class DequantPath:
    """The engine's CUDA path for one token's k experts at one precision: bf16 read in place over
    the pool (empty groups between the routed slots), else the k experts' parts gathered, decoded
    at once (`dequantize_parts`) and two grouped GEMMs; the weighted sum over k after."""

    def __init__(self, pool: SlotPool, dtype: torch.dtype):
        self.pool, self.dtype = pool, dtype
        self.parts = stack_views(pool.data, pool.layout)  # [slots, *shape] views, made once
        self.whole = dequantize_parts(self.parts, pool.layout, dtype) if pool.layout.bits == 16 else None

    def __call__(self, x: torch.Tensor, w: torch.Tensor, slots: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        k = slots.numel()
        rows = x.expand(k, -1).contiguous()  # [k, H]: the token's row once per expert, as the engine gathers it
        if self.whole is not None:  # in place: groups over the whole pool, one row where routed
            stack = self.whole
        else:
            stack = dequantize_parts({n: v.index_select(0, slots) for n, v in self.parts.items()},
                                     self.pool.layout, self.dtype)
        h = _grouped_mm(rows, stack.gate_up.transpose(-2, -1), offs)  # [k, 2I]
        gate, up = h.chunk(2, dim=-1)
        y = _grouped_mm(torch.nn.functional.silu(gate) * up, stack.down.transpose(-2, -1), offs)  # [k, H]
        return (y * w.view(k, 1)).sum(0, keepdim=True)


def routings(n: int, slots: int, k: int, device: torch.device) -> list[torch.Tensor]:
    """`n` routings of one token: k distinct slots each, sorted (grouped GEMMs take groups in order)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randperm(slots, generator=gen)[:k].sort().values.to(device) for _ in range(n)]


def offsets(slots: torch.Tensor, total: int | None) -> torch.Tensor:
    """Grouped-GEMM offsets: one row per routed slot, over `total` groups (the whole pool) or k."""
    if total is None:
        return torch.arange(1, slots.numel() + 1, dtype=torch.int32, device=slots.device)
    counts = torch.zeros(total, dtype=torch.int32, device=slots.device)
    counts[slots] = 1
    return counts.cumsum(0, dtype=torch.int32)


def reference_out(pool: SlotPool, x: torch.Tensor, w: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The fp32 dequantize reference of one token's k experts."""
    stack = dequantize_parts({n: v.index_select(0, slots) for n, v in stack_views(pool.data, pool.layout).items()},
                             pool.layout, torch.float32)
    h = torch.bmm(stack.gate_up, x.float().expand(slots.numel(), -1).unsqueeze(-1)).squeeze(-1)  # [k, 2I]
    y = torch.bmm(stack.down, reference(SILU, h).unsqueeze(-1)).squeeze(-1)  # [k, H]
    return (y * w.float().view(-1, 1)).sum(0, keepdim=True)


def cuda_median_s(fn, repeats: int) -> float:
    """Median seconds of `fn()` on the device (CUDA events), after a warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def cpu_median_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_one(name: str, shape: dict, bits: int, args, device: torch.device) -> list[dict]:
    """Rows for one shape and precision: each path's seconds per call of `--sets` routings."""
    k = shape["top_k"]
    slots = shape["experts"] if device.type == "cuda" else min(shape["experts"], args.cpu_slots)
    pool = make_pool(bits, shape, slots, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # each device's usual compute dtype
    sets = routings(args.sets, slots, k, device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, shape["hidden"], generator=gen).to(device, dtype)
    w = torch.softmax(torch.randn(1, k, generator=gen), -1).to(device, dtype)
    calls, extras = {}, {}
    engine = DequantPath(pool, dtype)
    offs = [offsets(s, slots if bits == 16 else None) for s in sets]
    calls["dequant-gemm-eager"] = lambda: [engine(x, w, s, o) for s, o in zip(sets, offs)]
    if device.type == "cuda":
        pools = [SlotPool(pool.data, pool.layout, s.int().view(1, k)) for s in sets]
        for mode in args.modes:  # each accumulation mode (kconfig.MODES) timed in this same run
            suffix, config = ("" if mode == 0 else f"-m{mode}"), (*run_tiles(args, mode), mode)
            calls[f"triton-eager{suffix}"] = eager_fn = (
                lambda config=config: [experts_forward(x, w, [p], SILU, config) for p in pools])
            eager = eager_fn()  # also compiles the kernels, outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = eager_fn()
            graph.replay()
            torch.cuda.synchronize()
            calls[f"triton-graph{suffix}"] = graph.replay
            err = max(((got.float() - want).abs().max() / want.abs().max()).item()
                      for got, want in zip(eager, (reference_out(pool, x, w, s) for s in sets)))
            extras[f"triton-eager{suffix}"] = extras[f"triton-graph{suffix}"] = {
                "mode": mode, "config": list(config), "max_rel_err": err, "graph_equal": all(torch.equal(a, b) for a, b in zip(eager, captured))}
    rows = []
    for path, fn in calls.items():
        seconds = (cuda_median_s if device.type == "cuda" else cpu_median_s)(fn, args.repeats) / args.sets
        rows.append({"device": device_name(device), "bits": bits, "shape": name, "path": path,
                     "us_per_expert": seconds / k * 1e6, "gbps": expert_bytes(pool) * k / seconds / 1e9,
                     "expert_bytes": expert_bytes(pool), "top_k": k, **extras.get(path, {})})
    del pool, calls  # the pool (and the closures over it) before the next shape's
    return rows


def run_tiles(args, mode: int) -> tuple[int, ...]:
    """The six tiles a mode runs at here: `--config`'s, else the mode's own CUDA tiles (on a CPU too:
    the interpreter checks the GPU's programs)."""
    return tuple(args.config) if args.config else kconfig.mode_tiles(mode, torch.device("cuda"))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({os.cpu_count()} cores)"


def add_ratios(rows: list[dict]) -> None:
    bf16 = {(r["shape"], r["path"]): r["us_per_expert"] for r in rows if r["bits"] == 16}
    for r in rows:
        base = bf16.get((r["shape"], r["path"]))
        r["ratio_to_bf16"] = r["us_per_expert"] / base if base else None


def table(rows: list[dict]) -> str:
    lines = [f"{'shape':<20}{'path':<21}{'bits':>5}{'us/expert':>11}{'GB/s':>9}{'x bf16':>8}  check"]
    for r in rows:
        ratio = f"{r['ratio_to_bf16']:.2f}" if r["ratio_to_bf16"] is not None else "-"
        check = f"err {r['max_rel_err']:.1e} graph {'=' if r['graph_equal'] else '!='}" if "max_rel_err" in r else ""
        lines.append(f"{r['shape']:<20}{r['path']:<21}{r['bits']:>5}{r['us_per_expert']:>11.2f}{r['gbps']:>9.1f}"
                     f"{ratio:>8}  {check}")
    return "\n".join(lines)


# ---- ahead-of-time compilation for a GPU this machine does not have -----------------------------

def tiles(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 6 or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not six positive integers R1,BK1,R2,BK2,B3,WARPS")
    return values


def precision_set(text: str) -> str:
    """A --tune-sets entry: stored precisions, comma-separated ("4,2")."""
    try:
        bits = [int(b) for b in text.split(",")]
    except ValueError:
        bits = []
    if not bits or any(b not in (16, 8, 4, 2) for b in bits):
        raise argparse.ArgumentTypeError(f"'{text}' is not precisions among 16, 8, 4, 2, comma-separated")
    return text


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a positive number of seconds")
    return value


# SASS (cuobjdump -sass): an instruction's opcode, after its address comment and any predicate.
_SASS_OP = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", re.M)
# TTGIR: a layout conversion of a weight tile, [rows, NG, GW] with both > 1 (x's tiles are 1 x NG x GW,
# a tile of scales R x NG x 1).
_TILE_SHUFFLE = re.compile(r"ttg\.convert_layout %\S+ : tensor<(\d+)x\d+x(\d+)x")


# SASS: an instruction's address, and a branch's target (a loop closes with a branch back).
_SASS_AT = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(.*?);", re.M)
_BRANCH_TO = re.compile(r"\bBRA\s+(?:\S+\s+)?0x([0-9a-f]+)")


def machine_traffic(sass: str, ttgir: str) -> dict:
    """What a compiled kernel's machine code does (each instruction once, the loop body's too):
    instructions in all, global loads (LDG), shared-memory loads and stores (LDS, STS), barriers,
    int -> float conversions (I2F*), from Triton's IR the weight tiles it moves between register
    layouts (through shared memory), and the K loops: how many, and the instructions of their
    bodies (what a thread issues per K tile: at batch 1 a low-bit kernel's time, once its bytes are
    few, is these instructions, not its loads)."""
    ops = _SASS_OP.findall(sass)
    count = lambda *names: sum(op.startswith(names) for op in ops)  # noqa: E731
    shuffles = sum(int(m.group(1)) > 1 and int(m.group(2)) > 1 for m in _TILE_SHUFFLE.finditer(ttgir))
    at = [(int(a, 16), text) for a, text in _SASS_AT.findall(sass)]
    loops = [(int(m.group(1), 16), a) for a, text in at if (m := _BRANCH_TO.search(text)) and int(m.group(1), 16) < a]
    body = sum(1 for a, _ in at if any(lo <= a <= hi for lo, hi in loops))
    return dict(sass_ops=len(ops), global_loads=count("LDG"), shared_ops=count("LDS", "STS"), barriers=count("BAR"),
                int_to_float=count("I2F"), tile_shuffles=shuffles, loops=len(loops), loop_ops=body)


def compile_only(arch: int, shapes: list[str], args, modes: list[int], sets: list[str], out: Path | None) -> int:
    """Compile the three kernels for CUDA sm_`arch` with the arguments a call at batch 1 launches (each
    precision set's pools in one launch), per loop mode, and print each one's registers and spills
    and what its machine code does (`machine_traffic`, cuobjdump). Uses Triton's compiler entry points directly
    (no driver, no GPU). With `out`, the rows also go to compile_only.json there."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter does not compile", file=sys.stderr)
        return 2
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    rows = []
    print(f"{'shape':<20}{'kernel':<16}{'bits':<10}{'mode':>4}  {'regs':>5}{'spill':>6}{'sass':>6}{'LDG':>5}"
          f"{'LDS/STS':>8}{'BAR':>5}{'I2F':>5}{'shuffle':>8}{'loop':>6}{'/weight':>8}  (sm_{arch}, Triton {triton.__version__})")
    for name, text, mode in ((n, t, m) for n in shapes for t in sets for m in modes):
        bits = sorted({int(b) for b in text.split(",")}, reverse=True)
        tiles = run_tiles(args, mode)
        config = [*tiles, mode]
        s = SHAPES[name]
        k, hidden, inter = s["top_k"], s["hidden"], s["width"]
        pools = [make_pool(b, dict(s, width=inter), 2, torch.device("cpu"), distinct=1) for b in bits]
        layouts = [v for p in pools for v in kexperts.layout_ints(p.layout)]
        data, ids = [p.data for p in pools], [torch.zeros(1, k, dtype=torch.int32) for _ in pools]
        x, w = torch.zeros(1, hidden, dtype=torch.bfloat16), torch.zeros(1, k, dtype=torch.bfloat16)
        h = torch.empty(len(pools), k, inter)
        y, out_t = torch.empty(len(pools), k, hidden), torch.empty(1, hidden, dtype=torch.bfloat16)
        launches = [kexperts.gate_up_launch(x, data, ids, layouts, k, int(Act.SILU), True, False, 0.0, 0.0, config, h),
                    *kexperts.down_launches(h, w, data, ids, layouts, hidden, config, y, out_t, int(Act.SILU))]
        for kernel, grid, kargs, options in launches:
            binder = create_function_from_signature(kernel.signature, kernel.params, backend)
            bound, spec, opts = binder(*kargs, **options)
            opts, signature, constexprs, attrs = kernel._pack_args(backend, options, bound, spec, opts)
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                      options=opts.__dict__)
            row = dict(shape=name, kernel=kernel.__name__, bits=bits, group=GROUP, mode=mode, sm=arch,
                       triton=triton.__version__, config=config)
            if os.environ.get("MOETOOL_DUMP_IR"):
                stem = f"/tmp/moetool-{kernel.__name__}-{'_'.join(map(str, bits))}-m{mode}"
                Path(f"{stem}.ttgir").write_text(compiled.asm["ttgir"])
                Path(f"{stem}.ptx").write_text(compiled.asm["ptx"])
                Path(f"{stem}.cubin").write_bytes(compiled.asm["cubin"])
            if not cuobjdump.exists():
                print(f"{cuobjdump} is missing (it comes with Triton's CUDA backend): no registers or machine "
                      "code to read", file=sys.stderr)
                return 1
            path = Path(f"/tmp/moetool-{os.getpid()}-{kernel.__name__}.cubin")
            path.write_bytes(compiled.asm["cubin"])
            try:
                res = subprocess.run([str(cuobjdump), "-res-usage", str(path)], capture_output=True, text=True).stdout
                sass = subprocess.run([str(cuobjdump), "-sass", str(path)], capture_output=True, text=True).stdout
            finally:
                path.unlink()
            found = re.search(r"REG:(\d+).*LOCAL:(\d+)", res)
            row.update(registers=int(found.group(1)) if found else None,
                       spilled_bytes=int(found.group(2)) if found else None,
                       **machine_traffic(sass, compiled.asm["ttgir"]))
            # Instructions a thread issues per weight in its K loops (one loop a pool, or the same number
            # each, as mode 3's gate and up loops at INT8: a program's tile is rows x K tile weights of
            # each pool, gate and up rows both for gate_up).
            tile = {"gate_up_kernel": 2 * tiles[0] * tiles[1], "down_kernel": tiles[2] * tiles[3]}.get(kernel.__name__)
            row["loop_ops_per_weight"] = (row["loop_ops"] * 32 * tiles[5] / (tile * len(pools))
                                          if tile and row["loops"] and row["loops"] % len(pools) == 0 else None)
            rows.append(row)
            print(f"{name:<20}{kernel.__name__:<16}{','.join(map(str, bits)):<10}{mode:>4}  {row['registers']!s:>5}"
                  f"{row['spilled_bytes']!s:>6}{row['sass_ops']:>6}{row['global_loads']:>5}{row['shared_ops']:>8}"
                  f"{row['barriers']:>5}{row['int_to_float']:>5}{row['tile_shuffles']:>8}{row['loop_ops']:>6}"
                  f"{'-' if row['loop_ops_per_weight'] is None else format(row['loop_ops_per_weight'], '.1f'):>8}")
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "compile_only.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


# ---- the kernels' configs tuned on this device ----------------------------------------------------

# The fields a tune varies (index into R1,BK1,R2,BK2,B3,WARPS,MODE) and the values it tries: rows a
# program (more, smaller programs hide latency at batch 1), K tiles, warps, the loop mode.
TUNE_FIELDS = {0: (8, 16, 32, 64), 1: (64, 128, 256, 512), 2: (8, 16, 32, 64), 3: (64, 128, 256, 512),
               5: (1, 2, 4, 8), 6: kconfig.MODES}
TUNE_TOLERANCE = 1e-2  # of the reference's largest magnitude (bf16 output; the kernels measured ~4e-3)


def mixed_pools(name: str, bits_set: list[int], args, device: torch.device) -> tuple:
    """One pool per precision, the routings, and per routing the pools with their ids: a routing's
    k slots dealt to the precisions in turn (a DyMoE-like mix in one launch), -1 elsewhere."""
    shape = SHAPES[name]
    k = shape["top_k"]
    slots = shape["experts"] if device.type == "cuda" else min(shape["experts"], args.cpu_slots)
    pools = [make_pool(b, shape, slots, device) for b in bits_set]
    sets = routings(args.sets, slots, k, device)
    calls = []
    for s in sets:
        ids = []
        for p in range(len(pools)):
            mine = torch.tensor([j % len(pools) == p for j in range(k)], device=device)
            ids.append(torch.where(mine, s, -1).int().view(1, k))
        calls.append([SlotPool(pool.data, pool.layout, i) for pool, i in zip(pools, ids)])
    return pools, sets, calls


def tune_one(name: str, bits_set: list[int], args, device: torch.device, seconds: float) -> dict:
    """A coordinate search from the default config over `TUNE_FIELDS`, two rounds or `seconds`: each
    candidate's output checked against the fp32 dequantize reference first (a config that fails it,
    or cannot launch, is recorded and never chosen), then timed (median; a CUDA graph on CUDA)."""
    shape = SHAPES[name]
    k = shape["top_k"]
    pools, sets, calls = mixed_pools(name, bits_set, args, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, shape["hidden"], generator=gen).to(device, dtype)
    w = torch.softmax(torch.randn(1, k, generator=gen), -1).to(device, dtype)
    wants = []
    for s, call in zip(sets, calls):
        want = 0
        for pool, slot_pool in zip(pools, call):
            mine = slot_pool.ids.view(-1) >= 0
            if bool(mine.any()):
                want = want + reference_out(pool, x, w[:, mine], s[mine])
        wants.append(want)
    tried: dict[tuple, dict] = {}

    def measure(config: tuple) -> float | None:
        if config in tried:
            return tried[config].get("us_per_expert")
        row = tried[config] = {"config": list(config)}
        fn = lambda: [experts_forward(x, w, call, SILU, config) for call in calls]  # noqa: E731
        try:
            got = fn()
            err = max(((g.float() - want).abs().max() / want.abs().max()).item() for g, want in zip(got, wants))
            row["max_rel_err"] = err
            if not err <= TUNE_TOLERANCE:
                row["refused"] = f"output off the reference by {err:.2g}"
                return None
            if device.type == "cuda":
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                seconds_ = cuda_median_s(graph.replay, args.repeats)
            else:
                seconds_ = cpu_median_s(fn, args.repeats)
        except Exception as e:  # a config the compiler or the launch refuses: recorded, never chosen
            row["refused"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            return None
        row["us_per_expert"] = seconds_ / (len(calls) * k) * 1e6
        return row["us_per_expert"]

    deadline = time.perf_counter() + seconds
    default = kconfig.default_config(device) if device.type == "cuda" else (*run_tiles(args, 0), 0)
    best, best_us = tuple(default), measure(tuple(default))
    # Mode 3's tiles differ from the default's (`kconfig.WORDS_TILES`): a coordinate search from the
    # default would try it only on tiles made for the other modes, so it is a second starting point.
    words = (*run_tiles(args, 3), 3)
    us = measure(words)
    if us is not None and (best_us is None or us < 0.98 * best_us):
        best, best_us = words, us
    for _ in range(2):
        for field, values in TUNE_FIELDS.items():
            for v in values:
                if time.perf_counter() > deadline:
                    break
                cand = best[:field] + (v,) + best[field + 1:]
                us = measure(cand)
                if us is not None and (best_us is None or us < 0.98 * best_us):  # 2%: over timing noise
                    best, best_us = cand, us
    nbytes = sum(expert_bytes(p) for p in pools) / len(pools)  # an expert's bytes, over the set's precisions
    return {"shape": name, "bits": bits_set, "default": list(default), "default_us": tried[tuple(default)].get("us_per_expert"),
            "best": list(best), "best_us": best_us, "expert_bytes": nbytes,
            "best_gbps": nbytes / (best_us * 1e3) if best_us else None, "tried": list(tried.values())}


def tune(args, device: torch.device) -> int:
    """Tune every shape and precision set in `--tune-sets`; write kernel-configs-<device>.json (the
    form `moetool.kernels.config` reads: copy it to moetool/kernels/configs/<device>.json, or name it
    in MOETOOL_KERNEL_CONFIGS) and print default against best."""
    import triton

    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        print("--tune times the Triton kernels on CUDA (on a CPU only under TRITON_INTERPRET=1, as a check "
              "of the search, not a timing)", file=sys.stderr)
        return 2
    if device.type != "cuda":
        args.repeats, args.sets = min(args.repeats, 2), min(args.sets, 1)
    sets = [sorted({int(b) for b in s.split(",")}, reverse=True) for s in args.tune_sets]
    jobs = [(name, s) for name in args.shapes for s in sets]
    results = []
    for i, (name, bits_set) in enumerate(jobs):
        share = args.tune_seconds / len(jobs)
        print(f"tuning {name} bits {','.join(map(str, bits_set))} ({share:.0f} s)", flush=True)
        results.append(tune_one(name, bits_set, args, device, share))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    name = device_name(device)
    configs: dict[str, dict[str, list[int]]] = {}
    for r in results:
        if r["best_us"] is not None:
            s = SHAPES[r["shape"]]
            configs.setdefault(f"{s['hidden']}x{s['width']}", {})[kconfig.precisions_key(r["bits"])] = r["best"]
    doc = {"device": name, "torch": torch.__version__, "triton": triton.__version__,
           "source": "scripts/bench_kernels.py --tune (best of the configs checked against the fp32 "
                     "dequantize reference, median us per expert in a CUDA graph)",
           "configs": configs, "measured": results}
    # The issue's goals read off the best configs: each set's time against bf16's best, and GB/s.
    bf16 = {r["shape"]: r["best_us"] for r in results if r["bits"] == [16] and r["best_us"]}
    print(f"{'shape':<20}{'bits':<10}{'default us':>12}{'best us':>12}{'best/def':>9}{'x bf16':>8}{'GB/s':>8}"
          "  best config (tried)")
    for r in results:
        d, b = r["default_us"], r["best_us"]
        base = bf16.get(r["shape"])
        r["best_ratio_to_bf16"] = b / base if b and base else None
        cols = [f"{d:.2f}" if d else "-", f"{b:.2f}" if b else "-", f"{b / d:.2f}" if d and b else "-",
                f"{r['best_ratio_to_bf16']:.2f}" if r["best_ratio_to_bf16"] else "-",
                f"{r['best_gbps']:.0f}" if r["best_gbps"] else "-"]
        print(f"{r['shape']:<20}{','.join(map(str, r['bits'])):<10}{cols[0]:>12}{cols[1]:>12}{cols[2]:>9}{cols[3]:>8}"
              f"{cols[4]:>8}  {r['best']} ({len(r['tried'])})")
    out = args.out or Path(".")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"kernel-configs-{kconfig.device_slug(name)}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    kconfig.load_tuned.cache_clear()
    kconfig.load_tuned(str(path))  # the file the engine would read: checked before it is shown
    print(f"wrote {path}: copy it to moetool/kernels/configs/{kconfig.device_slug(name)}.json, or "
          f"export {kconfig.CONFIGS_ENV}={path}")
    return 0


def main() -> int:
    global GROUP
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=[s for s in SHAPES if s != "tiny"])
    ap.add_argument("--bits", nargs="+", type=int, choices=(16, 8, 4, 2), default=[16, 8, 4, 2])
    ap.add_argument("--sets", type=int, default=32, help="routings per timed call (different experts each)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--cpu-slots", type=int, default=8, help="pool slots on a CPU (host memory on a shared machine)")
    ap.add_argument("--config", type=tiles, metavar="R1,BK1,R2,BK2,B3,WARPS",
                    help="the kernels' tiles for every mode (default: each mode's own, moetool.kernels.config.mode_tiles)")
    ap.add_argument("--modes", nargs="+", type=int, choices=kconfig.MODES, default=list(kconfig.MODES),
                    help="accumulation modes to time, each in this run (default: all; 0 is the default)")
    ap.add_argument("--out", type=Path, help="directory for bench_kernels.json")
    ap.add_argument("--group", type=int, choices=(32, 64, 128), default=64, help="HQQ group size of the pools")
    ap.add_argument("--compile-only", type=int, metavar="SM", help="compile for CUDA sm_SM without a GPU, and stop")
    ap.add_argument("--compile-sets", nargs="+", type=precision_set, metavar="BITS[,BITS]",
                    help="with --compile-only: precision sets, each compiled as one launch (default: --bits together)")
    ap.add_argument("--tune", action="store_true",
                    help="search the kernels' configs per shape and precision set, write kernel-configs-<device>.json")
    ap.add_argument("--tune-sets", nargs="+", type=precision_set, default=["16", "8", "4", "2", "4,2"], metavar="BITS[,BITS]",
                    help="precision sets to tune, each one launch (default: each precision, and DyMoE's 4,2)")
    ap.add_argument("--tune-seconds", type=positive_seconds, default=240, help="the whole tune's time, shared by its jobs")
    args = ap.parse_args()
    GROUP = args.group
    if args.compile_only:
        sets = args.compile_sets or [",".join(map(str, args.bits))]
        return compile_only(args.compile_only, args.shapes, args, args.modes, sets, args.out)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.tune:
        return tune(args, device)
    if device.type == "cpu":
        print("no CUDA device: the Triton kernels need CUDA to be timed (under TRITON_INTERPRET=1 they run "
              "on a CPU as a check, not a timing); timing the engine's dequantize path only", file=sys.stderr)
        args.repeats, args.sets = min(args.repeats, 5), min(args.sets, 4)
    rows = []
    for name in args.shapes:
        for bits in sorted(args.bits, reverse=True):
            rows += bench_one(name, SHAPES[name], bits, args, device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    add_ratios(rows)
    print(table(rows))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_kernels.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

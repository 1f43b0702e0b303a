"""Benchmark the engine's compute paths (experts_impl grouped_mm vs eager) at batch 1, in one run.

Every timing is the median wall time of one greedy decode step with a KV cache (perf_counter, after
a device sync on CUDA). Variants compared with each other are interleaved step by step: in each of
`--rounds` rounds every variant decodes `--tokens` tokens from the same prompt, the variants taking
turns at every step in an order rotated per step, so drift in machine load (large on a shared
2-core VM) hits all alike. Sections (`--skip` any of them):

  p1       plain transformers (its default grouped_mm experts kernel), plain eager loop, and engine
           `resident` with each experts_impl; ratios engine / plain per kernel; same greedy tokens.
  static   over a quantized bundle's store at budget 100%: `resident`, `static` bits=8, 4, 2 (those
           the bundle has); each quantized one again without torch's low-bit kernels where it runs
           on one (per-channel INT8: the int8 weight-only kernel; INT4 and INT2: the packed-int4 one).
  offload  over the bundle at budget 25%, wall clock: `lru` and `dymoe` 4/2 (high_bits/low_bits).
  host     host (Python) time per MoE layer per decode step of `resident`: `Engine.run_layer` less
           the expert math inside it (`runtime.grouped_mlp`, or `EngineExperts.expert_forward` for
           eager), in a separate pass so the timers never touch the timed comparisons.
  ppl      perplexity of static INT8, INT4 and INT2 through each experts_impl (eager: dequantize, then
           matmul: the reference) on the first 1,024 tokens of moetool's training text
           (tokenizer-less models: its bytes).
  kernels  one MoE layer's expert math for k experts and one token (CPU): the compute-dtype weights
           in one grouped GEMM per projection, the bundle's INT4 (and INT2) blobs decoded for the k
           at once (`dequantize_stack`) then the same GEMMs, torch's packed-int4 CPU kernel
           (`_weight_int4pack_mm_for_cpu`, the tinygemm layout torchao uses) once per expert and
           projection where its group size (>= 32, dividing the input width) fits, the rest decoded,
           and the engine's own kernel path: the bundle's INT4 and INT2 blobs converted as in a slot,
           the k experts in one kernel call per projection (`int4_kernel.fused_forward`); in fp32
           and in bf16 (the kernel takes bf16 activations: fp32 ones are rounded).
  prefill  one forward of a `--prefill-tokens` prompt through static INT8, INT4 and INT2, with
           torch's low-bit kernels (several tokens: experts decoded from their layout) and without.

Without `--bundle` the model is first quantized (HQQ without its optimizer, bits 16/8/4/2, group
size auto, INT8 per channel: `moetool quantize --int8-per-channel`) into a temporary directory. `--model qwen-moe-tiny` builds, in that directory, a random
Qwen1.5-MoE-A2.7B-shaped model scaled down with tests/tiny.py's save_tiny (seed 0, saved in bf16):
4 layers, 60 experts, top-4 without top-k renormalisation, hidden 512, expert MLP 352, shared
expert 1408, 8 attention / 8 KV heads, vocab 8192.

    .venv/bin/python scripts/bench_engine.py --model demo --tokens 32 --rounds 3
    .venv/bin/python scripts/bench_engine.py --model demo --bundle out/bundle --skip ppl --json bench.json
    .venv/bin/python scripts/bench_engine.py --model qwen-moe-tiny --tokens 8 --rounds 1
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache

import moetool.engine.runtime as runtime
from moetool.checkpoint import find_experts_modules
from moetool.datasets import train_text
from moetool.engine import build_engine
from moetool.engine.store import HostStore
from moetool.model import load_model, model_fingerprint
from moetool.source import load_config, resolve_source
from moetool.quant.bundle import Bundle
from moetool.quant.quantize import QuantizeConfig, quantize
from moetool.tokenizer import encode, load_tokenizer

from bench_kernels_section import section_kernels  # a sibling file (scripts/ is on sys.path when run)

IMPLS = ("grouped_mm", "eager")
SECTIONS = ("p1", "static", "offload", "host", "ppl", "kernels", "prefill")
PROMPT = "The history of the city begins"
PPL_TOKENS = 1024
QWEN_MOE_TINY = dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, num_key_value_heads=8,
                     vocab_size=8192, max_position_embeddings=4096, num_experts=60, num_experts_per_tok=4,
                     moe_intermediate_size=352, shared_expert_intermediate_size=1408, norm_topk_prob=False)


def note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)  # progress on stderr: stdout stays the report


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode(model, ids: torch.Tensor, tokens: int, device: torch.device) -> tuple[list[float], list[int]]:
    """Prefill `ids` [1, T], then `tokens` greedy decode steps: each step's seconds, and the tokens."""
    step = Stepper(model, ids, device)
    times = [step() for _ in range(tokens)]
    return times, step.tokens


class Stepper:
    """One model decoding greedily from a prompt with its own KV cache; each call is one timed step."""

    def __init__(self, model, ids: torch.Tensor, device: torch.device):
        self.model, self.device, self.cache, self.tokens = model, device, DynamicCache(), []
        with torch.no_grad():
            logits = model(ids.to(device), past_key_values=self.cache, use_cache=True).logits
        self.next = logits[:, -1].argmax(-1, keepdim=True)

    def __call__(self) -> float:
        sync(self.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = self.model(self.next, past_key_values=self.cache, use_cache=True).logits
        sync(self.device)
        seconds = time.perf_counter() - t0
        self.next = logits[:, -1].argmax(-1, keepdim=True)
        self.tokens.append(int(self.next))
        return seconds


def interleaved(models: dict, ids: torch.Tensor, args, device) -> tuple[dict[str, float], dict[str, list[int]]]:
    """Median decode-step seconds and greedy tokens per variant. The variants take turns step by step
    (the order rotated every step), so drift in machine load hits all of them alike."""
    for name, m in models.items():  # warm-up: first-call allocations, caches filled, kernels chosen
        note(f"  warm-up {name}")
        decode(m, ids, 2, device)
    names, times, toks = list(models), {k: [] for k in models}, {}
    for r in range(args.rounds):
        note(f"  round {r + 1}/{args.rounds}")
        steppers = {name: Stepper(models[name], ids, device) for name in names}
        for i in range(args.tokens):
            turn = (r * args.tokens + i) % len(names)
            for name in names[turn:] + names[:turn]:  # rotated: no variant always goes first
                times[name].append(steppers[name]())
        toks = {name: st.tokens for name, st in steppers.items()}
    return {k: statistics.median(v) for k, v in times.items()}, toks


def rows(med: dict[str, float]) -> dict[str, float]:
    """Print the medians; return them in ms (for --json)."""
    for name, s in med.items():
        print(f"  {name:<28} median decode step {s * 1e3:9.3f} ms")
    return {k: v * 1e3 for k, v in med.items()}


class Bench:
    """What every section shares: the source, device, dtype, prompt, and the bundle (opened lazily)."""

    def __init__(self, args, src: str, tmp: Path):
        self.args, self.src, self.tmp = args, src, tmp
        self.device, self.dtype = torch.device(args.device), getattr(torch, args.dtype)
        self.config = load_config(src)
        self.tokenizer = load_tokenizer(src)
        self.ids = encode(self.tokenizer, PROMPT, self.config.vocab_size)[None]  # [1, T]
        self._bundle = None

    @property
    def bundle(self):
        if self._bundle is None:
            path = Path(self.args.bundle) if self.args.bundle else self.tmp / "bundle"
            if not self.args.bundle:
                note(f"quantizing {self.src} (hqq, no optimizer, bits 16/8/4/2, INT8 per channel) into {path}")
                quantize(QuantizeConfig(model=self.src, out=path, bits=(16, 8, 4, 2), method="hqq",
                                        hqq_optimize=False, group_size=0, int8_per_channel=True),
                         lambda p: p.stage == "shard" and note(f"  quantized {p.done}/{p.total} experts"))
            self._bundle = Bundle.open(path, model=model_fingerprint(self.config, self.src))
        return self._bundle

    def plain(self, **kw):
        return AutoModelForCausalLM.from_pretrained(self.src, dtype=self.dtype, **kw).to(self.device).eval()

    def engine(self, policy: str, impl: str, budget: str = "100%", store: str = "bundle", kernels: bool = True,
               **settings):
        """A freshly loaded model with its own engine: engines rewire the model, so none share one."""
        note(f"  building {policy} {settings or ''} {budget} {impl}")
        lm = load_model(self.src, device=self.device, dtype=self.dtype)
        st = (HostStore.from_experts(lm.experts, self.dtype) if store == "checkpoint"
              else HostStore.from_bundle(self.bundle, self.dtype))
        engine, _ = build_engine(lm, st, policy, settings={k: str(v) for k, v in settings.items()}, budget=budget,
                                 device=self.device, experts_impl=impl, kernels=kernels)
        return lm, engine


def section_p1(b: Bench) -> dict:
    print("\n== P1: plain transformers vs engine `resident` (checkpoint experts)")
    plain = b.plain()  # transformers' default experts kernel (grouped_mm)
    models = {"plain": plain, "plain-eager": b.plain(experts_implementation="eager")}
    for impl, name in zip(IMPLS, ("engine", "engine-eager")):
        models[name] = b.engine("resident", impl, store="checkpoint")[0].model
    med, toks = interleaved(models, b.ids, b.args, b.device)
    print(f"  (plain's default experts kernel: {plain.config._experts_implementation})")
    ms = rows(med)
    same, same_eager = toks["plain"] == toks["engine"], toks["plain-eager"] == toks["engine-eager"]
    print(f"same tokens: {same}  (eager: {same_eager})")
    ratios = {"engine/plain": med["engine"] / med["plain"],
              "engine-eager/plain-eager": med["engine-eager"] / med["plain-eager"]}
    print(f"ratio engine / plain = {ratios['engine/plain']:.3f}x (goal <= 1.05x)")
    print(f"ratio engine-eager / plain-eager = {ratios['engine-eager/plain-eager']:.3f}x")
    return {"median_ms": ms, "ratios": ratios, "same_tokens": same, "same_tokens_eager": same_eager}


def section_static(b: Bench) -> dict:
    print(f"\n== static precision from the bundle (bits {list(b.bundle.manifest.bits)}), budget 100%")
    quantized = [q for q in (8, 4, 2) if q in b.bundle.manifest.bits]
    variants = {"resident": ("resident", {}), **{f"static-int{q}": ("static", {"bits": q}) for q in quantized}}
    models = {}
    for impl in IMPLS:
        for name, (policy, settings) in variants.items():
            lm, engine = b.engine(policy, impl, **settings)
            models[name + ("" if impl == "grouped_mm" else "-eager")] = lm.model
            on_kernel = engine.kernel_layers.get(settings.get("bits", 0), ())
            if on_kernel:  # the same without torch's low-bit kernel
                kind = "int8 weight-only" if settings["bits"] == 8 else "packed-int4"
                print(f"  {name} runs torch's {kind} kernel in {len(on_kernel)} layers")
                models[f"{name}-dequantize"] = b.engine(policy, impl, kernels=False, **settings)[0].model
    med, _ = interleaved(models, b.ids, b.args, b.device)
    ms = rows(med)
    ratios = {}
    goals = {"int8": "1.0x", "int4": "1.0x", "int2": "1.1x"}  # decoding INT2 unpacks more per byte than INT4
    for q in (f"int{q}" for q in quantized):
        if f"static-{q}-dequantize" in med:
            ratios[f"static-{q}-dequantize/resident"] = r = med[f"static-{q}-dequantize"] / med["resident"]
            print(f"ratio static-{q.upper()} without the low-bit kernel (dequantize) / resident = {r:.3f}x")
    for impl, sfx in zip(IMPLS, ("", "-eager")):
        for q, goal in ((f"int{q}", goals[f"int{q}"]) for q in quantized):
            ratios[f"static-{q}/resident ({impl})"] = r = med[f"static-{q}{sfx}"] / med["resident" + sfx]
            print(f"ratio static-{q.upper()} / resident ({impl}) = {r:.3f}x (goal <= {goal})")
    return {"median_ms": ms, "ratios": ratios}


def section_offload(b: Bench) -> dict:
    print("\n== offloading at budget 25% (wall clock), before = eager, after = grouped_mm")
    variants = {"lru": ("lru", {})}
    if {4, 2} <= set(b.bundle.manifest.bits):
        variants["dymoe-4/2"] = ("dymoe", {"high_bits": 4, "low_bits": 2})
    else:
        print("  (dymoe 4/2 skipped: the bundle lacks 4 or 2 bits)")
    models = {}
    for impl in IMPLS:
        for name, (policy, settings) in variants.items():
            models[f"{name} {impl}"] = b.engine(policy, impl, budget="25%", **settings)[0].model
    med, _ = interleaved(models, b.ids, b.args, b.device)
    ms = rows(med)
    ratios = {}
    for name in variants:
        ratios[name] = r = med[f"{name} grouped_mm"] / med[f"{name} eager"]
        print(f"ratio {name} grouped_mm / eager = {r:.3f}x")
    return {"median_ms": ms, "ratios_grouped_over_eager": ratios}


def section_prefill(b: Bench) -> dict:
    """One forward of a `--prefill-tokens` prompt (moetool's training text) through static INT8, INT4
    and INT2 at budget 100%, with torch's low-bit kernel and without (dequantize), for the precisions
    that run on one; the variants alternate, median of `--rounds` after one warm-up each."""
    n = b.args.prefill_tokens
    print(f"\n== prefill: one forward of {n} tokens, static precision, low-bit kernel vs dequantize")
    ids = encode(b.tokenizer, train_text()[:20 * n], b.config.vocab_size)[: n][None].to(b.device)
    if ids.shape[1] < n:
        print(f"  (the text gives {ids.shape[1]} tokens)")
    out = {}
    for bits in (8, 4, 2):
        if bits not in b.bundle.manifest.bits:
            continue
        lm, engine = b.engine("static", "grouped_mm", bits=bits)
        if not engine.kernel_layers.get(bits):
            print(f"  (INT{bits}: no layer on a kernel)")
            continue
        models = {True: lm.model, False: b.engine("static", "grouped_mm", kernels=False, bits=bits)[0].model}
        times = {kernel: [] for kernel in models}
        with torch.no_grad():
            for r in range(b.args.rounds + 1):
                for kernel, m in models.items():
                    sync(b.device)
                    t0 = time.perf_counter()
                    m(ids)
                    sync(b.device)
                    if r:  # the first round warms up
                        times[kernel].append(time.perf_counter() - t0)
        med = {("kernel" if k else "dequantize"): statistics.median(v) for k, v in times.items()}
        for name, sec in med.items():
            print(f"  static-int{bits} {name:<11} median prefill {sec * 1e3:9.1f} ms")
        out[f"int{bits}"] = {**{k: v * 1e3 for k, v in med.items()}, "ratio": med["kernel"] / med["dequantize"]}
        print(f"ratio static-INT{bits} prefill, kernel / dequantize = {med['kernel'] / med['dequantize']:.3f}x")
    return out


def timed(fn, acc: list[float]):
    """`fn`, adding each call's seconds to acc[0]."""
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        y = fn(*a, **k)
        acc[0] += time.perf_counter() - t0
        return y
    return wrapper


def engine_host_times(b: Bench, impl: str) -> dict[str, float]:
    """Per MoE layer per decode step: run_layer, the expert math inside it, and the difference (us).
    The wrappers are instance/module attributes set for this pass only and deleted after it."""
    lm, engine = b.engine("resident", impl, store="checkpoint")
    decode(lm.model, b.ids, 2, b.device)  # warm-up, unwrapped
    math_s, rec = [0.0], []
    run_layer, mlp = engine.run_layer, runtime.grouped_mlp
    modules = [m for m in lm.model.modules() if isinstance(m, runtime.EngineExperts)]

    def layer(module, hidden, *a):
        sync(b.device)  # so run_layer's one host sync does not wait for earlier device work
        math_s[0] = 0.0
        t0 = time.perf_counter()
        y = run_layer(module, hidden, *a)
        if hidden.shape[0] == 1:  # decode steps only (batch 1: one token)
            rec.append((time.perf_counter() - t0, math_s[0]))
        return y

    engine.run_layer, runtime.grouped_mlp = layer, timed(mlp, math_s)
    for m in modules:
        m.expert_forward = timed(m.expert_forward, math_s)
    try:
        decode(lm.model, b.ids, b.args.tokens * b.args.rounds, b.device)
    finally:
        del engine.run_layer
        runtime.grouped_mlp = mlp
        for m in modules:
            del m.expert_forward
    return {"run_layer_us": statistics.median(t for t, _ in rec) * 1e6,
            "expert_math_us": statistics.median(m for _, m in rec) * 1e6,
            "host_us": statistics.median(t - m for t, m in rec) * 1e6}


def plain_experts_us(b: Bench, **kw) -> float:
    """The plain model's experts forward per layer per decode step (us), synced on both sides."""
    model = b.plain(**kw)
    decode(model, b.ids, 2, b.device)
    rec = []
    for m in find_experts_modules(model).values():
        def fwd(hidden, *a, _f=m.forward, **k):
            sync(b.device)
            t0 = time.perf_counter()
            y = _f(hidden, *a, **k)
            sync(b.device)
            if hidden.shape[0] == 1:
                rec.append(time.perf_counter() - t0)
            return y
        m.forward = fwd  # instance attribute on a throw-away model
    decode(model, b.ids, b.args.tokens * b.args.rounds, b.device)
    return statistics.median(rec) * 1e6


def section_host(b: Bench) -> dict:
    print("\n== host time per MoE layer per decode step, engine `resident` (median over layers x steps)")
    out = {impl: engine_host_times(b, impl) for impl in IMPLS}
    for impl, r in out.items():
        print(f"  engine {impl:<11} run_layer {r['run_layer_us']:9.1f} us   expert math {r['expert_math_us']:9.1f} us"
              f"   host (run_layer - math) {r['host_us']:9.1f} us")
    out["plain experts forward grouped_mm_us"] = g = plain_experts_us(b)
    out["plain experts forward eager_us"] = e = plain_experts_us(b, experts_implementation="eager")
    print(f"  plain experts forward (reference): grouped_mm {g:9.1f} us   eager {e:9.1f} us")
    return out


def section_ppl(b: Bench) -> dict:
    ids = encode(b.tokenizer, train_text()[:16 * PPL_TOKENS], b.config.vocab_size)[:PPL_TOKENS]
    quantized = [q for q in (8, 4, 2) if q in b.bundle.manifest.bits]
    print(f"\n== perplexity, static {', '.join(f'INT{q}' for q in quantized)}, {len(ids)} tokens of moetool's "
          "training text (eager: dequantize each expert, then matmul: the reference)")
    out = {}
    for bits in quantized:
        for impl in IMPLS:
            lm, _ = b.engine("static", impl, bits=bits)
            with torch.no_grad():
                logits = lm.model(ids[None].to(b.device), use_cache=False).logits[0].float()  # [T, V]
            out[f"int{bits} {impl}"] = p = math.exp(F.cross_entropy(logits[:-1], ids[1:].to(b.device)).item())
            print(f"  perplexity static-INT{bits} {impl:<11} {p:12.6f}")
        out[f"int{bits} rel_diff"] = d = abs(out[f"int{bits} grouped_mm"] - out[f"int{bits} eager"]) / out[f"int{bits} eager"]
        print(f"relative difference INT{bits} grouped_mm vs eager = {d * 100:.5f}% (goal within 0.5%)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="a model directory or hub id, 'demo', or 'qwen-moe-tiny'")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps per variant per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill-tokens", type=int, default=256, help="prompt length of the prefill section")
    ap.add_argument("--bundle", default=None, help="an existing bundle of the model (default: quantize one)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--skip", default="", help=f"comma list among {','.join(SECTIONS)}")
    ap.add_argument("--json", default=None, help="also write every median and ratio to this JSON file")
    args = ap.parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if skip - set(SECTIONS):
        ap.error(f"--skip takes {','.join(SECTIONS)}, not {','.join(sorted(skip - set(SECTIONS)))}")
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        src = args.model
        if src == "qwen-moe-tiny":
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from tiny import save_tiny

            note("building qwen-moe-tiny (random, seed 0)")
            src = str(save_tiny("qwen2_moe", Path(tmp) / "qwen-moe-tiny", seed=0, dtype=torch.bfloat16,
                                **QWEN_MOE_TINY))
        b = Bench(args, resolve_source(src), Path(tmp))
        print(f"model {args.model} ({b.config.model_type}), device {b.device}, dtype {args.dtype}, "
              f"threads {torch.get_num_threads()}, {args.rounds} rounds x {args.tokens} decode steps per variant")
        results = {"model": args.model, "device": str(b.device), "dtype": args.dtype,
                   "threads": torch.get_num_threads(), "tokens": args.tokens, "rounds": args.rounds}
        for name, fn in (("p1", section_p1), ("static", section_static), ("offload", section_offload),
                         ("host", section_host), ("ppl", section_ppl), ("kernels", section_kernels),
                         ("prefill", section_prefill)):
            if name not in skip:
                note(f"[{name}]")
                results[name] = fn(b)
                sys.stdout.flush()
                gc.collect()  # engines and models reference each other: free the section's before the next
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

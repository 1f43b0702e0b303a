"""GPU benchmark of the engine on a real-geometry MoE: policies under offloading budgets against
the roofline, accelerate's offload, plain transformers and the simulated clock, in one run.

The model is a random-weight Qwen1.5-MoE-A2.7B (hidden 2048, 60 experts of width 1408, top-4, a
shared expert of 5632 = 4 x 1408, vocab 151936) built on the device from a config and saved as a
checkpoint, with `--layers` of its 24 layers (default 4, so a run fits a short GPU lease: every
per-layer figure is the full model's, per-token bytes and times scale with the layer count).
Random routers route near-uniformly, the hard case for a cache; as in a trained MoE, its router
rows are scaled so routing is peaked (logit std ~2.5 at the router input's RMS norm) and skewed
(row scales falling as rank^-0.35: larger-norm experts win the top-k more often). Say so where
figures are quoted.

In order, each part timed against `--time-limit` (a part that does not fit is recorded as skipped):
  bandwidth  pinned host-to-device copies (256 MiB, median of 10) and device-to-device copies
             (1 GiB, bytes read + written).
  quantize   `moetool quantize --device cuda` at bits 16, 8, 4, 2: seconds per expert (P5).
  p1         plain transformers (bf16, whole model on the device) vs engine `resident`: median
             decode step, interleaved step by step (scripts/bench_engine.py's `interleaved`).
  policies   per budget (`--budgets`, shares of the bf16 experts) and policy: batch 1, a
             `--prompt`-token prompt, `--tokens` new tokens after a warm-up generation: TTFT, TPOT
             mean/p99, hit rate, decode bytes per token, stall, peak allocated vs the budget; and
             the roofline: decode bytes moved / pinned H2D bandwidth + (dense weights + the experts
             each token reads, at their precisions) / device bandwidth.
  timing     `moetool profile --what timing` on the device: a hardware profile (hw-profile.json).
  sim        each policy at the first budget again with `--clock sim --hw hw-profile.json`.
  accelerate the same checkpoint with accelerate's `device_map="auto"` and `max_memory` set to each
             budget's total: median decode step.

Writes `bench_gpu.json` (one row per model, policy and budget) and prints a table.

    python3 scripts/bench_gpu.py --out gpu-out            # on a CUDA machine (scripts/gpu_check.sh)
    python3 scripts/bench_gpu.py --out /tmp/g --layers 2 --tokens 16 --budgets 25 --skip quantize
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from moetool.engine import build_engine
from moetool.engine.stats import Stats
from moetool.engine.store import HostStore
from moetool.model import attention_for_decode, load_model
from moetool.quant.bundle import MANIFEST, Bundle
from moetool.engine.clock import preset_for_device
from moetool.quant.quantize import QuantizeConfig, quantize

from bench_engine import interleaved, note  # a sibling file (scripts/ is on sys.path when run)

QWEN15_MOE = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, vocab_size=151936,
                  max_position_embeddings=8192, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                  shared_expert_intermediate_size=5632, intermediate_size=5632, norm_topk_prob=False,
                  decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
# (name, policy, settings, budgets it runs at: None = every --budgets share)
POLICIES = [("resident", "resident", {}, ("100%",)), ("static int4", "static", {"bits": "4"}, None),
            ("lod", "lod", {}, None), ("lru", "lru", {}, None), ("eap", "eap", {}, None), ("fate", "fate", {}, None),
            ("dymoe 4/2", "dymoe", {"high_bits": "4", "low_bits": "2"}, None),
            ("dymoe 4/0", "dymoe", {"high_bits": "4", "low_bits": "0"}, None),
            ("smoe", "smoe", {}, None),
            ("dynaexq 4/2", "dynaexq", {"b_hi": "4", "b_lo": "2"}, None)]  # 4/2: every expert at b_lo must fit 25%
# A dry run of this script on a CPU (`--device cpu --geometry tiny`): the same parts on a small shape.
TINY = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, vocab_size=8192, moe_intermediate_size=176,
            shared_expert_intermediate_size=704, intermediate_size=704)
DEV = torch.device("cuda")
SECTIONS = ("bandwidth", "quantize", "p1", "policies", "timing", "sim", "accelerate")


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.time() + seconds

    def left(self) -> float:
        return self.end - time.time()


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def timed_copy(dst: torch.Tensor, src: torch.Tensor, repeats: int = 10) -> float:
    dst.copy_(src, non_blocking=True)
    out = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def bandwidth() -> dict[str, float]:
    n = 256 << 20
    src, dst = torch.empty(n, dtype=torch.uint8).pin_memory(), torch.empty(n, dtype=torch.uint8, device="cuda")
    h2d = n / timed_copy(dst, src) / 1e9
    big = 1 << 30
    a, b = torch.empty(big, dtype=torch.uint8, device="cuda"), torch.empty(big, dtype=torch.uint8, device="cuda")
    d2d = 2 * big / timed_copy(b, a) / 1e9  # read + write
    del a, b, src, dst
    return {"h2d_pinned_gbps": h2d, "device_gbps": d2d}


def build_checkpoint(path: Path, layers: int, geometry: dict, seed: int = 0) -> Path:
    """The random Qwen1.5-MoE-shaped checkpoint, built on the device (seconds, not minutes on a CPU)."""
    if (path / "config.json").is_file():
        return path
    cfg = AutoConfig.for_model("qwen2_moe", num_hidden_layers=layers, **geometry)
    torch.manual_seed(seed)
    with DEV:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    E, H = cfg.num_experts, cfg.hidden_size
    rank_scale = (torch.arange(1, E + 1, device=DEV, dtype=torch.float32) ** -0.35)
    rank_scale = rank_scale / rank_scale.square().mean().sqrt()  # mean square 1: the overall scale stays 2.5
    with torch.no_grad():
        for layer in model.model.layers:
            w = torch.randn(E, H, generator=gen, device=DEV) * (2.5 / H ** 0.5)  # logit std 2.5 at unit RMS input
            w *= rank_scale[torch.randperm(E, generator=gen, device=DEV)][:, None]  # popularity not by index
            layer.mlp.gate.weight.copy_(w)
    model.save_pretrained(path)
    del model
    collect()
    return path


def collect() -> None:
    """Give the device memory of models and engines the caller has dropped back (`del` them first)."""
    gc.collect()  # engines and models hold cycles: collect them so their device memory goes back
    if DEV.type == "cuda":
        torch.cuda.empty_cache()


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def step_profile(model, cache, nxt: torch.Tensor, steps: int = 4) -> dict[str, float]:
    """Per decode step, under torch's profiler: kernel launches, blocking host calls (synchronize,
    blocking memcpy), and the GPU's busy time against the step's wall time (what the host costs)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        sync()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"launches": sum(e.count for e in events if e.key in LAUNCHES) / steps,
            "blocking_calls": sum(e.count for e in events if e.key in SYNCS) / steps,
            "gpu_busy_ms": busy / 1e3 / steps, "wall_ms": wall * 1e3 / steps}


def expert_read_bytes(summary: dict, tokens: int, expert_bytes: dict[int, int]) -> float:
    """Expert bytes each decode token reads on the device, from the precision mix (rows per bits)."""
    mix = summary.get("precision_mix") or {}
    return sum(int(n) * expert_bytes.get(int(b), 0) for b, n in mix.items()) / max(1, tokens)


def engine_run(lm, store_of, policy: str, settings: dict, budget: str, ids: torch.Tensor, tokens: int,
               clock: str = "wall", hw: str | None = None, profiled: bool = False) -> dict:
    """Build the engine, warm it with a short generation, then prefill `ids` and decode `tokens`
    steps with fresh counters."""
    attn = lm.model.config._attn_implementation
    kw = {"hw": hw} if hw else {}
    engine, plan = build_engine(lm, store_of(), policy, settings=settings, budget=budget, device=DEV,
                                max_tokens=ids.shape[1] + tokens + 8, clock=clock, **kw)
    try:
        with torch.no_grad():
            lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
            context, foreign, peak = engine.stats.context, engine.stats.foreign_bytes, engine.stats.peak_allocated_bytes
            engine.stats = Stats(tuple(g.index for g in lm.geometry.layers))
            engine.stats.context, engine.stats.foreign_bytes, engine.stats.peak_allocated_bytes = context, foreign, peak
            cache = DynamicCache()
            out = lm.model(ids, past_key_values=cache, use_cache=True)
            after_prefill = engine.stats.total("bytes_h2d")
            nxt = out.logits[:, -1:].argmax(-1)
            for _ in range(tokens):
                out = lm.model(nxt, past_key_values=cache, use_cache=True)
                nxt = out.logits[:, -1:].argmax(-1)
            sync()
        s = engine.stats.summary()
        prof = step_profile(lm.model, cache, nxt) if profiled and DEV.type == "cuda" else None
        decode_bytes = (engine.stats.total("bytes_h2d") - after_prefill) / tokens
        mix_tokens = ids.shape[1] + tokens  # precision_mix counts prefill rows too
        return dict(ttft_s=s["ttft_s"], tpot_s=s["tpot_s"]["mean"], tpot_p99_s=s["tpot_s"].get("p99"),
                    tpot_median_s=s["tpot_s"].get("median"), hit_rate=s["hit_rate"], bytes_per_token=decode_bytes,
                    stall_s=s["stall_s"], budget_bytes=plan.total_bytes, peak_device_bytes=s["peak_device_bytes"],
                    peak_allocated_bytes=s["peak_allocated_bytes"], substitutions=s["substitutions"],
                    skips=s["skips"], cpu_experts=s["cpu_experts"], precision_mix=s["precision_mix"],
                    expert_read_bytes=expert_read_bytes(s, mix_tokens, {b: engine.store.slot_bytes(b) for b in engine.store.bits}),
                    non_expert_bytes=plan.non_expert_bytes, profile=prof)
    finally:
        engine.close()
        lm.model.set_attn_implementation(attn)  # DyMoE switches to eager attention for its scores
        del engine
        collect()


def accelerate_tpot(ckpt: Path, budget_bytes: int, ids: torch.Tensor, tokens: int) -> float:
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device_map="auto",
                                                 max_memory={0: int(budget_bytes), "cpu": "200GiB"}).eval()
    try:
        times = []
        with torch.no_grad():
            cache = DynamicCache()
            out = model(ids, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            for _ in range(tokens):
                sync()
                t0 = time.perf_counter()
                out = model(nxt.to(ids.device), past_key_values=cache, use_cache=True)
                sync()
                times.append(time.perf_counter() - t0)
                nxt = out.logits[:, -1:].argmax(-1)
        return statistics.median(times[1:])
    finally:
        del model
        collect()


def write(out: Path, results: dict) -> None:
    tmp = out / "bench_gpu.json.tmp"
    tmp.write_text(json.dumps(results, indent=1, default=str))
    os.replace(tmp, out / "bench_gpu.json")


def table(results: dict) -> None:
    print(f"\n{'policy':<13}{'budget':>7}{'TTFT ms':>9}{'TPOT ms':>9}{'p99':>8}{'hit':>6}{'MB/tok':>8}"
          f"{'roof ms':>9}{'roof %':>7}{'sim ms':>8}{'|sim-wall|':>11}{'accel ms':>10}{'peak/budget':>12}")
    for r in results["rows"]:
        if "error" in r:
            print(f"{r['policy']:<13}{r['budget']:>7}  {r['error'][:100]}")
            continue
        def f(v, scale=1e3, w=9, d=2):
            return f"{v * scale:>{w}.{d}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"
        share = r["roofline_s"] / r["tpot_wall_s"] if r.get("roofline_s") else None
        err = abs(r["tpot_sim_s"] - r["tpot_wall_s"]) / r["tpot_wall_s"] if r.get("tpot_sim_s") else None
        peak = r["peak_allocated_bytes"] / r["budget_bytes"] if r.get("peak_allocated_bytes") else None
        print(f"{r['policy']:<13}{r['budget']:>7}{f(r['ttft_s'])}{f(r['tpot_wall_s'])}{f(r['tpot_p99_s'], w=8)}"
              f"{f(r['hit_rate'], 1, 6)}{f(r['bytes_per_token'], 1e-6, 8, 1)}{f(r.get('roofline_s'))}"
              f"{f(share, 100, 7, 0)}{f(r.get('tpot_sim_s'), w=8)}{f(err, 100, 10, 1)}%{f(r.get('accelerate_tpot_s'), w=10)}"
              f"{f(peak, 1, 12, 2)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for the results (and the models, unless --work)")
    ap.add_argument("--work", type=Path, default=None, help="where the checkpoint and bundle go (default: OUT/work)")
    ap.add_argument("--layers", type=int, default=4, help="layers of Qwen1.5-MoE's 24")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=128, help="decode tokens timed per run")
    ap.add_argument("--budgets", default="25,50", help="comma list of shares of the bf16 experts, in percent")
    ap.add_argument("--p1-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=420, help="seconds; parts that would start later are skipped")
    ap.add_argument("--device", default="cuda", help="cuda; cpu for a dry run of the script (with --geometry tiny)")
    ap.add_argument("--geometry", default="qwen1.5-moe", choices=["qwen1.5-moe", "tiny"])
    ap.add_argument("--skip", default="", help=f"comma list among {','.join(SECTIONS)}")
    args = ap.parse_args()
    global DEV
    DEV = torch.device(args.device)
    attention_for_decode(DEV)  # as moetool's load_model sets it, for the plain baselines too
    geometry = {**QWEN15_MOE, **(TINY if args.geometry == "tiny" else {})}
    deadline = Deadline(args.time_limit)
    skip = set(filter(None, args.skip.split(",")))
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    budgets = [f"{b.strip()}%" for b in args.budgets.split(",")]
    results: dict = {"device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu", "torch": torch.__version__,
                     "layers": args.layers, "geometry": geometry, "prompt": args.prompt, "tokens": args.tokens, "rows": [], "skipped": []}

    def part(name: str, seconds: float) -> bool:
        if name in skip:
            return False
        if deadline.left() < seconds:
            results["skipped"].append(f"{name}: {deadline.left():.0f} s left, needs ~{seconds:.0f}")
            note(f"skip {name}: out of time")
            return False
        note(f"== {name} ({deadline.left():.0f} s left)")
        return True

    if DEV.type == "cuda" and part("bandwidth", 5):
        results["bandwidth"] = bandwidth()
        note(f"  {results['bandwidth']}")
    t0 = time.time()
    ckpt = build_checkpoint(work / f"{args.geometry}-x{args.layers}", args.layers, geometry)
    results["build_s"] = time.time() - t0
    bundle = work / "bundle"
    if not (bundle / MANIFEST).is_file() and part("quantize", 60):
        t0, done = time.time(), []
        quantize(QuantizeConfig(model=str(ckpt), out=bundle, bits=(16, 8, 4, 2), device=DEV.type),
                 progress=lambda p: done.append((p.stage, time.time())))
        experts = args.layers * geometry["num_experts"]
        expert_times = [t for s, t in done if s == "expert"]
        span = expert_times[-1] - expert_times[0] if len(expert_times) > 1 else time.time() - t0
        results["quantize"] = {"seconds": time.time() - t0, "experts": experts, "bits": [16, 8, 4, 2],
                               "seconds_per_expert": span / max(1, len(expert_times) - 1)}
        note(f"  {results['quantize']}")
    has_bundle = (bundle / MANIFEST).is_file()
    ids = torch.randint(0, geometry["vocab_size"], (1, args.prompt), generator=torch.Generator().manual_seed(0)).to(DEV)

    if part("p1", 40):
        plain = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).to(DEV).eval()
        lm = load_model(ckpt, device=DEV, dtype=torch.bfloat16)
        engine, _ = build_engine(lm, HostStore.from_experts(lm.experts, torch.bfloat16), "resident", device=DEV,
                                 max_tokens=args.prompt + args.p1_tokens * args.rounds + 8)
        ns = argparse.Namespace(tokens=args.p1_tokens, rounds=args.rounds)
        med, toks = interleaved({"plain": plain, "engine resident": lm.model}, ids, ns, DEV)
        profiles = {}
        if DEV.type == "cuda":
            for name, model in (("plain", plain), ("engine resident", lm.model)):
                with torch.no_grad():
                    cache = DynamicCache()
                    out = model(ids, past_key_values=cache, use_cache=True)
                profiles[name] = step_profile(model, cache, out.logits[:, -1:].argmax(-1))
        results["p1"] = {"profile": profiles, "plain_s": med["plain"], "engine_s": med["engine resident"],
                         "ratio": med["engine resident"] / med["plain"],
                         "same_tokens": toks["plain"] == toks["engine resident"]}
        print(f"P1 ratio engine / plain = {results['p1']['ratio']:.3f} "
              f"(plain {med['plain'] * 1e3:.2f} ms, engine {med['engine resident'] * 1e3:.2f} ms)", flush=True)
        engine.close()
        del plain, engine, lm
        collect()
        write(args.out, results)

    lm = load_model(ckpt, device=DEV, dtype=torch.bfloat16)
    if has_bundle:
        lm.bundle = Bundle.open(bundle, model=lm.fingerprint)

    def store_of(model=lm):  # a fresh store per policy; without a bundle (quantize skipped), the reference precision
        if has_bundle:
            return HostStore.from_bundle(model.bundle, torch.bfloat16)
        return HostStore.from_experts(model.experts, torch.bfloat16)
    bw = results.get("bandwidth")
    if part("policies", 20):
        # resident 100% also first: against its row (run last) it shows how far the machine drifts
        # over the policy runs, which bounds what a difference between two rows can mean.
        first = engine_run(lm, store_of, "resident", {}, "100%", ids, args.tokens, profiled=False)
        results["resident_first_tpot_s"] = first["tpot_s"]
        note(f"  resident 100% (first): TPOT {first['tpot_s'] * 1e3:.2f} ms")
        for budget in budgets + ["100%"]:
            for name, policy, settings, only in POLICIES:
                if (only is None and budget == "100%") or (only is not None and budget not in only):
                    continue
                if (not has_bundle and policy not in ("resident", "lod", "lru", "eap")) or not part(f"{name} {budget}", 15):
                    continue
                row = {"model": f"{args.geometry} x{args.layers} layers", "policy": name, "budget": budget,
                       "device": results["device"]}
                try:
                    r = engine_run(lm, store_of, policy, settings, budget, ids, args.tokens,
                                   profiled=policy in ("resident", "static", "lru", "dymoe"))
                    row.update(r, tpot_wall_s=r["tpot_s"])
                    if bw:
                        row["roofline_s"] = (r["bytes_per_token"] / (bw["h2d_pinned_gbps"] * 1e9) +
                                             (r["non_expert_bytes"] + r["expert_read_bytes"]) / (bw["device_gbps"] * 1e9))
                    note(f"  {name} {budget}: TPOT {r['tpot_s'] * 1e3:.2f} ms, hit {r['hit_rate']}")
                except Exception as e:  # a refused budget (static int4 at 25%) is a result too
                    row["error"] = f"{type(e).__name__}: {e}"
                    note(f"  {name} {budget}: {row['error'][:200]}")
                results["rows"].append(row)
                write(args.out, results)

    hw = args.out / "hw-profile.json"
    if has_bundle and part("timing", 30):
        from moetool.profile import ProfileConfig, profile

        prof = profile(ProfileConfig(model=str(ckpt), bundle=bundle, what=("timing",), device=DEV.type,
                                     hw_base=preset_for_device(torch.cuda.get_device_name()) or "h100pcie"
                                     if DEV.type == "cuda" else "h100pcie",
                                     data=("heldout",), seqs_per_data=1))
        hw.write_text(json.dumps(prof.hw, indent=1))
        results["timing"] = {"hw_profile": str(hw), "t_dense_s": prof.hw.get("t_dense_s"),
                             "t_dense_captured_s": prof.hw.get("t_dense_captured_s"),
                             "t_dense_captured_source": prof.hw["sources"].get("t_dense_captured_s"),
                             "t_expert_s": prof.hw.get("t_expert_s"), "h2d_gbps": prof.hw.get("h2d_gbps")}
        write(args.out, results)
    if hw.is_file() and part("sim", 20):
        for row in results["rows"]:
            if row["budget"] != budgets[0] or "error" in row or not part(f"sim {row['policy']}", 10):
                continue
            name, policy, settings, _ = next(p for p in POLICIES if p[0] == row["policy"])
            try:
                r = engine_run(lm, store_of, policy, settings, row["budget"], ids, min(args.tokens, 32), "sim", str(hw))
                row["tpot_sim_s"] = r["tpot_s"]
            except Exception as e:
                row["sim_error"] = f"{type(e).__name__}: {e}"
            write(args.out, results)
    del lm, store_of
    collect()
    if DEV.type == "cuda" and part("accelerate", 40):
        for budget in budgets:
            rows = [r for r in results["rows"] if r["budget"] == budget and "budget_bytes" in r]
            if not rows or not part(f"accelerate {budget}", 30):
                continue
            try:
                tpot = accelerate_tpot(ckpt, max(r["budget_bytes"] for r in rows), ids, 8)
            except Exception as e:
                results.setdefault("accelerate_errors", {})[budget] = f"{type(e).__name__}: {e}"
                continue
            for r in rows:
                r["accelerate_tpot_s"] = tpot
                r["speedup_vs_accelerate"] = tpot / r["tpot_wall_s"]
            write(args.out, results)
    write(args.out, results)
    table(results)
    if results["skipped"]:
        print("skipped: " + "; ".join(results["skipped"]))


if __name__ == "__main__":
    main()

"""Peak host memory of `quantize` and of a bundle-only `run`, on random checkpoints that differ only in expert count.

    .venv/bin/python scripts/bench_memory.py                                  # 64 vs 128 experts (3.4 GB ckpt)
    .venv/bin/python scripts/bench_memory.py --baseline-src /tmp/old-moetool  # also an older checkout, side by side
    .venv/bin/python scripts/bench_memory.py --experts 128 --layers 24 --hidden 2048 --width 768 \\
        --bits 4 --no-reference --no-hqq-solver --budget 4GiB --workdir /big   # ~30 GB bf16 checkpoint

Memory is the peak of RssAnon (anonymous resident memory) sampled from /proc/PID/status every 10 ms,
not VmHWM: a memory-mapped checkpoint or bundle that is only read lives in the page cache and is
not the process's own. Figures are over the import baseline (a process that imports torch,
transformers and moetool's stages and exits). Each checkpoint is random qwen3_moe weights in the
per-expert key layout real checkpoints use (`experts.E.gate_proj.weight`), written shard by shard
so writing it never holds more than one shard. `--baseline-src DIR` runs the same commands with
an older moetool checkout first on PYTHONPATH (older code needs --model beside --bundle; it is
given). `--no-hqq-solver` rounds to nearest on hqq's grid in every code measured (memory does not
depend on the solver; time does, tenfold). Prints one table and a JSON line per (code, experts).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

IMPORTS = "import torch, transformers, moetool.cli, moetool.quant.quantize, moetool.run"


def write_random_checkpoint(out: Path, *, layers: int, experts: int, hidden: int, width: int, top_k: int = 8,
                            vocab: int = 32000, shard_bytes: int = 2 << 30, seed: int = 0) -> Path:
    """A random bf16 qwen3_moe checkpoint in the per-expert layout, written one shard at a time."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from moetool.checkpoint import build_skeleton, expert_parameter_names

    if (out / "config.json").is_file():
        return out  # already written by an earlier run of the same settings
    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model("qwen3_moe", hidden_size=hidden, num_hidden_layers=layers, num_experts=experts,
                                  moe_intermediate_size=width, intermediate_size=4 * width,
                                  num_experts_per_tok=top_k, num_attention_heads=16, num_key_value_heads=4,
                                  head_dim=128, vocab_size=vocab, max_position_embeddings=4096,
                                  tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])
    skeleton = build_skeleton(config, torch.bfloat16)
    fused = expert_parameter_names(skeleton)
    gen = torch.Generator().manual_seed(seed)
    # Tensors are slices of one random pool at random offsets: drawing 30 GB of normals would take
    # longer than the measurement, and memory and time do not depend on the values.
    pool = (torch.randn(1 << 25, generator=gen) * 0.02).to(torch.bfloat16)
    doubled = torch.cat([pool, pool])

    def rand(*shape: int) -> torch.Tensor:
        n = torch.Size(shape).numel()
        start = int(torch.randint(0, pool.numel(), (1,), generator=gen))
        if n <= pool.numel():
            return doubled[start:start + n].clone().view(*shape)
        return pool.repeat(-(-n // pool.numel()) + 1)[start:start + n].view(*shape)

    def tensors():
        for name, p in skeleton.state_dict().items():
            if name in fused:
                continue
            # Router weights larger than the rest, so routing is decisive rather than near-uniform.
            yield name, (torch.ones(p.shape, dtype=torch.bfloat16) if name.endswith("norm.weight")
                         else rand(*p.shape) * (10 if name.endswith("mlp.gate.weight") else 1))
        for i in range(layers):
            for e in range(experts):
                prefix = f"model.layers.{i}.mlp.experts.{e}"
                yield f"{prefix}.gate_proj.weight", rand(width, hidden)
                yield f"{prefix}.up_proj.weight", rand(width, hidden)
                yield f"{prefix}.down_proj.weight", rand(hidden, width)

    weight_map, shard, size, n = {}, {}, 0, 0

    def flush() -> None:
        nonlocal shard, size, n
        name = f"model-{n:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard, size, n = {}, 0, n + 1

    for key, t in tensors():
        shard[key] = t
        size += t.numel() * t.element_size()
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(out)  # last: its presence marks a complete checkpoint
    return out


def peak_anon_rss(cmd: list[str], env: dict[str, str]) -> tuple[int, float, int]:
    """(peak RssAnon bytes, wall seconds, exit code) of `cmd`, sampled from /proc every 10 ms."""
    t0 = time.perf_counter()
    # cwd is not the repository: `python -c` puts the cwd first on sys.path, ahead of PYTHONPATH.
    proc = subprocess.Popen(cmd, env=env, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        status = Path(f"/proc/{proc.pid}/status")
        while not done.is_set():
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("RssAnon:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
            except (OSError, ValueError):
                pass
            time.sleep(0.01)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    _, stderr = proc.communicate()
    done.set()
    thread.join()
    if proc.returncode:
        print(f"  ! {' '.join(cmd[2:])} exited {proc.returncode}: {stderr.strip().splitlines()[-1:]}", file=sys.stderr)
    return peak, time.perf_counter() - t0, proc.returncode


def measure(label: str, src: Path | None, ckpt: Path, work: Path, args: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src) if src else os.environ.get("PYTHONPATH", ""),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    py = [sys.executable, "-c"]
    base, _, _ = peak_anon_rss(py + [IMPORTS], env)
    # --no-hqq-solver turns hqq's zero-point solver off in the child (older code has no flag for it):
    # memory does not depend on it, and with it 1,024 experts take most of an hour on 2 cores.
    solver_off = ("import hqq.core.quantize as q; f = q.Quantizer.__dict__['quantize'].__func__; "
                  "q.Quantizer.quantize = classmethod(lambda c, *a, **k: f(c, *a, **{**k, 'optimize': False})); ")
    cli = [sys.executable, "-c", ("" if args.hqq_solver else solver_off)
           + "import sys; from moetool.cli import main; sys.argv[0] = 'moetool'; main()"]
    bundle = work / f"bundle-{label}"
    shutil.rmtree(bundle, ignore_errors=True)
    quant_args = ["--bits", args.bits] + ([] if args.reference else ["--no-reference"])
    q_peak, q_s, q_rc = peak_anon_rss(cli + ["quantize", str(ckpt), *quant_args, "--out", str(bundle)], env)
    run_bits = [] if args.reference else ["--set", f"bits={max(int(b) for b in args.bits.split(','))}"]
    model = ["--model", str(ckpt)] if src else []  # older code cannot run from a bundle alone
    r_peak, r_s, r_rc = peak_anon_rss(cli + ["run", *model, "--bundle", str(bundle), "--policy", "lru", *run_bits,
                                             "--budget", args.budget, "--max-new-tokens", str(args.tokens),
                                             "--prompt", "The capital of France is"], env)
    if not args.keep:
        shutil.rmtree(bundle, ignore_errors=True)
    return {"code": label.split("-")[0], "experts": int(label.split("-")[1]), "import_baseline_mib": base / 2**20,
            "quantize_peak_mib": (q_peak - base) / 2**20, "quantize_s": q_s, "quantize_rc": q_rc,
            "run_peak_mib": (r_peak - base) / 2**20, "run_s": r_s, "run_rc": r_rc}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", default="64,128", help="expert counts to compare, comma-separated")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--width", type=int, default=512, help="expert intermediate size")
    ap.add_argument("--bits", default="4")
    ap.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                    help="store the bf16 reference in the bundle too (moetool quantize's default)")
    ap.add_argument("--hqq-solver", action=argparse.BooleanOptionalAction, default=True,
                    help="hqq's zero-point solver (off: round to nearest, in every code measured)")
    ap.add_argument("--budget", default="1GiB", help="the run's absolute device budget")
    ap.add_argument("--tokens", type=int, default=8, help="new tokens the run generates")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/moetool-bench-memory"))
    ap.add_argument("--baseline-src", type=Path, help="an older moetool checkout to measure first")
    ap.add_argument("--only-baseline", action="store_true", help="measure only --baseline-src")
    ap.add_argument("--keep", action="store_true", help="keep checkpoints and bundles")
    args = ap.parse_args()
    rows = []
    for n in (int(x) for x in args.experts.split(",")):
        ckpt = args.workdir / f"ckpt-{args.layers}x{n}x{args.hidden}x{args.width}"
        t0 = time.perf_counter()
        write_random_checkpoint(ckpt, layers=args.layers, experts=n, hidden=args.hidden, width=args.width)
        gb = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 1e9
        print(f"checkpoint {ckpt.name}: {gb:.2f} GB bf16 (written in {time.perf_counter() - t0:.0f} s)", flush=True)
        codes = ((("before", args.baseline_src),) if args.baseline_src else ()) + \
            ((("now", None),) if not args.only_baseline else ())
        for label, src in codes:
            row = measure(f"{label}-{n}", src, ckpt, args.workdir, args)
            row["checkpoint_gb"] = gb
            rows.append(row)
            print(json.dumps(row), flush=True)
        if not args.keep:
            shutil.rmtree(ckpt, ignore_errors=True)
    print(f"\n{'code':8}{'experts':>8}{'ckpt GB':>9}{'quantize MiB':>14}{'s':>7}{'run MiB':>10}{'s':>7}")
    for r in rows:
        failed = "  (FAILED: see above)" if r["quantize_rc"] or r["run_rc"] else ""
        print(f"{r['code']:8}{r['experts']:>8}{r['checkpoint_gb']:>9.2f}{r['quantize_peak_mib']:>14.0f}"
              f"{r['quantize_s']:>7.0f}{r['run_peak_mib']:>10.0f}{r['run_s']:>7.0f}{failed}")
    for code in dict.fromkeys(r["code"] for r in rows):
        mine = [r for r in rows if r["code"] == code]
        if len(mine) >= 2:
            lo, hi = mine[0], mine[-1]
            print(f"{code}: {hi['experts']} vs {lo['experts']} experts: quantize peak x"
                  f"{hi['quantize_peak_mib'] / lo['quantize_peak_mib']:.2f}, run peak x"
                  f"{hi['run_peak_mib'] / lo['run_peak_mib']:.2f} (goal <= 1.15)")


if __name__ == "__main__":
    main()

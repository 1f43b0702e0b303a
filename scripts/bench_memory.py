"""Peak host memory of `quantize` and of a bundle-only `run`, on random checkpoints that differ only in expert count.

    .venv/bin/python scripts/bench_memory.py                                  # 64 vs 128 experts, both writers
    .venv/bin/python scripts/bench_memory.py --baseline-src /tmp/old-moetool  # also an older checkout, side by side
    .venv/bin/python scripts/bench_memory.py --experts 128 --layers 24 --hidden 2048 --width 768 \\
        --bits 4 --no-reference --no-hqq-solver --budget 4GiB --writers moetool --workdir /big   # ~30 GB bf16
    .venv/bin/python scripts/bench_memory.py --lengths 128,1024,4096                          # against the work's length

Memory is the peak of RssAnon (anonymous resident memory) sampled from /proc/PID/status every 10 ms,
not VmHWM: a memory-mapped checkpoint or bundle that is only read lives in the page cache and is
not the process's own. Figures are over the import baseline (a process that imports torch,
transformers and moetool's stages and exits). Each checkpoint is random bf16 qwen3_moe weights
(routers scaled up, so routing is decisive), written two ways, as `--writers` picks:

- `moetool`: the per-expert key layout real checkpoints use (`experts.E.gate_proj.weight`), written
  shard by shard (2 GB shards) so writing it never holds more than one shard;
- `transformers`: transformers' own `AutoModelForCausalLM.from_config(...)` + `save_pretrained`,
  the way a user makes a test model (it holds the whole model while it writes). transformers 5.24
  converts its fused experts back to per-expert keys and writes one shard up to 50 GB, keys sorted
  by name (`down_proj` before `gate_proj`): the same model in another file layout and key order.

The run is `moetool run --bundle B --policy lru --set bits=BITS --budget BUDGET`, checked against
the budget it was given: its peak must stay within RUN_BOUND x (non-expert weights + budget, +
--host-budget where given; read from the Run artifact) and grow at most MAX_GROWTH from the
fewest to the most experts. `--baseline-src DIR` runs the same commands with an older moetool
checkout first on PYTHONPATH (`--baseline-model`: code older than bundle-only runs also gets
--model). `--no-hqq-solver` rounds to nearest on hqq's grid in every code measured (memory does not
depend on the solver; time does, tenfold). Prints one JSON line per (writer, code, experts), then a
table and the checks; exits 1 if a check of the code measured last fails.

`--lengths` measures instead each long-running command (`run` under every paper's policy on both
decode paths, one prompt or many, `eval ppl` both ways, an lm-eval task, `profile`) on a tiny
model at each length, and prints the growth of its peak per 1,000 tokens (documents for lm-eval,
decode steps for profile) beside its artifact's (`--works` picks commands).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from moetool.engine.budget import parse_size
from moetool.errors import MoetoolError

IMPORTS = "import torch, transformers, moetool.cli, moetool.quant.quantize, moetool.run"
RUN_BOUND = 1.3  # a run's peak over (non-expert weights + budget): the bound (#46)
MAX_GROWTH = 0.15  # a run's peak from the fewest to the most experts, at the same budget
ROUTER_SCALE = 10  # router weights this much larger than the rest: routing decisive, not near-uniform


def qwen3_moe_config(*, layers: int, experts: int, hidden: int, width: int, top_k: int, vocab: int):
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen3_moe", hidden_size=hidden, num_hidden_layers=layers, num_experts=experts,
                                moe_intermediate_size=width, intermediate_size=4 * width,
                                num_experts_per_tok=top_k, num_attention_heads=16, num_key_value_heads=4,
                                head_dim=128, vocab_size=vocab, max_position_embeddings=4096,
                                tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])


def write_random_checkpoint(out: Path, *, layers: int, experts: int, hidden: int, width: int, top_k: int = 8,
                            vocab: int = 32000, shard_bytes: int = 2 << 30, seed: int = 0) -> Path:
    """A random bf16 qwen3_moe checkpoint in the per-expert layout, written one shard at a time."""
    from safetensors.torch import save_file

    from moetool.checkpoint import build_skeleton, expert_parameter_names

    if (out / "config.json").is_file():
        return out  # already written by an earlier run of the same settings
    out.mkdir(parents=True, exist_ok=True)
    config = qwen3_moe_config(layers=layers, experts=experts, hidden=hidden, width=width, top_k=top_k, vocab=vocab)
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
            yield name, (torch.ones(p.shape, dtype=torch.bfloat16) if name.endswith("norm.weight")
                         else rand(*p.shape) * (ROUTER_SCALE if name.endswith("mlp.gate.weight") else 1))
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


def write_transformers_checkpoint(out: Path, *, layers: int, experts: int, hidden: int, width: int, top_k: int = 8,
                                  vocab: int = 32000, seed: int = 0) -> Path:
    """The same model made as a user would: transformers' `from_config` (its own random init, bf16),
    routers scaled up, then `save_pretrained`. Written to a temporary folder and renamed, so a
    folder with a config is always complete."""
    from transformers import AutoModelForCausalLM

    if (out / "config.json").is_file():
        return out
    config = qwen3_moe_config(layers=layers, experts=experts, hidden=hidden, width=width, top_k=top_k, vocab=vocab)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(ROUTER_SCALE)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    del model
    gc.collect()
    partial.rename(out)
    return out


WRITERS = {"moetool": write_random_checkpoint, "transformers": write_transformers_checkpoint}


def tree_anon_rss(pid: int) -> int:
    """RssAnon bytes of `pid` and its descendants now (0 for a process that is gone)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


def peak_anon_rss(cmd: list[str], env: dict[str, str]) -> tuple[int, float, int]:
    """(peak RssAnon bytes of the process tree, wall seconds, exit code) of `cmd`, sampled every 10 ms."""
    t0 = time.perf_counter()
    # cwd is not the repository: `python -c` puts the cwd first on sys.path, ahead of PYTHONPATH.
    proc = subprocess.Popen(cmd, env=env, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_anon_rss(proc.pid))
            time.sleep(0.01)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    _, stderr = proc.communicate()
    done.set()
    thread.join()
    if proc.returncode:
        print(f"  ! {' '.join(cmd[3:5])} exited {proc.returncode}: {stderr.strip().splitlines()[-1:]}", file=sys.stderr)
    return peak, time.perf_counter() - t0, proc.returncode


def measure(code: str, src: Path | None, ckpt: Path, args: argparse.Namespace) -> dict:
    """Peaks of the import baseline, `quantize` and a bundle-only `run` of `ckpt` with the code in `src`
    (None: this checkout), and the run's budget as its Run artifact records it."""
    env = dict(os.environ, PYTHONPATH=str(src) if src else os.environ.get("PYTHONPATH", ""),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    base, _, _ = peak_anon_rss([sys.executable, "-c", IMPORTS], env)
    # --no-hqq-solver turns hqq's zero-point solver off in the child (older code has no flag for it):
    # memory does not depend on it, and with it 1,024 experts take most of an hour on 2 cores.
    solver_off = ("import hqq.core.quantize as q; f = q.Quantizer.__dict__['quantize'].__func__; "
                  "q.Quantizer.quantize = classmethod(lambda c, *a, **k: f(c, *a, **{**k, 'optimize': False})); ")
    cli = [sys.executable, "-c", ("" if args.hqq_solver else solver_off)
           + "import sys; from moetool.cli import main; sys.argv[0] = 'moetool'; main()"]
    bundle, artifact = args.workdir / f"bundle-{code}", args.workdir / f"run-{code}.json"
    shutil.rmtree(bundle, ignore_errors=True)
    artifact.unlink(missing_ok=True)
    quant_args = ["--bits", args.bits] + ([] if args.reference else ["--no-reference"])
    q_peak, q_s, q_rc = peak_anon_rss(cli + ["quantize", str(ckpt), *quant_args, "--out", str(bundle)], env)
    model = ["--model", str(ckpt)] if src and args.baseline_model else []
    host = ["--host-budget", args.host_budget] if args.host_budget else []
    r_peak, r_s, r_rc = peak_anon_rss(cli + ["run", *model, "--bundle", str(bundle), "--policy", "lru",
                                             "--set", f"bits={args.run_bits}", "--budget", args.budget, *host,
                                             "--max-new-tokens", str(args.tokens), "--prompt", args.prompt,
                                             "--out", str(artifact)], env)
    plan = json.loads(artifact.read_text())["budget"] if artifact.is_file() else {}
    if not args.keep:
        shutil.rmtree(bundle, ignore_errors=True)
    host_bytes = parse_size(args.host_budget, "--host-budget") if args.host_budget else 0
    # What the run may hold: the non-expert weights and the device budget (on a CPU the "device"
    # is host memory too, so the weights count twice here: the bound, generous on a CPU),
    # plus the pinned tier's --host-budget where one is given.
    allowed = plan.get("non_expert_bytes", 0) + plan.get("total_bytes", 0) + host_bytes
    return {"code": code, "import_baseline_mib": base / 2**20,
            "quantize_peak_mib": (q_peak - base) / 2**20, "quantize_s": q_s, "quantize_rc": q_rc,
            "run_peak_mib": (r_peak - base) / 2**20, "run_s": r_s, "run_rc": r_rc,
            "non_expert_mib": plan.get("non_expert_bytes", 0) / 2**20, "budget_mib": plan.get("total_bytes", 0) / 2**20,
            "cache_mib": plan.get("cache_bytes", 0) / 2**20, "run_bound_mib": RUN_BOUND * allowed / 2**20}


def checks(rows: list[dict]) -> list[tuple[str, str, bool]]:
    """(writer and code, what was checked, whether it held): each run within its bound, and the
    growth from the fewest to the most experts of each (writer, code)."""
    out = []
    for r in rows:
        ok = not (r["quantize_rc"] or r["run_rc"]) and r["run_peak_mib"] <= r["run_bound_mib"]
        out.append((f"{r['writer']} {r['code']}", f"{r['experts']} experts: run peak {r['run_peak_mib']:.0f} MiB <= "
                    f"{RUN_BOUND} x (non-expert + budget) = {r['run_bound_mib']:.0f} MiB", ok))
    for key in dict.fromkeys((r["writer"], r["code"]) for r in rows):
        mine = sorted((r for r in rows if (r["writer"], r["code"]) == key), key=lambda r: r["experts"])
        if len(mine) >= 2:
            lo, hi = mine[0], mine[-1]
            growth = hi["run_peak_mib"] / lo["run_peak_mib"] - 1
            out.append((" ".join(key), f"{lo['experts']} -> {hi['experts']} experts: run peak {growth:+.1%} "
                        f"(<= {MAX_GROWTH:.0%}), quantize peak {hi['quantize_peak_mib'] / lo['quantize_peak_mib'] - 1:+.1%}",
                        growth <= MAX_GROWTH))
    return out



# -- against the work's length (--lengths) -----------------------------------------------------------

LENGTH_POLICIES = ("lru", "fate", "dymoe", "smoe", "dynaexq")
PROMPT = "The quick brown fox jumps over the lazy dog."
PER_PROMPT = 16  # new tokens per prompt where the length is a number of prompts
MC_TASKS = 6  # bigbench-mc-cloze's tasks: --limit counts per task


def length_works(bundle: Path, work: Path, text: Path) -> dict[str, tuple[str, Callable[[int], list[str]]]]:
    """name -> (the unit of its length, its moetool arguments for a length n): each long-running command,
    a run under every paper's policy on both decode paths, ppl both ways, an lm-eval task, a profile."""
    engine = ["--bundle", str(bundle), "--budget", "50%", "--clock", "sim"]

    def run(policy: str, decode: str) -> Callable[[int], list[str]]:
        return lambda n: ["run", *engine, "--policy", policy, "--decode", decode, "--prompt", PROMPT,
                          "--max-new-tokens", str(n)]

    def prompts(n: int) -> list[str]:
        path = work / f"prompts-{n}.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"{PROMPT} ({i})"}) + "\n" for i in range(max(1, n // PER_PROMPT))))
        return ["run", *engine, "--policy", "lru", "--decode", "host", "--prompts", str(path),
                "--max-new-tokens", str(PER_PROMPT)]

    def ppl(*more: str) -> Callable[[int], list[str]]:
        return lambda n: ["eval", "ppl", *engine, "--policy", "lru", "--data", str(text), "--context", "128",
                          "--limit", str(n), *more]

    works = {f"run {p} host": ("tokens", run(p, "host")) for p in LENGTH_POLICIES}
    works["run lru captured"] = ("tokens", run("lru", "captured"))
    works[f"run lru n/{PER_PROMPT} prompts"] = ("tokens", prompts)
    works["eval ppl"] = ("tokens", ppl())
    works["eval ppl --stepwise"] = ("tokens", ppl("--stepwise"))
    works["eval bigbench-mc-cloze"] = ("documents", lambda n: ["eval", "bigbench-mc-cloze", *engine, "--policy", "lru",
                                                               "--limit", str(max(1, n // MC_TASKS))])
    works["profile"] = ("decode tokens", lambda n: ["profile", "--bundle", str(bundle), "--data", "heldout", "--seqs", "1",
                                                    "--seq-len", "32", "--what", "routing,similarity,prefetch",
                                                    "--decode-tokens", str(n)])
    return works


def length_model(work: Path, longest: int) -> tuple[Path, Path]:
    """A tiny qwen2_moe (tests/tiny.py, 2 MoE layers of 4 experts) with a character tokenizer and room
    for `longest` tokens, its bundle at 16/4/2 bits, and a text file of at least `longest` characters."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers import save_char_tokenizer
    from tiny import save_tiny

    from moetool.datasets import heldout_text
    from moetool.quant.quantize import QuantizeConfig, quantize

    ckpt, bundle, text = work / f"tiny-{longest}", work / f"tiny-{longest}-bundle", work / "long.txt"
    if not (ckpt / "config.json").is_file():
        save_tiny("qwen2_moe", ckpt, max_position_embeddings=longest + 256)
        save_char_tokenizer(ckpt)
    if not (bundle / "bundle.json").is_file():
        quantize(QuantizeConfig(model=str(ckpt), out=bundle, bits=(16, 4, 2), group_size=16, dtype="float32",
                                hqq_optimize=False))
    held = heldout_text()
    text.write_text(held * (longest // len(held) + 1))
    return bundle, text


def kv_bytes_per_token(bundle: Path) -> int:
    """What a host-path sequence's KV cache holds per token (fp32): what a run must keep as it grows."""
    cfg = json.loads((bundle / "model" / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head * 4


def measure_lengths(args: argparse.Namespace) -> None:
    """Peak host memory of each long-running command at each of --lengths, RssAnon over the import
    baseline (sampled), then its growth per 1,000 units of length (least squares over the lengths)
    beside the artifact's own. A process's peak of Python allocations is its loading's, whatever the
    length: tests/test_memory_growth.py reads them along one run instead."""
    lengths = sorted(int(x) for x in args.lengths.split(","))
    args.workdir.mkdir(parents=True, exist_ok=True)
    bundle, text = length_model(args.workdir, max(lengths))
    works = length_works(bundle, args.workdir, text)
    chosen = list(works) if args.works == "all" else [w.strip() for w in args.works.split(",")]
    if unknown := [w for w in chosen if w not in works]:
        sys.exit(f"--works: {', '.join(unknown)} is not one of {', '.join(works)}.")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    base, _, _ = peak_anon_rss([sys.executable, "-c", IMPORTS], env)
    main_call = "import sys; from moetool.cli import main; sys.argv[0] = 'moetool'; main()"
    rows = []
    for name in chosen:
        unit, make = works[name]
        for n in lengths:
            out = args.workdir / f"length-{name.replace(' ', '_').replace('/', '_')}-{n}.json"
            cmd = make(n) + ["--out", str(out)]
            rss, secs, rc = peak_anon_rss([sys.executable, "-c", main_call, *cmd], env)
            data = json.loads(out.read_text()) if out.is_file() and not rc else {}
            # The x of a lm-eval row is the documents it scored (--limit counts per task, tasks differ in size).
            units = data.get("n", n) if unit == "documents" else n
            row = {"work": name, "unit": unit, "length": units, "rss_mib": (rss - base) / 2**20, "s": secs, "rc": rc,
                   "artifact_kib": out.stat().st_size / 2**10 if data else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\nimport baseline {base / 2**20:.0f} MiB; a host-path KV cache holds {kv_bytes_per_token(bundle)} B a token "
          "(the captured step's static cache is sized for the run's length)")
    head = "".join(f"{'n=' + str(n):>10}" for n in lengths)
    print(f"\n{'work':28}{'unit':>14}{head}   per 1,000: {'RSS MiB':>8}{'artifact KiB':>13}")
    for name in chosen:
        mine = [r for r in rows if r["work"] == name]
        cells = "".join(f"{r['rss_mib']:>10.1f}" if not r["rc"] else f"{'failed':>10}" for r in mine)
        ok = [r for r in mine if not r["rc"]]

        def slope(key: str) -> str:
            pts = [(r["length"], r[key]) for r in ok if r[key] is not None]
            if len({x for x, _ in pts}) < 2:
                return "-"
            return f"{np.polyfit(*zip(*pts), 1)[0] * 1000:.1f}"

        print(f"{name:28}{mine[0]['unit']:>14}{cells}   {'':11}{slope('rss_mib'):>8}{slope('artifact_kib'):>13}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", default="64,128", help="expert counts to compare, comma-separated")
    ap.add_argument("--writers", default="moetool,transformers", help=f"checkpoint writers ({', '.join(WRITERS)})")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--width", type=int, default=512, help="expert intermediate size")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--bits", default="4", help="quantize --bits")
    ap.add_argument("--run-bits", type=int, help="the precision the run's lru policy uses (default: the highest of --bits)")
    ap.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                    help="store the bf16 reference in the bundle too (moetool quantize's default)")
    ap.add_argument("--hqq-solver", action=argparse.BooleanOptionalAction, default=True,
                    help="hqq's zero-point solver (off: round to nearest, in every code measured)")
    ap.add_argument("--budget", default="1GiB", help="the run's absolute device budget")
    ap.add_argument("--host-budget", help="the run's --host-budget (default: none given)")
    ap.add_argument("--tokens", type=int, default=8, help="new tokens the run generates")
    ap.add_argument("--prompt", default="the quick brown fox")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/moetool-bench-memory"))
    ap.add_argument("--baseline-src", type=Path, help="an older moetool checkout to measure first")
    ap.add_argument("--baseline-model", action="store_true", help="give the baseline --model too (pre bundle-only code)")
    ap.add_argument("--only-baseline", action="store_true", help="measure only --baseline-src")
    ap.add_argument("--keep", action="store_true", help="keep checkpoints and bundles")
    ap.add_argument("--lengths", help="instead: peak host memory of each long-running command at these lengths "
                                      "(tokens, documents or decode steps; comma-separated, e.g. 256,1024,4096)")
    ap.add_argument("--works", default="all", help="with --lengths: which commands (comma-separated names, or all)")
    args = ap.parse_args()
    if args.lengths:
        measure_lengths(args)
        return
    writers = args.writers.split(",")
    if unknown := [w for w in writers if w not in WRITERS]:
        sys.exit(f"--writers: {', '.join(unknown)} is not one of {', '.join(WRITERS)}.")
    if args.host_budget:
        try:
            parse_size(args.host_budget, "--host-budget")
        except MoetoolError as e:
            sys.exit(str(e))
    if args.run_bits is None:
        args.run_bits = max(int(b) for b in args.bits.split(","))
    args.workdir.mkdir(parents=True, exist_ok=True)
    codes = ((("before", args.baseline_src),) if args.baseline_src else ()) + \
        ((("now", None),) if not args.only_baseline else ())
    rows = []
    for writer in writers:
        for n in (int(x) for x in args.experts.split(",")):
            ckpt = args.workdir / f"ckpt-{writer}-{args.layers}x{n}x{args.hidden}x{args.width}"
            t0 = time.perf_counter()
            WRITERS[writer](ckpt, layers=args.layers, experts=n, hidden=args.hidden, width=args.width, top_k=args.top_k)
            gb = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 1e9
            print(f"checkpoint {ckpt.name}: {gb:.2f} GB bf16 (written in {time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr, flush=True)
            for code, src in codes:
                row = {"writer": writer, "experts": n, "checkpoint_gb": gb, **measure(code, src, ckpt, args)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            if not args.keep:
                shutil.rmtree(ckpt, ignore_errors=True)
    print(f"\n{'writer':13}{'code':7}{'experts':>8}{'ckpt GB':>9}{'quantize MiB':>14}{'s':>6}{'run MiB':>9}{'s':>6}"
          f"{'bound MiB':>11}{'run/bound':>11}")
    for r in rows:
        failed = "  (FAILED: see above)" if r["quantize_rc"] or r["run_rc"] else ""
        print(f"{r['writer']:13}{r['code']:7}{r['experts']:>8}{r['checkpoint_gb']:>9.2f}{r['quantize_peak_mib']:>14.0f}"
              f"{r['quantize_s']:>6.0f}{r['run_peak_mib']:>9.0f}{r['run_s']:>6.0f}{r['run_bound_mib']:>11.0f}"
              f"{r['run_peak_mib'] / max(r['run_bound_mib'], 1e-9):>11.2f}{failed}")
    if rows:
        r = rows[-1]
        print(f"budget {args.budget}: non-expert {r['non_expert_mib']:.0f} MiB, total {r['budget_mib']:.0f} MiB, "
              f"expert cache {r['cache_mib']:.0f} MiB; import baseline {r['import_baseline_mib']:.0f} MiB")
    results = checks(rows)
    for who, what, ok in results:
        print(f"{'ok  ' if ok else 'FAIL'} {who}: {what}")
    last = codes[-1][0] if codes else None
    sys.exit(1 if any(not ok and who.endswith(f" {last}") for who, _, ok in results) else 0)


if __name__ == "__main__":
    main()

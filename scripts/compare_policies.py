"""Compare every policy on one model, budget and (simulated) machine: TPOT, hit rate, traffic.

Each policy decodes the same prompts (held-out text, never seen by the demo's router fitting)
greedily; the table and a JSON of every Run artifact are written to --out.

    .venv/bin/python scripts/compare_policies.py --bundle out/demo-bundle --budget 25% --hw rtx3090 \
        --prompts 8 --tokens 64 --out out/compare
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from moetool.errors import MoetoolError
from moetool.pipeline import heldout_prompts
from moetool.run import RunConfig, run

# (label, policy, --set knobs): the presets of the issue, with DyMoE in both of its configurations.
POLICIES = [
    ("lod", "lod", {}),
    ("lru", "lru", {}),
    ("eap", "eap", {}),
    ("fate", "fate", {}),
    ("dymoe 4/2", "dymoe", {"config": "4/2"}),
    ("dymoe 4/0", "dymoe", {"config": "4/0"}),
    ("smoe", "smoe", {}),
    ("dynaexq", "dynaexq", {}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--bundle", type=Path, default=None, help="bundle with 16/8/4/2 bits (needed by fate, dymoe, dynaexq)")
    ap.add_argument("--budget", default="25%")
    ap.add_argument("--hw", default="rtx3090")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--fit", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("out/compare"))
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=200)  # a wide table: keep columns whole when piped to a file
    prompts = heldout_prompts(args.prompts)
    args.out.mkdir(parents=True, exist_ok=True)
    table = Table(title=f"policies on {args.model}: budget {args.budget}, sim clock {args.hw}, "
                        f"{args.prompts} prompts x {args.tokens} tokens, batch 1")
    for col in ("policy", "TPOT mean (ms)", "TPOT p99 (ms)", "TTFT (ms)", "hit rate", "MiB / token",
                "stall (s)", "subst.", "skips", "CPU experts", "precision mix"):
        table.add_column(col, justify="right")
    rows = {}
    for label, policy, knobs in POLICIES:
        cfg = RunConfig(model=args.model, bundle=args.bundle, policy=policy, settings=knobs, fit=args.fit,
                        budget=args.budget, clock="sim", hw=args.hw, prompts=prompts,
                        max_new_tokens=args.tokens)
        try:
            with console.status(f"{label} ..."):
                r = run(cfg)
        except MoetoolError as e:
            table.add_row(label, *["-"] * 9, f"refused: {e}")
            rows[label] = {"refused": str(e)}
            continue
        r.save(args.out / f"{label.replace(' ', '_').replace('/', '-')}.run.json")
        s = r.summary
        mix = ", ".join(f"{b}b:{n}" for b, n in s["precision_mix"].items())
        table.add_row(label, f"{r.tpot_s['mean'] * 1e3:.2f}", f"{r.tpot_s['p99'] * 1e3:.2f}", f"{r.ttft_s * 1e3:.1f}",
                      f"{r.hit_rate:.3f}", f"{r.bytes_per_token / 2**20:.2f}", f"{r.stall_s:.3f}",
                      str(s["substitutions"]), str(s["skips"]), str(s["cpu_experts"]), mix)
        rows[label] = {"tpot_s": r.tpot_s, "ttft_s": r.ttft_s, "hit_rate": r.hit_rate,
                       "bytes_per_token": r.bytes_per_token, "stall_s": r.stall_s, "summary": s, "params": r.params}
    console.print(table)
    (args.out / "compare.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

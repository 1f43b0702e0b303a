"""Compare every policy on one model, budget and (simulated) machine: TPOT, hit rate, traffic.

The settings are the packaged grid moetool/grids/compare-policies.yaml, run by `moetool sweep`'s
code (on a local Ray by default, `--workers 0` for one after another in this process): each
policy decodes the same held-out prompts greedily. The Run artifacts and sweep.json go to --out,
where a re-run reuses every valid one; the table is printed and written to OUT/compare.json.

    .venv/bin/python scripts/compare_policies.py --bundle out/demo/bundle --fit out/demo/demo.fit.json \
        --budget 25% --hw rtx3090 --prompts 8 --tokens 64 --out out/compare
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from moetool.errors import MoetoolError
from moetool.grid import load_grid
from moetool.run import Run
from moetool.sweep import SweepConfig, add_worker_arguments, sweep

GRID = "compare-policies"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundle's own model, else demo)")
    ap.add_argument("--bundle", type=Path, default=None, help="bundle with 16/8/4/2 bits (needed by fate, dymoe, dynaexq)")
    ap.add_argument("--budget", default=None, help="device budget (default: the grid's)")
    ap.add_argument("--hw", default=None, help="hardware profile of the sim clock (default: the grid's)")
    ap.add_argument("--prompts", type=int, default=None, help="held-out prompts (default: the grid's)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per prompt (default: the grid's)")
    ap.add_argument("--fit", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("out/compare"))
    add_worker_arguments(ap)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=200)  # a wide table: keep columns whole when piped to a file
    overrides = {"model": args.model or (None if args.bundle else "demo"), "budget": args.budget, "hw": args.hw,
                 "prompts": {"heldout": args.prompts} if args.prompts else None, "max_new_tokens": args.tokens}
    overrides.update({k: str(v.resolve()) for k, v in (("bundle", args.bundle), ("fit", args.fit)) if v})
    overrides = {k: v for k, v in overrides.items() if v is not None}
    grid = {**load_grid(GRID), **overrides}  # what the cells get: the title says it
    cfg = SweepConfig(grid=GRID, out=args.out, overrides=overrides, workers=args.workers, address=args.address)
    try:
        with console.status("sweeping ...") as status:
            index = sweep(cfg, progress=lambda name, state, done, total: status.update(f"{done}/{total} {name}: {state}"))
    except MoetoolError as e:
        raise SystemExit(f"error: {e}") from None
    table = Table(title=f"policies on {args.model or args.bundle or 'demo'}: budget {grid['budget']}, sim clock "
                        f"{grid['hw']}, {grid['prompts']['heldout']} prompts x {grid['max_new_tokens']} tokens, batch 1")
    for col in ("policy", "TPOT mean (ms)", "TPOT p99 (ms)", "TTFT (ms)", "hit rate", "MiB / token",
                "stall (s)", "subst.", "skips", "CPU experts", "precision mix"):
        table.add_column(col, justify="right")
    rows = {}
    for label, cell in index.cells.items():
        if cell["status"] != "done":
            table.add_row(label, *["-"] * 9, f"{cell['status']}: {cell['reason']}")
            rows[label] = {cell["status"]: cell["reason"]}
            continue
        r = Run.load(args.out / cell["artifact"])
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

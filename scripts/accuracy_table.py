"""Quality under every policy: held-out perplexity and offline multiple-choice accuracy, one table.

The settings are the packaged grid moetool/grids/accuracy-table.yaml (each policy x ppl and one
multiple-choice task), run by `moetool sweep`'s code (on a local Ray by default, `--workers 0` for
one after another in this process). The Eval artifacts and sweep.json go to --out (a cell whose
artifact is valid is not re-run), and the table is printed as markdown and written to
OUT/accuracy.json. "agree" is the share of questions where the setting picks the same choice as
`resident` (the exact model): on a model near chance accuracy it says more about what a policy
changes than accuracy does.

    .venv/bin/python scripts/accuracy_table.py --bundle out/demo/bundle --fit out/demo/demo.fit.json \
        --budget 25% --ppl-tokens 4096 --mc-limit 40 --out out/accuracy
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console

from moetool.errors import MoetoolError
from moetool.grid import load_grid
from moetool.sweep import SweepConfig, add_worker_arguments, sweep

GRID = "accuracy-table"
TASK_SEP = "_task="  # cells are named <setting>_task=<task>


def _choices(samples: dict) -> dict[tuple[str, int], int]:
    """(task, doc) -> index of the choice with the highest log-likelihood."""
    return {(task, s["doc_id"]): max(range(len(s["resps"])), key=lambda i: s["resps"][i][0])
            for task, rows in samples.items() for s in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundle's own model)")
    ap.add_argument("--bundle", type=Path, required=True, help="bundle with 16/4/2 bits")
    ap.add_argument("--fit", type=Path, default=None, help="fit artifact (SMoE's alpha)")
    ap.add_argument("--budget", default=None, help="device budget (default: the grid's)")
    ap.add_argument("--hw", default=None, help="hardware profile of the sim clock (default: the grid's)")
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--mc-limit", type=int, default=40, help="questions per BIG-bench task (0: skip MC)")
    ap.add_argument("--task", default="bigbench-mc")
    ap.add_argument("--only", default="", help="comma-separated settings (cell names before _task=) to run (default all)")
    ap.add_argument("--mc-only", default="", help="comma-separated settings that get the MC task (default: those of --only)")
    ap.add_argument("--out", type=Path, default=Path("out/accuracy"))
    add_worker_arguments(ap)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=200)
    grid = load_grid(GRID)
    tasks = [{"task": "ppl", "limit": args.ppl_tokens}] + (
        [{"task": args.task, "limit": args.mc_limit}] if args.mc_limit else [])
    grid["grid"]["task"] = tasks
    grid.update({"bundle": str(args.bundle.resolve())})
    grid.update({k: v for k, v in (("budget", args.budget), ("hw", args.hw)) if v is not None})
    grid.update({"model": args.model} if args.model else {})
    grid.update({"fit": str(args.fit.resolve())} if args.fit else {})
    only = [s.strip() for s in args.only.split(",") if s.strip()] or ["*"]
    mc = [s.strip() for s in args.mc_only.split(",") if s.strip()] or only
    patterns = tuple(f"{o}{TASK_SEP}ppl" for o in only) + tuple(f"{o}{TASK_SEP}{args.task}" for o in mc if args.mc_limit)
    try:
        with console.status("sweeping ...") as status:
            index = sweep(SweepConfig(grid=grid, out=args.out, only=patterns, workers=args.workers,
                                      address=args.address),
                          progress=lambda name, state, done, total: status.update(f"{done}/{total} {name}: {state}"))
    except MoetoolError as e:
        raise SystemExit(f"error: {e}") from None
    results: dict[str, dict] = {}
    for name, cell in index.cells.items():
        label, task = name.split(TASK_SEP)
        r = results.setdefault(label, {"policy": cell["settings"]["policy"], "knobs": cell["settings"]["settings"],
                                       "budget": cell["settings"].get("budget")})
        if cell["status"] != "done":
            r[task] = {"refused": cell["reason"]}
            console.print(f"[yellow]{label}: {task} {cell['status']}: {cell['reason']}")
            continue
        e = json.loads((args.out / cell["artifact"]).read_text())
        r[task] = {"metrics": e["metrics"], "stderr": e["stderr"], "n": e["n"], "params": e["params"],
                   "summary": {k: e["summary"].get(k) for k in ("precision_mix", "skips", "substitutions",
                                                                 "hit_rate", "cpu_experts")}}
        if task != "ppl":
            r[task]["choices"] = _choices(e["samples"])
    ref = results.get("resident", {}).get(args.task, {}).get("choices")
    lines = ["| setting | budget | ppl | " + f"{args.task} acc | agree w/ resident | precision mix (ppl) | skips | subst. |",
             "|---|---|---|---|---|---|---|---|"]
    for label, r in results.items():
        ppl, mc = r.get("ppl", {}), r.get(args.task, {})
        ppl_s = f"{ppl['metrics']['ppl']:.2f}" if "metrics" in ppl else ppl.get("refused", "-")[:40]
        if "metrics" in mc:
            acc = f"{mc['metrics']['acc']:.3f} ± {mc['stderr'].get('acc', float('nan')):.3f}"
            ch = mc["choices"]
            agree = f"{sum(ch[k] == ref.get(k) for k in ch) / len(ch):.3f}" if ref else "-"
        else:
            acc, agree = "-", "-"
        s = ppl.get("summary", {})
        total = sum((s.get("precision_mix") or {}).values()) or 1
        mix = ", ".join(f"{b}b {n / total:.0%}" for b, n in (s.get("precision_mix") or {}).items())
        lines.append(f"| {label} | {r['budget']} | {ppl_s} | {acc} | {agree} | {mix} | {s.get('skips', '-')} | "
                     f"{s.get('substitutions', '-')} |")
        for task in list(r):
            if isinstance(r[task], dict):
                r[task].pop("choices", None)
    print("\n".join(lines))
    (args.out / "accuracy.json").write_text(json.dumps(results, indent=1))
    (args.out / "accuracy.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

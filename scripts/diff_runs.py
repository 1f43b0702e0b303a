"""Compare two directories of Run artifacts (e.g. `make demo`'s out/demo/runs before and after a change).

For every run name present in both, it compares what a refactor must not change: the generated
tokens, the hit rate, the bytes moved host-to-device, the simulated TTFT and TPOT, and the engine's
other counters (substitutions, skips, CPU experts, prefetches, precision mix, stall). The budget's
plan (total bytes, KV/activation margin, reservation peak) is shown beside them, and compared too
with `--strict`: a change to how the margin is sized moves it without changing what a run does.
It reads the JSON directly, so artifacts of two schema versions compare. Prints one line per run
and exits 1 if anything compared differs.

    .venv/bin/python scripts/diff_runs.py /tmp/demo-before/runs out/demo/runs
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

COUNTERS = ("hit_rate", "bytes_h2d", "ttft_s", "tpot_s", "substitutions", "skips", "cpu_experts",
            "prefetch_issued", "prefetch_used", "precision_mix", "stall_s")
PLAN = ("budget_bytes", "margin_bytes", "cache_bytes", "peak_device_bytes")


def _flat(run: dict[str, Any]) -> dict[str, Any]:
    """The compared fields of one Run artifact, wherever its schema keeps them."""
    engine = run.get("engine", {}) if isinstance(run.get("engine"), dict) else {}
    summary = {**run.get("summary", {}), **engine.get("summary", {})}
    out = {"tokens": run.get("tokens")}
    budget = run.get("budget") or engine.get("budget") or {}
    for key in COUNTERS + PLAN:
        for where in (run, engine, summary, budget):
            if key in where:
                out[key] = where[key]
                break
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _runs(directory: Path) -> dict[str, dict[str, Any]]:
    runs = {}
    for path in sorted(directory.rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and data.get("schema") == "run":
            runs[str(path.relative_to(directory))] = data
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--strict", action="store_true", help="the budget plan must match too")
    args = ap.parse_args()
    before, after = _runs(args.before), _runs(args.after)
    if not before or not after:
        print(f"no Run artifacts in {args.before if not before else args.after}", file=sys.stderr)
        return 1
    differ = 0
    for name in sorted(before.keys() | after.keys()):
        if name not in before or name not in after:
            print(f"{name}: only {'after' if name not in before else 'before'}")
            differ += 1
            continue
        a, b = _flat(before[name]), _flat(after[name])
        keys = sorted(a.keys() | b.keys())
        bad = [k for k in keys if k not in PLAN and not _same(a.get(k), b.get(k))]
        moved = [k for k in keys if k in PLAN and not _same(a.get(k), b.get(k))]
        if args.strict:
            bad += moved
        tp = (a.get("tpot_s") or {}).get("mean")
        summary = (f"hit rate {a.get('hit_rate'):.4f}, {a.get('bytes_h2d')} B, TPOT "
                   f"{'-' if tp is None else f'{tp * 1e3:.4f} ms'}, {sum(map(len, a.get('tokens') or []))} tokens"
                   if a.get("hit_rate") is not None else "")
        plan = "; ".join(f"{k} {a.get(k)} -> {b.get(k)}" for k in moved)
        print(f"{name}: {'same' if not bad else 'DIFFERENT in ' + ', '.join(bad)} ({summary})"
              + (f"; plan moved: {plan}" if plan else ""))
        differ += bool(bad)
    print(f"{len(before.keys() & after.keys()) - differ} of {len(before.keys() | after.keys())} runs identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

"""Quality under every policy: held-out perplexity and offline multiple-choice accuracy, one table.

Each setting is evaluated through the engine (`moetool eval`) on the same text and questions; the
Eval artifacts go to --out (a setting whose artifact is already there is not re-run), and the
table is printed as markdown and written to OUT/accuracy.json. "agree" is the share of questions
where the setting picks the same choice as `resident` (the exact model): on a model near chance
accuracy it says more about what a policy changes than accuracy does.

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
from moetool.evaluate import EvalConfig, evaluate

# (label, policy, knobs, budget or None for --budget): the settings of the eval issue.
SETTINGS = [
    ("resident", "resident", {}, "100%"),
    ("static int4", "static", {"bits": "4"}, "100%"),
    ("static int2", "static", {"bits": "2"}, "100%"),
    ("lru", "lru", {}, None),
    ("fate", "fate", {}, None),
    *[(f"dymoe {c} r={r}", "dymoe", {"config": c, "r": r}, None) for c in ("4/2", "4/0") for r in ("0.75", "0.9", "1.0")],
    ("smoe (fitted alpha)", "smoe", {}, None),
    # at 25% the INT2 low tier alone fills the demo's budget (n_hi = 0); 40% leaves room for a hot INT4 set
    ("dynaexq 4/2", "dynaexq", {"config": "4/2"}, "40%"),
]


def _choices(samples: dict) -> dict[tuple[str, int], int]:
    """(task, doc) -> index of the choice with the highest log-likelihood."""
    return {(task, s["doc_id"]): max(range(len(s["resps"])), key=lambda i: s["resps"][i][0])
            for task, rows in samples.items() for s in rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--bundle", type=Path, required=True, help="bundle with 16/4/2 bits")
    ap.add_argument("--fit", type=Path, default=None, help="fit artifact (SMoE's alpha)")
    ap.add_argument("--budget", default="25%")
    ap.add_argument("--hw", default="rtx3090")
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--mc-limit", type=int, default=40, help="questions per BIG-bench task (0: skip MC)")
    ap.add_argument("--task", default="bigbench-mc")
    ap.add_argument("--only", default="", help="comma-separated labels to run (default all)")
    ap.add_argument("--mc-only", default="", help="comma-separated labels that also get the MC task (default all)")
    ap.add_argument("--out", type=Path, default=Path("out/accuracy"))
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=200)
    args.out.mkdir(parents=True, exist_ok=True)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    mc_only = {s.strip() for s in args.mc_only.split(",") if s.strip()}
    tasks = [("ppl", args.ppl_tokens)] + ([(args.task, args.mc_limit)] if args.mc_limit else [])
    results: dict[str, dict] = {}
    for label, policy, knobs, budget in SETTINGS:
        if only and label not in only:
            continue
        results[label] = {"policy": policy, "knobs": knobs, "budget": budget or args.budget}
        for task, limit in tasks:
            if task != "ppl" and mc_only and label not in mc_only:
                continue
            path = args.out / f"{label.replace(' ', '_').replace('/', '-')}.{task}.eval.json"
            if not path.is_file():
                cfg = EvalConfig(task=task, model=args.model, bundle=args.bundle, policy=policy, settings=knobs,
                                 fit=args.fit, budget=budget or args.budget, clock="sim", hw=args.hw, limit=limit)
                try:
                    with console.status(f"{label}: {task} ..."):
                        evaluate(cfg).save(path)
                except MoetoolError as e:
                    results[label][task] = {"refused": str(e)}
                    console.print(f"[yellow]{label}: {task} refused: {e}")
                    continue
            e = json.loads(path.read_text())
            results[label][task] = {"metrics": e["metrics"], "stderr": e["stderr"], "n": e["n"],
                                    "params": e["params"], "summary": {k: e["summary"].get(k) for k in
                                                                       ("precision_mix", "skips", "substitutions",
                                                                        "hit_rate", "cpu_experts")}}
            if task != "ppl":
                results[label][task]["choices"] = _choices(e["samples"])
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

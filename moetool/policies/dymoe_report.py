"""DyMoE's report pieces (`DyMoE.report`): Table 3's ablation from the runs present, Fig. 5 (per-layer
quantization sensitivity) and Fig. 11 (quality against the retention ratio r)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from moetool.policies.stages import cache_bytes, table

# Table 3's rows, in the paper's order (the last, 4/0 without the prefetcher, is ours: 4/0 alone).
ABLATION = ("1. Load on Demand", "2. Cache", "3. Cache + Prefetch", "4. Cache+Dyquant(4/2)",
            "5. Cache+Dyquant(4/2)+Prefetcher", "6. Cache+Dyquant(4/0)+Prefetcher", "Cache+Dyquant(4/0)")


def recorded_precisions(params: dict[str, Any]) -> tuple[int, int]:
    """(high, low) bits a recorded run or eval ran at: every policy records them as `precisions`
    (`Policy.describe`); artifacts written before that carry `high`/`low` or the knobs `high_bits`/`low_bits`."""
    if isinstance(params.get("precisions"), dict):
        return int(params["precisions"]["high"]), int(params["precisions"]["low"])
    return (int(params.get("high", params.get("high_bits", 4))), int(params.get("low", params.get("low_bits", 2))))


def ablation_row(policy: str, p: dict[str, Any]) -> str | None:
    """The Table 3 row a run stands for: lod, lru and eap are rows 1-3; DyMoE at r = 1 is a cache."""
    if policy == "lod":
        return ABLATION[0]
    if policy in ("lru", "eap"):
        return ABLATION[1 if policy == "lru" else 2]
    if policy != "dymoe":
        return None
    prefetch = p.get("prefetcher", "dymoe") != "none"
    if float(p.get("r", 0)) >= 1.0:
        return ABLATION[2 if prefetch else 1]
    if recorded_precisions(p)[1] == 0:
        return ABLATION[5 if prefetch else 6]
    return ABLATION[4 if prefetch else 3]


def configuration(policy: str, p: dict[str, Any], batch: int = 1, bundle: str | None = None,
                  workload: str | None = None) -> str:
    """What a Table 3 row's run ran, to tell apart runs that stand for one row: the policy, its
    precisions and DyMoE's r (a 16-bit `lru` and DyMoE at r = 1 in INT4 are both "2. Cache"; DyMoE at
    r = 0.75 and 0.9 both row 5), every other knob off its default (an LFU cache, eap's k, DyMoE's
    hh_ratio: they were averaged with the defaults' runs into one cell), a batch of more than one, the
    `bundle` where runs of several stand for a row (a group-16 and a group-8 bundle's INT4) and the
    workload (the prompts and how far they ran, `workload`) where runs of several do (one prompt of 32
    tokens and four of 4)."""
    from moetool.figures import off_default

    high, low = recorded_precisions(p)
    if policy == "dymoe":
        name = f"dymoe {high}/{low}, r = {float(p.get('critical_share', p.get('r', 0))):.3g}"
    else:
        bits = p.get("bits")
        name = f"{policy} {bits}-bit" if isinstance(bits, int) else policy
    # lam is solved from r (shown); the tiers are in the name
    knobs = [f"{k}={p[k]}" for k in off_default(policy, p) if k not in ("lam", "high_bits", "low_bits")]
    return ", ".join([name, *knobs, *([f"batch {batch}"] if batch > 1 else []), *([f"bundle {bundle}"] if bundle else []),
                      *([workload] if workload else [])])


def workload(r: Any) -> str:
    """The prompts a run decoded and how far: "4 prompt(s) x 32 tokens" and a digest of the prompts and
    lengths, which tells two prompt sets of one size apart. TTFT and TPOT move with both (the context)."""
    import hashlib
    import json

    digest = hashlib.sha256(json.dumps([r.prompts, [len(t) for t in r.tokens]]).encode()).hexdigest()[:8]
    return f"{len(r.prompts)} prompt(s) x {max(map(len, r.tokens), default=0)} tokens @{digest}"


def ablation(runs: tuple, shown: Any = None) -> str:
    """Table 3 from the runs present: TTFT and TPOT per row and budget, one table per clock (seconds of
    the sim clock and of the wall are not averaged together), and a row per configuration where runs of
    more than one stand for it; a cell averages the runs of one configuration and workload (repeats).
    `shown(path)`: how the report names a run (its file name by default)."""
    from moetool.policies.stages import bundle_names, bundle_of, machine

    by_clock: dict[str, list] = defaultdict(list)
    bundles = bundle_names([r.inputs for _, r in runs])
    several = len({bundle_of(r.inputs) for _, r in runs}) > 1
    works = len({workload(r) for _, r in runs}) > 1  # a cell's runs are repeats of one workload, not others
    for path, r in runs:
        row = ablation_row(r.policy, r.params)
        if row:
            # The decode path is part of the clock: the captured step runs a policy's host half a step late
            # (docs/engine.md), so its runs are not averaged with the host path's. The machine is the hw
            # file's content (`machine`): two experiments' hw.json had been one clock.
            decode = (r.summary or {}).get("path")
            bundle = bundles[bundle_of(r.inputs)] if several else None
            by_clock[f"{machine(r.clock, r.hw, r.inputs)}{f', {decode} path' if decode else ''}"].append(
                (row, configuration(r.policy, r.params, r.batch_size, bundle, workload(r) if works else None), path, r))
    return "\n".join(_ablation_table(clock, rows, shown or (lambda p: p.name)) for clock, rows in sorted(by_clock.items()))


def _ablation_table(clock: str, rows: list, shown: Any) -> str:
    cells: dict[tuple[str, str, int], list] = defaultdict(list)
    names: dict[tuple[str, str], list[str]] = defaultdict(list)
    for row, cfg, path, r in rows:
        cells[row, cfg, cache_bytes(r)].append(r)
        names[row, cfg].append(shown(path))
    budgets = sorted({b for _, _, b in cells})
    # three significant digits, or the bytes where that heads two budgets alike ("16 MiB" twice)
    shown = [f"{b / 2**20:.3g} MiB" for b in budgets]
    shown = shown if len(set(shown)) == len(shown) else [f"{b:,} B" for b in budgets]
    heads = [h for s in shown for h in (f"TTFT(s) {s}", f"TPOT(s) {s}")]
    body = []
    for name in ABLATION:
        configs = sorted({cfg for row, cfg in names if row == name})
        for cfg in configs:
            vals = []
            for b in budgets:
                rs = cells.get((name, cfg, b), [])
                ttft = [r.ttft_s for r in rs if r.ttft_s is not None]
                tpot = [r.tpot_s["mean"] for r in rs if r.tpot_s]
                vals += [float(np.mean(ttft)) if ttft else None, float(np.mean(tpot)) if tpot else None]
            label = name if len(configs) == 1 else f"{name} ({cfg})"
            body.append([label, *vals, ", ".join(names[name, cfg])])
    return (f"### Ablation in the style of DyMoE Table 3 (clock: {clock}; a cell averages the runs of one "
            "configuration; a column is an expert cache)\n\n" + table(["Configuration", *heads, "runs"], body))



def depth_claim(s: Any, name: str) -> list[str]:
    """Fig. 5's trend as a claim row: the mean Δppl of INT2 in one of the first third of MoE layers
    against one of the last third. A verdict only where the two means differ by more than two standard
    errors of their difference, taken over the layers (each layer is one sample of a noisy perplexity
    difference); fewer than two layers a third give no spread to judge by, so no verdict."""
    third = len(s.layers) // 3
    shallow = [ls.delta[2] for ls in s.layers[:max(1, third)]]
    deep = [ls.delta[2] for ls in s.layers[-max(1, third):]]
    a, b = sum(shallow) / len(shallow), sum(deep) / len(deep)
    measured = f"mean Δppl first {len(shallow)} layers {a:+.3f}, last {len(deep)} {b:+.3f}"
    if third < 2:
        verdict, measured = "inconclusive", measured + " (fewer than 6 MoE layers: no spread to judge by)"
    else:
        se = math.sqrt(statistics.variance(shallow) / len(shallow) + statistics.variance(deep) / len(deep))
        verdict = "met" if a - b > 2 * se else "not met" if b - a > 2 * se else "inconclusive"
        measured += f" (difference {a - b:+.3f} ± {2 * se:.3f}, two standard errors over the layers)"
    return [f"INT2 in one layer hurts shallow layers more than deep ones (`{name}`)", measured,
            f"{a / b:.2f}x" if b > 0 else "-", verdict]


def sensitivity_figure(s: Any, path: Path) -> Path:
    """Fig. 5: held-out perplexity with one MoE layer quantized, per layer and precision."""
    from moetool.figures import save, subplots

    fig, ax = subplots(figsize=(max(6, 0.3 * len(s.layers) + 3), 4))
    width = 0.8 / len(s.bits)
    for i, b in enumerate(s.bits):
        ax.bar(np.arange(len(s.layers)) + i * width, [ls.delta[b] for ls in s.layers], width, label=f"INT{b}")
    ax.set_xticks(np.arange(len(s.layers)) + 0.4 - width / 2, [str(ls.layer) for ls in s.layers], fontsize=7)
    ax.set(xlabel="MoE layer quantized (others at full precision)", ylabel="Δ held-out perplexity",
           title=f"Per-layer quantization sensitivity (DyMoE Fig. 5)\nbase perplexity {s.base_ppl:.3f} "
                 f"on {s.tokens} {s.data} tokens")
    ax.axhline(0, color="black", lw=0.5)
    ax.legend()
    return save(fig, path)


def retention_figure(rows: tuple, path: Path) -> Path | None:
    """Fig. 11: quality vs the retention ratio r, one line per High/Low configuration."""
    dy: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for x in rows:
        if x["policy"] == "dymoe" and "r" in x["params"]:
            high, low = recorded_precisions(x["params"])
            cfg = x["params"].get("config") or f"{high}/{low}"
            # the share of critical experts that ran (Table 2's r); older records carry only the r asked for
            r = x["params"].get("critical_share", x["params"]["r"])
            dy[x["metric"]][cfg].append((float(r), x["value"]))
    if not dy:
        return None
    from moetool.figures import metric_axes, save, ylabel

    fig, axes = metric_axes(sorted(dy), 5, 4)
    for metric, ax in axes.items():
        for cfg, pts in sorted(dy[metric].items()):
            pts.sort()
            ax.plot([p for p, _ in pts], [v for _, v in pts], "o-", label=f"DyMoE {cfg}")
        ax.set(xlabel="retention ratio r", ylabel=ylabel(list(rows), metric), title=metric)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Quality vs retention (DyMoE Fig. 11)")
    return save(fig, path)

"""`moetool fit`: policy knobs (SMoE alpha, Fate L/n/p, DyMoE lambda, DynaExq n_hi) from a profile and runs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress
from rich.table import Table

from moetool.cli import JsonOpt, command, err, out
from moetool.errors import MoetoolError


def parse_seconds(text: str | None) -> float | None:
    """'0.05', '0.05s' or '50ms' -> seconds."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(ms|s)?\s*", text)
    if not m:
        raise MoetoolError(f"--target-tpot takes seconds such as 0.05 or 50ms, not '{text}'.")
    return float(m.group(1)) * (1e-3 if m.group(2) == "ms" else 1.0)


@command
def fit(
    profile: Annotated[Path, typer.Argument(help="A profile artifact (moetool profile --out).")],
    save: Annotated[Path, typer.Option("--out", help="Where to write the fit artifact (NAME.fit.json).")],
    more: Annotated[list[Path] | None, typer.Argument(help="More run/eval artifacts (so that --runs *.run.json works).")] = None,
    runs: Annotated[list[Path] | None, typer.Option(help="Run artifacts (smoe at several alpha) and eval artifacts (fate at several p).")] = None,
    sweep: Annotated[bool, typer.Option(help="Run smoe at --alphas on the sim clock to fit T(alpha).")] = False,
    alphas: Annotated[str, typer.Option(help="Alphas for --sweep, comma-separated.")] = "0,0.1,0.2,0.3,0.4,0.5",
    target_tpot: Annotated[str | None, typer.Option(help="TPOT budget R for SMoE eq. 5: seconds (0.05) or 50ms.")] = None,
    max_loss: Annotated[float, typer.Option(help="Fate p: relative loss allowed (0.01 = 1%).")] = 0.01,
    l_threshold: Annotated[float, typer.Option(help="Fate L: decode prefetch recall every deeper layer must keep.")] = 0.7,
    r: Annotated[float, typer.Option(help="DyMoE target mean retention (without --budget).")] = 0.75,
    budget: Annotated[str | None, typer.Option(help="Device budget (12GiB) or expert cache share (25%) for DyMoE r and DynaExq n_hi.")] = None,
    model: Annotated[str | None, typer.Option(help="Model for --sweep (default: the profile's).")] = None,
    bundle: Annotated[Path | None, typer.Option(help="Bundle for --sweep runs.")] = None,
    hw: Annotated[str, typer.Option(help="Hardware profile for --sweep (a preset or the profile's NAME.hw.json).")] = "rtx3090",
    sweep_budget: Annotated[str, typer.Option(help="Budget of the --sweep runs.")] = "25%",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per --sweep run.")] = 16,
    as_json: JsonOpt = False,
) -> None:
    """Fit policy knobs from PROFILE (and runs), each with its evidence, into a fit artifact.

    Example: `moetool fit demo.profile.json --sweep --hw demo.hw.json --target-tpot 40ms --budget 25% --out demo.fit.json`
    """
    from moetool.fit import FitConfig
    from moetool.fit import fit as fit_stage

    try:
        grid = tuple(float(a) for a in alphas.split(",") if a.strip())
    except ValueError:
        raise MoetoolError(f"--alphas takes comma-separated numbers, not '{alphas}'.") from None
    cfg = FitConfig(profile=profile, runs=tuple([*(runs or []), *(more or [])]), sweep=sweep, alphas=grid,
                    target_tpot=parse_seconds(target_tpot), max_loss=max_loss, l_threshold=l_threshold, r=r,
                    budget=budget, model=model, bundle=bundle, hw=hw, sweep_budget=sweep_budget,
                    max_new_tokens=max_new_tokens)
    with Progress(console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("smoe sweep", total=len(grid), visible=sweep)
        result = fit_stage(cfg, progress=lambda part, done, total: bar.update(task, completed=done))
    result.save(save)
    for w in result.evidence.get("warnings", []):
        err.print(f"[yellow]warning:[/yellow] {w}", highlight=False)
    if as_json:
        out.print_json(json.dumps(result.to_json()))
        return
    table = Table(title=f"fitted knobs for {result.model.source}")
    for col in ("policy", "knob", "value", "from"):
        table.add_column(col)
    for pol, knobs in result.params.items():
        for k, v in knobs.items():
            src = result.evidence.get(pol, {}).get(k, {}).get("from", "")
            table.add_row(pol, k, f"{v:.4g}" if isinstance(v, float) else str(v), str(src)[:70])
    out.print(table)
    for k, why in result.evidence.get("skipped", {}).items():
        err.print(f"not fitted: {k} ({why})", highlight=False)
    err.print(f"fit written to {save}", highlight=False)

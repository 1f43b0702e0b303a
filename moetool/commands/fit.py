"""`moetool fit`: policy knobs (SMoE alpha, Fate L/n/p, DyMoE lambda, DynaExq n_hi) from a profile and runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress
from rich.table import Table

from moetool.app import command, err, given, not_an_input, only_with, out, styled, writable
from moetool.options import DeviceOpt, Dtype, DtypeOpt, HwOpt, JsonOpt, parse_numbers, parse_seconds
from moetool.spec import DEFAULT_BUDGET, DEFAULT_HW


@command
def fit(
    ctx: typer.Context,
    profile: Annotated[Path, typer.Argument(help="A profile artifact (moetool profile --out).")],
    save: Annotated[Path, typer.Option("--out", help="Where to write the fit artifact (NAME.fit.json).")],
    more: Annotated[list[Path] | None, typer.Argument(help="More run/eval artifacts (so that --runs *.run.json works).")] = None,
    runs: Annotated[list[Path] | None, typer.Option(help="Run artifacts (smoe at several alpha) and eval artifacts (fate at several p).")] = None,
    sweep: Annotated[bool, typer.Option(help="Run smoe at --alphas on the sim clock to fit T(alpha).")] = False,
    alphas: Annotated[str | None, typer.Option(help="Alphas for --sweep, comma-separated (default: 0 to 0.5 by 0.1).")] = None,
    target_tpot: Annotated[str | None, typer.Option(help="TPOT budget R for SMoE eq. 5: seconds (0.05) or 50ms.")] = None,
    max_loss: Annotated[float, typer.Option(help="Fate p: relative loss allowed (0.01 = 1%).")] = 0.01,
    l_threshold: Annotated[float, typer.Option(help="Fate L: decode prefetch recall every deeper layer must keep.")] = 0.7,
    r: Annotated[float | None, typer.Option(help="DyMoE target share of critical experts (Table 2 r); without it, the largest r --budget "
                                            "holds, or 0.75 (§6.2) without --budget.", show_default=False)] = None,
    budget: Annotated[str | None, typer.Option(help="Device budget (12GiB) or expert cache share (25%) for DynaExq "
                                               "n_hi, and DyMoE r without --r.")] = None,
    model: Annotated[str | None, typer.Option(help="Model for --sweep (default: the profile's).")] = None,
    bundle: Annotated[Path | None, typer.Option(help="Bundle for --sweep (default: the profile's, where it was made "
                                                "from one, else the model's experts).")] = None,
    hw: HwOpt = DEFAULT_HW,
    sweep_budget: Annotated[str | None, typer.Option(help=f"Budget of the --sweep runs (default: --budget, else "
                                                          f"{DEFAULT_BUDGET}).", show_default=False)] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Tokens per --sweep run (default: 32, run's own).")] = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = Dtype.auto,
    as_json: JsonOpt = False,
) -> None:
    """Fit policy knobs from PROFILE (and runs), each with its evidence, into a fit artifact.

    Example: `moetool fit demo.profile.json --sweep --hw rtx3090 --target-tpot 40ms --budget 25% --out demo.fit.json`
    (`--hw demo.hw.json` where `moetool profile --what timing` wrote this machine's profile beside its --out)
    """
    from moetool.fit import ALPHAS, SWEEP_TOKENS, FitConfig
    from moetool.fit import fit as fit_stage
    from moetool.run import RunConfig

    writable(save)
    not_an_input(save, profile, hw, *(runs or []), *(more or []), inside=bundle)
    from moetool.engine.clock import load_hw

    load_hw(hw)  # an unknown preset or a bad profile file is refused even where only --sweep would read it
    if not sweep:  # the options of --sweep's runs
        only_with("--sweep", given(ctx, "alphas", "model", "bundle", "hw", "sweep_budget", "max_new_tokens", "device", "dtype"))
    grid = parse_numbers(alphas, "--alphas") if alphas is not None else ALPHAS
    # one budget for the whole fit unless asked otherwise: SMoE's alpha then holds where n_hi and r do
    sweep_runs = RunConfig(model=model, bundle=bundle, budget=sweep_budget or budget or DEFAULT_BUDGET, hw=hw, device=device,
                           dtype=Dtype(dtype).value,
                           max_new_tokens=SWEEP_TOKENS if max_new_tokens is None else max_new_tokens)
    cfg = FitConfig(profile=profile, runs=tuple([*(runs or []), *(more or [])]), sweep=sweep_runs if sweep else None,
                    alphas=grid, target_tpot=parse_seconds(target_tpot), max_loss=max_loss, l_threshold=l_threshold,
                    r=r, budget=budget)
    if not sweep and not runs and not more:  # R is SMoE's eq. 5, read only against smoe runs (a value is checked first)
        cfg.check()
        only_with("smoe runs", given(ctx, "target_tpot"), fix="add --sweep or --runs")
    with Progress(console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("smoe sweep", total=len(grid), visible=sweep)
        result = fit_stage(cfg, progress=lambda part, done, total: bar.update(task, completed=done))
    result.save(save)
    for w in result.evidence.get("warnings", []):
        err.print(styled(("warning:", "yellow"), f" {w}"), highlight=False)
    if as_json:
        out.print_json(json.dumps(result.to_json()))
        return
    table = Table(title=f"fitted knobs for {result.model.source}")
    for col in ("policy", "knob", "value", "from"):
        table.add_column(col)
    for pol, knobs in result.params.items():
        for k, v in knobs.items():
            src = result.evidence.get(pol, {}).get(k, {}).get("from", "")
            table.add_row(pol, k, f"{v:.4g}" if isinstance(v, float) else str(v), str(src))  # the table folds it: a cut dropped the hw preset n was sized with
    out.print(table)
    for k, why in result.evidence.get("skipped", {}).items():
        err.print(f"not fitted: {k} ({why})", highlight=False)
    err.print(f"fit written to {save}", highlight=False)

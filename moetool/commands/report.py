"""`moetool report`: figures and a markdown summary from artifacts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moetool.app import command, err, out, writable


@command
def report(
    inputs: Annotated[list[Path], typer.Argument(help="Artifact files or directories (searched recursively for *.json).")],
    save: Annotated[Path, typer.Option("--out", help="Report directory (PNG figures and summary.md); a previous "
                                                     "report there is replaced whole.")],
    by_model: Annotated[bool, typer.Option("--by-model", help="Artifacts of several models: one sub-report per "
                                                              "model (otherwise they are refused).")] = False,
) -> None:
    """Draw figures and write summary.md from profile, fit, run and eval artifacts.

    Example: `moetool report out/ --out out/report`
    """
    from moetool.report import report as report_stage

    writable(save, "dir")
    with err.status("drawing ..."):
        paths = report_stage(list(inputs), save, by_model=by_model)
    for p in paths:
        out.print(str(p), highlight=False)

"""`moetool report`: figures and a markdown summary from artifacts."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moetool.cli import command, err, out


@command
def report(
    inputs: Annotated[list[Path], typer.Argument(help="Artifact files or directories (searched recursively for *.json).")],
    save: Annotated[Path, typer.Option("--out", help="Report directory (PNG figures and summary.md).")],
) -> None:
    """Draw figures and write summary.md from profile, fit, run and eval artifacts.

    Example: `moetool report out/ --out out/report`
    """
    from moetool.report import report as report_stage

    with err.status("drawing ..."):
        paths = report_stage(list(inputs), save)
    for p in paths:
        out.print(str(p), highlight=False)

"""The `moetool` command line: one thin command per stage; Rich lives here and nowhere else.

Results go to stdout (a Rich table, or JSON with --json); progress and errors go to stderr. A
`MoetoolError` becomes one red line and exit code 1.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from moetool.errors import MoetoolError

app = typer.Typer(
    name="moetool",
    help="Run Mixture-of-Experts models on one memory-limited GPU.\n\nExample: moetool check ./my-moe-checkpoint",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="markdown",
)
out = Console()
err = Console(stderr=True)

ModelArg = Annotated[str, typer.Argument(help="A local Hugging Face model directory, a hub id, or 'demo'.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON instead of a table.")]


def _quiet_libraries() -> None:
    """transformers' loading bars and warnings would bury moetool's own output."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


@app.callback()
def _root() -> None:
    """Run Mixture-of-Experts models on one memory-limited GPU.

    Pipeline: quantize -> profile -> fit -> run / eval -> report; each stage writes a JSON
    artifact the next one reads. Example: `moetool check ./my-moe-checkpoint`
    """


def command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Register `fn` as a command that turns a MoetoolError into one red line and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _quiet_libraries()
        try:
            return fn(*args, **kwargs)
        except MoetoolError as e:
            err.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return app.command()(wrapper)


@command
def check(
    model: ModelArg,
    prompt: Annotated[str | None, typer.Option(help="Prompt to run (default: a fixed English sentence).")] = None,
    as_json: JsonOpt = False,
    save: Annotated[Path | None, typer.Option("--out", help="Also write the check report artifact here.")] = None,
) -> None:
    """Compare moetool's experts module with plain transformers on MODEL (fp32, CPU).

    Loads the model both ways, runs one prompt, and reports per MoE layer the routing agreement
    and the max abs difference of the experts' output, then the max abs logit difference. Exit 0
    only if the logits agree within 1e-5 and every routing decision matches.

    Example: moetool check ./tiny-mixtral --json
    """
    from moetool.check import DEFAULT_PROMPT, check_model

    with err.status(f"checking {model} ..."):
        report = check_model(model, prompt or DEFAULT_PROMPT)
    if save is not None:
        report.save(save)
    if as_json:
        out.print_json(json.dumps(report.to_json()))
    else:
        table = Table(title=f"moetool check: {report.model.source} ({report.model.model_type})")
        table.add_column("layer", justify="right")
        table.add_column("routing agreement", justify="right")
        table.add_column("max |Δ experts out|", justify="right")
        for lc in report.layers:
            table.add_row(str(lc.layer), f"{lc.routing_agreement:.4f}", f"{lc.max_abs_diff:.3g}")
        out.print(table)
        verdict = "[green]PASS[/green]" if report.passed else "[red]FAIL[/red]"
        out.print(f"{verdict}  max |Δ logits| = {report.max_abs_diff:.3g} (tolerance {report.tolerance:g})")
    if not report.passed:
        raise typer.Exit(1)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

"""`moetool check`: moetool's experts module against plain transformers, same prompt, fp32 on a CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from moetool.app import command, err, not_an_input, out, styled, writable
from moetool.options import JsonOpt, ModelArg


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

    writable(save)
    not_an_input(save, inside=model)
    with err.status(Text(f"checking {model} ...")):  # a path may hold "[" (a Status reads markup)
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
        verdict = ("PASS", "green") if report.passed else ("FAIL", "red")
        out.print(styled(verdict, f"  max |Δ logits| = {report.max_abs_diff:.3g} (tolerance {report.tolerance:g})"))
    if not report.passed:
        raise typer.Exit(1)

"""The `moetool` command line: one thin command per stage; Rich lives here and nowhere else.

Results go to stdout (a Rich table, or JSON with --json); progress and errors go to stderr. A
`MoetoolError` becomes one red line and exit code 1.
"""

from __future__ import annotations

import functools
import json
import logging
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
# Progress bars use `disable=not err.is_terminal`: on a pipe or a log file a bar cannot redraw, and
# its teardown would put a blank line before a one-line error.

ModelArg = Annotated[str, typer.Argument(help="A local Hugging Face model directory, a hub id, or 'demo'.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON instead of a table.")]


# torchao (pulled in by the gptq extra) logs kernel-library misses and deprecations on import;
# on a CLI they would bury the one line moetool prints.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)


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


def command(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """Register `fn` as a command that turns a MoetoolError into one red line and exit code 1."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            _quiet_libraries()
            try:
                return fn(*args, **kwargs)
            except MoetoolError as e:
                err.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
                raise typer.Exit(1) from None

        return app.command(name=name)(wrapper)

    return register(fn) if fn is not None else register


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


def parse_settings(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise MoetoolError(f"--set takes key=value, not '{pair}'.")
        out[key.strip()] = value.strip()
    return out


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.3f} ms"


@command
def run(
    model: Annotated[str | None, typer.Option(help="Model directory, hub id, or 'demo' (default: the --bundle's own "
                                              "model, else demo).")] = None,
    bundle: Annotated[Path | None, typer.Option(help="Quantized bundle directory; it holds the whole model, so "
                                                "--model is optional (default: experts from the checkpoint).")] = None,
    policy: Annotated[str, typer.Option(help="Policy preset: resident, static, lod, lru, eap, fate, dymoe, smoe, dynaexq.")] = "lru",
    set_: Annotated[list[str] | None, typer.Option("--set", help="Policy knob key=value (repeatable).")] = None,
    fit: Annotated[Path | None, typer.Option(help="Fit artifact whose knobs for this policy are used.")] = None,
    budget: Annotated[str, typer.Option(help="Device budget: a size (12GiB) or the expert cache as a share of bf16 experts (25%).")] = "25%",
    clock: Annotated[str, typer.Option(help="wall (measured) or sim (modelled on --hw).")] = "wall",
    hw: Annotated[str, typer.Option(help="Hardware profile for the sim clock: a preset name or a profile JSON.")] = "rtx3090",
    prompt: Annotated[str | None, typer.Option(help="One prompt.")] = None,
    prompts: Annotated[Path | None, typer.Option(help='JSONL file of {"prompt": ...} lines.')] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt (greedy).")] = 32,
    batch_size: Annotated[int, typer.Option(help="Prompts per batch.")] = 1,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    dtype: Annotated[str, typer.Option(help="Compute dtype: auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, "
                                       "float16.")] = "auto",
    host_budget: Annotated[str | None, typer.Option(help="Host memory for pinned experts and the staging ring "
                                                    "(e.g. 32GiB; default on CUDA: free memory less a margin; on a "
                                                    "CPU, experts are read from the mapped bundle unless given).")] = None,
    save: Annotated[Path | None, typer.Option("--out", help="Where to write the Run artifact (JSON).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Generate greedily under a policy and a device budget; report TTFT/TPOT, hits and traffic.

    Example: `moetool run --bundle out/bundle --policy lru --budget 25% --clock sim --hw rtx3090 --prompt "Hello" --out lru.run.json`
    """
    from rich.progress import Progress

    from moetool.run import RunConfig, read_prompts
    from moetool.run import run as run_stage

    if prompt is not None and prompts is not None:
        raise MoetoolError("give --prompt or --prompts, not both.")
    texts = read_prompts(prompts) if prompts is not None else (prompt or "The capital of France is",)
    if isinstance(texts, str):
        texts = (texts,)
    cfg = RunConfig(model=model, bundle=bundle, policy=policy, settings=parse_settings(set_ or []), fit=fit,
                    budget=budget, clock=clock, hw=hw, prompts=tuple(texts), max_new_tokens=max_new_tokens,
                    batch_size=batch_size, device=device, dtype=dtype, host_budget=host_budget)
    with Progress(console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task(f"run {policy}", total=len(texts))
        result = run_stage(cfg, progress=lambda done, total: bar.update(task, completed=done))
    if save is not None:
        result.save(save)
    if as_json:
        out.print_json(json.dumps(result.to_json()))
        return
    for p, t in zip(result.prompts, result.texts):
        out.print(f"[bold]{p}[/bold]{t}", highlight=False)
    table = Table(title=f"{policy} on {result.model.source} ({result.clock} clock{', ' + result.hw if result.hw else ''})")
    for col in ("TTFT", "TPOT mean", "TPOT p99", "hit rate", "bytes/token", "stall", "peak device", "budget"):
        table.add_column(col, justify="right")
    tp = result.tpot_s or {}
    table.add_row(_fmt_s(result.ttft_s), _fmt_s(tp.get("mean")), _fmt_s(tp.get("p99")),
                  "-" if result.hit_rate is None else f"{result.hit_rate:.3f}", f"{result.bytes_per_token / 2**20:.2f} MiB",
                  f"{result.stall_s:.4f} s", f"{result.peak_device_bytes / 2**20:.1f} MiB",
                  f"{result.budget_bytes / 2**20:.1f} MiB")
    out.print(table)
    b = result.budget
    err.print(f"budget: non-expert {b['non_expert_bytes'] / 2**20:.1f} MiB, KV/activation margin "
              f"{b['margin_bytes'] / 2**20:.1f} MiB, staging {b['staging_bytes'] / 2**20:.1f} MiB, expert cache "
              f"{b['cache_bytes'] / 2**20:.1f} MiB", highlight=False)


# Commands in their own modules register themselves on `app` when imported.
import moetool.commands  # noqa: E402,F401  (each command module registers itself)


def main() -> None:
    app()


if __name__ == "__main__":
    # `python -m moetool.cli`: the commands registered themselves on the package module's app, not on
    # this __main__ copy's, so run that one.
    from moetool.cli import main as package_main

    package_main()

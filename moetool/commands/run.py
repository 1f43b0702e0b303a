"""`moetool run`: greedy generation under a policy and a device budget, as a table of the engine's stats."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from moetool.app import command, err, given, not_an_input, out, styled, writable
from moetool.errors import MoetoolError, size_text
from moetool.options import (BatchOpt, BudgetOpt, BundleOpt, Clock, ClockOpt, Decode, DecodeOpt, DeviceOpt, Dtype, DtypeOpt, FitOpt,
                             ExpertsImpl, ExpertsImplOpt, HostBudgetOpt, HwOpt, JsonOpt, ModelOpt, PolicyOpt, SetOpt,
                             engine_notes, spec_fields)
from moetool.spec import DEFAULT_BUDGET, DEFAULT_HW


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.3f} ms"


@command
def run(
    ctx: typer.Context,
    model: ModelOpt = None,
    bundle: BundleOpt = None,
    policy: PolicyOpt = "lru",
    set_: SetOpt = None,
    fit: FitOpt = None,
    budget: BudgetOpt = DEFAULT_BUDGET,
    clock: ClockOpt = Clock.wall,
    hw: HwOpt = DEFAULT_HW,
    prompt: Annotated[str | None, typer.Option(help="One prompt, the model's input as written: no chat template is applied (default: a fixed English sentence).")] = None,
    prompts: Annotated[Path | None, typer.Option(help='JSONL file of {"prompt": ...} lines.')] = None,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt (greedy).")] = 32,
    batch_size: BatchOpt = 1,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = Dtype.auto,
    host_budget: HostBudgetOpt = None,
    experts_impl: ExpertsImplOpt = ExpertsImpl.grouped_mm,
    decode: DecodeOpt = Decode.auto,
    save: Annotated[Path | None, typer.Option("--out", help="Where to write the Run artifact (JSON).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Generate greedily under a policy and a device budget; report TTFT/TPOT, hits and traffic.

    Example: `moetool run --bundle out/bundle --policy lru --budget 25% --clock sim --hw rtx3090 --prompt "Hello" --out lru.run.json`
    """
    from moetool.datasets import read_prompts
    from moetool.run import RunConfig
    from moetool.run import run as run_stage

    writable(save)
    not_an_input(save, fit, prompts, hw, inside=bundle or model)
    if prompt is not None and prompts is not None:
        raise MoetoolError("give --prompt or --prompts, not both.")
    texts = read_prompts(prompts) if prompts is not None else (prompt,) if prompt is not None else RunConfig.prompts
    cfg = RunConfig(**spec_fields(model, bundle, policy, set_, fit, budget, clock, hw, device, dtype, host_budget,
                                     experts_impl, decode),
                    prompts=texts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    with Progress(console=err, transient=True, disable=not err.is_terminal) as bar:
        # generated tokens; the bar's default columns read markup, and --policy is checked only later
        task = bar.add_task(escape(f"run {policy}"), total=len(cfg.prompts) * max_new_tokens)
        result = run_stage(cfg, progress=lambda done, total: bar.update(task, completed=done))
    if save is not None:
        result.save(save)
    # notes after the work: a refusal is its one sentence alone
    for said in engine_notes(Clock(clock) == Clock.wall and bool(given(ctx, "hw")), hw, fit, policy, result.summary):
        err.print(styled(("note:", "yellow"), f" {said}"), highlight=False)
    s = result.summary
    compiled = f", compiled in {s['compile_s']:.1f} s" if s.get("compile_s") is not None else ""
    err.print(f"decode path: {s.get('path', 'host')} ({s.get('path_reason', '')}{compiled})", highlight=False)
    if as_json:
        out.print_json(json.dumps(result.to_json()))
        return
    for p, t in zip(result.prompts, result.texts):
        out.print(styled((p, "bold"), t), highlight=False)
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
    err.print(f"budget: non-expert {size_text(b['non_expert_bytes'])}, KV/activation margin "
              f"{size_text(b['margin_bytes'])}, staging {size_text(b['staging_bytes'])}, expert cache "
              f"{size_text(b['cache_bytes'])}", highlight=False)

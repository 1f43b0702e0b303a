"""`moetool quantize`: every expert at every precision as one contiguous blob, in a bundle."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from moetool.app import command, err, given, only_with, out, styled, writable
from moetool.errors import MoetoolError, not_text
from moetool.options import JsonOpt, ModelArg, parse_numbers


@command
def quantize(
    ctx: typer.Context,
    model: ModelArg = "demo",
    bits: Annotated[str, typer.Option(help="Precisions to store, comma-separated; 16 (bf16) is added unless "
                                      "--no-reference.")] = "8,4,2",
    reference: Annotated[bool, typer.Option(help="Also store the bf16 reference (16 bits): lossless policies and "
                                            "16-bit tiers need it; without it a bundle is far smaller.")] = True,
    method: Annotated[str, typer.Option(help="hqq (calibration-free) or gptq (needs moetool[gptq]).")] = "hqq",
    group_size: Annotated[int, typer.Option(help="Input columns sharing one scale and zero; 0 = 64, or the "
                                            "largest power of two under 64 that divides the expert widths.")] = 0,
    int8_per_channel: Annotated[bool, typer.Option(help="Store INT8 experts with one scale and zero per output "
                                                   "row instead of --group-size groups: the layout torch's int8 "
                                                   "weight-only CPU kernel runs without dequantizing.")] = False,
    save: Annotated[Path, typer.Option("--out", help="Bundle directory to write.")] = Path("bundle"),
    calib_text: Annotated[Path | None, typer.Option(help="UTF-8 text to calibrate on, for GPTQ or HQQ's --calibrate "
                                                    "(default: shipped training text).")] = None,
    calib_tokens: Annotated[int | None, typer.Option(help="Calibration tokens in total, for GPTQ or HQQ's --calibrate "
                                                     "[default: 2048].", show_default=False)] = None,
    calibrate: Annotated[bool, typer.Option(help="Also measure HQQ's output error on calibration activations.")] = False,
    dtype: Annotated[str, typer.Option(help="dtype the checkpoint is read and calibrated in, and the bundle's "
                                       "non-expert weights are stored in.")] = "bfloat16",
    hqq_optimize: Annotated[bool, typer.Option(help="Run hqq's zero-point solver; --no-hqq-optimize rounds to "
                                               "nearest on hqq's grid, ~10x faster on a CPU.")] = True,
    verify: Annotated[str, typer.Option(help="Re-open check: fast (sizes, headers) or full (rehash shards).")] = "fast",
    as_json: JsonOpt = False,
) -> None:
    """Quantize MODEL's experts at several precisions into a self-contained bundle (resumable).

    The checkpoint is read one MoE layer at a time, so host memory stays at the non-expert weights
    plus one layer's experts whatever the model's size. Each (layer, expert, bits) is one contiguous
    uint8 blob (weights, scales, zeros, biases back to back) so the engine moves it with one copy;
    the bundle's model/ holds the config, tokenizer and non-expert weights, so `moetool run --bundle`
    needs no checkpoint. An interrupted run leaves no bundle.json; rerun the same command to
    continue from the finished shards.

    Example: `moetool quantize demo --bits 8,4,2 --method hqq --out out/demo-bundle`
    (`--int8-per-channel`: INT8 in the layout torch's int8 CPU kernel runs; `moetool run` uses it)
    """
    from moetool.quant.quantize import QuantizeConfig
    from moetool.quant.quantize import quantize as quantize_stage

    writable(save, "dir")
    if not_text(str(Path(save).resolve())) is not None:  # a bundle there could be written but never opened
        raise MoetoolError(f"--out {save} is not UTF-8 (a byte of its path is not), and safetensors opens only UTF-8 "
                           "paths, so no command could read the bundle; give another directory.")
    feeds = [name for name, value in (("--calib-text", calib_text), ("--calib-tokens", calib_tokens)) if value is not None]
    if feeds and method == "hqq" and not calibrate:  # HQQ reads no activations unless asked to measure its error
        raise MoetoolError(f"{' and '.join(feeds)} {'feed' if len(feeds) > 1 else 'feeds'} calibration, which HQQ runs "
                           "only with --calibrate (to measure its output error); add --calibrate, or --method gptq.")
    asked = parse_numbers(bits, "--bits", int)
    if not reference and 16 in asked:
        raise MoetoolError("--no-reference leaves the bf16 reference (16 bits) out, and --bits names 16; give one of "
                           "them.")
    wanted = sorted({*((16,) if reference else ()), *asked}, reverse=True)
    if not [b for b in wanted if b != 16]:  # no quantizer runs: bf16 experts are copied as they are
        only_with("a low-bit precision in --bits", given(ctx, "method", "group_size", "int8_per_channel", "hqq_optimize",
                                                         "calibrate"), "add 8, 4 or 2 to --bits")
    counted = {} if calib_tokens is None else {"calib_tokens": calib_tokens}  # else QuantizeConfig's default
    cfg = QuantizeConfig(model=model, out=save, bits=tuple(wanted), method=method, group_size=group_size,
                         int8_per_channel=int8_per_channel, calib_text=calib_text, calibrate=calibrate, dtype=dtype,
                         verify=verify, hqq_optimize=hqq_optimize, **counted)
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]}"), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("loading", total=None, rate="")

        def progress(p) -> None:
            speed = bar.tasks[task].speed
            bar.update(task, total=p.total, completed=p.done,
                       description=p.stage if p.layer is None else f"layer {p.layer}",
                       rate=f"{speed:.1f} experts/s" if speed else "")

        bundle = quantize_stage(cfg, progress=progress,
                                note=lambda text: err.print(styled(("note:", "yellow"), f" {text}"), highlight=False,
                                                            soft_wrap=True))
    if as_json:
        out.print_json(json.dumps(bundle.to_json()))
        return
    sizes = bundle.sizes()
    ref = sizes.get(16) or bundle.bf16_bytes()  # --no-reference stores none: bf16 from the experts' shapes
    per_channel = ", INT8 per channel" if bundle.settings.get("int8_per_channel") else ""
    table = Table(title=f"bundle {save} ({bundle.method}, group {bundle.group_size}{per_channel})")
    for col in ("bits", "bytes", "vs bf16"):
        table.add_column(col, justify="right")
    for b, n in sizes.items():
        table.add_row(str(b), f"{n / 2**20:.1f} MiB", f"{n / ref:.3f}")
    out.print(table)

"""`moetool profile`: routing skew, sensitivity, similarity, prefetch accuracy and timings of a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress
from rich.table import Table

from moetool.app import command, err, given, not_an_input, only_with, out, writable
from moetool.errors import MoetoolError
from moetool.options import DeviceOpt, Dtype, DtypeOpt, JsonOpt, ModelOpt, parse_numbers
from moetool.spec import DEFAULT_HW


def _split(values: list[str] | None) -> tuple[str, ...]:
    return tuple(v.strip() for item in values or [] for v in item.split(",") if v.strip())


def _device_preset(device: str, what: tuple[str, ...]) -> str:
    """--hw-base's default: on a CUDA device the shipped preset made for it (the throughputs a
    measured profile keeps are then that GPU's), said on stderr; else DEFAULT_HW."""
    if not {"timing", "all"} & set(what) or not str(device).startswith("cuda"):
        return DEFAULT_HW
    import torch

    if not torch.cuda.is_available():
        return DEFAULT_HW  # the device check refuses this run later, in its own words
    from moetool.engine.clock import preset_for_device

    name = torch.cuda.get_device_name(torch.device(device))
    preset = preset_for_device(name)
    if preset is None:
        err.print(f"note: no shipped hardware preset is made for the {name}; the hardware profile keeps "
                  f"{DEFAULT_HW}'s throughputs where it measures none (--hw-base chooses another)", highlight=False)
        return DEFAULT_HW
    err.print(f"note: the hardware profile keeps preset {preset}'s throughputs where it measures none "
              f"(made for the {name}; --hw-base chooses another)", highlight=False)
    return preset


@command
def profile(
    ctx: typer.Context,
    save: Annotated[Path, typer.Option("--out", help="Where to write the profile artifact (NAME.profile.json).")],
    model: ModelOpt = None,
    bundle: Annotated[Path | None, typer.Option(help="Quantized bundle for sensitivity and timing (default: HQQ in memory).")] = None,
    data: Annotated[list[str] | None, typer.Option(help="Data set name (heldout, train, a BIG-bench task) or a text/JSONL file; repeat or comma-separate. Default: heldout, general_knowledge, movie_recommendation.")] = None,
    what: Annotated[list[str] | None, typer.Option(help="all, routing, sensitivity, similarity, prefetch, timing; repeat or comma-separate.")] = None,
    seqs: Annotated[int, typer.Option(help="Sequences (prompts) per data set.")] = 4,
    seq_len: Annotated[int, typer.Option(help="Tokens per text sequence.")] = 128,
    decode_tokens: Annotated[int, typer.Option(help="Greedy decode steps traced after each prompt.")] = 16,
    bits: Annotated[str, typer.Option(help="Sensitivity precisions, comma-separated (DyMoE Fig. 5 uses 2).")] = "2",
    ppl_tokens: Annotated[int, typer.Option(help="Held-out tokens scored per perplexity.")] = 512,
    ppl_data: Annotated[str, typer.Option(help="Text the sensitivity's perplexities are scored on: a data set name (heldout, train) or a text file; pick one of the model's own domain (a code model's code).")] = "heldout",
    hw_base: Annotated[str | None, typer.Option(help=f"Preset whose throughputs the written hardware profile keeps (default: the shipped preset made for this CUDA device, else {DEFAULT_HW}).")] = None,
    hw_out: Annotated[Path | None, typer.Option(help="Hardware profile JSON to write from the timings (default: NAME.hw.json beside --out).")] = None,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = Dtype.auto,
    as_json: JsonOpt = False,
) -> None:
    """Measure what the policies' knobs are fitted from, on MODEL over --data.

    routing: expert counts per layer in prefill and decode, heavy-hitter load, skew, gate scores,
    hot-set overlap across data sets, activation ratio vs batch. sensitivity: held-out perplexity
    with one layer's experts at INT2, and with a share of experts at INT2 (Fate). similarity and
    prefetch: adjacent-layer cosine and cross-layer prediction recall. timing: per-layer and
    per-expert times on this machine, also written as a hardware profile for `run --clock sim`.

    Example: `moetool profile --model demo --data heldout --data general_knowledge --what routing,prefetch --out demo.profile.json`
    """
    from moetool.profile import ProfileConfig
    from moetool.profile import profile as profile_stage

    writable(save)
    writable(hw_out, option="--hw-out")
    files = [Path(d) for d in _split(data)]
    not_an_input(save, *files, *([Path(ppl_data)] if Path(ppl_data).is_file() else []), inside=bundle or model)
    not_an_input(hw_out, *files, inside=bundle or model, option="--hw-out")
    if hw_out is not None and Path(hw_out).resolve() == Path(save).resolve():
        raise MoetoolError(f"--hw-out {hw_out} is the same file as --out; give the hardware profile another path.")
    from moetool.engine.clock import load_hw

    if hw_base is None:
        hw_base = _device_preset(device, _split(what) or ("all",))
    load_hw(hw_base)  # an unknown preset is refused before the measuring, not after it
    sens_bits = parse_numbers(bits, "--bits", int)
    from moetool.profile.data import TEXTS

    if ppl_data not in TEXTS and not Path(ppl_data).is_file():
        raise MoetoolError(f"--ppl-data {ppl_data} is neither a text file nor a text data set ({', '.join(TEXTS)}): the "
                           "sensitivity scores perplexity over running text.")
    from moetool.datasets import read_text_file

    # a file's text before anything loads (binary, NUL, only whitespace: refused after the whole profile)
    for path, option in [*((f, "--data") for f in files if f.is_file()),
                         *([(Path(ppl_data), "--ppl-data")] if ppl_data not in TEXTS else [])]:
        read_text_file(path, option, "the sensitivity scores perplexity over" if option == "--ppl-data" else None)
    parts = _split(what) or ("all",)
    if hw_out is not None and "timing" not in parts and "all" not in parts:  # it would not be written, unsaid
        raise MoetoolError(f"--hw-out {hw_out} is written from the timing part, which --what {','.join(parts)} leaves out; add "
                           "timing to --what, or leave --hw-out out.")
    # Each part reads its own options; one given where its part is left out would be recorded in the
    # profile's settings (--data even as an input) as if it had been measured with.
    on = {"routing", "sensitivity", "similarity", "prefetch", "timing"} if "all" in parts else set(parts)
    traced = "--what routing, similarity or prefetch"
    if not {"routing", "similarity", "prefetch"} & on:  # timing reads the first 32 tokens of --data's first sequence
        only_with(traced, given(ctx, "seqs", "decode_tokens", *(() if "timing" in on else ("data", "seq_len"))),
                  "add one of them to --what")
    if "sensitivity" not in on:  # scored on the held-out text, whatever --data is
        only_with("--what sensitivity", given(ctx, "bits", "ppl_tokens", "ppl_data"), "add sensitivity to --what")
    if "timing" not in on:
        only_with("--what timing", given(ctx, "hw_base"), "add timing to --what")
    cfg = ProfileConfig(model=model, bundle=bundle, data=_split(data) or ProfileConfig.data,
                        what=_split(what) or ("all",), seqs_per_data=seqs, seq_len=seq_len,
                        decode_tokens=decode_tokens, sensitivity_bits=sens_bits, ppl_tokens=ppl_tokens, ppl_data=ppl_data,
                        hw_base=hw_base, device=device, dtype=Dtype(dtype).value)
    bar = Progress(console=err, transient=True, disable=not err.is_terminal)
    tasks: dict[str, int] = {}

    def progress(part: str, done: int, total: int) -> None:
        if not tasks:
            bar.start()  # only once work starts, so an early error is not preceded by a blank bar line
        if part not in tasks:
            tasks[part] = bar.add_task(part, total=total)
        bar.update(tasks[part], completed=done, total=total)

    try:
        result = profile_stage(cfg, progress=progress)
    finally:
        bar.stop()
    if result.hw is not None:  # first: a hardware file that cannot be written leaves no profile without it
        hw_path = hw_out or save.with_name(save.name.removesuffix(".json").removesuffix(".profile") + ".hw.json")
        from moetool.artifacts import atomic_write_bytes

        atomic_write_bytes(hw_path, (json.dumps(result.hw, indent=1) + "\n").encode())
        err.print(f"hardware profile for `run --clock sim --hw {hw_path}` written", highlight=False)
    result.save(save)
    if result.sensitivity is not None and result.sensitivity.tokens < ppl_tokens // 2:
        err.print(f"note: the sensitivity scored {result.sensitivity.tokens:,} tokens of {ppl_data}, not the "
                  f"{ppl_tokens:,} --ppl-tokens asked for (the text is that short): its perplexity changes are "
                  "that much noisier; give a longer text.", highlight=False)
    for said in result.notes:
        err.print(f"note: {said}", highlight=False)
    if as_json:
        out.print_json(json.dumps(result.to_json()))
        return
    table = Table(title=f"profile of {result.model.source} ({', '.join(result.what)})")
    table.add_column("layer", justify="right")
    cols = []
    if result.routing:
        cols += [("gini", lambda i: f"{result.routing.layers[i].gini:.3f}"),
                 ("top-10% share", lambda i: f"{result.routing.layers[i].top10_share:.3f}")]
    if result.sensitivity:
        b0 = result.sensitivity.bits[0] if result.sensitivity.bits else None
        if b0:
            cols.append((f"Δppl INT{b0}", lambda i: f"{result.sensitivity.layers[i].delta[b0]:+.3f}"))
    if result.prefetch:
        recall = {lp.layer: lp.recall_topk.get("decode") for lp in result.prefetch.layers}
        cols.append(("prefetch recall (decode)", lambda i: "-" if recall.get(result.info.moe_layers[i]) is None
                     else f"{recall[result.info.moe_layers[i]]:.3f}"))
    if result.timing:
        cols.append(("t_moe ms", lambda i: f"{result.timing.layers[i].t_moe * 1e3:.3f}"))
    for name, _ in cols:
        table.add_column(name, justify="right")
    for i, layer in enumerate(result.info.moe_layers):
        table.add_row(str(layer), *[fn(i) for _, fn in cols])
    out.print(table)
    if result.timing:
        out.print(_experts_table(result.timing))
    err.print(f"profile written to {save}", highlight=False)


def _experts_table(t) -> Table:
    """One expert per precision as the timing part measured it, on the path a run takes there."""
    dense = f"t_dense {t.t_dense_s * 1e3:.3f} ms"
    if t.t_dense_captured_s is not None:
        dense += f", {t.t_dense_captured_s * 1e3:.3f} ms in the captured step"
    table = Table(title=f"one expert, one token, on {t.device} ({t.dtype})", caption=dense)
    for name in ("bits", "path", "load µs", "dequant µs", "compute µs"):
        table.add_column(name, justify="left" if name == "path" else "right")
    for e in t.experts:
        table.add_row(str(e.bits), e.path, f"{e.load_s * 1e6:.1f}", f"{e.dequant_s * 1e6:.1f}", f"{e.compute_s * 1e6:.1f}")
    return table

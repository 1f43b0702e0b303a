"""The quantize stage: a Hugging Face MoE checkpoint in, a verified expert bundle out.

    bundle = quantize(QuantizeConfig(model="path/to/ckpt", out=Path("out/b"), bits=(16, 8, 4, 2)),
                      progress=lambda p: bar.update(p.done, total=p.total))

One MoE layer at a time, eight experts at a time: experts are read from the memory-mapped
checkpoint (`checkpoint.py`), each is quantized at every precision and streamed into its layer's
shard, and the span is dropped before the next is read, so host memory is the non-expert weights
plus a few experts whatever the model's size. Calibrated runs (GPTQ, or HQQ with
`calibrate`) are layer-sequential as GPTQ tools are: one batched forward over the calibration
sequences, and each MoE layer is quantized when the hidden states reach it, from the tokens its
router sends to each expert. The non-expert weights, config, generation config and tokenizer go
to `model/`, so the bundle runs without the checkpoint.

A journal next to the shards records each finished shard with its sha256, so an interrupted run
(a Ctrl-C, a full disk, a weight refused in a later layer) leaves no `bundle.json` and the next run with
the same settings and weights fingerprint continues from the shards that still hash right; weights
repaired since start over, other settings or another model are refused (`journal.py`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import torch

from moetool.artifacts import sha256_file
from moetool.errors import MoetoolError, keeping, not_a_file, quote
from moetool.machine import return_freed_heap
from moetool.files import DirectoryLock as _DirectoryLock
from moetool.files import not_inside_a_model, target_of_temp, temp_file_of, umask_mode
from moetool.model import ExpertWeights, LoadedModel, MoeLayer, load_model
from moetool.prequantized import without_quantization
from moetool.quant import gptq, hqq
from moetool.quant.bundle import MANIFEST, METHODS, Bundle, Entry
from moetool.quant.calibration import calibrate_layer_by_layer, calibration_ids, calibration_length
from moetool.quant.journal import JOURNAL, SHARD_NAME, Journal
from moetool.tokenizer import unknown_tokens
from moetool.quant.shards import MODEL_DIR, NON_EXPERT, ModelFile, Shard, ShardWriter, file_crc32, write_safetensors
from moetool.quant.notes import coarse_note, gate_up_shape, precision_note, row_error, size_note
from moetool.quant.format import (DTYPES, META_DTYPE, Bits, Layout, QTensor, auto_group_size, dequantize,
                                   dequantize_qtensor, encode, make_layout, relative_error, views)

READ_CHUNK = 8  # experts read from the checkpoint at once: memory stays flat in the number of experts
LOCK = ".quantize.lock"  # flock'ed while a quantize writes the directory


@dataclass(frozen=True)
class QuantizeConfig:
    model: str  # local checkpoint directory or hub id
    out: Path  # bundle directory
    bits: tuple[int, ...] = (16, 8, 4, 2)  # stored precisions; 16 is the bf16 reference
    method: str = "hqq"  # "hqq" (calibration-free) or "gptq" (needs moetool[gptq])
    group_size: int = 0  # input columns sharing one scale and zero; 0: auto (`auto_group_size`)
    int8_per_channel: bool = False  # INT8 with one scale and zero per output row (torch's int8 kernel's layout)
    axis: int = 1  # hqq's grouping axis; 1 (consecutive input columns) is what GPTQ shares
    calib_text: Path | None = None  # UTF-8 text to calibrate on (default: moetool's shipped training text)
    calib_tokens: int = 2048  # calibration tokens in total
    calib_seq_len: int = 256
    calibrate: bool = False  # collect calibration tokens for HQQ too, to report output error
    min_tokens: int = 32  # a GPTQ expert routed fewer calibration tokens than this falls back to HQQ
    dtype: str = "bfloat16"  # dtype the checkpoint is loaded and calibrated in
    device: str = "cpu"  # where hqq's optimizer runs ("cuda" is much faster where there is one)
    hqq_optimize: bool = True  # hqq's proximal solver; False rounds to nearest on its grid (~10x faster on CPU)
    seed: int = 0  # random calibration tokens for tokenizer-less test checkpoints
    verify: str = "fast"  # how the finished bundle is re-opened: "fast" (sizes, headers) or "full" (rehash shards)


@dataclass(frozen=True)
class Progress:
    """What `quantize` reports: stage is "load", "calibrate", "expert" (after each expert, all
    precisions) or "shard" (after each layer's shard is in place); done/total count experts."""

    stage: str
    done: int
    total: int
    layer: int | None = None


def quantize(cfg: QuantizeConfig, progress: Callable[[Progress], None] | None = None,
             note: Callable[[str], None] | None = None) -> Bundle:
    """Quantize every expert of `cfg.model` at `cfg.bits` into a self-contained bundle in `cfg.out`;
    `note` gets what its settings fail to save (`size_note`) before the work, and what the bundle
    changes in the model's numbers (`precision_note`) once it is done."""
    report = progress or (lambda p: None)
    bits = _check(cfg)
    out = Path(cfg.out)
    not_inside_a_model(out, "the bundle", itself=False)  # out itself may be this bundle: a resume
    check_out_dir(out)
    if cfg.calib_text is not None and not Path(cfg.calib_text).is_file():
        raise not_a_file(cfg.calib_text, "--calib-text")

    # The streamed experts keep only the span being quantized (and the calibration forward walks
    # each layer's experts in ascending order, so each span is read once per layer).
    lm = load_model(cfg.model, device="cpu", dtype=DTYPES[cfg.dtype], expert_cache_bytes=0, expert_chunk=READ_CHUNK)
    layers = lm.geometry.layers
    if cfg.group_size == 0:
        cfg = dataclasses.replace(cfg, group_size=auto_group_size(layers))
    cfg = dataclasses.replace(cfg, calib_seq_len=calibration_length(lm, cfg))  # within the model's positions
    total = sum(layer.num_experts for layer in layers)
    report(Progress("load", 0, total))
    inputs = {"calib_text": sha256_file(Path(cfg.calib_text))} if cfg.calib_text else {}
    settings = _settings(cfg, bits, inputs, lm.tokenizer is not None)
    # The weights' digest too (where known): an interrupted run never resumes on another checkpoint
    # of the same architecture.
    weights = {"weights_sha256": lm.fingerprint.weights_sha256} if lm.fingerprint.weights_sha256 else {}
    identity = {"model_type": lm.fingerprint.model_type, "config_sha256": lm.fingerprint.config_sha256,
                "settings": settings, **weights}
    layouts = {layer.index: {b: make_layout(b, gate_up_shape(layer), (layer.hidden_size, layer.intermediate_size),
                                            layer.has_bias, cfg.group_size, cfg.axis, cfg.int8_per_channel) for b in bits}
               for layer in layers}
    if (said := size_note(layers, layouts, cfg.group_size)) and note is not None:
        note(said)
    # The calibration text is read before anything is written: a text the tokenizer cannot use is
    # refused without a directory left behind.
    calib = calibration_ids(lm, cfg) if _calibrated(cfg) else None
    if calib is not None and calib.numel() != cfg.calib_tokens and note is not None:  # whole sequences, or less text
        why = "the text holds no more whole sequences" if calib.numel() < cfg.calib_tokens else "calibration takes whole sequences"
        note(f"calibration uses {calib.numel()} tokens ({calib.shape[0]} sequence(s) of {calib.shape[1]}), not the "
             f"{cfg.calib_tokens} of --calib-tokens: {why}.")
    if calib is not None and lm.tokenizer is not None and note is not None \
            and (unknown := unknown_tokens(calib.reshape(-1), lm.tokenizer)[0]):  # placeholders calibrated on, said
        note(f"{unknown} of the {calib.numel()} calibration tokens are the tokenizer's unknown token (characters its "
             "vocabulary lacks): the experts are calibrated on that placeholder there; give text in a script it spells.")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)  # only now: refused settings leave no directory behind
        lock = DirectoryLock(out)
    except OSError as e:
        raise _cannot_write(out, e, finished=False) from None
    try:
        with lock:
            check_out_dir(out)  # again, under the lock: another run may have finished here since the first look
            try:
                bundle = _write_bundle(lm, cfg, bits, out, inputs, identity, layouts, total, report, calib, note)
            except OSError as e:
                raise _cannot_write(out, e, finished=any(out.glob("layer-*.safetensors"))) from None
            try:
                Bundle.open(out, verify=cfg.verify, model=lm.fingerprint)  # read back what was written, as a user will
            except KeyboardInterrupt as e:  # the bundle is whole: running the command again would refuse it
                raise keeping(e, f"{out} holds the finished bundle ({MANIFEST} is written); `moetool verify {out}` "
                                 "rehashes it") from None
    except MoetoolError:
        # Refused before a single layer was finished (a checkpoint whose weights do not fit its
        # config, ...): nothing there is worth resuming, so a directory this run made goes too.
        if created and not any(out.glob("layer-*.safetensors")):
            shutil.rmtree(out, ignore_errors=True)
        raise
    said = precision_note(lm.experts.checkpoint.stored_dtypes(), cfg.dtype, reference=16 in cfg.bits)  # a finished one
    for said in (said, coarse_note(bundle.entries)):
        if said and note is not None:
            note(said)
    return bundle


def _write_bundle(lm: LoadedModel, cfg: QuantizeConfig, bits: tuple[Bits, ...], out: Path, inputs: dict[str, str],
                  identity: dict, layouts: dict[int, dict[Bits, Layout]], total: int,
                  report: Callable[[Progress], None], calib: torch.Tensor | None,
                  note: Callable[[str], None] | None) -> Bundle:
    """Quantize the layers the journal lacks (GPTQ / calibrated HQQ on `calib` token ids), then write
    the manifest (the caller holds `out`'s lock)."""
    layers = lm.geometry.layers
    _remove_strays(out)
    journal = Journal(out, identity, note)
    settings, settings_sha = identity["settings"], journal.settings_sha
    model_files = write_model_files(lm, out)
    todo = [layer for layer in layers if layer.index not in journal.done]
    done = total - sum(layer.num_experts for layer in todo)

    def quantize_layer(layer: MoeLayer, routed: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        nonlocal done

        def on_expert(expert: int, base: int = done) -> None:
            report(Progress("expert", base + expert + 1, total, layer.index))

        journal.add(layer.index, *_quantize_layer(lm, layer, cfg, layouts[layer.index], routed, out, settings_sha, on_expert))
        return_freed_heap()  # the layer's transients, freed, returned: memory flat over the model's depth
        done += layer.num_experts
        report(Progress("shard", done, total, layer.index))

    try:
        if todo and _calibrated(cfg):
            report(Progress("calibrate", done, total))
            calibrate_layer_by_layer(lm, calib, {g.index for g in todo}, quantize_layer)
        else:
            for layer in todo:
                quantize_layer(layer, None)
    except MoetoolError as e:  # a weight refused as it was read (not finite, a scale past float16), ...
        raise _unfinished(e, out, len(journal.done), len(layers)) if journal.done else e from None
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the shard being written is dropped, the journal kept
        if journal.done:
            keeping(e, f"{out} keeps the {len(journal.done)} of {len(layers)} MoE layers finished (no bundle yet); "
                       "the same command continues from them")
        raise

    bundle = Bundle(model=lm.fingerprint, inputs=inputs, method=cfg.method, bits=tuple(int(b) for b in bits),
                    group_size=cfg.group_size, axis=cfg.axis, settings=settings, settings_sha256=settings_sha,
                    layouts={_layout_key(lay): lay for per in layouts.values() for lay in per.values()},
                    shards=tuple(journal.done[layer.index][0] for layer in layers),
                    entries=tuple(e for layer in layers for e in journal.done[layer.index][1]),
                    model_files=model_files)
    bundle.save(out / MANIFEST)
    journal.remove()
    return bundle


def _unfinished(e: MoetoolError, out: Path, finished: int, layers: int) -> MoetoolError:
    """`e`, a refusal after `finished` layers were journaled, saying what stays and what a re-run does. The
    settings hash holds the weights' fingerprint (`weights_digest`: small tensors whole, large ones
    sampled), so a re-run continues only on the same weights: a repair the fingerprint does not see (one
    element of a large tensor) continues, a repaired small tensor or another checkpoint starts over."""
    return MoetoolError(f"{str(e).rstrip('.')}; {out} keeps the {finished} of {layers} MoE layers finished before "
                        f"this but is no bundle yet (no {MANIFEST}): the same command on the fixed checkpoint "
                        "continues from them, or starts over if the weights' fingerprint changed (another "
                        "checkpoint, or a fixed tensor small enough to be hashed whole).")


def _cannot_write(out: Path, e: OSError, finished: bool) -> MoetoolError:
    # A full disk, a read-only or vanished directory: what was finished stays journaled for a re-run;
    # with nothing finished, a directory this run made is removed (`quantize`), so none is promised.
    where = target_of_temp(e.filename) if e.filename else out  # never the temp file of a shard or model/
    then = "finished layers are kept, re-run the same command to continue" if finished else \
        "no layer was finished, so nothing is kept; re-run the same command to start again"
    from moetool.machine import space_cause

    cause = space_cause(e, f" writing {where}")  # a full disk, a quota, `ulimit -f`: named, with the way on
    return MoetoolError(f"cannot write the bundle in {out}: {cause or f'{e.strerror or e} ({where})'}; {then}.")


# ---- the output directory -----------------------------------------------------------------------

_WRITTEN = frozenset({MODEL_DIR, MANIFEST, JOURNAL})  # besides the shards, what quantize writes in a bundle directory


def own_temp_file(name: str) -> bool:
    """Whether `name` is a temp file quantize's own writes make beside what they write (a shard, model/,
    the journal, the manifest): what a run killed in the middle of a write leaves behind."""
    shard = re.match(rf"\.({SHARD_NAME.pattern})\.", name)
    return temp_file_of(name, _WRITTEN | ({shard.group(1)} if shard else set()))


def _own(name: str) -> bool:
    """Whether quantize itself puts `name` in a bundle directory; anything else is the user's."""
    return name in _WRITTEN or name == LOCK or SHARD_NAME.fullmatch(name) is not None or own_temp_file(name)


def check_out_dir(out: Path) -> None:
    """Refuse, in one sentence, an output that is a file, a finished bundle, or a directory that is
    not empty and not an unfinished bundle (a journal, and only the files quantize writes, its temp
    files included: a run killed in the middle of any write resumes)."""
    if out.exists() and not out.is_dir():
        raise MoetoolError(f"{out} is a file, not a directory to write a bundle in; choose another output directory.")
    if (out / MANIFEST).exists():
        raise MoetoolError(f"{out} already holds a finished bundle ({MANIFEST}); choose another output directory "
                           "or delete it.")
    if not out.is_dir():
        return
    names = sorted(p.name for p in out.iterdir())
    foreign = [n for n in names if not _own(n)]
    if not foreign and JOURNAL not in names:  # killed before its first journal: only the lock and temp files
        foreign = [n for n in names if n != LOCK and not own_temp_file(n)]
    if foreign:
        raise MoetoolError(f"{out} is not empty and is not a moetool bundle (it holds {quote(foreign[0])}); choose an "
                           "empty or new output directory.")


def DirectoryLock(out: Path) -> _DirectoryLock:  # noqa: N802 - kept for callers of the class it was
    """An exclusive lock on a bundle directory while one quantize writes it (`moetool.files.DirectoryLock`)."""
    return _DirectoryLock(out, LOCK, f"another moetool quantize is writing a bundle in {out}; wait for it to finish "
                                     "or choose another output directory.")


def write_model_files(lm: LoadedModel, out: Path) -> tuple[ModelFile, ...]:
    """Write `out/model/`: config, generation config, tokenizer and the non-expert weights.

    Built in a temp directory beside it and renamed into place, so an interrupted write never
    leaves a half `model/`; rewritten on every (re)run, since it is small next to the experts.
    """
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR}.", suffix=".tmp", dir=out))
    try:
        # Dequantized as they loaded (an FP8/MXFP4 checkpoint), the non-expert weights are the model's own.
        without_quantization(lm.model.config).save_pretrained(tmp)
        if lm.model.generation_config is not None:
            lm.model.generation_config.save_pretrained(tmp)
        if lm.tokenizer is not None:
            lm.tokenizer.save_pretrained(str(tmp))
        write_safetensors(tmp / NON_EXPERT, non_expert_state(lm.model), {"format": "pt"})
        records = []
        for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
            os.chmod(f, umask_mode())
            records.append(ModelFile(name=str(f.relative_to(tmp)), nbytes=f.stat().st_size, sha256=sha256_file(f),
                                     crc32=file_crc32(f)))
        final = out / MODEL_DIR
        if final.exists():
            shutil.rmtree(final)
        os.chmod(tmp, umask_mode(directory=True))
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tuple(records)


def non_expert_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every real parameter and persistent buffer, each tied tensor once under its first name (the
    embedding before lm_head: `tie_weights` restores the other at load)."""
    state, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.is_meta or (t.numel() and t.data_ptr() in seen):
            continue
        seen.add(t.data_ptr())
        state[name] = t
    return state


def _check(cfg: QuantizeConfig) -> tuple[Bits, ...]:
    """Refuse bad settings before loading anything (bits, method, axis, dtype, the gptq extra)."""
    bits = tuple(sorted({Bits.parse(b) for b in cfg.bits}, reverse=True))
    if not bits:
        raise MoetoolError("no precisions to store; give bits such as 16,8,4,2.")
    if cfg.method not in METHODS:
        raise MoetoolError(f"unknown quantization method '{cfg.method}'; choose one of {', '.join(METHODS)}.")
    if isinstance(cfg.group_size, bool) or not isinstance(cfg.group_size, int) or cfg.group_size < 0:
        raise MoetoolError(f"--group-size must be a positive number of input columns (or 0: auto), "
                           f"not {cfg.group_size}.")
    if cfg.dtype not in DTYPES or cfg.dtype == "uint8":
        raise MoetoolError(f"dtype '{cfg.dtype}' is not a float dtype moetool loads models in.")
    if cfg.method == "gptq":
        if cfg.axis != 1:
            raise MoetoolError("GPTQ groups consecutive input columns (hqq axis 1); drop the axis 0 setting.")
        if not gptq.available():
            gptq.load_gptqmodel()  # raises the install hint
    if cfg.int8_per_channel:
        if Bits.INT8 not in bits:
            raise MoetoolError("--int8-per-channel changes how INT8 experts are stored; add 8 to --bits or drop it.")
        if cfg.method != "hqq":
            raise MoetoolError("per-channel INT8 is quantized by hqq; drop --int8-per-channel or use --method hqq.")
        if cfg.axis != 1:
            raise MoetoolError("per-channel INT8 groups each row's input columns (axis 1); drop the axis 0 setting.")
    if cfg.verify not in ("fast", "full"):
        raise MoetoolError(f"verify must be 'fast' or 'full', not '{cfg.verify}'.")
    if cfg.calib_tokens < 1 or cfg.calib_seq_len < 1 or cfg.min_tokens < 0:
        raise MoetoolError("calibration token counts must be positive.")
    return bits


def _settings(cfg: QuantizeConfig, bits: tuple[Bits, ...], inputs: dict[str, str], has_tokenizer: bool) -> dict:
    settings = {"bits": [int(b) for b in bits], "method": cfg.method, "group_size": cfg.group_size,
                "axis": cfg.axis, "dtype": cfg.dtype, "device": cfg.device,
                "hqq": {"version": version("hqq"), "optimize": cfg.hqq_optimize, "round_zero": False}}
    if cfg.int8_per_channel:  # only when set: older bundles' settings (and their resume hash) stay as they were
        settings["int8_per_channel"] = True
    if _calibrated(cfg):
        source = "file" if cfg.calib_text else "moetool.datasets.train_text" if has_tokenizer else "random ids"
        settings["calibration"] = {"source": source, "text_sha256": inputs.get("calib_text"),
                                   "tokens": cfg.calib_tokens, "seq_len": cfg.calib_seq_len, "seed": cfg.seed}
    if cfg.method == "gptq":
        settings["gptq"] = {"gptqmodel": version("gptqmodel"), "damp_percent": gptq.DAMP_PERCENT,
                            "mse": gptq.MSE_NORM, "act_order": False, "sym": False, "min_tokens": cfg.min_tokens}
    return settings


def _calibrated(cfg: QuantizeConfig) -> bool:
    return cfg.method == "gptq" or cfg.calibrate or cfg.calib_text is not None


def _layout_key(layout: Layout) -> str:
    gu, dn = (p.shape for p in layout.projections)
    group = layout.projections[0].group_size
    if layout.projections[1].group_size != group:  # per-channel INT8: each projection's own width
        group = f"{group}-{layout.projections[1].group_size}"
    bias = "-bias" if any(p.name == "gate_up_bias" for p in layout.parts) else ""
    return f"b{layout.bits}-g{group}-a{layout.projections[0].axis}-{gu[0]}x{gu[1]}-{dn[0]}x{dn[1]}{bias}"


# ---- one layer ----------------------------------------------------------------------------------


def _quantize_layer(lm: LoadedModel, layer: MoeLayer, cfg: QuantizeConfig, layouts: dict[Bits, Layout],
                    routed: tuple[torch.Tensor, torch.Tensor] | None, out: Path, settings_sha: str,
                    on_expert: Callable[[int], None]) -> tuple[Shard, list[Entry]]:
    experts_module = lm.model.get_submodule(layer.path).experts  # the model's own activation lives here
    per_expert = sum(lay.nbytes for lay in layouts.values())
    writer = ShardWriter(out / f"layer-{layer.index:03d}.safetensors", layer.index,
                         per_expert * layer.num_experts, settings_sha)
    entries = []
    try:
        for expert in range(layer.num_experts):
            ref = lm.experts.get(layer.index, expert).to("cpu", torch.float32)  # read a span at a time
            x = None
            if routed is not None:
                hidden, top_k = routed  # [T, H], [T, k]
                x = hidden[(top_k == expert).any(dim=1)]  # [n, H] tokens the router sent here
            y_ref = experts_module.expert_forward(x, ref).float() if x is not None and len(x) else None  # [n, H]
            for bits, layout in layouts.items():
                method, q = _quantize_expert(ref, bits, layout, x, cfg, experts_module)
                blob = encode(layout, ref, q)  # uint8 [layout.nbytes]
                approx = dequantize(blob, layout)
                _refuse_overflow(ref, approx, layout, layer.index, expert, blob)
                offset, crc = writer.write(blob)
                out_error = None
                if y_ref is not None:
                    out_error = relative_error(y_ref, experts_module.expert_forward(x, approx))
                entries.append(Entry(
                    layer=layer.index, expert=expert, bits=int(bits), method=method, shard=writer.path.name,
                    offset=offset, nbytes=layout.nbytes, layout=_layout_key(layout), crc32=crc,
                    rel_error={p.name: relative_error(getattr(ref, p.name), getattr(approx, p.name))
                               for p in layout.projections},
                    row_error={p.name: row_error(getattr(ref, p.name), getattr(approx, p.name))
                               for p in layout.projections},
                    out_error=out_error, tokens=None if x is None else len(x)))
            on_expert(expert)
        return writer.finish(), entries
    except BaseException:
        writer.abort()
        raise


def _refuse_overflow(ref: ExpertWeights, approx: ExpertWeights, layout: Layout, layer: int, expert: int,
                     blob: torch.Tensor) -> None:
    """Refuse an expert whose stored form is not finite though its weights are (`load_into` refused any
    that are not): a group's scale past float16's range (META_DTYPE: a weight near 1e6 at INT4) is
    stored as infinity and every output of the expert would be NaN. Checked on the blob just decoded,
    and for per-channel INT8 on the row offsets the CPU kernel keeps in float16 (`int8_kernel`), which
    a row past float16's range overflows where the decoded weights do not."""
    v = views(blob, layout)
    if layout.per_channel and int(layout.bits) == 8:
        for proj in layout.projections:
            offset = v[f"{proj.name}.scale"].float() * (128 - v[f"{proj.name}.zero"].float())
            if not bool(torch.isfinite(offset.half()).all()):
                big = float(getattr(ref, proj.name).abs().max())
                raise MoetoolError(f"expert {expert} of layer {layer} cannot be stored at 8 bits per channel: its "
                                   f"{proj.name} projection holds weights of magnitude {big:.3g}, past float16's range, "
                                   "where the INT8 CPU kernel keeps each row's offset; quantize without "
                                   "--int8-per-channel (grouped INT8 has no such offset).")
    for proj in layout.projections:
        got = getattr(approx, proj.name)
        if not bool(torch.isfinite(got).all()):
            big = float(getattr(ref, proj.name).abs().max())
            zero = v.get(f"{proj.name}.zero")
            if zero is not None and not bool(torch.isfinite(zero.float()).all()):
                # hqq's zero is the group's minimum over its step: a group far from 0 with little spread (a
                # healthy row of weights near 4 in float32), not a damaged weight
                raise MoetoolError(
                    f"expert {expert} of layer {layer} cannot be stored at {int(layout.bits)} bits: a group of its "
                    f"{proj.name} projection lies far from 0 for its spread (weights up to {big:.3g}), and its zero "
                    f"point overflows the bundle's {META_DTYPE} zeros; quantize from --dtype bfloat16 (whose rounding "
                    "widens such a group), at 16 bits only (--bits 16), or with a larger --group-size.")
            raise MoetoolError(f"expert {expert} of layer {layer} cannot be stored at {int(layout.bits)} bits: its "
                               f"{proj.name} projection holds a weight of magnitude {big:.3g}, whose group scale "
                               f"overflows the bundle's {META_DTYPE} scales; the checkpoint is damaged or not of "
                               "this scale (quantize it at 16 bits only, --bits 16, or repair the weight).")


def _quantize_expert(ref: ExpertWeights, bits: Bits, layout: Layout, x: torch.Tensor | None, cfg: QuantizeConfig,
                     experts_module: torch.nn.Module) -> tuple[str, dict[str, QTensor] | None]:
    """(method that made it, quantized projections) for one expert at one precision."""
    if bits == Bits.BF16:
        return "bf16", None
    if cfg.method == "gptq" and x is not None and len(x) >= cfg.min_tokens:
        projections = {p.name: p for p in layout.projections}
        layer = experts_module.layer
        impl = experts_module.impl

        def act(h: torch.Tensor) -> torch.Tensor:  # [n, 2I] -> [n, I], as ProviderExperts.expert_forward does
            return impl._apply_gate(h) if layer.gated else impl.act_fn(h)

        return "gptq", gptq.quantize_expert(ref, bits, cfg.group_size, x, act,
                                            lambda name, q: dequantize_qtensor(q, projections[name]))
    return "hqq", {p.name: hqq.quantize_weight(getattr(ref, p.name), bits, p.group_size, cfg.axis, cfg.device,
                                               cfg.hqq_optimize) for p in layout.projections}


# ---- resume journal (`journal.py`) ---------------------------------------------------------------


def _remove_strays(out: Path) -> None:
    """A killed run's temp shards, half-written model/ and half-written journal or manifest. Safe to
    delete: the caller holds the directory's lock, so no live run is writing them."""
    for stray in out.glob(".*.tmp"):
        if not own_temp_file(stray.name):
            continue
        if stray.is_dir():
            shutil.rmtree(stray, ignore_errors=True)
        else:
            stray.unlink(missing_ok=True)

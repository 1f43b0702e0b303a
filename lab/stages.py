"""The four stages of the demo conversion, each resumable from the fit's workdir (`make fit-demo`).

Stage 1, the layerwise fit (`lab.layerwise`); stage 2, distillation on the fitting text
(`lab.distil`); stage 3, rounds of refinement on the fitting text and the dense model's own samples
(`lab.distil.REFINE`); stage 4, one router temperature (`lab.gates.calibrate`). The package only
applies the result (`moetool.demo.convert`); nothing here is imported by it.

    >>> from moetool.demo import fetch_dense_gguf, load_dense
    >>> from lab.stages import fit_demo
    >>> dense, tok = load_dense(fetch_dense_gguf())
    >>> params = fit_demo(dense, tok, workdir=Path("/tmp/demo-fit")).params
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from lab.distil import REFINE, REFINE_ROUNDS, DistilSettings, distil, teacher_samples
from lab.gates import calibrate
from lab.layerwise import FitSettings, fit_conversion, spread_windows
from moetool.datasets import train_text
from moetool.demo import ConversionParams, Progress, convert, load_params, save_params
from moetool.errors import MoetoolError


def _say(progress: Progress | None, msg: str) -> None:
    if progress is not None:
        progress(msg)


@dataclass(frozen=True)
class Fitted:
    params: ConversionParams  # every stage: what gets committed
    layerwise: ConversionParams | None  # stage 1 only (hard gating); None when stage 2 was reused without it
    baseline: ConversionParams | None  # least-squares routers, no compensation; None as layerwise
    distilled: ConversionParams | None = None  # stages 1-2: before the refinement on teacher samples
    refined: ConversionParams | None = None  # stages 1-3: before the router temperature (stage 4)


def stage_tag(fit, text: str) -> str:
    """Name of the stages' files in the fit's workdir: its settings and its training text, so that a
    changed text or setting never resumes from another fit's checkpoint."""
    return hashlib.sha256(json.dumps(asdict(fit), sort_keys=True).encode() + text.encode()).hexdigest()[:12]


def fit_demo(dense, tok, fit=None, s=None, refine=None, *, workdir: Path, progress: Progress | None = None,
             report=None, min_ratio: float | None = 3.25, rounds: int | None = None) -> Fitted:
    """The four stages of the demo conversion; the first three keep their results in `workdir` for reuse.

    Stage 1 (`lab.layerwise.fit_conversion`, minutes) is saved once finished; stage 2 (`distil` on the
    fitting text, half an hour to an hour on 2 cores) and stage 3 (`rounds` runs of `distil` with
    `REFINE` on the fitting text and the teacher's own samples, each from the last one's result,
    about 23 minutes a round) checkpoint as they go and keep each round's result, so an interrupted
    fit resumes where it stopped. `refine=False` stops after stage 2. Stage 4 (`calibrate`, minutes,
    not kept) scales every router's logits by one temperature chosen on fitting text, keeping the
    mean top-1 score >= `min_ratio` x the (k+1)-th; `min_ratio=None` skips it.
    """
    fit = FitSettings() if fit is None else fit
    s = DistilSettings() if s is None else s
    refine = REFINE if refine is None else refine
    rounds = REFINE_ROUNDS if rounds is None else rounds
    workdir.mkdir(parents=True, exist_ok=True)
    text = train_text()
    tag = stage_tag(fit, text)
    stage1, base = workdir / f"layerwise-{tag}.safetensors", workdir / f"baseline-{tag}.safetensors"
    stage2 = workdir / f"distilled-{stage_tag(s, tag)}.safetensors"
    layerwise = baseline = None
    if stage1.is_file() and base.is_file():
        layerwise, baseline = load_params(stage1), load_params(base)
        _say(progress, f"stage 1 (layerwise fit) reused from {stage1}")
    elif not stage2.is_file():
        outcome = fit_conversion(dense, tok, fit, progress=progress)
        save_params(outcome.baseline, base)
        save_params(outcome.params, stage1)  # last: its presence means stage 1 finished
        # The committed file stores fp16; train from exactly what a resume would load.
        layerwise, baseline = load_params(stage1), load_params(base)
    _say(progress, "stage 2: tokenising the training text")
    ids = torch.tensor(tok(text)["input_ids"])
    if stage2.is_file():
        _say(progress, f"stage 2 (distillation) reused from {stage2}")
    else:
        save_params(distil(dense, ids, layerwise, s, checkpoint=workdir / f"distil-{tag}.pt", report=report), stage2)
    distilled = refined = load_params(stage2)  # fp16, as committed: stage 3 starts from what a resume loads
    for r in range(rounds if refine is not False else 0):
        refined = _refine(dense, tok, ids, refined, refine, r, rounds, workdir, stage_tag(s, tag), progress, report)
    params = refined if min_ratio is None else calibrate_routers(dense, tok, refined, min_ratio, progress, ids)
    return Fitted(params, layerwise, baseline, distilled, refined)


def calibrate_routers(dense, tok, refined: ConversionParams, min_ratio: float = 3.25,
                      progress: Progress | None = None, ids: torch.Tensor | None = None) -> ConversionParams:
    """Stage 4 (`lab.gates.calibrate`) on 16 windows of 512 spread over the fitting text (all five
    domains; the evaluation texts stay unread). `ids`: the fitting text's tokens, if already made."""
    if "calibrate" in refined.meta or min_ratio <= 0:
        raise MoetoolError("stage 4 takes a conversion without a router temperature and a gate ratio floor > 0 "
                           f"(this one has temperature {refined.meta.get('calibrate', {}).get('t')}, floor {min_ratio}).")
    ids = torch.tensor(tok(train_text())["input_ids"]) if ids is None else ids
    return calibrate(dense, spread_windows(ids, 16 * 512, 512), refined, convert, min_ratio=min_ratio,
                     progress=progress)[0]


def stored_teacher_samples(dense, tok, n: int, seq_len: int, seed: int, workdir: Path,
                           progress: Progress | None = None) -> torch.Tensor:
    """[n, seq_len] samples of the dense model (`lab.distil.teacher_samples`) for `seed`, drawn once
    and kept in `workdir` (stage 3 draws 120 a round; ~10 minutes on 2 cores)."""
    samples_file = workdir / f"teacher-{n}x{seq_len}-{seed}.pt"
    if samples_file.is_file():
        return torch.load(samples_file, weights_only=True)

    def sampled(done: int, total: int) -> None:
        _say(progress, f"sampling the dense model, {done}/{total} windows")
    samples = teacher_samples(dense, n, seq_len, start_id=tok.convert_tokens_to_ids("<|endoftext|>"), seed=seed,
                              progress=sampled)
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = samples_file.with_name(samples_file.name + f".tmp{os.getpid()}")
    torch.save(samples, tmp)
    os.replace(tmp, samples_file)
    return samples


def _refine(dense, tok, ids: torch.Tensor, start: ConversionParams, refine, r: int, rounds: int, workdir: Path,
            tag: str, progress: Progress | None, report) -> ConversionParams:
    """Stage 3, round r (from 0): `distil` with `refine` at seed `refine.seed + r` from `start` (the
    distilled conversion, or the last round's result) on the fitting text and that seed's teacher
    samples (drawn once, kept). Each round's result is kept in `workdir` and reused."""
    settings = replace(refine, seed=refine.seed + r)
    result = workdir / f"refined{r + 1}-{stage_tag(settings, tag)}.safetensors"
    head = f"stage 3, round {r + 1}/{rounds}"
    if result.is_file():
        _say(progress, f"{head} (refinement) reused from {result}")
        return load_params(result)
    samples = stored_teacher_samples(dense, tok, settings.steps * settings.general, settings.seq_len, settings.seed,
                                     workdir, progress=lambda msg: _say(progress, f"{head}: {msg}"))
    _say(progress, f"{head}: refining on the fitting text and the teacher's samples")
    checkpoint = workdir / f"refine{r + 1}-{tag}.pt"
    save_params(distil(dense, ids, start, settings, general=samples, checkpoint=checkpoint, report=report), result)
    return load_params(result)  # fp16, as committed: the next round starts from what a resume loads

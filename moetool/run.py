"""`moetool run`: greedy generation under a policy and a device budget, with the engine's stats.

    result = run(RunConfig(bundle=Path("out/bundle"), policy="lru", budget="25%", clock="sim", hw="rtx3090",
                           prompts=("Hello",), max_new_tokens=16))
    result.tpot_s["p50"], result.hit_rate

A bundle is self-contained: with `bundle` and no `model`, the model (config, tokenizer,
non-expert weights) comes from the bundle and nothing of the checkpoint is read. With `model`
too, the non-expert weights come from the checkpoint (streamed, experts never read) and the
bundle must be of that model. With `model` alone, experts are packed in memory from the checkpoint
at the reference precision (small models; quantize a bundle for large ones).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

from moetool.artifacts import sha256_file
from moetool.fit_artifact import Fit
from moetool.engine import PLAN_TOKENS, BudgetSplit, build_engine, parse_size
from moetool.engine.store import HostStore
from moetool.errors import MoetoolError, not_text, quote
from moetool.inference import NonFiniteRows, context_length, context_words, nonfinite_sentence, vocab_size
from moetool.model import LoadedModel, load_model
from moetool.quant.bundle import load_bundle_model
from moetool.run_artifact import Run
from moetool.spec import EngineSpec, check_positive, check_types, resolve_dtype
from moetool.tokenizer import (check_ids, encode, framing, refuse_dropped, refuse_unknown, unknown_tokens,
                               without_tail)


@dataclass(frozen=True, kw_only=True)
class RunConfig(EngineSpec):
    """An engine spec and the prompts to generate from."""

    prompts: tuple[str, ...] = ("The capital of France is",)
    max_new_tokens: int = 32
    batch_size: int = 1

    def check(self) -> None:
        check_types(self)
        check_positive(max_new_tokens=self.max_new_tokens, batch_size=self.batch_size)
        if not self.prompts:
            raise MoetoolError("there are no prompts to run.")
        for i, prompt in enumerate(self.prompts, 1):
            # An empty prompt has no token to start from: the model would fail deep inside a forward.
            if not isinstance(prompt, str) or not prompt.strip():
                what = ("empty" if not prompt else "only whitespace") if isinstance(prompt, str) else "not text"
                raise MoetoolError(f"prompt {i} of {len(self.prompts)} is {what}; give it some text to continue.")
            if (why := not_text(prompt)) is not None:  # --prompt with a byte that is not UTF-8, a grid's "\\ud800"
                raise MoetoolError(f"prompt {i} of {len(self.prompts)} {why}.")
        super().check()


def load(cfg: EngineSpec, dtype: torch.dtype) -> tuple[LoadedModel, HostStore, dict[str, str]]:
    """The model and the host store `cfg` asks for (see the module docstring), and the inputs' sha256."""
    if cfg.bundle is None:
        lm = load_model(cfg.model or "demo", device=cfg.device, dtype=dtype)
        return lm, HostStore.from_experts(lm.experts, dtype), {}
    from moetool.quant.bundle import MANIFEST, Bundle

    bundle = Path(cfg.bundle)
    if cfg.model is None:
        lm = load_bundle_model(bundle, device=cfg.device, dtype=dtype)
    else:
        lm = load_model(cfg.model, device=cfg.device, dtype=dtype)
        lm.bundle = Bundle.open(bundle, model=lm.fingerprint)
    return lm, HostStore.from_bundle(lm.bundle, dtype), {str(bundle / MANIFEST): sha256_file(bundle / MANIFEST)}


def _encode(lm: LoadedModel, prompts: list[str], notes: set[str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask; tokenizer-less test models fold prompt bytes into the vocab.
    A prompt is continued, so it does not end with the EOS some tokenizers end every text with
    (`tokenizer.without_tail`); what the model will not read of a prompt (the unknown token in place of
    characters, characters dropped) is added to `notes`, and a prompt with no token of its own is refused."""
    tok, pad = lm.tokenizer, 0
    if tok is None:
        rows = [encode(None, p, vocab_size(lm.model)) for p in prompts]
    else:
        if tok.pad_token is None and len(prompts) > 1:
            # a pad row is masked out, so any token pads it: end-of-sequence where the tokenizer has one (as
            # generate pads), else the vocabulary's first (a tokenizer with neither was a traceback)
            tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.convert_ids_to_tokens(0)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        frame, rows = framing(tok), []
        for i, p in enumerate(prompts):
            ids = tok(p).input_ids
            what = f"prompt {i + 1} ({quote(p, 40)})"
            check_ids(torch.tensor(ids, dtype=torch.long), tok, vocab_size(lm.model))
            refuse_unknown(torch.tensor(ids, dtype=torch.long), tok, what, p)
            dropped = refuse_dropped(tok, p, ids, what)  # RunConfig.check refused blank prompts
            if notes is not None:
                notes.update(_unread(tok, p, ids, what, frame, dropped))
            rows.append(torch.tensor(without_tail(ids, frame), dtype=torch.long))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    check_ids(ids[:, :1], tok, vocab_size(lm.model))  # the pad token's id too: it is embedded as well
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


def _unread(tok: Any, prompt: str, ids: list[int], what: str, frame: tuple[list[int], list[int]],
            dropped: int) -> list[str]:
    """What `run` says of a prompt the model will not read whole (recorded under summary.text_notes)."""
    said = []
    unknown = unknown_tokens(torch.tensor(ids, dtype=torch.long), tok, prompt)[0]
    if unknown:
        said.append(f"{what} has {unknown} unknown token(s) ({quote(tok.unk_token, 10)}) in place of characters the "
                    "vocabulary lacks: the model reads the placeholder, not them.")
    if dropped:
        said.append(f"{what} has {dropped} character(s) the tokenizer drops (no token covers them): the model "
                    "reads the prompt without them.")
    if without_tail(ids, frame) is not ids:
        said.append(f"the tokenizer ends every text with {quote(tok.decode(frame[1]), 20)}; prompts are run without "
                    "it, since the model is to continue them.")
    return said


@dataclass
class Prepared:
    """An engine-backed model ready to run: what run and eval share."""

    spec: EngineSpec
    lm: LoadedModel
    engine: Any
    budget: BudgetSplit
    inputs: dict[str, str]  # sha256 of the bundle manifest / fit artifact used
    dtype: str = "float32"  # the compute dtype, resolved
    store: HostStore | None = None  # what `build` (re)builds the engine from
    fitted: dict[str, Any] | None = None
    fit_sizing: dict[str, Any] | None = None  # knob -> the budget and tiers it was fitted for (`Fit.sizing`)
    max_tokens: int = PLAN_TOKENS
    batch: int = 1
    host_budget: int | None = None
    captured_refusal: str | None = None  # why an engine planned for the captured step could not be built


def fitted_knobs(fit: Any, policy: str, path: Any) -> dict[str, Any]:
    """`fit`'s knobs for `policy`; refused where no paper's fit sets that policy's knobs (lru, static):
    `moetool fit` never writes them, so they are an edit, and they ran (lru at INT4) while the run said
    the fit changed nothing."""
    from moetool.policies import POLICIES
    from moetool.policies.knobs import hooked

    knobs = fit.params.get(policy) or {}
    cls = POLICIES.get(policy)
    if knobs and cls is not None and not any(issubclass(cls, hook) for _, hook in hooked("fit")):
        raise MoetoolError(f"{path} holds knobs of policy '{policy}' ({', '.join(f'{k}={v}' for k, v in knobs.items())}), "
                           "which no paper's fit sets (moetool fit never writes them); give them with --set instead.")
    return knobs


def prepare(spec: EngineSpec, max_tokens: int | Callable[[LoadedModel], int] = PLAN_TOKENS,
            batch: int | None = None, captured: bool = False) -> Prepared:
    """Load the model, open the store, build the policy and the engine from `spec`.

    `max_tokens` (or a function of the loaded model, for lengths counted with its tokenizer) and
    `batch` (default: the config's batch_size, 1 for a bare spec) size the KV/activation margin the
    budget reserves; the engine refuses a longer forward. The caller has `check()`ed the spec (run
    and evaluate do, first thing), so a bad one fails before the model loads. `captured` plans the
    engine for the captured decode step (`engine.decode`).
    """
    dtype = resolve_dtype(spec.dtype, spec.device)
    host_budget = None if spec.host_budget is None else parse_size(spec.host_budget, "--host-budget")
    lm, store, inputs = load(spec, dtype)
    from moetool.engine.clock import hw_path

    hw = hw_path(spec.hw).resolve()  # read by the engine's cost model whatever the clock: an edit is a new input
    inputs[str(hw)] = sha256_file(hw)
    if callable(max_tokens):
        max_tokens = max_tokens(lm)
    fitted = sizing = None
    if spec.fit is not None:
        fit = Fit.load(Path(spec.fit), model=lm.fingerprint)
        fitted, sizing = fitted_knobs(fit, spec.policy, spec.fit), fit.sizing(spec.policy)
        inputs[str(spec.fit)] = sha256_file(Path(spec.fit))
    ready = Prepared(spec=spec, lm=lm, engine=None, budget=None, inputs=inputs, dtype=str(dtype).removeprefix("torch."),
                     store=store, fitted=fitted, fit_sizing=sizing, max_tokens=max_tokens,
                     batch=batch or getattr(spec, "batch_size", 1), host_budget=host_budget)
    return build(ready, captured)


def build(ready: Prepared, captured: bool = False) -> Prepared:
    """(Re)build `ready`'s engine over its loaded model and store, for the captured decode step or the
    host path (a captured plan the model or policy cannot take is rebuilt for the host path)."""
    if ready.engine is not None:
        ready.engine.close()
    spec = ready.spec

    def engine(captured: bool) -> tuple[Any, BudgetSplit]:
        return build_engine(
            ready.lm, ready.store, spec.policy, settings=spec.settings, fitted=ready.fitted, budget=spec.budget,
            clock=spec.clock, hw=spec.hw, device=spec.device, max_tokens=ready.max_tokens, batch=ready.batch,
            host_budget=ready.host_budget, experts_impl=spec.experts_impl, captured=captured,
            fit_sizing=ready.fit_sizing)

    ready.captured_refusal = None
    if captured:
        try:
            ready.engine, ready.budget = engine(True)
            return ready
        except MoetoolError as e:  # the step's workspace past a tight budget, say: the host path may still run
            ready.captured_refusal = str(e).rstrip(".")
    ready.engine, ready.budget = engine(False)  # its own refusal, where the host path cannot run either
    return ready


def engine_record(ready: Prepared) -> dict[str, Any]:
    """The `EngineRecord` fields of a Run or an Eval: the spec as it ran and the engine's counters so far."""
    spec, engine, split = ready.spec, ready.engine, ready.budget
    s = engine.stats.summary()
    return dict(policy=spec.policy, params=engine.policy.describe(), clock=spec.clock,
                hw=spec.hw if spec.clock == "sim" else None, device=str(spec.device), dtype=ready.dtype,
                budget_bytes=split.total_bytes, budget=dataclasses.asdict(split), peak_device_bytes=s["peak_device_bytes"],
                summary={**s, "warm_bytes": engine.warm_bytes, **engine.decode_info,
                         # a wall-clock time on a CPU is a time at this many threads (OMP_NUM_THREADS, torch's own)
                         **({"host_threads": torch.get_num_threads()} if spec.clock == "wall" else {}),
                         **({"fit_dropped": engine.fit_dropped} if engine.fit_dropped else {}),
                         **({"clamped": engine.policy.clamped} if engine.policy.clamped else {}),
                         **({"policy_notes": engine.policy.notes} if engine.policy.notes else {})},
                layers={str(k): v.to_json() for k, v in engine.stats.layers.items()})


class _StepCounter(BaseStreamer):
    """Progress in generated tokens, all prompts together: generate hands a streamer the prompt, then
    each step's new tokens (one per sequence of the batch)."""

    def __init__(self, progress: Callable[[int, int], None], done: int, width: int, total: int):
        self.progress, self.done, self.width, self.total, self.prompt_seen = progress, done, width, total, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first call is the prompt itself
            self.prompt_seen = True
            return
        self.done += self.width
        self.progress(min(self.done, self.total), self.total)

    def end(self) -> None:
        pass


def _sequence_tokens(lm: LoadedModel, prompts: list[str], max_new_tokens: int) -> int:
    """The longest sequence a run makes: its longest prompt (a batch is left-padded to it) plus the
    tokens it generates; the KV margin is sized for it. Refused past the model's own context, and a
    prompt too long to fit whatever its tokens before it is tokenized (a 4 MB prompt took 2.2 GB and 38 s
    in one tokenizer call to be refused): no token spells more characters than the vocabulary's longest."""
    limit = context_length(lm.model)
    if limit is not None and lm.tokenizer is not None:
        most = max(map(len, lm.tokenizer.get_vocab()), default=1)
        for i, p in enumerate(prompts):
            if len(p) > (limit + 1) * most:
                raise MoetoolError(f"prompt {i + 1} of {len(prompts)} is {len(p)} characters, more than {lm.path}'s "
                                   f"context of {limit} tokens can hold ({context_words(lm.model)}; no token of its "
                                   f"tokenizer spells more than {most} characters).")
    lengths = [_encode(lm, [p])[0].shape[1] for p in prompts]
    longest = max(lengths)
    if limit is not None and longest + max_new_tokens > limit:
        which = f"prompt {lengths.index(longest) + 1} of {len(prompts)}, " if len(prompts) > 1 else ""
        raise MoetoolError(f"the longest prompt ({which}{longest} tokens) plus --max-new-tokens {max_new_tokens} is "
                           f"{longest + max_new_tokens} tokens, more than {lm.path}'s context of {limit} "
                           f"({context_words(lm.model)}).")
    return longest + max_new_tokens


def _program(ready: Prepared, reason: str, asked: bool) -> Any:
    """The captured decode program of `ready`'s engine, or None after rebuilding the engine for the
    host path where the model or the policy cannot take it (the reason is recorded in the run).
    `asked`: --decode captured, which runs a model type the captured step is not checked on."""
    from moetool.engine.decode import DecodeProgram

    try:
        program = DecodeProgram(ready.engine, max_tokens=ready.max_tokens, host_budget=ready.host_budget,
                                unverified_ok=asked)
    except MoetoolError as e:
        build(ready, captured=False)
        ready.engine.decode_info = {"path": "host", "path_reason": f"the captured step fell back: {str(e).rstrip('.')}"}
        return None
    if not program.verified:
        reason += (f"; its tokens are not checked against transformers' for model type "
                   f"'{program.model_type or 'unknown'}'")
    ready.engine.decode_info = {"path": "captured", "path_reason": reason, **program.summary()}
    if ready.host_budget is not None and not program.mirrors.pinned:
        # A captured engine has no host tiers, and mirrors that are views pin nothing: the option was
        # given and nothing read it (on a CPU always), said rather than recorded as if it had bounded something.
        ready.engine.decode_info["host_budget_unread"] = (
            "--host-budget was not read: a captured engine keeps no host tiers, and its host mirrors here are "
            "views (of the mapped bundle, or of the in-memory store) that pin nothing")
    return program


def run(cfg: RunConfig, progress: Callable[[int, int], None] | None = None) -> Run:
    from moetool.engine.decode import choose_path

    cfg.check()
    prompts = list(cfg.prompts)
    batch = min(cfg.batch_size, len(prompts))
    path, reason = choose_path(cfg.decode, torch.device(cfg.device), batch, cfg.experts_impl)
    if path == "captured" and cfg.max_new_tokens < 2:  # compiled (minutes on a real model) and never run
        path, reason = "host", "one new token is the prefill's: there is no decode step to capture"
    ready = prepare(cfg, max_tokens=lambda lm: _sequence_tokens(lm, prompts, cfg.max_new_tokens), batch=batch,
                    captured=path == "captured")
    ready.engine.decode_info = {"path": "host", "path_reason": reason}
    if path == "captured" and ready.captured_refusal is not None:
        ready.engine.decode_info["path_reason"] = f"the captured step fell back: {ready.captured_refusal}"
        path = "host"
    program = _program(ready, reason, asked=cfg.decode == "captured") if path == "captured" else None
    lm = ready.lm
    tokens: list[list[int]] = []
    texts: list[str] = []
    notes: set[str] = set()  # what the model will not read of the prompts (`_unread`)
    bad = None  # the first prompt whose logits were not finite
    with torch.no_grad():
        for i, prompt in enumerate(prompts if program is not None else ()):
            ids, _ = _encode(lm, [prompt], notes)
            done = i * cfg.max_new_tokens
            row = program.generate(ids, cfg.max_new_tokens, progress=(lambda n, done=done: progress(
                done + n, len(prompts) * cfg.max_new_tokens)) if progress else None)
            tokens.append(row)
            texts.append(lm.tokenizer.decode(row, skip_special_tokens=True) if lm.tokenizer else "")
            if bad is None and bool(program.nonfinite):  # one read a prompt, after its decode
                bad = i
        if program is not None:
            ready.engine.decode_info.update(program.summary())
        for start in range(0, len(prompts) if program is None else 0, cfg.batch_size):
            batch = prompts[start:start + cfg.batch_size]
            ids, mask = _encode(lm, batch, notes)
            counter = _StepCounter(progress, start * cfg.max_new_tokens, len(batch), len(prompts) * cfg.max_new_tokens)
            out = lm.model.generate(ids.to(cfg.device), attention_mask=mask.to(cfg.device), do_sample=False,
                                    max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.max_new_tokens,
                                    pad_token_id=lm.tokenizer.pad_token_id if lm.tokenizer else 0,
                                    streamer=counter if progress else None,
                                    logits_processor=LogitsProcessorList([check := NonFiniteRows(len(batch), cfg.device)]))
            for row in out[:, ids.shape[1]:].tolist():
                tokens.append(row)
                texts.append(lm.tokenizer.decode(row, skip_special_tokens=True) if lm.tokenizer else "")
            if bad is None and bool(check.rows.any()):
                bad = start + int(check.rows.int().argmax())
    ready.engine.close()
    if bad is not None:
        raise MoetoolError(nonfinite_sentence(f"for prompt {bad + 1} of {len(prompts)}", lm.fingerprint.source))
    record = engine_record(ready)
    s = record["summary"]
    if notes:
        s["text_notes"] = sorted(notes)
    if getattr(lm.tokenizer, "chat_template", None):  # prompts are raw text, as lm-eval's default: recorded
        s["chat_template"] = "not applied"
    return Run(model=lm.fingerprint, inputs=ready.inputs, **record, ttft_s=s["ttft_s"], tpot_s=s["tpot_s"],
               hit_rate=s["hit_rate"], bytes_h2d=s["bytes_h2d"], bytes_per_token=s["bytes_per_token"],
               stall_s=s["stall_s"], prompts=prompts, tokens=tokens, texts=texts, batch_size=ready.batch)


__all__ = ["Prepared", "Run", "RunConfig", "BudgetSplit", "engine_record", "load", "prepare", "run"]

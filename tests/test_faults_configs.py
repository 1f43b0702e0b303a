"""config.json values that transformers reads without complaint but cannot run, and a model that
computes NaN: each is one sentence before any weight is read (or, for NaN, before any artifact is
written), where each gave a traceback after the model had loaded, or a run of meaningless tokens
with exit code 0. The controls named `..._still_runs` pass on valid neighbours of each fault."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from helpers import one_error_line
from moetool.cli import app
from moetool.inference import NonFiniteRows, not_finite
from tiny import save_tiny

runner = CliRunner()


def _cli(*args) -> object:
    return runner.invoke(app, [str(a) for a in args])


def _edited(src: Path, dst: Path, **fields) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


# ---- a router transformers itself cannot run -------------------------------------------------------

@pytest.fixture(scope="module")
def grouped_ckpt(tmp_path_factory):
    """A tiny DeepSeek-V3 of 4 routed experts a layer, in groups (n_group, topk_group) of the test's."""
    return save_tiny("deepseek_v3", tmp_path_factory.mktemp("grouped") / "m")


# DeepSeek-V3's router takes the top 2 scores of each group, views the experts as [n_group, E / n_group]
# and picks topk_group groups: each of these fails there on every input.
@pytest.mark.parametrize("n_group,topk_group,raised", [
    (4, 2, "selected index k out of range"),  # groups of one expert: top 2 of 1
    (3, 1, "is invalid for input of size"),  # 3 groups do not divide 4 experts
    (2, 3, "selected index k out of range"),  # 3 of 2 groups
])
def test_a_router_transformers_cannot_run_is_refused_before_any_weight_is_read(grouped_ckpt, tmp_path, n_group,
                                                                                topk_group, raised):
    bad = _edited(grouped_ckpt, tmp_path / "bad", n_group=n_group, topk_group=topk_group)
    for args in (("run", "--model", bad, "--max-new-tokens", "2", "--out", tmp_path / "r.json"),
                 ("quantize", bad, "--out", tmp_path / "b"), ("check", bad)):
        line = one_error_line(_cli(*args))
        assert "cannot route tokens" in line and raised in line, line
        assert f"n_group={n_group}" in line and f"topk_group={topk_group}" in line, line
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "b").exists()


def test_a_grouped_router_transformers_can_run_still_runs(grouped_ckpt, tmp_path):
    good = _edited(grouped_ckpt, tmp_path / "good", n_group=2, topk_group=1)  # 2 groups of 2, one kept
    result = _cli("run", "--model", good, "--max-new-tokens", "2", "--out", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert len(json.loads((tmp_path / "r.json").read_text())["tokens"][0]) == 2


@pytest.mark.parametrize("k", [1, 3])
def test_a_top_k_the_router_does_not_route_is_refused(tiny_ckpt, tmp_path, k):
    """PhiMoE's sparsemixer chooses 2 experts a token whatever `num_experts_per_tok` says: with 1, a
    DyMoE run recorded a critical share of 1.0 where 42% of its experts ran at high bits, and the
    captured step fell back on a raw shape error. Every stage refuses before a weight is read; 2 runs."""
    bad = _edited(tiny_ckpt("phimoe"), tmp_path / "bad", num_experts_per_tok=k)
    for args in (("run", "--model", bad, "--max-new-tokens", "2", "--out", tmp_path / "r.json"),
                 ("quantize", bad, "--out", tmp_path / "b")):
        line = one_error_line(_cli(*args))
        assert "(PhimoeTopKRouter) routes each token to 2 experts" in line and f"says {k}" in line, line
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "b").exists()
    good = _cli("run", "--model", tiny_ckpt("phimoe"), "--max-new-tokens", "2", "--out", tmp_path / "r.json")
    assert good.exit_code == 0, good.output


# ---- a dtype torch does not have ---------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("dtype", "float7"), ("dtype", "int8"), ("torch_dtype", "auto"),
                                         ("dtype", 5)])
def test_a_config_dtype_that_is_no_floating_point_torch_dtype_is_named(tiny_ckpt, tmp_path, field, value):
    bad = _edited(tiny_ckpt("qwen2_moe"), tmp_path / "bad", **{field: value})
    line = one_error_line(_cli("run", "--model", bad, "--max-new-tokens", "2"))
    assert f"{field} = {value!r}" in line and "bfloat16" in line, line


def test_a_config_dtype_torch_has_still_runs(tiny_ckpt, tmp_path):
    good = _edited(tiny_ckpt("qwen2_moe"), tmp_path / "good", dtype="bfloat16")
    assert _cli("run", "--model", good, "--max-new-tokens", "2").exit_code == 0


# ---- a model that computes NaN ------------------------------------------------------------------------

def test_not_finite_flags_nan_and_plus_inf_but_not_a_masked_token():
    logits = torch.zeros(1, 8)
    assert not bool(not_finite(logits.index_fill(-1, torch.tensor([3]), float("-inf"))))
    assert bool(not_finite(logits.index_fill(-1, torch.tensor([3]), float("nan"))))
    assert bool(not_finite(logits.index_fill(-1, torch.tensor([3]), float("inf"))))


def test_the_host_paths_check_marks_only_the_rows_that_were_not_finite():
    check = NonFiniteRows(3, "cpu")
    scores = torch.zeros(3, 5)
    scores[1, 2] = float("nan")
    assert check(torch.zeros(3, 1, dtype=torch.long), scores) is scores  # no score changed
    scores = torch.zeros(3, 5)
    scores[2, 0] = float("-inf")  # a processor's mask, not a fault
    check(None, scores)
    assert check.rows.tolist() == [False, True, False]


@pytest.mark.parametrize("decode", ["host", "captured"])
def test_a_model_that_computes_nan_is_one_sentence_and_no_artifact(tiny_ckpt, tmp_path, decode):
    # rms_norm_eps < 0: the norm takes the root of a negative number wherever a row's variance is below 1.
    bad = _edited(tiny_ckpt("qwen2_moe"), tmp_path / "bad", rms_norm_eps=-1.0)
    out = tmp_path / "r.json"
    line = one_error_line(_cli("run", "--model", bad, "--max-new-tokens", "3", "--decode", decode, "--out", out))
    assert "NaN or infinite logits for prompt 1 of 1" in line and "moetool check" in line, line
    assert not out.exists()
    line = one_error_line(_cli("check", bad))
    assert "plain transformers" in line and "NaN or infinite logits" in line, line


def test_a_model_that_computes_finite_logits_still_runs_on_both_paths(tiny_ckpt, tmp_path):
    for decode in ("host", "captured"):
        out = tmp_path / f"{decode}.json"
        result = _cli("run", "--model", tiny_ckpt("qwen2_moe"), "--max-new-tokens", "3", "--decode", decode,
                      "--out", out)
        assert result.exit_code == 0, result.output
        assert len(json.loads(out.read_text())["tokens"][0]) == 3


def test_an_eval_of_a_model_that_computes_nan_is_one_sentence_and_no_artifact(char_ckpt, tmp_path, monkeypatch):
    """ppl read nan, and lm-eval's acc took the argmax of NaN log-likelihoods (the first choice): both
    were written as results."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr("moetool.evaluate.hub_reachable", lambda: False)
    monkeypatch.setattr("moetool.eval_tasks.hub_reachable", lambda: False)
    bad = _edited(char_ckpt, tmp_path / "bad", rms_norm_eps=-1.0)
    out = tmp_path / "e.json"
    line = one_error_line(_cli("eval", "ppl", "--model", bad, "--limit", "64", "--out", out))
    assert "NaN or infinite logits in the window at token 0 of " in line, line
    data = tmp_path / "t.jsonl"
    data.write_text(json.dumps({"q": "The sky is", "choices": ["blue", "green"], "answer": 0}) + "\n")
    task = tmp_path / "t.yaml"
    task.write_text(f"task: t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
                    "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: choices\ndoc_to_target: answer\n"
                    "metric_list:\n  - metric: acc\n")
    line = one_error_line(_cli("eval", task, "--model", bad, "--out", out))
    assert "NaN or infinite logits scoring the request 'The sky is'" in line, line
    assert not out.exists()


@pytest.mark.parametrize("what", ["routing", "sensitivity"])
def test_a_profile_of_a_model_that_computes_nan_is_one_sentence_and_no_artifact(tiny_ckpt, tmp_path, what):
    """The routing of NaN hidden states was profiled (and fitted to) as any other; a sensitivity of nan
    against a base of nan ranked nothing."""
    bad = _edited(tiny_ckpt("qwen2_moe"), tmp_path / "bad", rms_norm_eps=-1.0)
    out = tmp_path / "p.json"
    traced = ("--data", "heldout", "--seqs", "1", "--seq-len", "12", "--decode-tokens", "2")  # what routing reads
    line = one_error_line(_cli("profile", "--model", bad, "--what", what, *(traced if what == "routing" else
                                                                           ("--ppl-tokens", "64")), "--out", out))
    assert "NaN or infinite logits" in line, line
    assert not out.exists()


def test_a_generation_of_a_model_that_computes_nan_is_one_sentence(char_ckpt, tmp_path, monkeypatch):
    """A generate_until task scored the text of NaN logits (whatever tokens the argmax gave) as an answer."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr("moetool.evaluate.hub_reachable", lambda: False)
    monkeypatch.setattr("moetool.eval_tasks.hub_reachable", lambda: False)
    bad = _edited(char_ckpt, tmp_path / "bad", rms_norm_eps=-1.0)
    data = tmp_path / "g.jsonl"
    data.write_text(json.dumps({"q": "The sky is", "target": "blue"}) + "\n")
    task = tmp_path / "g.yaml"
    task.write_text(f"task: g\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
                    "output_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: target\n"
                    "generation_kwargs:\n  max_gen_toks: 4\n  until: ['\\n']\n"
                    "metric_list:\n  - metric: exact_match\n")
    out = tmp_path / "e.json"
    line = one_error_line(_cli("eval", task, "--model", bad, "--out", out))
    assert "NaN or infinite logits generating an answer" in line, line
    assert not out.exists()
    good = _cli("eval", task, "--model", char_ckpt, "--out", out)  # the same task on a finite model
    assert good.exit_code == 0, good.output


def test_a_calibration_on_nan_hidden_states_is_one_sentence_and_no_bundle(char_ckpt, tmp_path):
    """HQQ's output error measured on NaN activations was written into the manifest as NaN."""
    bad = _edited(char_ckpt, tmp_path / "bad", rms_norm_eps=-1.0)
    line = one_error_line(_cli("quantize", bad, "--calibrate", "--calib-tokens", "256", "--out", tmp_path / "b"))
    assert "NaN or infinite numbers in the hidden states reaching MoE layer 0 on the calibration text" in line, line
    assert not (tmp_path / "b").exists()

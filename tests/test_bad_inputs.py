"""Mistakes a researcher makes by hand, each one sentence and exit code 1, nothing left half-written.

Found by feeding every subcommand bad input (a fuzzing pass over the CLI): special files as --out,
empty prompts, damaged artifacts inside a report's directory, a binary grid, negative knob counts,
a one-byte edit of a bundle's config.json, a refused quantize that left its directory behind, an
empty --bits, an unknown --hw for fit, a sweep whose every cell is refused, and a user's own figure
in a report's --out. Each test fails on the code before these fixes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from moetool.artifacts import atomic_write_bytes
from moetool.cli import app
from moetool.errors import MoetoolError, not_a_file, size_text
from moetool.policies import POLICIES
from moetool.policies.base import parse_params
from moetool.quant import quantize
from moetool.quant.bundle import Bundle
from test_cli import _one_error_line
from test_quant_bundle import config, tiny_moe
from test_reliability import VALID, write

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad-inputs")
    out = root / "bundle"
    quantize(config(tiny_moe(root / "model"), out, bits=(16, 4), calibrate=False, hqq_optimize=False))
    return out


def run_args(bundle: Path, *extra: str) -> list[str]:
    return ["run", "--bundle", str(bundle), "--budget", "100%", "--clock", "sim", "--max-new-tokens", "2", *extra]


# ---- outputs ----------------------------------------------------------------------------------------

def test_an_output_path_that_is_a_symlink_is_written_through_and_a_fifo_is_refused(tmp_path):
    target = tmp_path / "target.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    atomic_write_bytes(link, b"new")
    assert link.is_symlink() and target.read_text() == "new"  # the link survives, its file is replaced
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(MoetoolError, match="not a regular file"):
        atomic_write_bytes(fifo, b"x")
    assert fifo.exists() and not fifo.is_file()  # still the FIFO, not a file renamed over it
    with pytest.raises(MoetoolError, match="is a directory"):
        atomic_write_bytes(tmp_path, b"x")


def test_fit_into_a_special_file_is_one_sentence_and_leaves_it_alone(tmp_path):
    from test_fit import synthetic_profile

    profile = tmp_path / "p.profile.json"
    synthetic_profile().save(profile)
    fifo = tmp_path / "out.fit.json"
    os.mkfifo(fifo)
    line = _one_error_line(runner.invoke(app, ["fit", str(profile), "--out", str(fifo)]))
    assert "not a regular file" in line and not fifo.is_file()


# ---- prompts ----------------------------------------------------------------------------------------

def test_an_empty_prompt_is_refused_before_the_model_runs(tiny_bundle, tmp_path):
    line = _one_error_line(runner.invoke(app, run_args(tiny_bundle, "--prompt", "")))
    assert "prompt 1 of 1 is empty" in line  # it used to run the default prompt instead
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": "   "}\n')
    line = _one_error_line(runner.invoke(app, run_args(tiny_bundle, "--prompts", str(prompts))))
    assert "prompt 2 of 2 is empty" in line  # it used to crash inside transformers' attention


# ---- artifacts ------------------------------------------------------------------------------------

def test_a_damaged_artifact_found_in_a_report_directory_is_an_error_not_a_missing_row(tmp_path):
    art = tmp_path / "art"
    art.mkdir()
    write(art / "a.run.json", VALID["run"])
    (art / "b.run.json").write_text(json.dumps(VALID["run"])[:50])  # truncated by a full disk
    line = _one_error_line(runner.invoke(app, ["report", str(art), "--out", str(tmp_path / "rep")]))
    assert "b.run.json is not valid JSON" in line
    (art / "b.run.json").unlink()
    (art / "notes.json").write_text("{")  # not named like an artifact: still passed over
    assert runner.invoke(app, ["report", str(art), "--out", str(tmp_path / "rep")]).exit_code == 0


@pytest.mark.parametrize("field,value,says", [
    ("hit_rate", 5.0, "a share must lie in [0, 1]"),
    ("hit_rate", float("nan"), "a share must lie in [0, 1]"),
    ("ttft_s", float("nan"), "ttft_s is NaN"),
])
def test_impossible_values_in_an_artifact_are_refused_naming_the_field(field, value, says, tmp_path):
    doc = json.loads(json.dumps(VALID["run"]))
    doc[field] = value
    path = tmp_path / "x.run.json"
    path.write_text(json.dumps(doc))  # json writes NaN as the bare token NaN, which Python reads back
    line = _one_error_line(runner.invoke(app, ["report", str(path), "--out", str(tmp_path / "rep")]))
    assert says in line


def test_report_keeps_a_figure_of_the_users_own_in_its_out_directory(tmp_path):
    art = tmp_path / "art"
    art.mkdir()
    write(art / "a.run.json", VALID["run"])
    write(art / "p.profile.json", VALID["profile"])  # a profile draws figures
    rep = tmp_path / "rep"
    assert runner.invoke(app, ["report", str(art), "--out", str(rep)]).exit_code == 0
    figures = sorted(p.name for p in rep.glob("*.png"))
    assert figures  # its own figures: replaced freely on the next report
    assert runner.invoke(app, ["report", str(art), "--out", str(rep)]).exit_code == 0
    shutil.copy(rep / figures[0], rep / "my_notes.png")  # linked from no summary.md: the user's
    line = _one_error_line(runner.invoke(app, ["report", str(art), "--out", str(rep)]))
    assert "my_notes.png" in line and (rep / "my_notes.png").is_file()


# ---- bundles and quantize -------------------------------------------------------------------------

def test_a_same_size_edit_of_a_bundles_config_is_caught_when_it_opens(tiny_bundle, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(tiny_bundle, copy)
    cfg = copy / "model" / "config.json"
    text = cfg.read_text()
    edited = text.replace('"num_experts_per_tok": 2', '"num_experts_per_tok": 3')
    assert edited != text and len(edited) == len(text)
    cfg.write_text(edited)
    with pytest.raises(MoetoolError, match="config.json .* is corrupt"):
        Bundle.open(copy)  # the fast open: sizes for the shards, but small model files are hashed
    assert "is corrupt" in _one_error_line(runner.invoke(app, run_args(copy, "--prompt", "hi")))


def test_a_refused_quantize_leaves_no_directory_behind(tmp_path):
    model = tiny_moe(tmp_path / "m")  # no tokenizer: it cannot read calibration text
    text = tmp_path / "calib.txt"
    text.write_text("some text to calibrate on")
    out = tmp_path / "q"
    line = _one_error_line(runner.invoke(app, ["quantize", str(model), "--bits", "4", "--group-size", "16",
                                               "--calibrate", "--calib-text", str(text), "--out", str(out)]))
    assert "no tokenizer" in line and not out.exists()
    bad = tmp_path / "bad"  # a checkpoint whose expert weights do not fit its config
    shutil.copytree(model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": cfg["moe_intermediate_size"] * 2}))
    line = _one_error_line(runner.invoke(app, ["quantize", str(bad), "--bits", "4", "--group-size", "16",
                                               "--out", str(out)]))
    assert "do not fit" in line and not out.exists()


def test_an_empty_precision_list_is_refused(tmp_path):
    line = _one_error_line(runner.invoke(app, ["quantize", "demo", "--bits=", "--out", str(tmp_path / "q")]))
    assert "--bits takes one or more" in line and not (tmp_path / "q").exists()


# ---- knobs, hardware, grids -----------------------------------------------------------------------

@pytest.mark.parametrize("policy,key,value,says", [
    ("eap", "k", "-1", "cannot be negative"),
    ("fate", "L", "-1", "cannot be negative"),
    ("fate", "n", "-5", "cannot be negative"),
    ("smoe", "alpha", "nan", "must be a finite number"),
    ("lru", "bits", "x", "takes an int"),
])
def test_a_knob_out_of_range_is_refused_naming_it(policy, key, value, says):
    with pytest.raises(MoetoolError, match=says) as info:
        parse_params(POLICIES[policy], {key: value})
    assert f"'{key}'" in str(info.value)


def test_a_negative_sentinel_knob_stays_allowed():
    assert parse_params(POLICIES["dynaexq"], {"n_hi": "-1"}).n_hi == -1  # -1: "the most the budget holds"
    with pytest.raises(MoetoolError, match="cannot be negative"):
        parse_params(POLICIES["fate"], {}, fitted={"L": -3})  # a hand-edited fit file, not only --set


def test_fit_refuses_an_unknown_hardware_preset(tmp_path):
    from test_fit import synthetic_profile

    profile = tmp_path / "p.profile.json"
    synthetic_profile().save(profile)
    args = ["fit", str(profile), "--hw", "nosuch", "--out", str(tmp_path / "f.json")]
    line = _one_error_line(runner.invoke(app, args))
    assert "no hardware profile 'nosuch'" in line and not (tmp_path / "f.json").exists()


def test_a_binary_grid_file_is_one_sentence(tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_bytes(bytes(range(128, 256)))
    line = _one_error_line(runner.invoke(app, ["sweep", str(grid), "--workers", "0", "--out", str(tmp_path / "o")]))
    assert "is not UTF-8 text" in line


def test_a_sweep_whose_every_cell_is_refused_exits_1(tiny_bundle, tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text(yaml.safe_dump({"bundle": str(tiny_bundle), "stage": "run", "clock": "sim", "prompts": [""],
                                    "max_new_tokens": 2, "grid": {"policy": ["lru", "lod"]}}))
    result = runner.invoke(app, ["sweep", str(grid), "--workers", "0", "--out", str(tmp_path / "o")])
    assert result.exit_code == 1 and "all 2 cells were refused" in result.stderr
    assert "prompt 1 of 1 is empty" in result.stderr


# ---- the sentences themselves ---------------------------------------------------------------------

def test_sizes_read_in_the_unit_that_shows_them_and_paths_say_what_they_are(tmp_path):
    assert size_text(18 * 2**10) == "18.0 KiB" and size_text(3 * 2**20) == "3.0 MiB" and size_text(12) == "12 B"
    assert size_text(5 * 2**30) == "5.0 GiB"
    assert str(not_a_file(tmp_path / "nope", "--data")).endswith("does not exist.")
    assert "is a directory; give a file" in str(not_a_file(tmp_path, "--data"))


def test_a_byte_order_mark_is_not_text_or_json(tmp_path):
    from moetool.datasets import read_prompts, read_text_file

    text = tmp_path / "t.txt"
    text.write_bytes("\ufeffHello".encode())
    assert read_text_file(text, "--data") == "Hello"
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes('\ufeff{"prompt": "Hi"}\n'.encode())
    assert read_prompts(prompts) == ("Hi",)  # it was refused as "line 1 is not JSON"


def test_a_sweep_never_writes_its_cells_into_a_bundle(tiny_bundle, tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text(yaml.safe_dump({"bundle": str(tiny_bundle), "stage": "run", "clock": "sim", "prompts": ["hi"],
                                    "max_new_tokens": 2, "grid": {"policy": ["lru"]}}))
    before = sorted(p.name for p in tiny_bundle.iterdir())
    line = _one_error_line(runner.invoke(app, ["sweep", str(grid), "--workers", "0", "--out", str(tiny_bundle)]))
    assert "holds a bundle" in line and sorted(p.name for p in tiny_bundle.iterdir()) == before


def test_a_manifest_naming_another_model_type_than_its_config_is_refused(tiny_bundle, tmp_path):
    from test_reliability import manifest, rewrite

    copy = tmp_path / "b"
    shutil.copytree(tiny_bundle, copy)
    doc = manifest(copy)
    doc["model"]["model_type"] = "mixtral"  # checksum recomputed: only the disagreement can catch it
    rewrite(copy, doc)
    with pytest.raises(MoetoolError, match="says the model is a 'mixtral' but its model/config.json says 'qwen2_moe'"):
        Bundle.open(copy)

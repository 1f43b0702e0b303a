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
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from moetool.artifacts import atomic_write_bytes
from moetool.cli import app
from moetool.errors import MoetoolError, not_a_file, size_text
from moetool.policies import POLICIES
from moetool.policies.base import parse_params
from moetool.quant import quantize
from moetool.quant.bundle import Bundle
from helpers import VALID, tiny_moe
from helpers import one_error_line as _one_error_line
from helpers import quantize_config as config
from helpers import write_json as write

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
    from helpers import synthetic_profile

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
    assert "prompt 2 of 2 is only whitespace" in line  # it used to crash inside transformers' attention


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


@pytest.mark.parametrize("given,says", [
    (["--calib-tokens", "512"], "--calib-tokens feeds calibration"),
    (["--calib-text", "TEXT"], "--calib-text feeds calibration"),
    (["--calib-text", "TEXT", "--calib-tokens", "2048"], "--calib-text and --calib-tokens feed calibration"),
])
def test_calibration_options_without_calibration_are_refused(tmp_path, given, says):
    """HQQ reads no activations unless --calibrate asks for its output error: --calib-tokens was ignored
    without a word, and --calib-text turned calibration on unasked (a run many times longer)."""
    text = tmp_path / "calib.txt"
    text.write_text("some text to calibrate on")
    out = tmp_path / "q"
    args = [str(text) if a == "TEXT" else a for a in given]
    line = _one_error_line(runner.invoke(app, ["quantize", str(tiny_moe(tmp_path / "m")), "--bits", "4", *args,
                                               "--out", str(out)]))
    assert line == f"error: {says}, which HQQ runs only with --calibrate (to measure its output error); add " \
                   "--calibrate, or --method gptq.", line
    assert not out.exists()


@pytest.mark.parametrize("args,says", [
    (["--bits", "16,4", "--no-reference"], "--no-reference leaves the bf16 reference (16 bits) out, and --bits names "
                                           "16; give one of them."),
    (["--bits", "16", "--group-size", "8", "--no-hqq-optimize"],
     "--group-size and --no-hqq-optimize are read only with a low-bit precision in --bits, so they change nothing here; "
     "leave them out, or add 8, 4 or 2 to --bits."),
])
def test_quantize_options_that_change_nothing_are_refused(tmp_path, args, says):
    """Each wrote a bundle whose settings recorded the option (`group_size: 8`, or 16 bits beside
    --no-reference) though nothing read it."""
    out = tmp_path / "q"
    line = _one_error_line(runner.invoke(app, ["quantize", str(tiny_moe(tmp_path / "m")), *args, "--out", str(out)]))
    assert says in line, line
    assert not out.exists()


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
    ("lru", "bits", "1_6", "takes an int, not '1_6'"),  # Python's digit grouping read it as 16
    ("smoe", "alpha", "0_3", "takes a float"),
])
def test_a_knob_out_of_range_is_refused_naming_it(policy, key, value, says):
    with pytest.raises(MoetoolError, match=says) as info:
        parse_params(POLICIES[policy], {key: value})
    assert f"'{key}'" in str(info.value)


@pytest.mark.parametrize("policy,key,value,most", [("fate", "L", "7", 6), ("fate", "n", "9", 8), ("eap", "k", "100", 8)])
def test_a_count_knob_beyond_the_model_is_refused_not_clamped(policy, key, value, most):
    from policy_fakes import make_ctx

    from moetool.policies import make_policy

    ctx = make_ctx(layers=range(6), E=8, cache_bytes=6000)
    with pytest.raises(MoetoolError, match=f"knob '{key}' of policy '{policy}' is {value}, but the model has {most}"):
        make_policy(policy, {key: value}, ctx)
    make_policy(policy, {key: str(most)}, ctx)  # the largest meaningful value runs
    # The paper's default (Fate's L = 3) still runs on a model with fewer layers: it caches them all.
    fate = make_policy("fate", {}, make_ctx(layers=(0, 1), cache_bytes=100_000))
    assert fate.quota == {0: 8, 1: 8}
    assert fate.describe()["L"] == 2  # and records the L it ran with: the run's params said L = 3
    with pytest.raises(MoetoolError, match="knob 'L' of policy 'fate' is 3, but the model has 2 MoE layers"):
        make_policy("fate", {"L": "3"}, make_ctx(layers=(0, 1), cache_bytes=100_000))  # asked for: not clamped


def test_a_default_clamped_to_the_model_is_recorded_and_said(tiny_bundle, tmp_path):
    """Fate's L = 3 on a two-layer model ran as L = 2 and recorded only L = 2: the run could not be told
    from one given `--set L=2`, and nothing was said."""
    out = tmp_path / "f.run.json"
    result = runner.invoke(app, run_args(tiny_bundle, "--policy", "fate", "--set", "p=0", "--prompt", "Hi", "--out", str(out)))
    assert result.exit_code == 0, result.output
    art = json.loads(out.read_text())
    layers = len(art["layers"])
    assert art["params"]["L"] == layers < 3
    assert art["summary"]["clamped"] == {"L": f"knob 'L' of policy 'fate' is 3, but the model has {layers} MoE layers."}
    assert f"note: knob 'L' of policy 'fate' is 3, but the model has {layers} MoE layers: its default ran clamped" \
        in result.stderr
    given = tmp_path / "g.run.json"
    result = runner.invoke(app, run_args(tiny_bundle, "--policy", "fate", "--set", "p=0", "--set", f"L={layers}", "--prompt", "Hi",
                                         "--out", str(given)))
    assert result.exit_code == 0 and "clamped" not in json.loads(given.read_text())["summary"]


def test_a_negative_sentinel_knob_stays_allowed():
    assert parse_params(POLICIES["dynaexq"], {"n_hi": "-1"}).n_hi == -1  # -1: "the most the budget holds"
    with pytest.raises(MoetoolError, match="cannot be negative"):
        parse_params(POLICIES["fate"], {}, fitted={"L": -3})  # a hand-edited fit file, not only --set


def test_fit_refuses_an_unknown_hardware_preset(tmp_path):
    from helpers import synthetic_profile

    profile = tmp_path / "p.profile.json"
    synthetic_profile().save(profile)
    args = ["fit", str(profile), "--hw", "nosuch", "--out", str(tmp_path / "f.json")]
    line = _one_error_line(runner.invoke(app, args))
    assert "no hardware profile 'nosuch'" in line and not (tmp_path / "f.json").exists()


@pytest.mark.parametrize("args,says", [
    (["fit", "PROFILE", "--alphas", "0.1,0.2"], "--alphas is read only with --sweep, so it changes nothing here; "
                                                "leave it out, or add --sweep."),
    (["fit", "PROFILE", "--hw", "h200", "--sweep-budget", "10%", "--device", "cpu"],
     "--hw, --sweep-budget and --device are read only with --sweep, so they change nothing here; leave them out, "
     "or add --sweep."),
    (["fit", "PROFILE", "--target-tpot", "3ms"], "--target-tpot is read only with smoe runs, so it changes nothing "
                                                 "here; leave it out, or add --sweep or --runs."),
    (["eval", "bigbench-mc", "--bundle", "BUNDLE", "--context", "3"], "--data, --stepwise and --context are for ppl, "
                                                                       "not lm-eval tasks."),
    (["profile", "--bundle", "BUNDLE", "--what", "routing", "--bits", "4"],
     "--bits is read only with --what sensitivity, so it changes nothing here; leave it out, or add sensitivity to --what."),
    (["profile", "--bundle", "BUNDLE", "--what", "sensitivity", "--data", "heldout", "--seqs", "2"],
     "--seqs and --data are read only with --what routing, similarity or prefetch"),
    (["profile", "--bundle", "BUNDLE", "--what", "timing", "--decode-tokens", "3"],
     "--decode-tokens is read only with --what routing, similarity or prefetch"),
    (["profile", "--bundle", "BUNDLE", "--what", "routing", "--hw-base", "h200"], "--hw-base is read only with --what timing"),
    (["sweep", "GRID", "--workers", "0", "--cpus-per-cell", "2"], "--cpus-per-cell is read only with Ray (--workers "
                                                                  "other than 0), so it changes nothing here; leave it "
                                                                  "out, or drop --workers 0."),
    (["sweep", "GRID", "--address", "localhost:6379", "--workers", "4"], "--workers is read only with the local Ray"),
])
def test_an_option_given_where_its_mode_is_off_is_refused(tiny_bundle, tmp_path, args, says):
    """Each ran with exit code 0 and wrote an artifact that recorded the option (a profile even listed
    --data as its input), while nothing read it: `fit --alphas` without --sweep, `eval TASK --context`,
    `profile --what routing --bits 4`, `sweep --workers 0 --cpus-per-cell 2`."""
    from helpers import synthetic_profile

    profile = synthetic_profile().save(tmp_path / "p.profile.json")
    grid = tmp_path / "g.yaml"
    grid.write_text("stage: run\ngrid:\n  policy: [lru]\n")
    out = tmp_path / "o"
    where = {"PROFILE": str(profile), "BUNDLE": str(tiny_bundle), "GRID": str(grid)}
    line = _one_error_line(runner.invoke(app, [*(where.get(a, a) for a in args), "--out", str(out)]))
    assert says in line, line
    assert not out.exists()


def test_a_binary_grid_file_is_one_sentence(tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_bytes(bytes(range(128, 256)))
    line = _one_error_line(runner.invoke(app, ["sweep", str(grid), "--workers", "0", "--out", str(tmp_path / "o")]))
    assert "is not UTF-8 text" in line


def test_a_sweep_whose_cells_no_model_could_run_is_refused_before_any_cell(tiny_bundle, tmp_path):
    """An empty prompt is wrong whatever the model: the sweep is refused in one sentence naming a
    cell, before any runs or its output exists (a refusal that depends on the model, an impossible
    budget, is a cell's recorded result instead: test_sweep.py)."""
    grid = tmp_path / "g.yaml"
    grid.write_text(yaml.safe_dump({"bundle": str(tiny_bundle), "stage": "run", "clock": "sim", "prompts": [""],
                                    "max_new_tokens": 2, "grid": {"policy": ["lru", "lod"]}}))
    line = _one_error_line(runner.invoke(app, ["sweep", str(grid), "--workers", "0", "--out", str(tmp_path / "o")]))
    assert line.startswith("error: cell lru: ") and "prompt 1 of 1 is empty" in line
    assert not (tmp_path / "o").exists()


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
    from helpers import manifest, rewrite

    copy = tmp_path / "b"
    shutil.copytree(tiny_bundle, copy)
    doc = manifest(copy)
    doc["model"]["model_type"] = "mixtral"  # checksum recomputed: only the disagreement can catch it
    rewrite(copy, doc)
    with pytest.raises(MoetoolError, match="says the model is a 'mixtral' but its model/config.json says 'qwen2_moe'"):
        Bundle.open(copy)


# ---- a second fuzzing pass --------------------------------------------------------------------------
# Each of these failed on the code before it: a traceback, exit code 0 with a wrong result, an input
# overwritten, or a sentence naming the wrong cause.

def test_a_failed_check_is_its_verdict_and_exit_code_1_not_a_bug_report(tiny_ckpt, monkeypatch):
    import dataclasses

    import moetool.check

    real = moetool.check.check_model
    monkeypatch.setattr(moetool.check, "check_model", lambda *a: dataclasses.replace(real(*a), passed=False))
    result = runner.invoke(app, ["check", str(tiny_ckpt("qwen2_moe"))])
    assert result.exit_code == 1 and "FAIL" in result.output
    assert "Traceback" not in result.output and "bug in moetool" not in result.output


@pytest.mark.parametrize("knob,value,says", [
    ("L", 1.5, "takes an int, not 1.5"), ("L", True, "takes an int, not true"), ("L", None, "takes an int, not null"),
    ("L", [1], "takes an int, not [1]"), ("p", None, "takes a float, not null"), ("cache_bits", 4.0, "takes an int"),
    ("eviction", 3, "takes a str, not 3"),
])
def test_a_fit_artifacts_knob_of_the_wrong_type_is_one_sentence(knob, value, says):
    with pytest.raises(MoetoolError, match=says.replace("[", r"\[").replace("]", r"\]")):
        parse_params(POLICIES["fate"], {}, {knob: value})
    assert parse_params(POLICIES["fate"], {}, {"p": 1}).p == 1.0  # JSON's 1 for a float knob is fine


@pytest.mark.parametrize("policy,settings,says", [
    ("smoe", {"eviction": "lru", "window": "9"}, "--set window=9 changes nothing with eviction=lru"),
    ("smoe", {"cpu_assist": "false", "cpu_rule": "eq4"}, "--set cpu_rule=eq4 changes nothing with cpu_assist=false"),
    ("fate", {"prefetcher": "none", "n": "7"}, "--set n=7 changes nothing with prefetcher=none"),
    ("fate", {"prefetcher": "none", "percentile": "0.1"}, "--set percentile=0.1 changes nothing with prefetcher=none"),
    ("dymoe", {"r": "0.9", "lam": "1"}, "--set r=0.9 changes nothing with lam=1.0"),
])
def test_a_knob_the_policy_does_not_read_beside_another_is_refused(tiny_bundle, policy, settings, says):
    """Each ran with the knob recorded in its params and the same tokens, hits and bytes as without it."""
    with pytest.raises(MoetoolError, match=re.escape(says)):
        parse_params(POLICIES[policy], settings)
    args = [a for k, v in settings.items() for a in ("--set", f"{k}={v}")]
    line = _one_error_line(runner.invoke(app, run_args(tiny_bundle, "--policy", policy, "--prompt", "Hi", *args)))
    assert says in line and line.endswith("out, or change " + line.split(" with ")[1].split("=")[0] + "."), line
    kept = {k: v for k, v in settings.items() if k not in ("window", "cpu_rule", "n", "percentile", "r")}
    parse_params(POLICIES[policy], kept)  # the other knob alone is fine, and so is the knob where it is read
    parse_params(POLICIES[policy], {k: v for k, v in settings.items() if k not in kept})


def test_a_run_with_a_fit_that_names_a_knob_the_policy_lacks_is_one_sentence(tiny_bundle, tmp_path):
    """A hand edit's misspelt knob (`alpah`) was passed over, and the default ran without a word."""
    model = json.loads((tiny_bundle / "bundle.json").read_text())["model"]
    fit = write(tmp_path / "f.fit.json", {**VALID["fit"], "model": model, "params": {"smoe": {"alpah": 0.1}}})
    line = _one_error_line(runner.invoke(app, run_args(tiny_bundle, "--policy", "smoe", "--fit", str(fit))))
    assert "params['smoe'] names 'alpah', which is no knob of policy 'smoe'" in line, line


def test_a_run_with_a_fit_that_fitted_nothing_for_its_policy_says_so(tiny_bundle, tmp_path):
    """smoe ran on its defaults with the fit recorded as an input, where the fit had said alpha was not fitted."""
    model = json.loads((tiny_bundle / "bundle.json").read_text())["model"]
    fit = write(tmp_path / "f.fit.json", {**VALID["fit"], "model": model, "params": {"fate": {"L": 1}},
                                          "evidence": {"skipped": {"smoe.alpha": "needs smoe runs"}}})
    result = runner.invoke(app, run_args(tiny_bundle, "--policy", "smoe", "--fit", str(fit)))
    assert result.exit_code == 0, result.output
    notes = [ln for ln in result.stderr.splitlines() if ln.startswith("note:")]
    assert notes == [f"note: {fit} holds no fitted knob of policy 'smoe' (it says smoe.alpha: needs smoe runs); it "
                     "runs on its defaults."], result.stderr
    result = runner.invoke(app, run_args(tiny_bundle, "--policy", "lru", "--fit", str(fit)))  # lru fits nothing
    assert result.exit_code == 0 and "note: policy 'lru' has no fitted knobs (no paper's fit is its), so --fit changes " \
                                     "nothing for it." in result.stderr, result.stderr


def test_a_fitted_n_hi_sized_for_another_budget_or_tiers_is_not_taken_and_the_run_says_so(tiny_bundle, tmp_path):
    """DynaExq's n_hi (§3.1) is sized for the fit's --budget and tiers. A run at another budget took it as
    it was: too few high-precision experts for a larger budget, without a word. It now derives n_hi from
    its own budget (the default, n_hi < 0), records what it dropped and why, and says so."""
    model = json.loads((tiny_bundle / "bundle.json").read_text())["model"]
    sized = {"budget": "75%", "cache_bytes": 1000, "knobs": {"b_hi": 16, "b_lo": 4}}
    fit = write(tmp_path / "f.fit.json", {**VALID["fit"], "model": model, "params": {"dynaexq": {"n_hi": 0}},
                                          "evidence": {"dynaexq": {"n_hi": {"value": 0, "sized_for": sized}}}})

    def ran(*extra: str) -> tuple[dict, list[str]]:
        out = tmp_path / "r.run.json"
        result = runner.invoke(app, [*run_args(tiny_bundle, "--policy", "dynaexq", "--fit", str(fit), "--prompt", "Hi",
                                               "--out", str(out)), *extra])
        assert result.exit_code == 0, result.output
        return json.loads(out.read_text()), [ln for ln in result.stderr.splitlines() if ln.startswith("note:")]

    art, notes = ran()  # run_args' --budget 100%
    assert art["params"]["n_hi"] == -1 and art["summary"]["fit_dropped"] == {
        "n_hi": "sized for --budget 75%, and this run has --budget 100%"}
    assert notes == [f"note: {fit} fitted for policy 'dynaexq': n_hi (sized for --budget 75%, and this run has --budget "
                     "100%); this run takes the policy's default for it (`moetool fit --budget` fits for this "
                     "run's budget)."], notes
    art, notes = ran("--budget", "75.0%")  # the fit's budget, spelled otherwise: taken
    assert art["params"]["n_hi"] == 0 and "fit_dropped" not in art["summary"] and notes == []
    art, notes = ran("--budget", "75%", "--set", "n_hi=1")  # --set is the user's, not the fit's
    assert art["params"]["n_hi"] == 1 and notes == []
    # a sweep over budgets with one fit: the cells record it, and the sweep says so once
    grid = tmp_path / "g.yaml"
    grid.write_text(f"stage: run\nbundle: {tiny_bundle}\nclock: sim\nmax_new_tokens: 2\nprompts: [Hi]\n"
                    "grid:\n  policy: [dynaexq]\n  budget: ['75%', '100%']\n")
    done = runner.invoke(app, ["sweep", str(grid), "--fit", str(fit), "--workers", "0", "--out", str(tmp_path / "sw")])
    assert done.exit_code == 0, done.output
    notes = [ln for ln in done.stderr.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith("note: 1 cell(s) ran their policy's default for fitted knobs that "
                                                            "do not hold there"), notes


def test_a_fitted_knob_recorded_without_what_it_was_sized_for_is_not_taken(tiny_bundle, tmp_path):
    """A fit written before fits recorded "sized_for" (or edited without it): its DynaExq n_hi ran at any
    budget unsaid, where the same numbers fitted now were dropped at another. It cannot be checked, so the
    run takes the default and says why; a DyMoE r given with --r is recorded as holding anywhere."""
    model = json.loads((tiny_bundle / "bundle.json").read_text())["model"]
    fit = write(tmp_path / "old.fit.json", {**VALID["fit"], "model": model, "params": {"dynaexq": {"n_hi": 0}},
                                            "evidence": {"dynaexq": {"n_hi": {"value": 0, "from": "--budget 50%"}}}})
    out = tmp_path / "r.run.json"
    result = runner.invoke(app, [*run_args(tiny_bundle, "--policy", "dynaexq", "--fit", str(fit), "--prompt", "Hi",
                                           "--out", str(out))])
    assert result.exit_code == 0, result.output
    art = json.loads(out.read_text())
    assert art["params"]["n_hi"] == -1 and art["summary"]["fit_dropped"]["n_hi"].startswith(
        "recorded without what it was sized for (budget, tiers, machine)"), art["summary"]
    assert "note:" in result.stderr and "re-run moetool fit" in result.stderr, result.stderr


def test_a_fitted_smoe_alpha_from_runs_with_another_cache_is_not_taken(tiny_bundle, tmp_path):
    """An alpha fitted through given runs records their expert cache (a Run records bytes, not --budget): a
    run whose cache differs takes the paper's alpha, records why and says so; one with the same cache takes it."""
    model = json.loads((tiny_bundle / "bundle.json").read_text())["model"]
    curve = {"points": [[0.0, 0.1, "a.run.json"], [0.2, 0.08, "b.run.json"]], "grid": [0.0, 0.2], "predicted": [0.1, 0.08],
             "degree": 1}

    def ran(cache: int) -> dict:
        fit = write(tmp_path / "f.fit.json", {**VALID["fit"], "model": model, "params": {"smoe": {"alpha": 0.05}},
                                              "evidence": {"smoe": {"alpha": {**curve, "sized_for": {"cache_bytes": cache}}}}})
        out = tmp_path / "r.run.json"
        result = runner.invoke(app, [*run_args(tiny_bundle, "--policy", "smoe", "--fit", str(fit), "--prompt", "Hi",
                                               "--out", str(out))])
        assert result.exit_code == 0, result.output
        return json.loads(out.read_text()), result.stderr

    art, said = ran(1000)
    cache = art["budget"]["cache_bytes"]
    assert art["params"]["alpha"] == 0.3 and art["summary"]["fit_dropped"] == {
        "alpha": f"sized for the expert cache of the runs it was fitted from, 1000 B, and this run's is {size_text(cache)}"}
    assert "note:" in said and "alpha" in said
    art, said = ran(cache)
    assert art["params"]["alpha"] == 0.05 and "fit_dropped" not in art["summary"] and "note:" not in said


def test_a_fitted_dymoe_r_for_other_tiers_is_dropped_with_its_lam():
    """DyMoE's r fitted from a budget assumed 4/2's bytes; `config=4/0` keeps no low tier, so the budget
    holds another r, and lam (solved from r) goes with it. An r the user asked for (`--r`) has no sizing."""
    from moetool.policies.knobs import Sizing, stale_fitted

    cls = POLICIES["dymoe"]
    sizing = {"r": Sizing("25%", 1000, {"high_bits": 4, "low_bits": 2})}
    fitted = {"r": 0.6, "lam": 0.2}
    drops = stale_fitted(cls, {"config": "4/0"}, fitted, sizing, lambda b: b == "25%", "25%")
    assert drops == {"r": "sized for low_bits=2, and this run has low_bits=0",
                     "lam": "derived from the fit's r, which this run does not take"}
    assert stale_fitted(cls, {"config": "4/2"}, fitted, sizing, lambda b: b == "25%", "25%") == {}
    assert stale_fitted(cls, {"low_bits": "0", "r": "0.9"}, fitted, sizing, lambda b: b == "25%", "25%") == {}
    assert set(stale_fitted(cls, {}, fitted, sizing, lambda b: False, "40%")) == {"r", "lam"}
    # a fit without sizing (written before fits recorded it) cannot be checked: dropped, lam with r
    assert set(stale_fitted(cls, {}, fitted, {}, lambda b: False, "40%")) == {"r", "lam"}
    assert stale_fitted(cls, {}, fitted, {"r": Sizing()}, lambda b: False, "40%") == {}  # --r's: holds anywhere


POINTS = [[0.0, 0.01, "runs"], [0.2, 0.008, "runs"]]


def test_hw_on_the_wall_clock_says_what_it_does(tiny_bundle):
    """`run --hw h100sxm` on the wall clock recorded `hw: null` and printed CPU times under "(wall clock)":
    nothing said that --hw had simulated nothing."""
    result = runner.invoke(app, [*run_args(tiny_bundle, "--policy", "lru", "--prompt", "Hi"), "--clock", "wall",
                                 "--hw", "h100sxm"])
    assert result.exit_code == 0, result.output
    notes = [ln for ln in result.stderr.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith("note: --hw h100sxm on the wall clock times nothing"), notes
    quiet = runner.invoke(app, [*run_args(tiny_bundle, "--policy", "lru", "--prompt", "Hi"), "--hw", "h100sxm"])
    assert quiet.exit_code == 0 and "note:" not in quiet.stderr, quiet.stderr  # the sim clock: --hw is its machine


@pytest.mark.parametrize("evidence,says", [
    ({"warnings": 5}, "evidence.warnings must be a list"),
    ({"warnings": "abc"}, "evidence.warnings must be a list"),  # drawn as three warnings, a, b and c
    ({"skipped": ["x"]}, "evidence.skipped must be an object"),
    ({"smoe": {"alpha": "x"}}, "evidence['smoe']['alpha'] must be an object"),
    ({"dynaexq": {"n_hi": {"sized_for": {"budget": "25%", "cache_bytes": "x", "knobs": {}}}}},
     "evidence['dynaexq']['n_hi']['sized_for'].cache_bytes must be an integer"),
    ({"smoe": {"alpha": {"points": [[0.1]], "grid": [0.0], "predicted": [0.01], "degree": 1}}},
     "evidence['smoe']['alpha'].points[0] must be a list of 3 values"),
    ({"smoe": {"alpha": {"points": POINTS, "grid": [0.0, 0.1], "predicted": [0.01], "degree": 1}}},
     "evidence['smoe']['alpha'].predicted holds T(alpha) at 1 alphas, not one per grid alpha (2)"),
    ({"smoe": {"alpha": {"points": POINTS, "grid": [0.0], "predicted": [0.01], "degree": 1, "target_tpot": "fast"}}},
     "target_tpot must be a number"),
    ({"smoe": {"alpha": {"points": POINTS, "grid": [0.0], "predicted": [0.01], "degree": 1, "alpha": float("nan")}}},
     "is nan; a fitted number is finite"),
    ({"dymoe": {"lam": {"value": 0.5, "r": 0.75, "M": 2, "schedule": [{"position": 0}]}}},
     "missing evidence['dymoe']['lam'].schedule[0].r"),
])
def test_a_fit_whose_evidence_report_draws_is_not_as_fit_writes_it_is_one_sentence(evidence, says, tmp_path):
    """Each was a traceback in report's drawing (TypeError, IndexError, matplotlib's ValueError, KeyError)."""
    fit = write(tmp_path / "x.fit.json", {**VALID["fit"], "evidence": evidence})
    line = _one_error_line(runner.invoke(app, ["report", str(fit), "--out", str(tmp_path / "rep")]))
    assert says in line, line
    assert not (tmp_path / "rep").exists()


@pytest.mark.parametrize("edit,says", [
    (lambda d: d.update(stage="train"), "stage is 'train', not one of run, eval"),
    (lambda d: d["cells"]["lru"].update(status="exploded"), ".status is 'exploded'"),
    (lambda d: d["cells"]["lru"].update(artifact="../../etc/passwd"), "not a file name in the sweep directory"),
    (lambda d: d["cells"]["lru"].update(status="refused", reason="two\nlines"), ".reason is not one line of text"),
])
def test_a_sweep_index_report_draws_is_read_as_sweep_writes_it(edit, says, tmp_path):
    """Each was drawn into the report's table as it was (a reason's newline broke the table)."""
    doc = json.loads(json.dumps(VALID["sweep"]))
    edit(doc)
    index = write(tmp_path / "sweep.json", doc)
    assert says in _one_error_line(runner.invoke(app, ["report", str(index), "--out", str(tmp_path / "rep")]))


def test_a_run_with_a_fit_whose_knob_is_the_wrong_type_is_one_sentence(tiny_bundle, tmp_path):
    model = json.loads((tiny_bundle / "bundle.json").read_text())["model"]  # a fit made for this model
    fit = write(tmp_path / "f.fit.json", {**VALID["fit"], "model": model, "params": {"fate": {"L": 1.5}}})
    line = _one_error_line(runner.invoke(app, run_args(tiny_bundle, "--policy", "fate", "--fit", str(fit))))
    assert "knob 'L' of policy 'fate' takes an int, not 1.5" in line


@pytest.mark.parametrize("edit,says", [
    (lambda d: d["tpot_s"].pop("mean"), "tpot_s['mean']"),
    (lambda d: d["tpot_s"].update(mean=float("inf")), "tpot_s['mean']"),
    (lambda d: d["tpot_s"].update(p99=-1.0), "tpot_s['p99']"),
    (lambda d: d.update(policy="smoe", params={"alpha": 5}), "alpha must be in [0, 1)"),
    (lambda d: d.update(policy="smoe", params={"alpha": "abc"}), "takes a float"),
    # What a hand edit made that no run writes; each was read and used (a helper's pass).
    (lambda d: d["tpot_s"].update(n=0), "tpot_s['n'] is 0; it counts the decode steps timed"),
    (lambda d: d["tpot_s"].update(n=2.5), "tpot_s['n'] is 2.5"),
    (lambda d: d.update(layers={"0": {"hit_rate": 5.0}}), "layers['0']['hit_rate']"),
    (lambda d: d.update(layers={"0": {"stall_s": float("nan")}}), "layers['0']['stall_s'] is nan"),
    (lambda d: d.update(clock="banana"), "clock is 'banana', not one of wall, sim"),
    (lambda d: d.update(device="tpu"), "device is 'tpu', not a device moetool runs on"),
    (lambda d: d.update(dtype="int3"), "dtype is 'int3'"),
    (lambda d: d.update(summary={"tpot_s": {**d["tpot_s"], "mean": 10.0}}),
     "but summary['tpot_s'] is {'mean': 10.0"),  # report's table showed one, fit and report's figures the other
])
def test_a_run_artifact_fit_and_report_cannot_use_is_refused_on_read(edit, says, tmp_path):
    from helpers import synthetic_profile

    doc = json.loads(json.dumps(VALID["run"]))
    edit(doc)
    run = write(tmp_path / "x.run.json", doc)
    profile = tmp_path / "p.profile.json"
    synthetic_profile().save(profile)
    for args in (["report", str(run), "--out", str(tmp_path / "rep")],
                 ["fit", str(profile), str(run), "--target-tpot", "1ms", "--out", str(tmp_path / "f.fit.json")]):
        assert says in _one_error_line(runner.invoke(app, args))
    assert not (tmp_path / "f.fit.json").exists()


def test_an_artifact_that_gives_a_key_twice_is_refused_not_read_as_its_last(tmp_path):
    """json keeps a repeated key's last value: a run with "policy" twice was read as whichever came last."""
    text = json.dumps(VALID["run"])
    run = tmp_path / "x.run.json"
    run.write_text(text.replace('"policy": ', '"policy": "smoe", "policy": ', 1))
    line = _one_error_line(runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "rep")]))
    assert line.endswith("gives the key 'policy' twice in one object; it is not one moetool wrote (keep one of them)."), \
        line
    assert not (tmp_path / "rep").exists()


@pytest.mark.parametrize("metrics", [{"ppl": 0.0}, {"ppl": float("nan")}, {"nll": -1.0}, {"acc": None}])
def test_an_eval_artifact_with_a_metric_no_evaluation_gives_is_refused(metrics, tmp_path):
    path = write(tmp_path / "x.eval.json", {**VALID["eval"], "metrics": metrics})
    line = _one_error_line(runner.invoke(app, ["report", str(path), "--out", str(tmp_path / "rep")]))
    assert f"metrics['{next(iter(metrics))}']" in line


MC = {"doc_id": 0, "resps": [[-1.0, False], [-2.0, True]]}


@pytest.mark.parametrize("edit,says", [
    ({"samples": {"t": [{**MC, "resps": [5, 6]}]}}, None),  # not pairs: a generation's texts, taken as such
    ({"samples": {"t": [{**MC, "resps": [[]]}]}}, "samples['t'][0].resps holds a response that is not a"),
    ({"samples": {"t": [{**MC, "resps": [[float("nan"), False], [-1.0, True]]}]}}, "samples['t'][0].resps"),
    ({"samples": {"t": [{**MC, "doc_id": [1]}]}}, "samples['t'][0].doc_id is [1]"),
    ({"summary": {"tpot_s": "fast"}}, "summary['tpot_s'] is 'fast'"),
    ({"metrics": {"acc": 7.0}}, "metrics['acc'] is 7.0, but an acc lies in [0, 1]"),
    ({"stderr": {"acc": float("nan")}}, "stderr['acc'] is nan"),
])
def test_an_eval_report_compares_policies_with_is_read_whole(edit, says, tmp_path):
    """Each was report's traceback (`_choices`, `_joined`) or a comparison over NaN or an accuracy of 7."""
    path = write(tmp_path / "x.eval.json", {**VALID["eval"], "samples": {"t": [MC]}, "policy": "lru", **edit})
    resident = write(tmp_path / "r.eval.json", {**VALID["eval"], "samples": {"t": [MC]}, "policy": "resident"})
    result = runner.invoke(app, ["report", str(path), str(resident), "--out", str(tmp_path / "rep")])
    if says is None:
        assert result.exit_code == 0, result.output
    else:
        assert says in _one_error_line(result)


def test_a_number_too_long_for_python_is_one_sentence_in_every_json_reader(tiny_bundle, tmp_path):
    huge = "9" * 5000
    run = tmp_path / "x.run.json"
    run.write_text(json.dumps(VALID["run"]).replace('"bytes_h2d": 1', f'"bytes_h2d": {huge}'))
    assert "number too long" in _one_error_line(runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "r")]))
    hw = tmp_path / "x.hw.json"
    hw.write_text('{"name": ' + huge + "}")
    assert "hardware profile" in _one_error_line(runner.invoke(app, run_args(tiny_bundle, "--hw", str(hw))))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi", "n": ' + huge + "}\n")
    assert "line 1 is not JSON" in _one_error_line(runner.invoke(app, run_args(tiny_bundle, "--prompts", str(prompts))))


def test_a_device_the_engine_cannot_run_on_is_refused_before_any_work(tiny_bundle, tmp_path):
    line = _one_error_line(runner.invoke(app, run_args(tiny_bundle, "--device", "meta")))
    assert "--device must be cpu or cuda" in line
    line = _one_error_line(runner.invoke(app, ["profile", "--bundle", str(tiny_bundle), "--what", "routing",
                                               "--device", "xpu", "--out", str(tmp_path / "p.profile.json")]))
    assert "--device must be cpu or cuda" in line and not (tmp_path / "p.profile.json").exists()


def test_a_config_transformers_rejects_is_named_as_the_inputs_fault(tmp_path):
    model = tiny_moe(tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "hidden_size": "32"}))
    line = _one_error_line(runner.invoke(app, ["check", str(model)]))
    assert "cannot read the config" in line and "hidden_size" in line


@pytest.mark.parametrize("top_k", [0, 5])
def test_a_top_k_no_layer_can_route_is_one_sentence(top_k, tmp_path):
    model = tiny_moe(tmp_path / "m")  # 4 experts a layer
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": top_k}))
    for args in (["check", str(model)], ["run", "--model", str(model), "--prompt", "hi", "--max-new-tokens", "1"]):
        assert f"routes each token to {top_k} experts" in _one_error_line(runner.invoke(app, args))


def test_an_output_that_is_one_of_the_commands_inputs_is_refused_and_the_input_kept(tiny_bundle, tmp_path):
    from helpers import synthetic_profile

    manifest = tiny_bundle / "bundle.json"
    before = manifest.read_bytes()
    line = _one_error_line(runner.invoke(app, run_args(tiny_bundle, "--out", str(manifest))))
    assert "lies inside" in line and manifest.read_bytes() == before
    data = tmp_path / "mine.txt"
    data.write_text("Some text of my own, to score.")
    line = _one_error_line(runner.invoke(app, ["eval", "ppl", "--bundle", str(tiny_bundle), "--data", str(data),
                                               "--out", str(data)]))
    assert "is also an input" in line and data.read_text() == "Some text of my own, to score."
    profile = tmp_path / "p.profile.json"
    synthetic_profile().save(profile)
    kept = profile.read_bytes()
    assert "is also an input" in _one_error_line(runner.invoke(app, ["fit", str(profile), "--out", str(profile)]))
    assert profile.read_bytes() == kept


def test_profile_refuses_its_hardware_output_over_its_profile_and_an_unknown_base_before_measuring(tiny_bundle, tmp_path):
    out = tmp_path / "p.profile.json"
    base = ["profile", "--bundle", str(tiny_bundle), "--what", "timing", "--seqs", "1", "--seq-len", "8", "--out", str(out)]
    assert "same file as --out" in _one_error_line(runner.invoke(app, [*base, "--hw-out", str(out)]))
    assert "no hardware profile 'nosuch'" in _one_error_line(runner.invoke(app, [*base, "--hw-base", "nosuch"]))
    assert list(tmp_path.iterdir()) == []


def test_whitespace_only_text_is_refused_like_an_empty_file(tiny_bundle, tmp_path):
    blank = tmp_path / "blank.txt"
    blank.write_text("   \n\n\t  \n")
    line = _one_error_line(runner.invoke(app, ["eval", "ppl", "--bundle", str(tiny_bundle), "--data", str(blank)]))
    assert "holds no text" in line


def test_eval_ppl_reads_its_text_before_the_model(tiny_bundle, tmp_path, monkeypatch):
    """A binary --data was refused after the model had loaded (13 s on the demo)."""
    import moetool.evaluate as evaluate

    monkeypatch.setattr(evaluate, "prepare", lambda *a, **k: pytest.fail("the model loaded"))
    binary = tmp_path / "b.bin"
    binary.write_bytes(bytes(range(128, 256)))
    line = _one_error_line(runner.invoke(app, ["eval", "ppl", "--bundle", str(tiny_bundle), "--data", str(binary)]))
    assert line.startswith(f"error: --data {binary} is not UTF-8 text")
    lines = tmp_path / "docs.jsonl"  # its braces and keys were scored as text, without a word
    lines.write_text('{"text": "one document"}\n{"text": "another"}\n')
    line = _one_error_line(runner.invoke(app, ["eval", "ppl", "--bundle", str(tiny_bundle), "--data", str(lines)]))
    assert "is JSON data (JSON Lines, or one JSON document), and ppl scores running text" in line


def test_decoding_through_a_kv_cache_uses_the_keyword_transformers_does_not_warn_about(tiny_ckpt):
    import warnings

    from moetool.model import load_reference
    from moetool.perplexity import stepwise_logits

    model = load_reference(tiny_ckpt("qwen2_moe"))
    rows = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers 5.24 deprecates `past_key_values`
        steps = stepwise_logits(model, rows)
    torch.testing.assert_close(steps, model(input_ids=rows).logits[:, :-1], rtol=1e-4, atol=1e-4)


def test_an_output_name_as_long_as_the_filesystem_allows_is_written(tmp_path):
    path = tmp_path / ("a" * 250 + ".json")  # 255 bytes: the longest name; the temp name beside it is longer
    atomic_write_bytes(path, b"{}")
    assert path.read_bytes() == b"{}" and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_negative_group_size_and_an_artifact_of_the_wrong_kind_read_as_sentences(tmp_path):
    model = tiny_moe(tmp_path / "m")
    line = _one_error_line(runner.invoke(app, ["quantize", str(model), "--bits", "4", "--group-size", "-1",
                                               "--out", str(tmp_path / "b")]))
    assert "--group-size must be a positive number" in line and not (tmp_path / "b").exists()
    path = write(tmp_path / "x.json", VALID["eval"])
    line = _one_error_line(runner.invoke(app, ["fit", str(path), "--out", str(tmp_path / "f.json")]))
    assert "is an 'eval' artifact, not the 'profile' this command needs" in line


@pytest.mark.parametrize("fail_at", [0, 1])
def test_a_full_disk_during_quantize_says_what_is_kept(fail_at, tmp_path, monkeypatch):
    """Before any layer is finished the directory is removed, and the sentence no longer promises
    finished layers; after one, they are kept for a re-run, as it says."""
    import errno
    import importlib

    q = importlib.import_module("moetool.quant.quantize")  # the module, not the function moetool.quant exports

    real, calls = q._quantize_layer, []

    def fill_the_disk(*args, **kwargs):
        calls.append(1)
        if len(calls) > fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(q, "_quantize_layer", fill_the_disk)
    model, out = tiny_moe(tmp_path / "m"), tmp_path / "b"
    line = _one_error_line(runner.invoke(app, ["quantize", str(model), "--bits", "4", "--group-size", "16",
                                               "--no-calibrate", "--out", str(out)]))
    if fail_at == 0:
        assert "no layer was finished, so nothing is kept" in line and not out.exists()
    else:
        assert "finished layers are kept" in line and list(out.glob("layer-*.safetensors"))


def test_a_group_size_refused_suggests_one_that_divides_every_expert_width(tmp_path):
    """The suggestion is tried as given: it divides both projections' input widths (hidden 40 and
    expert width 20: 8 divides the first only, 4 both), so following it is not refused next."""
    from tiny import save_tiny

    model = save_tiny("qwen2_moe", tmp_path / "m", hidden_size=40, moe_intermediate_size=20,
                      shared_expert_intermediate_size=24, intermediate_size=48)
    line = _one_error_line(runner.invoke(app, ["quantize", str(model), "--bits", "4", "--group-size", "8",
                                               "--no-hqq-optimize", "--out", str(tmp_path / "q")]))
    suggested = int(line.rsplit("e.g. ", 1)[1].split(")")[0])
    assert "does not divide" in line and 40 % suggested == 0 and 20 % suggested == 0
    result = runner.invoke(app, ["quantize", str(model), "--bits", "4", "--group-size", str(suggested),
                                 "--no-hqq-optimize", "--out", str(tmp_path / "q")])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("dtype,says", [(torch.float16, "float16"), (torch.float32, "float32"),
                                        (torch.bfloat16, None)])
def test_quantize_says_when_the_bundle_rounds_the_checkpoints_numbers(tmp_path, dtype, says):
    """A bundle keeps its 16-bit experts in bf16: an fp16 or fp32 checkpoint's numbers are rounded
    (its lossless runs then decode the bf16 model), which quantize says once; a bf16 checkpoint's
    are not, and nothing is said."""
    from tiny import save_tiny

    model = save_tiny("qwen2_moe", tmp_path / "m", dtype=dtype)
    result = runner.invoke(app, ["quantize", str(model), "--bits", "4", "--no-hqq-optimize",
                                 "--out", str(tmp_path / "q")])
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    if says is None:
        assert notes == []
    else:
        assert len(notes) == 1 and f"experts are {says}" in notes[0] and "bfloat16" in notes[0]
        # without the reference there are no 16-bit experts to round: only the other weights are said
        result = runner.invoke(app, ["quantize", str(model), "--bits", "4", "--no-reference", "--no-hqq-optimize",
                                     "--out", str(tmp_path / "q2")])
        notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
        assert len(notes) == 1 and "16-bit" not in notes[0] and "non-expert weights in bfloat16" in notes[0], notes


def test_profile_names_a_text_too_short_to_profile_as_such(tiny_bundle, tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("a")
    line = _one_error_line(runner.invoke(app, ["profile", "--bundle", str(tiny_bundle), "--data", str(one), "--what",
                                               "routing", "--seqs", "1", "--seq-len", "8",
                                               "--out", str(tmp_path / "p.json")]))
    assert "fewer than 2 tokens" in line and not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("edit,field", [
    (lambda p: p["info"].__setitem__("expert_bytes", {}), "expert_bytes"),
    (lambda p: p["sensitivity"].__setitem__("int2_share", {"abc": 11.0}), "int2_share['abc']"),
    (lambda p: p["sensitivity"].__setitem__("int2_share", {"0": float("nan")}), "int2_share['0']"),
    (lambda p: p["sensitivity"].__setitem__("base_ppl", float("inf")), "base_ppl"),
    (lambda p: p["sensitivity"].__setitem__("base_ppl", -5.0), "base_ppl"),
    (lambda p: p["sensitivity"]["layers"][0]["ppl"].__setitem__("2", float("nan")), "layers[0].ppl"),
    (lambda p: p["prefetch"]["layers"][0]["recall_topk"].__setitem__("decode", 5.0), "recall_topk"),
    (lambda p: p["prefetch"]["layers"][0]["recall_topk"].__setitem__("decode", float("nan")), "recall_topk"),
    # A NaN anywhere (a timing was fit's traceback "cannot convert float NaN to integer"), an anchor missing
    # (no share 0: Fate's p fitted from no loss at all), a part of no layers or of layers the model does not
    # have (Fate's n and L fitted from nothing), a batch size that is not a number (report's traceback).
    (lambda p: p["timing"]["layers"][0].__setitem__("t_moe", float("nan")), "timing.layers[0].t_moe is nan"),
    (lambda p: p["timing"]["layers"][0].__setitem__("t_attn", -1e-4), "timing.layers[0]['t_attn'] is -0.0001"),
    (lambda p: p["sensitivity"]["int2_share"].pop("0"), "int2_share lacks the share 0"),
    (lambda p: p["timing"].__setitem__("layers", []), "timing.layers is empty"),
    (lambda p: p["prefetch"].__setitem__("layers", []), "prefetch.layers is empty"),
    (lambda p: p["prefetch"]["layers"][0].__setitem__("layer", 99), "prefetch.layers[0].layer is 99, not a MoE layer"),
    (lambda p: p["timing"]["layers"][1].__setitem__("layer", 0), "timing.layers[1].layer is 0 again"),
    (lambda p: p["info"].__setitem__("moe_layers", [0, 1, 2, 2]), "moe_layers names a layer twice"),
    (lambda p: p.__setitem__("routing", {**VALID["profile"]["routing"],
                                         "activation_ratio": {"decode": {"abc": 0.5}}}),
     "activation_ratio['decode']['abc'] is keyed by a batch size"),
])
def test_a_profile_with_measurements_no_run_gives_is_refused_by_fit_and_report(tmp_path, edit, field):
    """NaN, infinite or impossible measurements (a perplexity under 1, a recall over 1, a share that
    is not a number, no expert sizes) are refused where the profile is read, in one sentence naming
    the field, by fit and report alike; they used to reach fit's arithmetic (a traceback, or NaN
    written into the fit artifact)."""
    from helpers import synthetic_profile

    good = synthetic_profile().save(tmp_path / "good.profile.json")
    data = json.loads(good.read_text())
    edit(data)
    bad = tmp_path / "in" / "bad.profile.json"
    bad.parent.mkdir()
    bad.write_text(json.dumps(data))  # NaN and Infinity as Python's json writes them
    line = _one_error_line(runner.invoke(app, ["fit", str(bad), "--out", str(tmp_path / "f.fit.json")]))
    assert field in line and not (tmp_path / "f.fit.json").exists()
    line = _one_error_line(runner.invoke(app, ["report", str(bad.parent), "--out", str(tmp_path / "r")]))
    assert field in line and not (tmp_path / "r").exists()


def _with(doc: dict, path: str, value) -> dict:
    doc = json.loads(json.dumps(doc))
    *keys, last = path.split(".")
    node = doc
    for k in keys:
        node = node[k]
    node[last] = value
    return doc


@pytest.mark.parametrize("kind,edit,field", [
    ("run", {"policy": "lru", "params": {"eviction": 3}}, "params"),
    ("run", {"bytes_per_token": float("inf")}, "bytes_per_token"),
    ("run", {"summary": {"hit_rate": 1.5}}, "summary['hit_rate']"),
    ("run", {"summary": {"tpot_s": {"mean": float("nan")}}}, "summary['tpot_s']['mean']"),
    ("fit", {"params": {"fate": {"L": "x"}}}, "params['fate']"),
    ("eval", {"metrics": {}, "subtasks": {}}, "metrics"),  # a tag's eval has its metrics in subtasks alone
    ("eval", {"task": " "}, "task"),
    ("eval", {"n": 0}, "n "),
])
def test_report_refuses_what_the_commands_that_use_it_refuse(tmp_path, kind, edit, field):
    """A run's knob of the wrong type, a non-finite measurement, a fit's knob of the wrong type, an
    evaluation of nothing: report reads artifacts as run --fit and fit do, so it refuses them too,
    in one sentence naming the field."""
    doc = VALID[kind]
    for key, value in edit.items():
        doc = _with(doc, key, value)
    (tmp_path / "in").mkdir()
    write(tmp_path / "in" / f"x.{kind}.json", doc)
    line = _one_error_line(runner.invoke(app, ["report", str(tmp_path / "in"), "--out", str(tmp_path / "r")]))
    assert field in line and not (tmp_path / "r").exists()


def test_a_safetensors_index_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    from tiny import save_tiny

    model = save_tiny("qwen2_moe", tmp_path / "m")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../../etc/passwd"}}))
    line = _one_error_line(runner.invoke(app, ["check", str(model)]))
    assert "'../../etc/passwd'" in line and "not a file name" in line


def test_a_demo_conversion_that_is_a_directory_or_not_one_is_refused_before_any_download(tmp_path, monkeypatch):
    from moetool import demo

    monkeypatch.setattr(demo, "fetch_dense_gguf", lambda **kw: pytest.fail("downloaded before the refusal"))
    line = _one_error_line(runner.invoke(app, ["demo-model", "--conversion", str(tmp_path), "--out",
                                               str(tmp_path / "d")]))
    assert "is a directory, not a file" in line
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    line = _one_error_line(runner.invoke(app, ["demo-model", "--conversion", str(junk), "--out", str(tmp_path / "d")]))
    assert "cannot read the demo conversion parameters" in line


@pytest.mark.parametrize("edit,says", [
    (lambda d: d.__setitem__("group_size", d["group_size"] * 2), "group_size"),
    (lambda d: d.__setitem__("method", "zzz"), "method"),
    (lambda d: d["entries"][0].__setitem__("method", "zzz"), "entries[0].method"),
    (lambda d: d["entries"][0]["rel_error"].__setitem__("down", float("nan")), "rel_error"),
    (lambda d: d["entries"][0].__setitem__("out_error", float("nan")), "entries[0].out_error is nan"),
])
def test_a_manifest_edited_with_its_checksum_redone_is_still_checked_for_sense(tiny_bundle, tmp_path, edit, says):
    """The checksum catches an accidental edit; a deliberate one (checksum recomputed) is still read
    for consistency: a group size its layouts do not have, an unknown method, a NaN error."""
    from helpers import copy, manifest, rewrite

    bundle = copy(tiny_bundle, tmp_path / "b")
    doc = manifest(bundle)
    edit(doc)
    rewrite(bundle, doc)
    line = _one_error_line(runner.invoke(app, ["verify", str(bundle)]))
    assert says in line


def test_a_bundle_of_the_first_format_is_refused_naming_its_manifest(tiny_bundle, tmp_path):
    """The refusal said "this bundle" without saying which: a sweep over several bundles left the reader
    to find the old one."""
    from helpers import copy, manifest, rewrite

    bundle = copy(tiny_bundle, tmp_path / "kept-from-2025")
    doc = manifest(bundle)
    doc["schema_version"] = 1
    rewrite(bundle, doc)
    line = _one_error_line(runner.invoke(app, ["verify", str(bundle)]))
    assert "kept-from-2025" in line and "bundle format 1" in line and "re-quantize" in line, line


@pytest.mark.parametrize("policy,settings,says", [
    ("dymoe", {"config": "8/2", "high_bits": "4"}, "--set config=8/2 sets high_bits and low_bits, and --set high_bits=4"),
    ("dynaexq", {"config": "16/4", "b_lo": "2"}, "--set config=16/4 sets b_hi and b_lo, and --set b_lo=2"),
    ("fate", {"cache_bits": "2", "low_bits": "4"}, "low_bits must not exceed cache_bits, not 4/2"),
])
def test_knobs_that_contradict_each_other_are_refused(policy, settings, says):
    """The shorthand won and the knob spelt out was dropped without a word (the artifact recorded both); Fate
    took an unpopular tier more precise than its cache, the inverse of §4.5."""
    from moetool.policies import POLICIES
    from moetool.policies.knobs import parse_params

    with pytest.raises(MoetoolError, match=re.escape(says)):
        parse_params(POLICIES[policy], settings)
    parse_params(POLICIES[policy], {k: v for k, v in settings.items() if k != next(iter(settings))})  # either alone


def test_a_setting_given_twice_is_refused_not_taken_as_its_last():
    from moetool.options import parse_settings

    with pytest.raises(MoetoolError, match=re.escape("--set gives bits twice (4 and 2); give it once.")):
        parse_settings(["bits=4", "bits=2"])
    assert parse_settings(["bits=4", "window=2"]) == {"bits": "4", "window": "2"}


def test_a_precision_no_bundle_stores_is_refused_as_such_not_sent_to_quantize(tiny_bundle):
    """`--set bits=3` said to make a bundle with `moetool quantize --bits 3`, which quantize refuses."""
    result = runner.invoke(app, run_args(tiny_bundle, "--policy", "lru", "--set", "bits=3", "--prompt", "Hi"))
    assert result.exit_code == 1
    assert _one_error_line(result) == "error: policy 'lru' wants 3-bit experts, and moetool stores experts at 16, 8, " \
                                     "4, 2 bits only."


def test_a_dymoe_r_reached_in_a_step_above_it_is_recorded_and_said(tiny_bundle, tmp_path):
    """On two top-2 layers DyMoE's share of critical experts moves in steps of 1/4: r = 0.6 ran a share of
    0.75 while the run recorded only r = 0.6."""
    out = tmp_path / "d.run.json"
    result = runner.invoke(app, run_args(tiny_bundle, "--policy", "dymoe", "--set", "config=4/0", "--set", "r=0.6",
                                         "--prompt", "Hi", "--out", str(out)))
    assert result.exit_code == 0, result.output
    art = json.loads(out.read_text())
    layers, k = len(art["layers"]), 2
    assert art["params"]["r"] == 0.6 and art["params"]["critical_share"] > 0.62
    said = f"DyMoE's r = 0.6 keeps a share of {art['params']['critical_share']:.3f}"
    assert art["summary"]["policy_notes"][0].startswith(said) and f"1/{layers * k}" in art["summary"]["policy_notes"][0]
    assert f"note: {said}" in result.stderr


def test_a_fitted_knob_the_run_cannot_take_runs_the_default_and_says_why(tiny_bundle, tmp_path):
    """A fitted DynaExq n_hi kept within the sizing's tolerance (or fitted without one) can exceed what this
    run's cache holds: the run stopped ("n_hi=... does not fit the budget") where it should run the policy's
    default and say why."""
    model = json.loads((tiny_bundle / "bundle.json").read_text())["model"]
    fit = write(tmp_path / "f.fit.json", {**VALID["fit"], "model": model, "params": {"dynaexq": {"n_hi": 64}},
                                          "evidence": {"dynaexq": {"n_hi": {"sized_for": {"budget": "60%"}}}}})
    out = tmp_path / "r.run.json"
    result = runner.invoke(app, ["run", "--bundle", str(tiny_bundle), "--budget", "60%", "--clock", "sim",
                                 "--max-new-tokens", "2", "--policy", "dynaexq", "--fit", str(fit), "--prompt", "Hi",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    art = json.loads(out.read_text())
    assert art["params"]["n_hi"] == -1 and art["summary"]["fit_dropped"]["n_hi"].startswith("refused here: ")
    assert "note:" in result.stderr

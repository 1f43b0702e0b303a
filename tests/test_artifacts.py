"""Artifacts: JSON round trip, strict reads, atomic writes."""

import json
import os
from dataclasses import FrozenInstanceError

import pytest

from moetool.artifacts import CheckReport, LayerCheck, ModelFingerprint, atomic_write_bytes
from moetool.errors import MoetoolError

FP_A = ModelFingerprint.of_config("a", {"model_type": "mixtral", "hidden_size": 32})
FP_B = ModelFingerprint.of_config("b", {"model_type": "mixtral", "hidden_size": 64})


def _report(fp=FP_A):
    return CheckReport(model=fp, inputs={"x.json": "ab" * 32}, prompt="hi", passed=True, max_abs_diff=0.0,
                       layers=(LayerCheck(layer=0, routing_agreement=1.0, max_abs_diff=0.0),))


def test_round_trip_rebuilds_nested_dataclasses(tmp_path):
    path = _report().save(tmp_path / "r.json")
    back = CheckReport.load(path, model=FP_A)
    assert back == _report()
    assert isinstance(back.layers[0], LayerCheck) and isinstance(back.model, ModelFingerprint)
    with pytest.raises(FrozenInstanceError):
        back.passed = False


def test_fingerprint_ignores_volatile_keys_but_not_shapes():
    base = {"model_type": "mixtral", "hidden_size": 32}
    same = ModelFingerprint.of_config("elsewhere", {**base, "transformers_version": "9.9", "dtype": "bfloat16"})
    assert same.same_model(FP_A) and not FP_B.same_model(FP_A)


def test_artifact_of_another_model_is_refused(tmp_path):
    path = _report().save(tmp_path / "r.json")
    with pytest.raises(MoetoolError, match="was made for model a"):
        CheckReport.load(path, model=FP_B)


@pytest.mark.parametrize("edit,match", [
    (lambda d: d.update(schema="bundle"), "'bundle' artifact"),
    (lambda d: d.update(schema_version=99), "newer than this moetool"),
    (lambda d: d.pop("prompt"), "missing prompt"),
])
def test_strict_reads(tmp_path, edit, match):
    data = _report().to_json()
    edit(data)
    (tmp_path / "r.json").write_text(json.dumps(data))
    with pytest.raises(MoetoolError, match=match):
        CheckReport.load(tmp_path / "r.json")


def test_invalid_json_and_missing_file(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(MoetoolError, match="not valid JSON"):
        CheckReport.load(tmp_path / "bad.json")
    with pytest.raises(MoetoolError, match="does not exist"):
        CheckReport.load(tmp_path / "none.json")


def test_atomic_write_leaves_old_file_and_no_temp_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "a.json"
    target.write_text("old")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("os.replace", boom)
    with pytest.raises(OSError):
        atomic_write_bytes(target, b"new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


@pytest.mark.parametrize("edit,match", [
    (lambda d: d.update(passed="yes"), "passed must be true or false, not the string 'yes'"),
    (lambda d: d["layers"][0].update(layer=True), r"layers\[0\].layer must be an integer, not true"),
    (lambda d: d["layers"][0].update(layer=-2), r"layers\[0\].layer is -2; it must not be negative"),
    (lambda d: d.update(layers={"0": {}}), "layers must be a list, not an object"),
    (lambda d: d["model"].update(config_sha256="abc"), "model.config_sha256 is 'abc', not a sha256"),
    (lambda d: d.update(schema_version="1"), "no valid schema_version"),
])
def test_reads_check_every_field_against_its_type_and_range(tmp_path, edit, match):
    data = _report().to_json()
    edit(data)
    (tmp_path / "r.json").write_text(json.dumps(data))
    with pytest.raises(MoetoolError, match=match) as info:
        CheckReport.load(tmp_path / "r.json")
    assert "r.json" in str(info.value) and len(str(info.value).splitlines()) == 1


def test_an_integral_float_reads_as_an_int_and_null_only_where_allowed(tmp_path):
    data = _report().to_json()
    data["layers"][0]["layer"] = 0.0  # a hand-edited file: the same index
    (tmp_path / "r.json").write_text(json.dumps(data))
    assert CheckReport.load(tmp_path / "r.json").layers[0].layer == 0
    data["tolerance"] = None
    (tmp_path / "r.json").write_text(json.dumps(data))
    with pytest.raises(MoetoolError, match="tolerance must be a number, not null"):
        CheckReport.load(tmp_path / "r.json")


def test_replace_dir_swaps_a_whole_directory_or_leaves_the_old_one(tmp_path, monkeypatch):
    from moetool.artifacts import replace_dir

    def fill(files):
        def write(tmp):
            for name in files:
                (tmp / name).write_text(name)
            return [tmp / name for name in files]
        return write

    target = tmp_path / "deep" / "rep"
    assert replace_dir(target, fill(["a.png", "summary.md"])) == [target / "a.png", target / "summary.md"]
    assert replace_dir(target, fill(["summary.md"])) == [target / "summary.md"]
    assert [p.name for p in target.iterdir()] == ["summary.md"]  # no stale a.png

    def ctrl_c(tmp):
        (tmp / "half.png").write_text("x")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replace_dir(target, ctrl_c)
    real, calls = os.replace, []

    def second_rename_fails(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr("os.replace", second_rename_fails)
    with pytest.raises(KeyboardInterrupt):
        replace_dir(target, fill(["b.png"]))
    monkeypatch.undo()
    assert [p.name for p in target.iterdir()] == ["summary.md"] and listdir(tmp_path) == ["deep", "deep/rep",
                                                                                          "deep/rep/summary.md"]
    with pytest.raises(KeyboardInterrupt):
        replace_dir(tmp_path / "new" / "parents" / "rep", ctrl_c)
    assert not (tmp_path / "new").exists()  # parents made for a failed directory are removed too


def listdir(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))

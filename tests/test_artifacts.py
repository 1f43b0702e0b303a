"""Artifacts: JSON round trip, strict reads, atomic writes."""

import json
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

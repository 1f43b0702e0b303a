"""Artifacts: JSON round trip, strict reads, atomic writes."""

import json
import os
from dataclasses import FrozenInstanceError

import pytest
import torch

from moetool.artifacts import CheckReport, LayerCheck, ModelFingerprint, atomic_write_bytes
from moetool.errors import MoetoolError
from helpers import VALID

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


def test_weights_digest_tells_checkpoints_of_one_architecture_apart_where_known():
    w1, w2 = "1" * 64, "2" * 64
    a1, a2 = (ModelFingerprint.of_config("a", {"model_type": "mixtral", "hidden_size": 32}, w) for w in (w1, w2))
    unknown = FP_A  # a hub id, or an artifact written before fingerprints had a digest
    assert a1.same_model(a1) and not a1.same_model(a2) and not a2.same_model(a1)
    assert a1.same_model(unknown) and unknown.same_model(a1)  # lenient: reads older artifacts
    assert not a1.same_model(unknown, strict=True) and a1.same_model(a1, strict=True)  # reuse needs proof
    assert not FP_B.same_model(a1, strict=True)


def test_artifact_without_a_weights_digest_still_loads(tmp_path):
    data = _report().to_json()
    assert data["model"].pop("weights_sha256") == ""
    (tmp_path / "r.json").write_text(json.dumps(data))
    assert CheckReport.load(tmp_path / "r.json", model=FP_A) == _report()
    data["model"]["weights_sha256"] = "not a digest"
    (tmp_path / "r.json").write_text(json.dumps(data))
    with pytest.raises(MoetoolError, match="weights_sha256"):
        CheckReport.load(tmp_path / "r.json")


def test_weights_digest_samples_every_weight_file(tmp_path):
    from moetool.digest import weights_digest

    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text("{}")
    assert weights_digest(str(src)) == "" and weights_digest("org/name") == ""
    blob = bytearray(os.urandom(3 << 20))
    (src / "model-00001.safetensors").write_bytes(blob)
    first = weights_digest(str(src))
    assert len(first) == 64
    (src / "config.json").write_text('{"edited": 1}')  # not a weight file
    assert weights_digest(str(src)) == first
    blob[-1] ^= 1  # the last sample ends at the last byte
    (src / "model-00001.safetensors").write_bytes(blob)
    assert weights_digest(str(src)) != first
    (src / "model-00002.safetensors").write_bytes(b"x")
    assert weights_digest(str(src)) not in ("", first)


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


def test_an_artifact_saved_by_an_editor_with_a_byte_order_mark_reads(tmp_path):
    """Notepad's UTF-8 BOM before the JSON was "not valid JSON (JSONDecodeError at 0)"."""
    from moetool.artifacts import read_json

    (tmp_path / "a.json").write_bytes(b"\xef\xbb\xbf" + json.dumps({"schema": "run", "n": 1}).encode())
    assert read_json(tmp_path / "a.json") == {"schema": "run", "n": 1}


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


def test_weights_digest_sees_a_change_to_small_tensors_alone(tmp_path):
    """Routers rescaled and nothing else (how a demo conversion's stage 4 changes a checkpoint): the
    digest differs, though the router sits between samples a per-file sampling would take."""
    from safetensors.torch import save_file

    from moetool.digest import weights_digest

    gen = torch.Generator().manual_seed(0)
    tensors = {"a.experts": torch.randn(2 << 20, generator=gen), "m.gate.weight": torch.randn(8, 128, generator=gen),
               "z.experts": torch.randn(2 << 20, generator=gen)}  # 8 MiB, 4 KiB, 8 MiB
    src = tmp_path / "ckpt"
    src.mkdir()
    save_file(tensors, src / "model.safetensors")
    first = weights_digest(str(src))
    save_file({**tensors, "m.gate.weight": tensors["m.gate.weight"] * 0.8}, src / "model.safetensors")
    assert weights_digest(str(src)) not in ("", first)
    save_file(tensors, src / "model.safetensors")
    assert weights_digest(str(src)) == first  # the same bytes again: the same digest


def test_digests_taken_two_ways_are_not_compared():
    w = "1" * 64
    old, new = (ModelFingerprint.of_config("a", {"model_type": "mixtral", "hidden_size": 32}, w, v) for v in (1, 2))
    assert old.same_model(new) and new.same_model(old)  # lenient reads: as if one digest were unknown
    assert not new.same_model(old, strict=True) and new.same_model(new, strict=True)  # reuse: recompute


def test_a_run_written_before_batch_size_was_recorded_reads_it_where_known_and_is_refused_where_not(tmp_path):
    """Such a run read as batch 1: a batched run's TPOT sat in batch-1 cells of report's Table 3 and fit's
    T(alpha). One prompt is a batch of one; the captured step's fall-back says the batch it could not take."""
    import copy

    from moetool.run_artifact import Run

    old = copy.deepcopy(VALID["run"])
    old.pop("batch_size")
    assert Run.from_json(old).batch_size == 1  # one prompt
    old.update(prompts=["a", "b"], tokens=[[1], [2]], texts=["", ""])
    with pytest.raises(MoetoolError, match=r"^old.run.json is not a valid run artifact: batch_size is missing, and the "
                                           r"run's 2 prompts may have been decoded together .*add \"batch_size\": N"):
        Run.from_json(old, where="old.run.json")
    old["summary"] = {**old["summary"], "path": "host",
                      "path_reason": "the captured step decodes one sequence at a time, not a batch of 2"}
    assert Run.from_json(old).batch_size == 2
    assert Run.from_json({**old, "batch_size": 1}).batch_size == 1  # recorded: taken as it is


def test_a_list_of_ints_or_strings_reads_in_one_pass_and_still_names_a_bad_element():
    """A Run's tokens took 35 us each to read (7 s for 100 prompts of 2,000 tokens): lists whose elements are
    all of their type are taken whole; any other goes element by element, naming the first bad one."""
    from moetool.schema import SchemaError, build

    ids = list(range(1000))
    got = build(list[list[int]], [ids, ids])
    assert got == [ids, ids] and got[0] is not ids  # a copy, as the element-wise read gives
    assert build(list[int], [1, 3.0]) == [1, 3] and type(build(list[int], [3.0])[0]) is int
    with pytest.raises(SchemaError, match=r"tokens\[1\]\[2\] must be an integer, not true"):
        build(list[list[int]], [[1], [1, 2, True]], "tokens")
    with pytest.raises(SchemaError, match=r"texts\[1\] must be a string, not the number 4"):
        build(list[str], ["a", 4], "texts")

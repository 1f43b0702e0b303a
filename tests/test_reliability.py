"""Every failure is one sentence, nothing is used or written half-way (issue 19).

Property-based (hypothesis): malformed artifacts of every kind and malformed bundle manifests are
either read as valid or refused with one MoetoolError of one line, and nothing else is raised; an
opened bundle reads every blob. Then the real CLI for each class of failure: exit 1, one line on
stderr, no traceback, and no file left but the intended one. Example counts are kept small so the
module runs in well under a minute next to the tiny bundle it quantizes once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from moetool.artifacts import CheckReport, ModelFingerprint
from moetool.fit_artifact import Fit
from moetool.cli import app
from moetool.errors import MoetoolError
from moetool.evaluate import Eval
from moetool.profile import Profile
from moetool.quant import Bundle, quantize
from moetool.quant.bundle import MANIFEST, load_bundle_model
from moetool.quant.quantize import JOURNAL, LOCK
from moetool.report import report
from moetool.run import Run
from moetool.schema import NEVER_NEGATIVE
from moetool.sweep import Sweep
from helpers import VALID, manifest, rewrite, synthetic_profile, synthetic_run, tiny_moe, valid_artifacts
from helpers import quantize_config as config
from helpers import write_json as write

runner = CliRunner()
FP = ModelFingerprint(source="synthetic", model_type="qwen2_moe", config_sha256="a" * 64)
OTHER = ModelFingerprint(source="other", model_type="qwen2_moe", config_sha256="b" * 64)
# No example database: a run leaves no .hypothesis/ in the checkout (a failure prints its reproduction).
FEW = settings(max_examples=40, deadline=None, database=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture])
SOME = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

# ---- what the contract means --------------------------------------------------------------------


def one_sentence(e: BaseException) -> str:
    """The message of a refusal, which must be a MoetoolError of exactly one line."""
    assert isinstance(e, MoetoolError), f"{type(e).__name__}: {e}"
    text = str(e)
    assert text and len(text.splitlines()) == 1, repr(text)
    return text


def refused(fn, *args, **kwargs) -> str:
    with pytest.raises(MoetoolError) as info:
        fn(*args, **kwargs)
    return one_sentence(info.value)


def loads_or_one_sentence(fn, *args, **kwargs) -> Any:
    """fn's value, or None after checking that it refused in one sentence (anything else fails the test)."""
    try:
        return fn(*args, **kwargs)
    except MoetoolError as e:
        one_sentence(e)
        return None


def cli_refuses(args: list[str]) -> str:
    """Run the real CLI: exit 1, one line on stderr starting with "error:", no traceback anywhere."""
    result = runner.invoke(app, args)
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def listing(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*")}


# ---- JSON, valid artifacts, and their mutations ---------------------------------------------------

json_scalars = (st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True)
                | st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


KINDS = {"check": CheckReport, "run": Run, "fit": Fit, "eval": Eval, "profile": Profile, "sweep": Sweep,
         "bundle": Bundle}
def node_paths(doc: Any, at: tuple = ()) -> list[tuple]:
    """The path of every node of a JSON document, the root included."""
    out = [at]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += node_paths(v, (*at, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += node_paths(v, (*at, i))
    return out


def typed_leaves(tp: Any, value: Any, at: tuple = (), nullable: bool = False,
                 field: bool = False) -> list[tuple[tuple, Any, bool, bool]]:
    """(path, type, may be null, is a dataclass field) of every leaf whose type the schema fixes
    (int, float, str, bool); a leaf that is a dict's value or a list's item is not a field."""
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return [leaf for f in dataclasses.fields(tp) if f.name in value
                for leaf in typed_leaves(hints[f.name], value[f.name], (*at, f.name), field=True)]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        return [] if value is None or len(options) != 1 else typed_leaves(options[0], value, at, True, field)
    if origin in (list, tuple):
        each = (lambda i: args[0]) if origin is list or args[-1] is Ellipsis else (lambda i: args[i])
        return [leaf for i, v in enumerate(value) for leaf in typed_leaves(each(i), v, (*at, i))]
    if origin is dict:
        return [leaf for k, v in value.items() for leaf in typed_leaves(args[1], v, (*at, k))]
    return [(at, tp, nullable, field)] if tp in (int, float, str, bool) else []


def sized_fields(kind: str) -> list[tuple[tuple, Any]]:
    """Leaves of the valid `kind` artifact that are fields named as sizes, counts, indices or times."""
    return [(p, tp) for p, tp, _, field in typed_leaves(KINDS[kind], VALID[kind])
            if field and tp in (int, float) and NEVER_NEGATIVE.search(p[-1])]


WRONG = {int: ["7", 1.5, True, [], {}, None], float: ["0.5", False, [1.0], {}, None],
         str: [3, 2.5, True, ["x"], {}, None], bool: [1, "true", [], None]}


def put(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


def drop(doc: Any, path: tuple) -> Any:
    node = doc
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return doc


@st.composite
def mutations(draw, doc: dict) -> Any:
    """`doc` with one node replaced by any JSON value, or one key or list item removed."""
    doc = json.loads(json.dumps(doc))
    path = draw(st.sampled_from(node_paths(doc)))
    if path and draw(st.booleans()):
        return drop(doc, path)
    return put(doc, path, draw(json_values))


def field_name(path: tuple) -> str:
    return next(str(k) for k in reversed(path) if isinstance(k, str))


# ---- artifacts: any JSON at all -------------------------------------------------------------------

ARTIFACT_KINDS = sorted(set(KINDS) - {"bundle"})


@pytest.mark.parametrize("kind", sorted(KINDS))
@FEW
@given(doc=json_values | st.fixed_dictionaries({"schema": st.sampled_from(sorted(KINDS)),
                                                 "schema_version": st.integers(-1, 3)},
                                                optional={"model": json_values, "inputs": json_values}))
def test_any_json_is_read_as_an_artifact_or_refused_in_one_sentence(kind, doc, tmp_path):
    loads_or_one_sentence(KINDS[kind].load, write(tmp_path / "a.json", doc))


@pytest.mark.parametrize("kind", ARTIFACT_KINDS)
@FEW
@given(data=st.data())
def test_a_mutated_artifact_is_read_whole_or_refused_in_one_sentence(kind, data, tmp_path):
    doc = data.draw(mutations(VALID[kind]))
    art = loads_or_one_sentence(KINDS[kind].load, write(tmp_path / "a.json", doc))
    if art is not None:  # what is accepted is a whole artifact: it writes and reads back the same (NaN too)
        again = KINDS[kind].load(art.save(tmp_path / "b.json"))
        assert json.dumps(again.to_json(), sort_keys=True) == json.dumps(art.to_json(), sort_keys=True)


@pytest.mark.parametrize("kind", ARTIFACT_KINDS)
@SOME
@given(data=st.data())
def test_a_value_of_the_wrong_kind_in_any_typed_field_is_refused_naming_the_field(kind, data, tmp_path):
    cls, doc = KINDS[kind], json.loads(json.dumps(VALID[kind]))
    path, tp, nullable, _ = data.draw(st.sampled_from(typed_leaves(cls, doc)))
    wrong = data.draw(st.sampled_from([w for w in WRONG[tp] if not (nullable and w is None)]))
    text = refused(cls.load, write(tmp_path / "a.json", put(doc, path, wrong)))
    assert field_name(path) in text and "a.json" in text


@pytest.mark.parametrize("kind", [k for k in ARTIFACT_KINDS if sized_fields(k)])
@FEW
@given(data=st.data())
def test_a_negative_size_count_index_or_time_is_refused_naming_the_field(kind, data, tmp_path):
    cls, doc = KINDS[kind], json.loads(json.dumps(VALID[kind]))
    path, tp = data.draw(st.sampled_from(sized_fields(kind)))
    bad = data.draw(st.integers(-2**40, -1) if tp is int else st.floats(max_value=-1e-9, allow_nan=False))
    text = refused(cls.load, write(tmp_path / "a.json", put(doc, path, bad)))
    assert field_name(path) in text and "negative" in text


@pytest.mark.parametrize("kind", ARTIFACT_KINDS)
@FEW
@given(data=st.data())
def test_a_truncated_file_or_binary_garbage_is_one_sentence(kind, data, tmp_path):
    whole = (json.dumps(VALID[kind], indent=1)).encode()
    if data.draw(st.booleans()):
        blob = whole[:data.draw(st.integers(0, len(whole) - 1))]  # any proper prefix: what a killed write leaves
    else:
        blob = data.draw(st.binary(max_size=256))
    (tmp_path / "a.json").write_bytes(blob)
    text = refused(KINDS[kind].load, tmp_path / "a.json")
    assert "a.json" in text


def test_deeply_nested_json_is_one_sentence(tmp_path):
    (tmp_path / "a.json").write_text("[" * 100_000 + "]" * 100_000)
    assert "a.json" in refused(Run.load, tmp_path / "a.json")


def test_wrong_types_are_named_with_what_was_expected(tmp_path):
    doc = json.loads(json.dumps(VALID["run"]))
    doc["budget_bytes"] = "12GiB"
    assert "budget_bytes must be an integer, not the string '12GiB'" in refused(Run.load, write(tmp_path / "r.json", doc))
    doc = json.loads(json.dumps(VALID["profile"]))
    doc["routing"]["layers"][1]["prefill"][3] = "x"
    assert "routing.layers[1].prefill[3] must be an integer" in refused(Profile.load, write(tmp_path / "p.json", doc))
    for top in ([1, 2], None, "run", 3):
        assert "not an object" in refused(Profile.load, write(tmp_path / "p.json", top))


def test_a_profile_of_an_impossible_shape_is_refused(tmp_path):
    doc = json.loads(json.dumps(VALID["profile"]))
    doc["info"]["top_k"] = 9
    assert "info.top_k is 9" in refused(Profile.load, write(tmp_path / "p.json", doc))
    doc = json.loads(json.dumps(VALID["profile"]))
    doc["info"]["expert_bytes"]["4"] = 0
    assert "expert_bytes[4] is 0" in refused(Profile.load, write(tmp_path / "p.json", doc))
    doc = json.loads(json.dumps(VALID["profile"]))
    doc["routing"]["layers"][0]["decode"] = [1, 2]
    assert "not one per expert" in refused(Profile.load, write(tmp_path / "p.json", doc))


# ---- bundle manifests -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reliability")
    model = tiny_moe(root / "model")
    out = root / "bundle"
    quantize(config(model, out, bits=(16, 4), calibrate=False, hqq_optimize=False))
    return out


@pytest.fixture
def scratch(bundle_dir, tmp_path) -> Path:
    """A copy of the bundle whose manifest a test may rewrite (shards and model/ linked, never written)."""
    copy = tmp_path / "bundle"
    copy.mkdir()
    for p in bundle_dir.iterdir():
        if p.name != MANIFEST:
            (copy / p.name).symlink_to(p)
    shutil.copy(bundle_dir / MANIFEST, copy / MANIFEST)
    return copy


def read_every_blob(directory: Path) -> None:
    opened = Bundle.open(directory)
    for e in opened.manifest.entries:
        opened.dequantize(e.layer, e.expert, e.bits)


@SOME
@given(data=st.data())
def test_a_mutated_manifest_opens_whole_or_is_refused_and_an_opened_bundle_reads_every_blob(data, bundle_dir,
                                                                                             scratch):
    doc = data.draw(mutations(manifest(bundle_dir)))
    rewrite(scratch, doc)
    loads_or_one_sentence(read_every_blob, scratch)  # no mid-generation traceback: every blob reads or refuses


@FEW
@given(data=st.data())
def test_a_wrong_kind_in_any_typed_manifest_field_is_refused_naming_the_field(data, bundle_dir, scratch):
    doc = manifest(bundle_dir)
    path, tp, nullable, _ = data.draw(st.sampled_from(typed_leaves(Bundle, doc)))
    wrong = data.draw(st.sampled_from([w for w in WRONG[tp] if not (nullable and w is None)]))
    rewrite(scratch, put(doc, path, wrong))
    assert field_name(path) in refused(Bundle.open, scratch)


@FEW
@given(data=st.data())
def test_a_hand_edited_manifest_is_refused_by_its_checksum(data, bundle_dir, scratch):
    original = manifest(bundle_dir)
    doc = data.draw(mutations(original))
    rewrite(scratch, doc, checksum=False)
    if doc != original:
        refused(Bundle.open, scratch)


def _past_the_blobs(doc: dict) -> None:
    """An offset inside the shard file, yet past the blob tensor (the header comes first)."""
    e = doc["entries"][-1]
    shard = next(s for s in doc["shards"] if s["name"] == e["shard"])
    e["offset"] = (shard["nbytes"] - e["nbytes"]) // 64 * 64


MANIFEST_EDITS = {
    "top level is a list": (lambda d: [d], "its JSON is a list"),
    "offset past the shard": (lambda d: d["entries"][0].update(offset=1 << 30), "run past the end of shard"),
    "offset past the blobs": (_past_the_blobs, "past the end of the"),
    "unaligned offset": (lambda d: d["entries"][0].update(offset=1), "multiple of 64"),
    "expert -1": (lambda d: d["entries"][0].update(expert=-1), "entries[0].expert is -1; it must not be negative"),
    "expert past the last": (lambda d: d["entries"][0].update(expert=99), "stores 4 experts"),
    "bits 3 in an entry": (lambda d: d["entries"][0].update(bits=3), "entries[0].bits is 3"),
    "bits 3 in the manifest": (lambda d: d["bits"].append(3), "not a stored precision"),
    "nbytes 0": (lambda d: d["entries"][0].update(nbytes=0), "entries[0].nbytes is 0"),
    "a duplicate entry": (lambda d: d["entries"].__setitem__(1, dict(d["entries"][0])), "repeats expert 0"),
    "an unknown layout": (lambda d: d["entries"][0].update(layout="nope"), "not a layout the manifest lists"),
    "a moved part": (lambda d: next(iter(d["layouts"].values()))["parts"][1].update(offset=8), "not where this format"),
    "a shard outside the bundle": (lambda d: d["shards"][0].update(name="../x.safetensors"), "not a file name inside"),
    "a model file outside model/": (lambda d: d["model_files"][0].update(name="../../etc/passwd"), "not a path inside"),
    "a crc32 that is not one": (lambda d: d["entries"][0].update(crc32=1 << 33), "not a CRC-32"),
    "a missing key": (lambda d: d.__delitem__("entries"), "missing entries"),
    "a string for a size": (lambda d: d["shards"][0].update(nbytes="big"), "shards[0].nbytes must be an integer"),
}


@pytest.mark.parametrize("name", sorted(MANIFEST_EDITS))
def test_each_class_of_bad_manifest_is_one_sentence_from_the_cli(name, scratch):
    edit, says = MANIFEST_EDITS[name]
    doc = manifest(scratch)
    doc = edit(doc) or doc
    rewrite(scratch, doc)
    before = listing(scratch)
    assert says in refused(Bundle.open, scratch)
    line = cli_refuses(["verify", str(scratch)])
    assert says in line and MANIFEST in line
    assert listing(scratch) == before


def test_a_manifest_whose_expert_count_disagrees_with_its_model_is_refused(scratch):
    doc = manifest(scratch)
    doc["entries"] = [e for e in doc["entries"] if e["expert"] != 3]  # consistent within itself: 0-2 everywhere
    rewrite(scratch, doc)
    Bundle.open(scratch)
    assert "stores 3 experts of layer 0, but its model has 4" in refused(load_bundle_model, scratch)


def test_run_on_a_bundle_with_an_offset_past_its_blobs_is_one_sentence(scratch, tmp_path):
    doc = manifest(scratch)
    _past_the_blobs(doc)
    rewrite(scratch, doc)
    line = cli_refuses(["run", "--bundle", str(scratch), "--prompt", "hi", "--max-new-tokens", "2",
                        "--out", str(tmp_path / "r.json")])
    assert "past the end of the" in line and not (tmp_path / "r.json").exists()


# ---- stages reading bad artifacts, through the CLI ------------------------------------------------


@pytest.mark.parametrize("content", ["[1, 2]", "null", "{\"schema\": \"profile\"", "\x00\x01binary"])
def test_fit_refuses_a_profile_that_is_not_one_in_one_sentence(content, tmp_path):
    (tmp_path / "p.profile.json").write_text(content)
    line = cli_refuses(["fit", str(tmp_path / "p.profile.json"), "--out", str(tmp_path / "f.json")])
    assert "p.profile.json" in line
    assert listing(tmp_path) == {"p.profile.json"}


def test_run_refuses_a_fit_that_is_garbage_in_one_sentence(bundle_dir, tmp_path):
    (tmp_path / "f.fit.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    line = cli_refuses(["run", "--bundle", str(bundle_dir), "--fit", str(tmp_path / "f.fit.json"), "--prompt", "hi",
                        "--max-new-tokens", "2", "--out", str(tmp_path / "r.json")])
    assert "f.fit.json is not valid JSON" in line
    assert listing(tmp_path) == {"f.fit.json"}


def test_fit_refuses_an_eval_that_is_not_an_object_in_one_sentence(tmp_path):
    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    write(tmp_path / "e.eval.json", [{"schema": "eval"}])
    line = cli_refuses(["fit", str(prof), "--runs", str(tmp_path / "e.eval.json"), "--out", str(tmp_path / "f.json")])
    assert "e.eval.json" in line and not (tmp_path / "f.json").exists()


# ---- report ---------------------------------------------------------------------------------------


@pytest.fixture
def two_models(tmp_path) -> Path:
    d = tmp_path / "art"
    d.mkdir()
    synthetic_run("lru", {}, 0.10).save(d / "a.run.json")
    synthetic_run("lru", {}, 0.20, model=OTHER).save(d / "b.run.json")
    return d


def test_report_refuses_artifacts_of_two_models_in_one_sentence(two_models, tmp_path):
    before = listing(tmp_path)
    line = cli_refuses(["report", str(two_models), "--out", str(tmp_path / "rep")])
    assert "different models" in line and "--by-model" in line
    assert listing(tmp_path) == before  # no report directory, no temp directory beside it


def test_report_by_model_writes_one_sub_report_per_model(two_models, tmp_path):
    result = runner.invoke(app, ["report", str(two_models), "--out", str(tmp_path / "rep"), "--by-model"])
    assert result.exit_code == 0, result.output
    subs = sorted(p.name for p in (tmp_path / "rep").iterdir() if p.is_dir())
    assert subs == ["qwen2_moe-aaaaaaaaaaaa", "qwen2_moe-bbbbbbbbbbbb"]
    index = (tmp_path / "rep" / "summary.md").read_text()
    assert all(f"({s}/summary.md)" in index for s in subs)
    assert "a.run.json" in (tmp_path / "rep" / subs[0] / "summary.md").read_text()
    assert "b.run.json" not in (tmp_path / "rep" / subs[0] / "summary.md").read_text()
    assert {p.name for p in tmp_path.iterdir()} == {"art", "rep"}


def test_report_tells_models_apart_by_their_weights_as_fit_does(tmp_path):
    """Runs of two checkpoints of one config and other weights were one model's rows (fit refused the pair)."""
    art = tmp_path / "art"
    art.mkdir()
    synthetic_run("lru", {}, 0.10, model=dataclasses.replace(FP, weights_sha256="1" * 64)).save(art / "a.run.json")
    synthetic_run("lru", {}, 0.20, model=dataclasses.replace(FP, weights_sha256="2" * 64)).save(art / "b.run.json")
    synthetic_run("lru", {}, 0.30).save(art / "c.run.json")  # no digest: joins the first model of its config
    line = cli_refuses(["report", str(art), "--out", str(tmp_path / "rep")])
    assert "different models" in line and "weights 111111111111" in line and "weights 222222222222" in line, line
    result = runner.invoke(app, ["report", str(art), "--out", str(tmp_path / "rep"), "--by-model"])
    assert result.exit_code == 0, result.output
    subs = sorted(p.name for p in (tmp_path / "rep").iterdir() if p.is_dir())
    assert subs == ["qwen2_moe-aaaaaaaaaaaa", "qwen2_moe-aaaaaaaaaaaa-weights-222222222222"]
    first = (tmp_path / "rep" / subs[0] / "summary.md").read_text()
    assert "a.run.json" in first and "c.run.json" in first and "b.run.json" not in first


def test_report_reads_a_file_reached_twice_once(tmp_path):
    """`report d d/sub` counted the run under d/sub twice, and changed the averages its tables show."""
    art = tmp_path / "art"
    (art / "sub").mkdir(parents=True)
    synthetic_run("lru", {}, 0.10).save(art / "a.run.json")
    synthetic_run("lru", {}, 0.30).save(art / "sub" / "c.run.json")
    result = runner.invoke(app, ["report", str(art), str(art / "sub"), str(art / "sub" / "c.run.json"),
                                 "--out", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    summary = (tmp_path / "rep" / "summary.md").read_text()
    assert summary.count("c.run.json") == summary.count("a.run.json") >= 1


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("unshare") is None, reason="root lists any directory, and "
                    "there is no unshare to run the report as another user")
def test_report_refuses_a_subdirectory_it_cannot_list():
    """An unlistable subdirectory's artifacts were missing from the report without a word (rglob passes over it)."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="moetool-unlistable-"))  # not under pytest's 0700 tmp: another user reads it
    try:
        root.chmod(0o777)
        art = root / "art"
        (art / "locked").mkdir(parents=True)
        synthetic_run("lru", {}, 0.10).save(art / "a.run.json")
        synthetic_run("lru", {}, 0.30).save(art / "locked" / "c.run.json")
        (art / "locked").chmod(0)
        args = ["report", str(art), "--out", str(root / "rep")]
        if os.geteuid() == 0:  # root lists anything: the report runs as an unprivileged user of a user namespace
            proc = subprocess.run(["unshare", "-U", sys.executable, "-m", "moetool.cli", *args], capture_output=True,
                                  text=True, timeout=300)
            code, stderr = proc.returncode, proc.stderr
        else:
            result = runner.invoke(app, args)
            code, stderr = result.exit_code, result.stderr
        lines = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
        assert code == 1 and len(lines) == 1 and f"cannot list {art / 'locked'} (Permission denied)" in lines[0], stderr
        assert not (root / "rep").exists()
    finally:
        (root / "art" / "locked").chmod(0o755)
        shutil.rmtree(root)


def test_a_report_out_that_is_a_link_is_refused_in_words(tmp_path):
    """It was `linkrep -> linkrep: Is a directory.`, the swap's own error."""
    art = tmp_path / "art"
    art.mkdir()
    synthetic_run("lru", {}, 0.10).save(art / "a.run.json")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    line = cli_refuses(["report", str(art), "--out", str(tmp_path / "link")])
    assert f"--out {tmp_path / 'link'} is a symbolic link (to {tmp_path / 'real'})" in line, line
    assert (tmp_path / "link").is_symlink() and not any((tmp_path / "real").iterdir())


def test_a_new_report_leaves_no_stale_figures_and_no_temp_directories(tmp_path):
    art = tmp_path / "art"
    art.mkdir()
    prof = VALID["profile"]
    write(art / "s.profile.json", prof)
    first = report([art], tmp_path / "rep")
    assert any(p.suffix == ".png" for p in first)
    (art / "s.profile.json").unlink()
    synthetic_run("lru", {}, 0.1).save(art / "a.run.json")
    second = report([art], tmp_path / "rep")
    assert [p.name for p in second] == ["summary.md"]
    assert {p.name for p in (tmp_path / "rep").iterdir()} == {"summary.md"}
    assert {p.name for p in tmp_path.iterdir()} == {"art", "rep"}


def test_an_interrupted_report_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    art = tmp_path / "art"
    art.mkdir()
    write(art / "s.profile.json", VALID["profile"])
    report([art], tmp_path / "rep")
    before = {p.name: p.read_bytes() for p in (tmp_path / "rep").iterdir()}

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("moetool.report.comparison_figures", ctrl_c)  # after the profile's figures are drawn
    with pytest.raises(KeyboardInterrupt):
        report([art], tmp_path / "rep")
    assert {p.name: p.read_bytes() for p in (tmp_path / "rep").iterdir()} == before
    assert {p.name for p in tmp_path.iterdir()} == {"art", "rep"}


def test_report_never_replaces_a_directory_that_is_not_a_report(tmp_path, two_models):
    (two_models / "b.run.json").unlink()
    line = cli_refuses(["report", str(two_models), "--out", str(two_models)])
    assert "not part of a moetool report" in line and "a.run.json" in line
    assert listing(two_models) == {"a.run.json"}


def test_report_refuses_an_invalid_artifact_and_a_named_non_artifact_in_one_sentence(tmp_path):
    art = tmp_path / "art"
    art.mkdir()
    doc = json.loads(json.dumps(VALID["run"]))
    doc["tpot_s"] = {"mean": "fast"}
    write(art / "a.run.json", doc)
    assert "tpot_s['mean'] must be" in cli_refuses(["report", str(art), "--out", str(tmp_path / "rep")])
    write(art / "a.run.json", VALID["run"])
    write(art / "config.json", {"model_type": "x"})  # found in a directory: not an artifact, passed over
    (art / "broken.json").write_text("{")
    assert runner.invoke(app, ["report", str(art), "--out", str(tmp_path / "rep")]).exit_code == 0
    line = cli_refuses(["report", str(art / "config.json"), "--out", str(tmp_path / "rep2")])
    assert "config.json is not an artifact report draws" in line
    write(art / "e.eval.json", {"schema": "eval", "schema_version": 1, "model": FP.__dict__, "metrics": [0.5]})
    assert "metrics must be an object" in cli_refuses(["report", str(art), "--out", str(tmp_path / "rep")])
    assert not (tmp_path / "rep2").exists()


# ---- quantize -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return tiny_moe(tmp_path_factory.mktemp("tiny") / "m")


def quick(model: Path, out: Path):
    return config(model, out, bits=(4,), calibrate=False, hqq_optimize=False)


def test_quantize_refuses_a_non_empty_directory_that_is_not_a_bundle(tiny_model, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    line = cli_refuses(["quantize", str(tiny_model), "--bits", "4", "--no-reference", "--out", str(out)])
    assert "not a moetool bundle" in line and "notes.txt" in line
    assert listing(out) == {"notes.txt"} and (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    (out / "layer-000.safetensors").write_text("not ours")  # a name like a shard, but no journal says so
    assert "layer-000.safetensors" in refused(quantize, quick(tiny_model, out))
    assert listing(out) == {"layer-000.safetensors"}


HOLD_LOCK = """
import sys, time
from pathlib import Path
from moetool.quant.quantize import DirectoryLock
with DirectoryLock(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.readline()
"""


def test_a_second_quantize_into_the_same_directory_is_refused_while_the_first_runs(tiny_model, tmp_path):
    out = tmp_path / "b"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        text = refused(quantize, quick(tiny_model, out))
        assert "another moetool quantize is writing" in text and str(out) in text
        assert listing(out) == {LOCK}  # the holder's lock, nothing of the refused run
        (out / JOURNAL).write_text("{}")  # a quantize under way, not one stopped
        from moetool.quant.bundle import Bundle

        with pytest.raises(MoetoolError, match="is a bundle a moetool quantize is writing now; wait for it"):
            Bundle.open(out)
        (out / JOURNAL).unlink()
    finally:
        holder.communicate("\n", timeout=60)
    assert listing(out) == set()
    bundle = quantize(quick(tiny_model, out))  # the directory is free again
    assert bundle.bits == (4,) and LOCK not in listing(out) and JOURNAL not in listing(out)


def test_a_killed_runs_lock_file_and_a_garbage_journal_do_not_stop_the_next_run(tiny_model, tmp_path):
    out = tmp_path / "b"
    out.mkdir()
    (out / LOCK).write_text("")  # what a killed run leaves: a file, no lock held
    (out / JOURNAL).write_text(json.dumps({"settings_sha256": "x", "layers": [1, 2]}))
    (out / ".layer-000.safetensors.abc.tmp").write_bytes(b"half")
    quantize(quick(tiny_model, out))
    assert {p.name for p in out.iterdir()} == {MANIFEST, "model", "layer-000.safetensors", "layer-001.safetensors"}
    (out / LOCK).write_text("")  # a quantize killed while it read its finished bundle back
    from moetool.quant.bundle import Bundle

    assert Bundle.open(out).unlisted() == []  # verify had refused the bundle over it, and quantize to redo it


def test_quantize_into_a_file_is_one_sentence(tiny_model, tmp_path):
    (tmp_path / "f").write_text("x")
    assert "is a file" in refused(quantize, quick(tiny_model, tmp_path / "f"))


def test_a_bundle_of_links_whose_originals_are_gone_names_the_link(bundle_dir, tmp_path):
    """A `cp -rs` copy of a bundle whose shard was deleted since said "is missing; re-run moetool quantize", which
    refuses a finished bundle."""
    import shutil

    from moetool.quant.bundle import Bundle

    orig = tmp_path / "orig"
    shutil.copytree(bundle_dir, orig)
    links = tmp_path / "links"
    shutil.copytree(orig, links, copy_function=lambda src, dst: os.symlink(os.path.abspath(src), dst))
    shard = sorted(orig.glob("layer-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(MoetoolError, match=f"shard {shard.name} of the bundle in {links} is a link to {shard}, which "
                                           "does not exist; restore that file, or copy the bundle with cp -r"):
        Bundle.open(links)
    (orig / "model" / "non_expert.safetensors").unlink()
    with pytest.raises(MoetoolError, match="non-expert weights of the bundle in .* is a link to"):
        Bundle.open(links)


def test_the_schema_accepts_what_moetool_writes(bundle_dir, tmp_path):
    """The other side of the contract: nothing valid is refused (every artifact, and a real bundle)."""
    for kind, art in valid_artifacts().items():
        assert KINDS[kind].load(art.save(tmp_path / f"{kind}.json")) == art
    read_every_blob(bundle_dir)
    assert os.access(bundle_dir / MANIFEST, os.R_OK)


@pytest.mark.parametrize("edit", [{"h2d_gbps": "fast"}, {"h2d_gbps": 0}])
def test_run_refuses_a_hardware_profile_of_the_wrong_types_in_one_sentence(bundle_dir, tmp_path, edit):
    from moetool.engine.clock import HW_DIR

    hw = {**json.loads((HW_DIR / "rtx3090.json").read_text()), **edit}
    write(tmp_path / "hw.json", hw)
    line = cli_refuses(["run", "--bundle", str(bundle_dir), "--clock", "sim", "--hw", str(tmp_path / "hw.json"),
                        "--prompt", "hi", "--max-new-tokens", "2", "--out", str(tmp_path / "r.json")])
    assert "hw.json" in line and "h2d_gbps" in line
    assert listing(tmp_path) == {"hw.json"}

"""Inputs that are not what they claim, and reads without bounds (issue 45, classes 1 and 2): each test
here failed on the code before it. `tests/test_faults.py` holds the other classes.

1. An input that is not what it claims is refused, not used: a tokenizer the checkpoint names must
   load, weights the config does not use are a mismatch, every file of a bundle's model/ is checked,
   and `verify` holds a bundle to exactly what its manifest lists.
2. Reads are bounded: every file moetool reads whole is a regular file of bounded size (FIFOs,
   devices, directories and oversized files are one sentence), a grid's YAML aliases are bounded in
   expansion, and a refusal quotes a short prefix of a value.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from helpers import manifest, rewrite, synthetic_profile
from helpers import SOME, copy, run_args
from helpers import one_error_line as error_line
from moetool.cli import app
from moetool.errors import MoetoolError
from moetool.files import GRID_BYTES, PROMPTS_BYTES, read_bytes
from moetool.quant.quantize import QuantizeConfig, quantize
from tiny import save_tiny

runner = CliRunner()


# ---- 1. an input that is not what it claims -----------------------------------------------------------

DAMAGE = ("remove tokenizer.json", "truncate tokenizer.json", "garble tokenizer.json", "vocabulary-less class")


def damage_tokenizer(directory: Path, how: str, at: float, cls: str) -> bool:
    """Damage the tokenizer files of `directory`; False when the damage happens to leave the same JSON."""
    tok = directory / "tokenizer.json"
    text = tok.read_bytes()
    if how == "remove tokenizer.json":
        tok.unlink()
    elif how == "truncate tokenizer.json":
        tok.write_bytes(text[:int(at * (len(text) - 1))])
        try:
            return json.loads(tok.read_bytes()) != json.loads(text)  # only trailing whitespace cut: still whole
        except ValueError:
            return True
    elif how == "garble tokenizer.json":
        tok.write_bytes(bytes(range(256)) * 3)
    else:  # a class that needs vocabulary files the directory does not have (transformers 5 builds it empty)
        tok.unlink()
        (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": cls}))
    return True


@SOME
@given(how=st.sampled_from(DAMAGE), at=st.floats(0, 1),
       cls=st.sampled_from(["Qwen2Tokenizer", "LlamaTokenizer", "GPT2Tokenizer", "PreTrainedTokenizerFast"]))
def test_a_tokenizer_the_checkpoint_names_loads_or_is_one_sentence(char_ckpt, tmp_path_factory, how, at, cls):
    from moetool.tokenizer import load_tokenizer

    directory = copy(char_ckpt, tmp_path_factory.mktemp("tok") / "m")
    if not damage_tokenizer(directory, how, at, cls):
        assert load_tokenizer(str(directory))("Hi").input_ids  # undamaged after all: it loads and tokenizes
        return
    with pytest.raises(MoetoolError) as info:
        load_tokenizer(str(directory))  # it was None, and the text was tokenized as bytes instead
    assert str(info.value).startswith(f"the tokenizer in {directory}") and "\n" not in str(info.value)


@pytest.mark.parametrize("how", ["remove tokenizer.json", "truncate tokenizer.json"])
def test_run_and_quantize_refuse_a_checkpoint_whose_tokenizer_does_not_load(char_ckpt, tmp_path, how):
    directory = copy(char_ckpt, tmp_path / "m")
    damage_tokenizer(directory, how, 0.5, "")
    args = ["run", "--model", str(directory), "--prompt", "Hi", "--max-new-tokens", "2", "--clock", "sim"]
    assert f"the tokenizer in {directory}" in error_line(runner.invoke(app, args))  # it generated empty text, exit 0
    out = tmp_path / "q"
    line = error_line(runner.invoke(app, ["quantize", str(directory), "--bits", "4", "--group-size", "16",
                                          "--no-hqq-optimize", "--out", str(out)]))
    assert f"the tokenizer in {directory}" in line and not out.exists()  # no bundle carrying the broken file


def test_weights_the_config_does_not_use_are_a_mismatch_not_a_shorter_model(char_ckpt, tmp_path):
    directory = copy(char_ckpt, tmp_path / "m")
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(num_hidden_layers=1, layer_types=cfg.get("layer_types", ["full_attention"] * 2)[:1])
    (directory / "config.json").write_text(json.dumps(cfg))
    for args in (["run", "--model", str(directory), "--prompt", "Hi", "--max-new-tokens", "2", "--clock", "sim"],
                 ["check", str(directory)],
                 ["quantize", str(directory), "--bits", "4", "--group-size", "16", "--out", str(tmp_path / "q")]):
        line = error_line(runner.invoke(app, args))
        assert "weights its config.json does not use" in line and "model.layers.1." in line
    assert not (tmp_path / "q").exists()


@pytest.fixture(scope="module")
def big_tokenizer_bundle(tmp_path_factory) -> Path:
    """A bundle whose tokenizer.json is over 1 MiB (a real vocabulary is 2-30 MiB): the size at which
    files of model/ used to be checked by their size only."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("bigtok")
    model = save_tiny("qwen2_moe", root / "m")
    chars = ["\n"] + [chr(i) for i in range(32, 127)]
    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    vocab |= {f"unused-token-{i:06d}": 98 + i for i in range(60_000)}  # never produced: the split is per character
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(model)
    assert (model / "tokenizer.json").stat().st_size > 1 << 20
    out = root / "b"
    quantize(QuantizeConfig(model=str(model), out=out, bits=(16, 4), group_size=16, dtype="float32",
                            hqq_optimize=False))
    return out


@SOME
@given(data=st.data())
def test_an_edit_of_any_file_of_a_bundles_model_directory_is_one_sentence_naming_it(big_tokenizer_bundle,
                                                                                   tmp_path_factory, data):
    directory = copy(big_tokenizer_bundle, tmp_path_factory.mktemp("edit") / "b")
    files = sorted(f.name for f in (directory / "model").iterdir() if f.name != "non_expert.safetensors")
    name = data.draw(st.sampled_from(files), "file")
    path = directory / "model" / name
    raw = bytearray(path.read_bytes())
    at = data.draw(st.integers(0, len(raw) - 1), "offset")
    raw[at] = data.draw(st.sampled_from([b for b in b" {}\"0x" if b != raw[at]]), "byte")
    path.write_bytes(bytes(raw))  # the same size: only a checksum tells
    line = error_line(runner.invoke(app, run_args(directory)))
    assert f"model/{name} in the bundle in {directory} is corrupt" in line


def _stray_shard(b: Path) -> str:
    shutil.copy(b / "layer-000.safetensors", b / "layer-007.safetensors")  # another layer's shard, of no entry
    return "layer-007.safetensors"


def _stray_model_file(b: Path) -> str:
    (b / "model" / "notes.txt").write_text("mine")
    return "model/notes.txt"


def _one_blob_twice(b: Path) -> str:
    doc = manifest(b)
    first, second = [e for e in doc["entries"] if e["layer"] == 0 and e["bits"] == 4][:2]
    second.update(offset=first["offset"], crc32=first["crc32"])  # expert 1 served expert 0's weights
    rewrite(b, doc)
    return "inside the blob of"


@pytest.mark.parametrize("edit", [_stray_shard, _stray_model_file, _one_blob_twice])
def test_verify_holds_a_bundle_to_exactly_what_its_manifest_lists(char_bundle, tmp_path, edit):
    directory = copy(char_bundle, tmp_path / "b")
    assert runner.invoke(app, ["verify", str(directory)]).exit_code == 0
    says = edit(directory)
    assert says in error_line(runner.invoke(app, ["verify", str(directory)]))  # it said OK


# ---- 2. reads without bounds --------------------------------------------------------------------------

@pytest.fixture
def fifo_writer():
    """Make FIFOs that cannot hang a test: a reader that opens one (the code before these fixes) gets
    end-of-file; after the test, each FIFO is opened once from this side, so no thread stays blocked."""
    made: list[Path] = []

    def make(path: Path) -> Path:
        os.mkfifo(path)
        made.append(path)
        threading.Thread(target=lambda: open(path, "wb").close(), daemon=True).start()  # blocks until a reader
        return path

    yield make
    for path in made:
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))  # releases the writer thread if nobody read
        except OSError:
            pass


KINDS = ("fifo", "character device", "directory", "oversized")


def special_file(path: Path, kind: str, limit: int, excess: int, fifo) -> str:
    """Put a file of `kind` at `path`; the words a refusal of it must hold."""
    if kind == "fifo":
        fifo(path)
        return "is a FIFO, not a regular file"
    if kind == "character device":
        path.symlink_to("/dev/null")  # a device that reads as empty: /dev/zero would read forever
        return "is a character device"
    if kind == "directory":
        path.mkdir()
        return "is a directory"
    with open(path, "wb") as f:
        f.truncate(limit + excess)  # sparse: no disk is used, yet it is too large to read
    return "moetool reads of such a file"


# (reader, arguments that make moetool read PATH whole, the most it reads of it)
READERS = {
    "report's *.run.json": (lambda p, ctx: ["report", str(p.parent), "--out", str(ctx["tmp"] / "rep")], None),
    "run --prompts": (lambda p, ctx: [*run_args(ctx["bundle"])[:-2], "--prompts", str(p)], PROMPTS_BYTES),
    "run --hw": (lambda p, ctx: run_args(ctx["bundle"], "--hw", str(p)), GRID_BYTES),
    "run --fit": (lambda p, ctx: run_args(ctx["bundle"], "--fit", str(p)), None),
    "eval ppl --data": (lambda p, ctx: ["eval", "ppl", "--bundle", str(ctx["bundle"]), "--data", str(p)], None),
    "fit --runs": (lambda p, ctx: ["fit", str(ctx["profile"]), "--runs", str(p), "--out", str(ctx["tmp"] / "f.json")],
                   None),
    "sweep grid file": (lambda p, ctx: ["sweep", str(p), "--workers", "0", "--out", str(ctx["tmp"] / "sw")],
                        GRID_BYTES),
}


@pytest.mark.parametrize("reader", sorted(READERS))
@settings(max_examples=2, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(KINDS), excess=st.integers(1, 1 << 20))
@example(kind="fifo", excess=1)
@example(kind="character device", excess=1)
@example(kind="directory", excess=1)
@example(kind="oversized", excess=1)
def test_every_file_moetool_reads_whole_is_a_regular_file_of_bounded_size(reader, kind, excess, char_bundle,
                                                                          tmp_path_factory, fifo_writer):
    args, limit = READERS[reader]
    if kind == "oversized" and limit is None:
        kind = "fifo"  # 256 MiB limits: the code before these fixes would read it all, so not here
    tmp = tmp_path_factory.mktemp("read")
    profile = tmp / "p.profile.json"
    synthetic_profile().save(profile)
    path = tmp / "in" / "x.run.json"
    path.parent.mkdir()
    says = special_file(path, kind, limit or 0, excess, fifo_writer)
    line = error_line(runner.invoke(app, args(path, {"bundle": char_bundle, "tmp": tmp, "profile": profile})))
    assert says in line and str(path.name) in line


@settings(max_examples=30, deadline=None, database=None, derandomize=True)
@given(limit=st.integers(0, 1 << 16), size=st.integers(0, 1 << 17))
def test_read_bytes_reads_a_file_up_to_its_limit_and_refuses_one_past_it(limit, size, tmp_path_factory):
    path = tmp_path_factory.mktemp("size") / "f"
    path.write_bytes(b"x" * size)
    if size <= limit:
        assert read_bytes(path, limit) == b"x" * size
    else:
        with pytest.raises(MoetoolError, match="more than the"):
            read_bytes(path, limit)


def alias_bomb(width: int, depth: int) -> str:
    """YAML whose aliases expand to width**depth strings: a few lines, `width**depth` values once loaded."""
    lines = [f"- &a0 [{', '.join(['lol'] * width)}]"]
    lines += [f"- &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, depth)]
    return "[" + ", ".join(ln[2:] for ln in lines) + "]"


WHERE = {  # where in a grid a value goes: each of these is quoted back when it is refused
    "knob": lambda v, b: f"bundle: {b}\nprompts: [hi]\nset:\n  eviction: {v}\ngrid:\n  policy: [lru]\n",
    "setting": lambda v, b: f"bundle: {b}\nprompts: [hi]\nbudget: {v}\ngrid:\n  policy: [lru]\n",
    "axis value": lambda v, b: f"bundle: {b}\nprompts: [hi]\ngrid:\n  policy: [lru]\n  budget: [{{x: {v}}}]\n",
    "policy set": lambda v, b: f"bundle: {b}\nprompts: [hi]\ngrid:\n  policy: [{{policy: lru, set: {v}}}]\n",
}


@pytest.mark.parametrize("where", sorted(WHERE))
@settings(max_examples=4, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(width=st.integers(2, 6), depth=st.integers(1, 6))
@example(width=9, depth=9)  # the bomb: 387 million strings
def test_a_grid_is_bounded_in_expansion_and_a_refusal_quotes_a_short_prefix(where, width, depth, char_bundle,
                                                                          tmp_path_factory):
    grid = tmp_path_factory.mktemp("bomb") / "g.yaml"
    grid.write_text(WHERE[where](alias_bomb(width, depth), char_bundle))
    line = error_line(runner.invoke(app, ["sweep", str(grid), "--workers", "0", "--out", str(grid.parent / "o")]))
    assert len(line) < 400, line[:400]  # a sentence, not the value: the bomb's repr was gigabytes
    assert not (grid.parent / "o").exists()


@pytest.mark.parametrize("policy,knob", [("fate", "L"), ("dymoe", "config"), ("lru", "no_such_knob"),
                                         ("smoe", "cpu_assist")])
def test_a_long_knob_value_is_quoted_by_a_short_prefix(policy, knob, char_bundle):
    """A knob value (or name) refused on the command line: the sentence quotes its start, not all of it
    (an int, a HIGH/LOW string, an unknown name and a bool knob, each parsed in its own place)."""
    long = "9/" * 20_000
    setting = f"{long}=1" if knob == "no_such_knob" else f"{knob}={long}"
    line = error_line(runner.invoke(app, run_args(char_bundle, "--policy", policy, "--set", setting)))
    assert len(line) < 400, line[:400]
    assert "9/9/" in line  # the value is named, by its start

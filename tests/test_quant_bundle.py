"""Bundles of a tiny Qwen2-MoE: layout on disk, verification, refusal of bad input, resume."""

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open

from moetool.errors import MoetoolError
from moetool.model import load_model
from moetool.quant import Bundle, quantize
from moetool.quant.bundle import MANIFEST
from moetool.quant.quantize import JOURNAL
from helpers import quantize_config as config
from helpers import tiny_moe


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return tiny_moe(root / "a"), tiny_moe(root / "b", seed=1, hidden_size=48)


@pytest.fixture(scope="module")
def built(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundles") / "a"
    return quantize(config(models[0], out)), out


def test_bundle_holds_every_expert_at_every_precision(built, models):
    bundle, out = built
    lm = load_model(str(models[0]), dtype=torch.float32)
    assert len(bundle.entries) == 2 * 4 * 4 and len(bundle.shards) == 2
    sizes = bundle.sizes()
    assert list(sizes) == [16, 8, 4, 2] and sizes[16] > sizes[8] > sizes[4] > sizes[2]
    # quantize's "vs bf16" column without a stored reference (--no-reference): bf16 from the shapes
    assert bundle.bf16_bytes() == sizes[16]
    ob = Bundle.open(out, verify="full", model=lm.fingerprint)
    for layer in lm.geometry.layers:
        for expert in range(layer.num_experts):
            ref = lm.experts.get(layer.index, expert)
            assert torch.equal(ob.dequantize(layer.index, expert, 16).gate_up, ref.gate_up.bfloat16().float())
            errs = [ob.entry(layer.index, expert, b).rel_error["down"] for b in (16, 8, 4, 2)]
            assert errs == sorted(errs) and errs[-1] < 0.6
            outs = [ob.entry(layer.index, expert, b).out_error for b in (16, 8, 4, 2)]
            assert all(e is not None for e in outs) and outs == sorted(outs)
    e = ob.entry(0, 1, 4)
    assert ob.blob(0, 1, 4).shape == (e.nbytes,) and ob.layout(e).projections[0].group_size == 16
    assert bundle.settings["hqq"]["optimize"] is True and bundle.axis == 1
    assert Bundle.load(out / MANIFEST) == bundle  # the manifest round-trips through JSON


def test_shards_are_plain_safetensors(built):
    bundle, out = built
    ob = Bundle.open(out)
    for shard in bundle.shards:
        with safe_open(str(out / shard.name), framework="pt") as f:
            assert torch.equal(f.get_tensor("blobs"), ob.shards[shard.name])
            assert f.metadata()["layer"] == str(shard.layer)


def test_corrupt_shard_byte_is_refused_naming_the_shard(built, tmp_path):
    bundle, out = built
    copy = tmp_path / "bundle"
    shutil.copytree(out, copy)
    shard = copy / bundle.shards[1].name
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    Bundle.open(copy, verify="fast")  # same size and header: only a full check can see a flipped byte
    with pytest.raises(MoetoolError, match=r"shard layer-001\.safetensors .* corrupt"):
        Bundle.open(copy, verify="full")
    shard.write_bytes(bytes(data[:-1]))
    with pytest.raises(MoetoolError, match=r"shard layer-001\.safetensors .* bytes"):
        Bundle.open(copy, verify="fast")


def test_bundle_of_another_model_is_refused(built, models):
    _, out = built
    other = load_model(str(models[1]), dtype=torch.float32).fingerprint
    with pytest.raises(MoetoolError, match="was made for model"):
        Bundle.open(out, model=other)


def test_bundle_of_other_weights_of_the_same_architecture_is_refused(built, models, tmp_path):
    """Same config, other weights (a fine-tune, the demo model rebuilt in place): the config hash
    cannot tell them apart, the weights digest does; a copy of the same checkpoint elsewhere is the
    same model."""
    _, out = built
    copy = tmp_path / "copy"
    shutil.copytree(models[0], copy)
    assert load_model(str(copy), dtype=torch.float32).fingerprint.same_model(Bundle.open(out).manifest.model)
    Bundle.open(out, model=load_model(str(copy), dtype=torch.float32).fingerprint)
    retrained = tiny_moe(tmp_path / "retrained", seed=7)  # the same config as models[0]
    fp = load_model(str(retrained), dtype=torch.float32).fingerprint
    assert fp.config_sha256 == Bundle.open(out).manifest.model.config_sha256
    with pytest.raises(MoetoolError, match=r"was made for model .*weights [0-9a-f]{12}\), not for .*weights"):
        Bundle.open(out, model=fp)


def test_bad_settings_are_refused(models, tmp_path):
    with pytest.raises(MoetoolError, match="5 is not a stored precision"):
        quantize(config(models[0], tmp_path / "x", bits=(8, 5)))
    with pytest.raises(MoetoolError, match="unknown quantization method"):
        quantize(config(models[0], tmp_path / "x", method="awq"))
    with pytest.raises(MoetoolError, match="group size 64 does not divide"):
        quantize(config(models[0], tmp_path / "x", group_size=64))
    assert not (tmp_path / "x").exists()  # refused before anything is written


def test_finished_bundle_is_not_overwritten(built, models):
    _, out = built
    with pytest.raises(MoetoolError, match="already holds a finished bundle"):
        quantize(config(models[0], out))


class Interrupt(Exception):
    pass


def interrupt_after_first_shard(progress):
    if progress.stage == "shard":
        raise Interrupt


def test_interrupted_run_resumes_to_an_identical_bundle(built, models, tmp_path):
    bundle, out = built
    resumed_dir = tmp_path / "resumed"
    with pytest.raises(Interrupt):
        quantize(config(models[0], resumed_dir), progress=interrupt_after_first_shard)
    assert not (resumed_dir / MANIFEST).exists()
    assert (resumed_dir / JOURNAL).exists() and (resumed_dir / "layer-000.safetensors").exists()
    assert not list(resumed_dir.glob("*.tmp")) and not list(resumed_dir.glob(".*.tmp"))

    seen = []
    again = quantize(config(models[0], resumed_dir), progress=seen.append)
    assert {p.layer for p in seen if p.stage == "expert"} == {1}  # layer 0 came from the journal
    assert again == bundle
    assert (resumed_dir / MANIFEST).read_text() == (out / MANIFEST).read_text()
    assert not (resumed_dir / JOURNAL).exists()
    Bundle.open(resumed_dir, verify="full")


def test_a_checkpoint_spelled_another_way_gives_the_same_manifest(built, models, tmp_path, monkeypatch):
    """`quantize ckpt`, `quantize /abs/ckpt` and `quantize ../ckpt` wrote the same shards but manifests that
    differed in model.source, so report, sweep and fit (which know a bundle by its manifest's sha256) took
    one bundle for three. The source is recorded resolved."""
    _, out = built
    model = models[0]
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    (tmp_path / "link").symlink_to(model)
    quantize(config(os.path.relpath(model), tmp_path / "x"))  # "../../models0/a"
    quantize(config(os.path.relpath(tmp_path / "link") + "/", tmp_path / "y"))  # "../link/", a link to it
    assert (tmp_path / "x" / MANIFEST).read_bytes() == (out / MANIFEST).read_bytes()
    assert (tmp_path / "y" / MANIFEST).read_bytes() == (out / MANIFEST).read_bytes()


def test_experts_of_small_weights_stored_coarser_than_their_bits_are_said(built, models, tmp_path):
    """hqq's step stops shrinking under a group range of ~0.013 at INT8: up rows scaled by 1e-3 (the model's
    function the same, down scaled up) were stored at "INT8" 96% off, with nothing said, and the recorded
    rel_error (gate and up stacked) read 0.005. Each entry records its worst row; quantize says so."""
    from safetensors.torch import load_file, save_file

    bundle, _ = built
    bound = {16: 0.01, 8: 0.05, 4: 0.5, 2: 1.0}  # bf16's rounding of fp32 weights, then `notes.ROW_BOUND`
    assert all(max(e.row_error.values()) <= bound[e.bits] for e in bundle.entries)
    small = tmp_path / "small"
    shutil.copytree(models[0], small)
    weights = load_file(small / "model.safetensors")
    for k in weights:
        if ".experts." in k and "up_proj" in k and "gate" not in k:
            weights[k] = weights[k] * 1e-3
    save_file(weights, small / "model.safetensors", metadata={"format": "pt"})
    said: list[str] = []
    got = quantize(config(small, tmp_path / "b", bits=(16, 8)), note=said.append)
    assert any(e.bits == 8 and e.row_error["gate_up"] > 0.05 for e in got.entries)
    assert [s for s in said if "coarser than their bits allow at INT8" in s and "row_error" in s], said


def test_resume_redoes_a_shard_that_no_longer_hashes_right(built, models, tmp_path):
    bundle, _ = built
    out = tmp_path / "c"
    with pytest.raises(Interrupt):
        quantize(config(models[0], out), progress=interrupt_after_first_shard)
    shard = out / "layer-000.safetensors"
    data = bytearray(shard.read_bytes())
    data[200] ^= 0x01
    shard.write_bytes(bytes(data))
    seen = []
    assert quantize(config(models[0], out, verify="full"), progress=seen.append) == bundle
    assert {p.layer for p in seen if p.stage == "expert"} == {0, 1}


def test_resume_with_other_settings_is_refused_and_a_deleted_directory_starts_clean(models, tmp_path):
    """Resumed with other settings (a forgotten option), the finished layers were deleted without a word:
    refused now, naming what changed; the directory deleted, the other settings start clean."""
    out = tmp_path / "b"
    with pytest.raises(Interrupt):
        quantize(config(models[0], out, bits=(4,)), progress=interrupt_after_first_shard)
    with pytest.raises(MoetoolError, match=r"holds 1 finished MoE layer\(s\) of an interrupted quantize of other "
                                           r"settings \(bits \[4\] -> \[2\]\)"):
        quantize(config(models[0], out, bits=(2,)))
    assert (out / "layer-000.safetensors").is_file()
    shutil.rmtree(out)
    seen = []
    bundle = quantize(config(models[0], out, bits=(2,)), progress=seen.append)
    assert {p.layer for p in seen if p.stage == "expert"} == {0, 1}
    assert bundle.bits == (2,) and {e.bits for e in bundle.entries} == {2}
    journal_free = json.loads((out / MANIFEST).read_text())
    assert journal_free["schema"] == "bundle" and not (out / JOURNAL).exists()


def test_calibration_tokens_come_from_the_text_in_sequences(tmp_path):
    from types import SimpleNamespace

    from moetool.quant.quantize import calibration_ids

    def char_tokenizer(text, add_special_tokens=True):  # one token per character: enough to check the slicing
        return SimpleNamespace(input_ids=[ord(c) % 128 for c in text])

    lm = SimpleNamespace(tokenizer=char_tokenizer, fingerprint=SimpleNamespace(source="stub"),
                         model=SimpleNamespace(config=SimpleNamespace(vocab_size=128)))
    text = tmp_path / "calib.txt"
    text.write_text("abcdefghij" * 30)  # 300 tokens
    ids = calibration_ids(lm, config(tmp_path, tmp_path / "o", calib_text=text, calib_tokens=256, calib_seq_len=64))
    assert ids.shape == (4, 64) and ids[0, 0] == ord("a") and ids[1, 0] == ord("e")  # 64 % 10 == 4
    text.write_text("too short")
    with pytest.raises(MoetoolError, match="fewer than one calibration sequence"):
        calibration_ids(lm, config(tmp_path, tmp_path / "o", calib_text=text, calib_seq_len=64))
    lm.tokenizer = None
    random_ids = calibration_ids(lm, config(tmp_path, tmp_path / "o", calib_tokens=128, calib_seq_len=64))
    assert random_ids.shape == (2, 64) and int(random_ids.max()) < 128


@pytest.mark.parametrize("moe_width,group", [(16, 16), (24, 8), (128, 64)])
def test_default_group_size_is_the_largest_that_tiles_every_projection(tmp_path, moe_width, group):
    """64 where the widths allow it; the demo model's 16-neuron experts need 16 (quantize must not refuse them)."""
    model = tiny_moe(tmp_path / "m", hidden_size=64, moe_intermediate_size=moe_width)
    bundle = quantize(config(model, tmp_path / "b", bits=(16, 4), group_size=0, calibrate=False))
    assert bundle.group_size == group
    assert {p.group_size for lay in bundle.layouts.values() if lay.bits == 4 for p in lay.projections} == {group}


@pytest.mark.parametrize("hidden,moe_width,said", [(40, 20, "--group-size 20"), (48, 24, "--group-size 24"),
                                                   (64, 16, None), (64, 9, "each input column stores")])
def test_a_group_too_small_to_save_bytes_is_said_with_the_group_that_would(tmp_path, hidden, moe_width, said):
    """Widths with few factors of two give groups of 4 or 8, where scales and zeros outweigh the codes
    (INT8 larger than bf16); quantize says so before the work, naming a group that divides every width."""
    model = tiny_moe(tmp_path / "m", hidden_size=hidden, moe_intermediate_size=moe_width)
    notes = []
    bundle = quantize(config(model, tmp_path / "b", group_size=0, calibrate=False, dtype="bfloat16"), note=notes.append)
    sizes = bundle.sizes()
    size_notes = [n for n in notes if "scale and a zero" in n]
    if said is None:
        assert not size_notes and sizes[2] < 0.3 * sizes[16]
    else:
        assert len(size_notes) == 1 and said in size_notes[0] and f"group size {bundle.group_size}" in size_notes[0]
        assert sizes[8] > 0.9 * sizes[16] or sizes[2] > 2.9 * sizes[16] / 8  # what the note is about, measured
        if bundle.group_size == 1:  # no group divides a width of 9 but one column ("groups of 1 columns" before)
            assert "no larger group divides" in size_notes[0]
            return
        wider = quantize(config(model, tmp_path / "b2", group_size=int(said.split()[-1]), calibrate=False,
                                bits=(16, 2)))
        assert wider.sizes()[2] < sizes[2]  # the group it names saves bytes


@pytest.mark.parametrize("tokens,said", [
    # sequences of the model's 128 positions, not moetool's 256: past them the model computes nothing it is used for
    (2048, "calibration uses 512 tokens (4 sequence(s) of 128), not the 2048 of --calib-tokens: the text holds no "
           "more whole sequences."),
    (100, "calibration uses 128 tokens (1 sequence(s) of 128), not the 100 of --calib-tokens: calibration takes "
          "whole sequences."),
])
def test_calibration_on_other_than_the_tokens_asked_for_says_so(char_ckpt, tmp_path, tokens, said):
    """A 600-token text calibrated on 512 tokens when 2048 were asked, and 100 asked calibrated on 256,
    each without a word."""
    from typer.testing import CliRunner

    from moetool.cli import app

    text = tmp_path / "calib.txt"
    text.write_text(("The king said hello. " * 30)[:600])  # one token a character
    done = CliRunner().invoke(app, ["quantize", str(char_ckpt), "--bits", "4", "--group-size", "16", "--no-reference",
                                    "--calibrate", "--calib-text", str(text), "--calib-tokens", str(tokens),
                                    "--out", str(tmp_path / "b")])
    assert done.exit_code == 0, done.output
    assert f"note: {said}" in " ".join(done.stderr.split()), done.stderr
    assert json.loads((tmp_path / "b" / "bundle.json").read_text())["settings"]["calibration"]["seq_len"] == 128

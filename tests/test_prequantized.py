"""Checkpoints released only in a low-bit format: block-scaled FP8 (DeepSeek-V3, MiniMax-M2, Qwen3's FP8
releases) and MXFP4 (gpt-oss), read dequantized as moetool streams them (`moetool/prequantized.py`).

The checkpoints are the tiny ones of `tests/tiny.py`, re-stored in each format the way those releases
store it: FP8 e4m3 codes per weight with a float32 `weight_scale_inv` per 16x16 block (amax / 448),
and MXFP4 `*_blocks` (two e2m1 codes a byte, 32 a block) with uint8 power-of-two `*_scales`.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from helpers import one_error_line
from moetool.cli import app
from tiny import save_tiny

runner = CliRunner()
BLOCK = 16  # FP8 block: smaller than the tiny weights, so a weight spans several blocks


def _cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def _quantized_by_fp8(key: str, t: torch.Tensor) -> bool:
    """The weights DeepSeek-V3's FP8 release stores in FP8: every linear layer's but the router's."""
    return (t.dim() >= 2 and key.endswith(".weight") and not any(s in key for s in ("embed", "lm_head", "norm"))
            and not key.endswith("mlp.gate.weight"))


def to_fp8(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    out = {}
    for key, t in tensors.items():
        if not _quantized_by_fp8(key, t):
            out[key] = t
            continue
        *lead, rows, cols = t.shape  # [out, in], or [E, out, in] for a fused experts tensor
        sr, sc = math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)
        padded = torch.zeros(*lead, sr * BLOCK, sc * BLOCK)
        padded[..., :rows, :cols] = t.float()
        blocks = padded.reshape(*lead, sr, BLOCK, sc, BLOCK)
        scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / 448.0  # [..., sr, sc]
        codes = (blocks / scale[..., :, None, :, None]).reshape(padded.shape)[..., :rows, :cols]
        out[key] = codes.to(torch.float8_e4m3fn).contiguous()
        out[key[:-len("weight")] + "weight_scale_inv"] = scale.contiguous()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def to_mxfp4(src: Path, dst: Path) -> Path:
    """gpt-oss's layout: experts' [E, in, out] weights as [E, out, in / 32, 16] code bytes and
    [E, out, in / 32] exponents (random codes: the numbers are transformers' to decode either way)."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    out = {}
    for key, t in tensors.items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            E, K, N = t.shape
            out[key + "_blocks"] = torch.randint(0, 256, (E, N, K // 32, 16), generator=g, dtype=torch.uint8)
            out[key + "_scales"] = torch.randint(118, 124, (E, N, K // 32), generator=g, dtype=torch.uint8)
        else:
            out[key] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """(the bf16 deepseek_v3 checkpoint, its FP8 release)."""
    root = tmp_path_factory.mktemp("fp8")
    plain = save_tiny("deepseek_v3", root / "bf16", dtype=torch.bfloat16)
    return plain, to_fp8(plain, root / "fp8")


def _tokens(*args) -> list:
    result = _cli("run", *args, "--prompt", "hello there", "--max-new-tokens", "6", "--clock", "sim", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["tokens"]


def test_dequantize_fp8_takes_the_blocks_of_a_ceil_divided_grid():
    """DeepSeek-V3's `weight_dequant`: block (i // b0, j // b1) scales element (i, j), also where the block
    does not divide the weight (V3's 576-row kv_a_proj_with_mqa in blocks of 128). transformers 5.24
    takes the block as rows // grid rows instead: 24 rows in a grid of 2 would be blocks of 12."""
    from moetool.prequantized import dequantize_fp8

    codes = torch.ones(24, 40).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # ceil(24 / 16) x ceil(40 / 16)
    w = dequantize_fp8(codes, scale, (16, 16))
    want = torch.tensor([[scale[i // 16, j // 16].item() for j in range(40)] for i in range(24)])
    assert torch.equal(w, want)
    e8 = torch.tensor([[127, 130]], dtype=torch.uint8)  # ue8m0 bytes: 2^0 and 2^3
    assert dequantize_fp8(torch.ones(4, 32).to(torch.float8_e4m3fn), e8, (16, 16))[0].tolist() == [1.0] * 16 + [8.0] * 16
    assert torch.equal(dequantize_fp8(codes, torch.tensor(0.5), None), torch.full((24, 40), 0.5))  # per tensor
    with pytest.raises(ValueError, match="no weight_block_size"):
        dequantize_fp8(codes, scale, None)


def test_an_fp8_checkpoint_is_read_as_the_numbers_its_scales_give(fp8):
    from moetool.model import load_model

    plain, quantized = fp8  # deepseek_v3's kv_a_proj_with_mqa: 24 rows, not a whole number of blocks
    result = _cli("check", quantized)  # against transformers loading it with dequantize=True
    assert result.exit_code == 0 and "PASS" in result.stdout, result.output
    # Not the raw codes cast to floats (what a lost scale gives: ~448 / amax times too large), but
    # the bf16 model within FP8's rounding (e4m3: 3 mantissa bits, ~6% of a block's largest value).
    lm, ref = load_model(str(quantized)), load_model(str(plain))
    for name, p in ref.model.named_parameters():
        if p.is_meta or p.dim() < 2:
            continue
        q = dict(lm.model.named_parameters())[name]
        assert (q - p).abs().max() <= 0.07 * p.abs().max() + 1e-6, name
    for layer in ref.geometry.layers:
        a, b = lm.experts.get(layer.index, 1).tensors(), ref.experts.get(layer.index, 1).tensors()
        for part in b:
            assert (a[part] - b[part]).abs().max() <= 0.07 * b[part].abs().max(), (layer.index, part)
            assert not torch.equal(a[part], b[part])  # dequantized FP8, not the bf16 weights


def test_an_fp8_checkpoints_bundle_runs_the_checkpoints_tokens(fp8, tmp_path):
    _, quantized = fp8
    out = tmp_path / "b"
    result = _cli("quantize", quantized, "--bits", "16,4", "--out", out)
    assert result.exit_code == 0 and "experts are FP8 times float32 block scales" in result.output, result.output
    # The bundle holds the model dequantized: its config no longer says FP8.
    assert "quantization_config" not in json.loads((out / "model" / "config.json").read_text())
    direct = _tokens("--model", quantized, "--policy", "lru")
    assert _tokens("--bundle", out, "--policy", "lru", "--set", "bits=16") == direct
    assert _tokens("--bundle", out, "--model", quantized, "--policy", "lru") == direct
    assert _cli("verify", out).exit_code == 0


@pytest.mark.parametrize("arch", ["mixtral", "granitemoe"])
def test_fp8_experts_per_expert_or_fused_are_read_exact_against_transformers(tmp_path, arch):
    """mixtral stores an expert per key (w1/w2/w3, renamed by transformers' conversion); granitemoe one
    [E, out, in] tensor a layer, which moetool reads a span of experts at a time (scales sliced too)."""
    from moetool.model import load_model

    quantized = to_fp8(save_tiny(arch, tmp_path / "bf16", dtype=torch.bfloat16), tmp_path / "fp8")
    result = _cli("check", quantized)
    assert result.exit_code == 0 and "PASS" in result.stdout, result.output
    lm = load_model(str(quantized))
    layer = lm.geometry.layers[0]
    whole = lm.experts.checkpoint.layer_experts(layer.path + ".experts")
    part = lm.experts.checkpoint.layer_experts(layer.path + ".experts", 1, 3)
    for name, t in part.items():
        assert torch.equal(t, whole[name][1:3]), name


def test_an_mxfp4_gpt_oss_checkpoint_is_read_as_transformers_reads_it(tmp_path):
    from moetool.model import load_model

    plain = save_tiny("gpt_oss", tmp_path / "bf16", dtype=torch.bfloat16, hidden_size=64, intermediate_size=32,
                      head_dim=16)
    quantized = to_mxfp4(plain, tmp_path / "mxfp4")
    result = _cli("check", quantized)
    assert result.exit_code == 0 and "PASS" in result.stdout, result.output
    w = load_model(str(quantized)).experts.get(0, 0).tensors()
    # e2m1 codes times powers of two (scales 118..123: 2^-9..2^-4): every value is one of them.
    grid = {c * 2.0 ** e for c in (0, 0.5, 1, 1.5, 2, 3, 4, 6) for e in range(-9, -3)}
    for part, t in w.items():
        if t.dim() == 2:
            assert {abs(v) for v in t.flatten().tolist()} <= grid, part
            assert t.abs().max() > 0, part


def test_a_quantized_tensor_without_its_scales_is_refused_not_cast(fp8, tmp_path):
    """transformers loads an FP8 weight whose scale is missing as its codes cast to floats, silently."""
    _, quantized = fp8
    damaged = shutil.copytree(quantized, tmp_path / "m")
    tensors = load_file(damaged / "model.safetensors")
    key = next(k for k in sorted(tensors) if k.endswith("self_attn.o_proj.weight_scale_inv"))
    del tensors[key]
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
    weight = key[:-len("_scale_inv")]
    for args in (["run", "--model", damaged, "--prompt", "hi", "--max-new-tokens", "2"], ["check", damaged],
                 ["quantize", damaged, "--bits", "4", "--out", tmp_path / "b"]):
        line = one_error_line(_cli(*args))
        assert f"stores {weight} in FP8 without its scales" in line, line
    assert not (tmp_path / "b").exists()


def test_an_fp8_scale_of_the_wrong_grid_is_one_sentence(fp8, tmp_path):
    _, quantized = fp8
    damaged = shutil.copytree(quantized, tmp_path / "m")
    tensors = load_file(damaged / "model.safetensors")
    key = next(k for k in sorted(tensors) if "experts.2.up_proj.weight_scale_inv" in k)
    tensors[key] = torch.ones(3, 3)
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
    line = one_error_line(_cli("run", "--model", damaged, "--prompt", "hi", "--max-new-tokens", "2"))
    assert "cannot be dequantized: scale grid (3, 3) is not that of a 16 x 32 weight in 16 x 16 blocks" in line, line


def test_mxfp4_codes_without_their_scales_are_refused(tmp_path):
    plain = save_tiny("gpt_oss", tmp_path / "bf16", dtype=torch.bfloat16, hidden_size=64, intermediate_size=32,
                      head_dim=16)
    quantized = to_mxfp4(plain, tmp_path / "mxfp4")
    tensors = load_file(quantized / "model.safetensors")
    key = next(k for k in sorted(tensors) if k.endswith("down_proj_scales"))
    del tensors[key]
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    line = one_error_line(_cli("run", "--model", quantized, "--prompt", "hi", "--max-new-tokens", "2"))
    assert f"stores {key[:-len('scales')]}blocks in MXFP4 without its scales" in line, line

"""The CLI: exit codes, one-sentence errors, JSON output."""

import json

import pytest
from transformers import AutoConfig
from typer.testing import CliRunner

from moetool.cli import app

runner = CliRunner()

UNSUPPORTED = {
    "dbrx": dict(d_model=32, n_heads=4, n_layers=2, vocab_size=128, max_seq_len=64,
                 ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2},
                 attn_config={"kv_n_heads": 2, "rope_theta": 10000.0}),
    "llama4_text": dict(hidden_size=32, intermediate_size=16, intermediate_size_mlp=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=128,
                        num_local_experts=4),
    "switch_transformers": dict(d_model=32, d_ff=16, num_layers=2, num_heads=4, num_experts=4, vocab_size=128,
                                d_kv=8),
}


def _one_error_line(result):
    assert result.exit_code == 1, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


def test_check_passes_with_table_and_json(tiny_ckpt):
    result = runner.invoke(app, ["check", str(tiny_ckpt("qwen3_moe"))])
    assert result.exit_code == 0, result.output
    assert "PASS" in result.stdout
    result = runner.invoke(app, ["check", str(tiny_ckpt("qwen3_moe")), "--json"])
    data = json.loads(result.stdout)
    assert data["schema"] == "check" and data["passed"] and len(data["layers"]) == 2


def test_missing_path(tmp_path):
    assert "does not exist" in _one_error_line(runner.invoke(app, ["check", str(tmp_path / "nope")]))


def test_dense_model_is_refused(tmp_path):
    AutoConfig.for_model("llama", hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128).save_pretrained(tmp_path)
    assert "dense model" in _one_error_line(runner.invoke(app, ["check", str(tmp_path)]))


@pytest.mark.parametrize("arch", sorted(UNSUPPORTED))
def test_unsupported_moe_architecture_is_named(tmp_path, arch):
    AutoConfig.for_model(arch, **UNSUPPORTED[arch]).save_pretrained(tmp_path)
    line = _one_error_line(runner.invoke(app, ["check", str(tmp_path)]))
    assert f"'{arch}'" in line and "does not support" in line


def test_corrupt_safetensors(tiny_ckpt, tmp_path):
    import shutil

    ckpt = shutil.copytree(tiny_ckpt("mixtral"), tmp_path / "ckpt")
    shard = ckpt / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[:8] = (10**12).to_bytes(8, "little")  # header length far past the end of the file
    shard.write_bytes(bytes(data))
    line = _one_error_line(runner.invoke(app, ["check", str(ckpt)]))
    assert "cannot load the weights" in line


def test_directory_without_config(tmp_path):
    assert "no config.json" in _one_error_line(runner.invoke(app, ["check", str(tmp_path)]))

"""A seventh pass, over checkpoints as they are found on the hub and on disk: each test here, but the
controls named `..._still_runs`, failed on the code before it (a prompt on the terminal, a traceback, a
misleading sentence, or a model run other than the checkpoint's without a word).

1. Code shipped with a checkpoint (an `auto_map`): a model type or a tokenizer class transformers does
   not ship is one sentence, never a "run the custom code? [y/N]" prompt; a type it does not know, or
   none, is named as such.
2. Weight files as they lie: a .safetensors beside model.safetensors that is not the model's, a weight
   stored twice, an index that lists nothing, pickled weights (advice that works in transformers 5).
3. Tied embeddings as transformers ties them: lm_head stored alone runs; stored beside a different
   embedding under a config that ties them is one sentence.
4. A checkpoint for another task (a classifier, the bare model): named as such.
5. A hub snapshot copied without its blobs: a link that leads nowhere is named, never read as absent.
6. A generation_config.json asking for beam search: a traceback after the load; now greedy, as documented.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from helpers import one_error_line, save_char_tokenizer
from moetool.cli import app
from tiny import tiny_config

runner = CliRunner()


def _cli(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def _run(model: Path, *extra: object):
    return _cli("run", "--model", model, "--prompt", "Hello", "--max-new-tokens", "1", "--clock", "sim", *extra)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, **fields) -> Path:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(fields)
    for k in [k for k, v in fields.items() if v is None]:
        data.pop(k)
    path.write_text(json.dumps(data))
    return path.parent


@pytest.fixture
def no_prompt(monkeypatch):
    """Every call of input() (transformers' "Do you wish to run the custom code? [y/N]"), recorded."""
    asked: list[str] = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": asked.append(prompt) or "")
    return asked


# ---- 1. code shipped with a checkpoint -------------------------------------------------------------

_CUSTOM = {"AutoConfig": "configuration_deepseek.DeepseekConfig",
           "AutoModelForCausalLM": "modeling_deepseek.DeepseekForCausalLM"}


@pytest.mark.parametrize("command", ["check", "quantize"])
def test_a_model_type_defined_by_shipped_code_is_one_sentence_without_a_prompt(tiny_ckpt, tmp_path, no_prompt,
                                                                                command):
    """deepseek-ai/deepseek-moe-16b's config.json: model_type "deepseek", an auto_map to its own modeling
    file. transformers asked on the terminal whether to run it, then failed in several lines."""
    ckpt = _edit_json(_copy(tiny_ckpt("deepseek_v3"), tmp_path / "m") / "config.json", model_type="deepseek",
                      architectures=["DeepseekForCausalLM"], auto_map=_CUSTOM)
    out = tmp_path / "b"
    args = ("check", ckpt) if command == "check" else ("quantize", ckpt, "--bits", "4", "--out", out)
    line = one_error_line(_cli(*args))
    assert "the model type 'deepseek'" in line and "defined by code shipped with the checkpoint" in line
    assert "auto_map" in line and "does not run" in line and "docs/models.md" in line
    assert no_prompt == [] and not out.exists()


def test_an_auto_map_without_an_auto_config_is_the_same_sentence(tiny_ckpt, tmp_path, no_prompt):
    """XVERSE-MoE style: only AutoModelForCausalLM is mapped; transformers said it does not recognize the type."""
    ckpt = _edit_json(_copy(tiny_ckpt("qwen2_moe"), tmp_path / "m") / "config.json", model_type="xverse",
                      auto_map={"AutoModelForCausalLM": "modeling_xverse.XverseForCausalLM"})
    line = one_error_line(_run(ckpt))
    assert "'xverse'" in line and "defined by code shipped with the checkpoint" in line and no_prompt == []


@pytest.mark.parametrize("model_type, said", [("qwen9_moe", "does not know the model type 'qwen9_moe'"),
                                              (None, "names no model_type")])
def test_a_model_type_transformers_lacks_is_named(tiny_ckpt, tmp_path, model_type, said):
    """No auto_map: a type of a newer transformers, or none (transformers guessed one from the path)."""
    ckpt = _edit_json(_copy(tiny_ckpt("qwen2_moe"), tmp_path / "m") / "config.json", model_type=model_type)
    line = one_error_line(_run(ckpt))
    assert said in line and "docs/models.md" in line


def test_an_auto_map_beside_a_type_transformers_ships_still_runs(tiny_ckpt, tmp_path, no_prompt):
    """DeepSeek-V3's config.json maps its own code too: moetool runs transformers' class, as before."""
    ckpt = _edit_json(_copy(tiny_ckpt("qwen2_moe"), tmp_path / "m") / "config.json", auto_map=_CUSTOM)
    result = _cli("check", ckpt)
    assert result.exit_code == 0, result.output
    assert no_prompt == []


def _custom_tokenizer(directory: Path, tokenizer_json: bool) -> Path:
    save_char_tokenizer(directory)
    if not tokenizer_json:  # Kimi-K2: a tiktoken file its own class reads, no tokenizer.json
        (directory / "tokenizer.json").unlink()
        (directory / "tiktoken.model").write_text("IQ== 0\n")
    return _edit_json(directory / "tokenizer_config.json", tokenizer_class="TikTokenTokenizer",
                      auto_map={"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]})


@pytest.mark.parametrize("arch, tokenizer_json", [("qwen2_moe", True), ("deepseek_v3", False)])
def test_a_tokenizer_class_defined_by_shipped_code_is_one_sentence(tiny_ckpt, tmp_path, no_prompt, arch,
                                                                   tokenizer_json):
    """A native model whose tokenizer_config.json maps a class of its own. With a tokenizer.json beside it,
    transformers silently built another tokenizer from that file (the run went on, its ids maybe not the
    model's); without one (deepseek_v3 has no tokenizer of transformers') it asked on the terminal."""
    ckpt = _custom_tokenizer(_copy(tiny_ckpt(arch), tmp_path / "m"), tokenizer_json)
    line = one_error_line(_run(ckpt))
    assert "the class 'TikTokenTokenizer', defined by code shipped with the checkpoint" in line
    assert "tokenizer_config.json's auto_map" in line and no_prompt == []


def test_a_custom_tokenizer_made_native_as_the_sentence_says_still_runs(tiny_ckpt, tmp_path):
    ckpt = _custom_tokenizer(_copy(tiny_ckpt("qwen2_moe"), tmp_path / "m"), True)
    _edit_json(ckpt / "tokenizer_config.json", auto_map=None, tokenizer_class="TokenizersBackend")
    result = _run(ckpt)
    assert result.exit_code == 0, result.output


# ---- 2. weight files as they lie -------------------------------------------------------------------

def test_a_safetensors_file_beside_model_safetensors_is_not_read(tiny_ckpt, tmp_path):
    """A PEFT adapter (or Mistral's consolidated.safetensors) beside the model: transformers reads
    model.safetensors only; moetool read every .safetensors and blamed the config."""
    ckpt = _copy(tiny_ckpt("qwen2_moe"), tmp_path / "m")
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 32)}, ckpt / "adapter_model.safetensors")
    result = _cli("check", ckpt)
    assert result.exit_code == 0, result.output


def _split(ckpt: Path) -> dict[str, torch.Tensor]:
    """`ckpt`'s weights in two shards with no index (an index lost in a copy); returns them."""
    tensors = load_file(ckpt / "model.safetensors")
    keys = sorted(tensors)
    save_file({k: tensors[k] for k in keys[:len(keys) // 2]}, ckpt / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] for k in keys[len(keys) // 2:]}, ckpt / "model-00002-of-00002.safetensors")
    (ckpt / "model.safetensors").unlink()
    return tensors


def test_a_weight_stored_twice_is_refused_not_picked(tiny_ckpt, tmp_path):
    """Shards of two copies side by side: the one read last won, silently."""
    ckpt = _copy(tiny_ckpt("qwen2_moe"), tmp_path / "m")
    tensors = _split(ckpt)
    save_file({"lm_head.weight": tensors["lm_head.weight"] * 2}, ckpt / "model-00003-of-00003.safetensors")
    line = one_error_line(_run(ckpt))
    assert "stores the weight lm_head.weight twice" in line and "model-00003-of-00003.safetensors" in line


def test_a_checkpoint_of_shards_without_their_index_still_runs(tiny_ckpt, tmp_path):
    ckpt = _copy(tiny_ckpt("qwen2_moe"), tmp_path / "m")
    _split(ckpt)
    result = _run(ckpt)
    assert result.exit_code == 0, result.output


def test_an_index_that_lists_no_shard_is_named(tiny_ckpt, tmp_path):
    """It said the directory held no safetensors weights, beside its model.safetensors."""
    ckpt = _copy(tiny_ckpt("qwen2_moe"), tmp_path / "m")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    line = one_error_line(_run(ckpt))
    assert "model.safetensors.index.json lists no shard" in line


def test_pickled_weights_are_refused_with_advice_that_works(tiny_ckpt, tmp_path):
    """The sentence said save_pretrained(safe_serialization=True), an argument transformers 5 no longer has;
    what it says now converts the checkpoint."""
    from transformers import AutoModelForCausalLM

    ckpt = _copy(tiny_ckpt("qwen2_moe"), tmp_path / "m")
    torch.save(load_file(ckpt / "model.safetensors"), ckpt / "pytorch_model.bin")
    (ckpt / "model.safetensors").unlink()
    line = one_error_line(_run(ckpt))
    assert "pickled (.bin) weights" in line and "safe_serialization" not in line
    assert "from_pretrained" in line and "save_pretrained" in line
    AutoModelForCausalLM.from_pretrained(ckpt).save_pretrained(tmp_path / "converted")
    result = _run(tmp_path / "converted")
    assert result.exit_code == 0, result.output


# ---- 3. tied embeddings ----------------------------------------------------------------------------

def _tied(src: Path, dst: Path, keep: str) -> Path:
    """A copy of `src` whose config ties lm_head to the embedding; `keep`: "both" (different values),
    "lm_head" (the head alone, as some converters save a tied pair)."""
    ckpt = _edit_json(_copy(src, dst) / "config.json", tie_word_embeddings=True)
    if keep == "lm_head":
        tensors = load_file(ckpt / "model.safetensors")
        del tensors["model.embed_tokens.weight"]
        save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    return ckpt


def test_a_tied_pair_stored_with_different_values_is_one_sentence(tiny_ckpt, tmp_path):
    """transformers leaves such a pair untied (and warns); moetool tied lm_head to the embedding and ran
    another model without a word."""
    ckpt = _tied(tiny_ckpt("qwen2_moe"), tmp_path / "m", "both")
    line = one_error_line(_run(ckpt))
    assert "stores lm_head.weight and model.embed_tokens.weight with different values" in line
    assert '"tie_word_embeddings": false' in line
    out = tmp_path / "b"
    one_error_line(_cli("quantize", ckpt, "--bits", "4", "--out", out))
    assert not out.exists()
    _edit_json(ckpt / "config.json", tie_word_embeddings=False)  # as the sentence says: runs, exactly
    result = _cli("check", ckpt)
    assert result.exit_code == 0, result.output


def test_a_tied_lm_head_stored_alone_runs_as_transformers_runs_it(tiny_ckpt, tmp_path):
    """It was refused as lacking model.embed_tokens.weight; transformers ties the embedding to the head."""
    from moetool.model import load_model

    ckpt = _tied(tiny_ckpt("qwen2_moe"), tmp_path / "m", "lm_head")
    result = _cli("check", ckpt)
    assert result.exit_code == 0, result.output
    model = load_model(ckpt).model
    stored = load_file(ckpt / "model.safetensors")["lm_head.weight"]
    assert torch.equal(model.model.embed_tokens.weight, stored) and torch.equal(model.lm_head.weight, stored)


# ---- 4. a checkpoint for another task --------------------------------------------------------------

@pytest.mark.parametrize("kind, said", [("classifier", "a sequence-classification (or reward) model"),
                                        ("bare", "the bare model, without a language-model head")])
def test_a_checkpoint_for_another_task_is_named(tmp_path, kind, said):
    """A reward model or the bare model saved alone: it was "weights its config.json does not use (score.weight)
    ... the config is of another model" or "lacks lm_head.weight ... incomplete"."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    torch.manual_seed(0)
    cls = AutoModelForSequenceClassification if kind == "classifier" else AutoModel
    cls.from_config(tiny_config("qwen2_moe", num_labels=1)).save_pretrained(tmp_path / "m")
    line = one_error_line(_run(tmp_path / "m"))
    name = "Qwen2MoeForSequenceClassification" if kind == "classifier" else "Qwen2MoeModel"
    assert f"holds '{name}' (config.json's architectures), {said}" in line and "ForCausalLM" in line


# ---- 5. a hub snapshot's links ---------------------------------------------------------------------

def _snapshot(src: Path, root: Path) -> Path:
    """`src` laid out as huggingface_hub caches it: snapshots/<rev>/<file> -> ../../blobs/<sha256>."""
    snapshot = root / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir()
    for f in sorted(src.iterdir()):
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, root / "blobs" / blob)
        os.symlink(f"../../blobs/{blob}", snapshot / f.name)
    return snapshot


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json", "generation_config.json"])
def test_a_link_into_missing_blobs_is_named(char_ckpt, tmp_path, name):
    """A snapshot copied with `cp -r` (links kept, blobs left behind) or a blob deleted from the cache:
    config.json was "no config.json", model.safetensors transformers' "no file named", and a missing
    tokenizer.json or generation_config.json was read as none: the text went in as bytes, silently."""
    snapshot = _snapshot(char_ckpt, tmp_path / "models--org--m")
    (tmp_path / "models--org--m" / "blobs" / os.readlink(snapshot / name).rsplit("/", 1)[1]).unlink()
    line = one_error_line(_run(snapshot))
    assert f"{snapshot / name} is a symbolic link to ../../blobs/" in line and "leads to no file" in line


def test_a_hub_snapshot_layout_still_runs(char_ckpt, tmp_path):
    result = _run(_snapshot(char_ckpt, tmp_path / "models--org--m"))
    assert result.exit_code == 0, result.output


# ---- 6. generation_config.json ---------------------------------------------------------------------

def test_a_generation_config_asking_for_beam_search_runs_greedily(tiny_ckpt, tmp_path):
    """generate(do_sample=False) still searched num_beams beams: its progress streamer refused them in a
    traceback after the model had loaded. moetool decodes greedily (the README), whatever the checkpoint's
    generation config asks: the same tokens as without it."""
    ckpt = _copy(tiny_ckpt("qwen2_moe"), tmp_path / "m")
    (ckpt / "generation_config.json").write_text(json.dumps({"num_beams": 4, "early_stopping": True}))
    greedy = _cli("run", "--model", tiny_ckpt("qwen2_moe"), "--prompt", "Hello", "--max-new-tokens", "3", "--json")
    beams = _cli("run", "--model", ckpt, "--prompt", "Hello", "--max-new-tokens", "3", "--json")
    assert beams.exit_code == greedy.exit_code == 0, beams.output
    assert json.loads(beams.stdout)["tokens"] == json.loads(greedy.stdout)["tokens"]


@pytest.mark.parametrize("asks", [{"max_time": 1e-9}, {"stop_strings": ["*"]}, {"do_sample": True, "num_return_sequences": 3}])
def test_a_generation_config_that_would_stop_or_multiply_a_run_is_not_taken(char_ckpt, tmp_path, asks):
    """`max_time` cut the host path's run to one token with exit code 0 (the captured step decoded all);
    `stop_strings` was transformers' traceback, as it needs a tokenizer handed to generate. `run` decodes
    all of --max-new-tokens, one sequence a prompt, on every path."""
    ckpt = _copy(char_ckpt, tmp_path / "m")
    (ckpt / "generation_config.json").write_text(json.dumps(asks))
    plain = _cli("run", "--model", char_ckpt, "--prompt", "Hello", "--max-new-tokens", "4", "--json")
    asked = _cli("run", "--model", ckpt, "--prompt", "Hello", "--max-new-tokens", "4", "--json")
    assert asked.exit_code == plain.exit_code == 0, asked.output
    assert json.loads(asked.stdout)["tokens"] == json.loads(plain.stdout)["tokens"]
    assert len(json.loads(asked.stdout)["tokens"][0]) == 4


def test_a_generation_config_asking_for_sampling_still_runs_greedily(tiny_ckpt, tmp_path):
    ckpt = _copy(tiny_ckpt("qwen2_moe"), tmp_path / "m")
    (ckpt / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0.9}))
    greedy = _cli("run", "--model", tiny_ckpt("qwen2_moe"), "--prompt", "Hello", "--max-new-tokens", "3", "--json")
    sampled = _cli("run", "--model", ckpt, "--prompt", "Hello", "--max-new-tokens", "3", "--json")
    assert sampled.exit_code == greedy.exit_code == 0, sampled.output
    assert json.loads(sampled.stdout)["tokens"] == json.loads(greedy.stdout)["tokens"]

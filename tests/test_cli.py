"""The CLI: exit codes, one-sentence errors, JSON output."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig
from typer.testing import CliRunner

from moetool.cli import app
from helpers import one_error_line as _one_error_line

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


def test_checkpoint_that_plain_transformers_cannot_run(tmp_path):
    """The reference forward itself fails (a hybrid whose every layer is linear attention has no
    sequence length for transformers' masks): one sentence naming transformers, no traceback."""
    from tiny import save_tiny

    ckpt = save_tiny("qwen3_next", tmp_path / "ckpt", layer_types=["linear_attention"] * 2)
    line = _one_error_line(runner.invoke(app, ["check", str(ckpt)]))
    assert "plain transformers" in line and "cannot run" in line and "config.json" in line
    # `run` cannot tell the checkpoint's fault from its own: the traceback, then a line that says
    # the error is transformers' and points to `moetool check`.
    result = runner.invoke(app, ["run", "--model", str(ckpt), "--prompt", "hi", "--max-new-tokens", "2"])
    assert result.exit_code == 1 and "Traceback" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "raised inside transformers" in last and "moetool check" in last


def test_sequences_past_the_models_context_are_refused(tiny_ckpt, tmp_path):
    """The tiny checkpoints have 128 positions (max_position_embeddings): a generation, a ppl window
    or a profile trace longer than that would run where the model has no trained positions. Each is
    refused in one sentence that names the option; ppl's default window is cut to the context."""
    ckpt = str(tiny_ckpt("qwen2_moe"))
    line = _one_error_line(runner.invoke(app, ["run", "--model", ckpt, "--prompt", "hi", "--max-new-tokens", "200"]))
    assert "--max-new-tokens 200" in line and "context of 128" in line
    line = _one_error_line(runner.invoke(app, ["eval", "ppl", "--model", ckpt, "--context", "200"]))
    assert "--context 200" in line and "context of 128" in line
    out = tmp_path / "p.json"
    line = _one_error_line(runner.invoke(app, ["profile", "--model", ckpt, "--what", "routing", "--seq-len", "120",
                                               "--decode-tokens", "9", "--out", str(out)]))
    assert "--seq-len 120 plus --decode-tokens 9" in line and not out.exists()
    result = runner.invoke(app, ["eval", "ppl", "--model", ckpt, "--limit", "300", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["options"]["context"] == 128  # 512 by default, cut to the model's


def test_a_prompt_past_the_context_is_named_among_several(tiny_ckpt, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("a", "x" * 126, "b")))
    line = _one_error_line(runner.invoke(app, ["run", "--model", str(tiny_ckpt("qwen2_moe")), "--prompts",
                                               str(prompts), "--max-new-tokens", "4"]))
    assert "the longest prompt (prompt 2 of 3, 126 tokens)" in line and "context of 128" in line


def test_a_model_of_one_position_has_no_perplexity_window(tmp_path):
    """Windows of one token predict nothing: a ppl over 0 tokens was a ZeroDivisionError in eval, and a
    sensitivity profile of ppl 1.0 everywhere (no layer sensitive, for fit to read)."""
    from tiny import save_tiny

    ckpt = str(save_tiny("qwen3_moe", tmp_path / "c1", max_position_embeddings=1))
    line = _one_error_line(runner.invoke(app, ["eval", "ppl", "--model", ckpt, "--limit", "64"]))
    assert "context is 1 token" in line and "needs 2 tokens or more" in line
    out = tmp_path / "p.json"
    line = _one_error_line(runner.invoke(app, ["profile", "--model", ckpt, "--what", "sensitivity", "--out", str(out)]))
    assert "context is 1 token" in line and not out.exists()


def test_dynamic_rope_runs_past_max_position_embeddings_as_far_as_its_factor(tmp_path):
    """Dynamic NTK scaling reads max_position_embeddings as where it starts rescaling, and exists to go
    past it (transformers does): 32 positions and factor 4 were refused at 50 tokens. They run, the same
    tokens as plain transformers' greedy ones, and past 32 x 4 the refusal names the factor."""
    from tiny import save_tiny

    from moetool.model import load_reference
    from moetool.run import RunConfig, run

    rope = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    path = save_tiny("qwen3_moe", tmp_path / "dyn", max_position_embeddings=32, rope_parameters=rope)
    prompt = "The quick brown fox jumps over"  # 30 tokens: bytes folded into the vocabulary
    got = run(RunConfig(model=str(path), policy="resident", budget="100%", decode="host", prompts=(prompt,),
                        max_new_tokens=20))
    ref = load_reference(path)
    ids = torch.tensor([[b % ref.config.vocab_size for b in prompt.encode()]])
    assert got.tokens[0] == ref.generate(ids, do_sample=False, max_new_tokens=20, min_new_tokens=20)[0, 30:].tolist()
    line = _one_error_line(runner.invoke(app, ["run", "--model", str(path), "--prompt", prompt, "--max-new-tokens", "99"]))
    assert "context of 128 (max_position_embeddings times its dynamic rope factor" in line


def test_directory_without_config(tmp_path):
    assert "no config.json" in _one_error_line(runner.invoke(app, ["check", str(tmp_path)]))


# -- where user input and the filesystem meet the CLI: one sentence, exit 1 ---------------------------------

def _refused(result, where, before=None):
    """Exit 1, one red sentence on stderr and no traceback; `where` holds what it held before (no stray files)."""
    line = _one_error_line(result)
    if before is not None:
        assert sorted(p.name for p in where.iterdir()) == before, list(where.iterdir())
    return line


@pytest.fixture()
def profile_file(tmp_path):
    from helpers import synthetic_profile

    return synthetic_profile().save(tmp_path / "s.profile.json")


def test_out_that_is_a_directory_is_refused_before_any_work(tiny_ckpt, profile_file, tmp_path):
    taken = tmp_path / "taken.json"
    taken.mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    for args in (["run", "--model", str(tiny_ckpt("qwen2_moe")), "--out", str(taken)],
                 ["eval", "ppl", "--model", str(tiny_ckpt("qwen2_moe")), "--out", str(taken)],
                 ["fit", str(profile_file), "--out", str(taken)],
                 ["profile", "--model", str(tiny_ckpt("qwen2_moe")), "--out", str(taken)],
                 ["check", str(tiny_ckpt("qwen2_moe")), "--out", str(taken)]):
        line = _refused(runner.invoke(app, args), tmp_path, before)
        assert f"--out {taken} is a directory" in line, (args, line)
        assert not any(taken.iterdir())


def test_out_under_a_file_or_a_file_for_a_directory_is_refused(profile_file, tmp_path):
    before = sorted(p.name for p in tmp_path.iterdir())
    under = profile_file / "s.fit.json"
    line = _refused(runner.invoke(app, ["fit", str(profile_file), "--out", str(under)]), tmp_path, before)
    assert f"lies under {profile_file}, which is a file" in line
    for args in (["report", str(profile_file), "--out", str(profile_file)],
                 ["sweep", "demo-runs", "--out", str(profile_file)],
                 ["quantize", "demo", "--out", str(profile_file)],
                 ["demo", "--out", str(profile_file)]):
        line = _refused(runner.invoke(app, args), tmp_path, before)
        assert f"--out {profile_file} is a file; give a directory" in line, (args, line)


def test_out_in_a_directory_this_user_cannot_write(profile_file, tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    # root may write anywhere, so the check is shown the answer an ordinary user would get
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: Path(p) != locked and real(p, mode, *a, **k))
    line = _refused(runner.invoke(app, ["fit", str(profile_file), "--out", str(locked / "s.fit.json")]), locked, [])
    assert f"{locked} is not writable" in line


def test_os_errors_from_deep_inside_are_one_sentence_with_path_and_cause(profile_file, tmp_path, monkeypatch):
    import moetool.artifacts
    import moetool.fit

    taken = tmp_path / "dir"
    taken.mkdir()

    def writes_a_directory(cfg, progress=None):
        taken.write_text("x")  # a real IsADirectoryError, with its path

    monkeypatch.setattr(moetool.fit, "fit", writes_a_directory)
    line = _one_error_line(runner.invoke(app, ["fit", str(profile_file), "--out", str(tmp_path / "s.fit.json")]))
    assert line == f"error: {taken}: Is a directory."

    monkeypatch.undo()

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(moetool.artifacts, "atomic_write_bytes", full)
    before = sorted(p.name for p in tmp_path.iterdir())
    line = _refused(runner.invoke(app, ["fit", str(profile_file), "--out", str(tmp_path / "s.fit.json")]),
                    tmp_path, before)
    assert "no space left on the device" in line and "run the same command again" in line


def test_a_bug_shows_its_traceback_and_asks_to_be_reported(profile_file, tmp_path, monkeypatch):
    import moetool.fit

    def buggy(cfg, progress=None):
        return {}["missing"]

    monkeypatch.setattr(moetool.fit, "fit", buggy)
    result = runner.invoke(app, ["fit", str(profile_file), "--out", str(tmp_path / "s.fit.json")])
    assert result.exit_code == 1
    assert "Traceback" in result.stderr and "KeyError: 'missing'" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: this is a bug in moetool") and "please report it" in last


@pytest.mark.parametrize("args,says", [
    (["--budget", "-3%"], "--budget '-3%' must be between 0% and 1000%"),
    (["--budget", "lots"], "--budget 'lots' is not a size"),
    (["--max-loss", "-1"], "--max-loss is a relative loss, 0 or more"),
    (["--max-loss", "nan"], "--max-loss is a relative loss, 0 or more"),
    (["--l-threshold", "2"], "--l-threshold is a recall between 0 and 1"),
    (["--r", "0.2"], "--r is a share of critical experts between 0.5"),
    (["--target-tpot", "0ms"], "--target-tpot must be more than 0 seconds"),
    (["--target-tpot", "soon"], "--target-tpot takes seconds"),
    (["--sweep", "--alphas", "0,2"], "--alphas are SMoE thresholds between 0 and 1"),
    (["--sweep", "--sweep-budget", "-1GiB"], "--sweep-budget '-1GiB' is not a size"),
    (["--sweep", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1, not 0"),
])
def test_fit_refuses_nonsense_values_in_one_sentence(profile_file, tmp_path, args, says):
    before = sorted(p.name for p in tmp_path.iterdir())
    line = _refused(runner.invoke(app, ["fit", str(profile_file), "--out", str(tmp_path / "s.fit.json"), *args]),
                    tmp_path, before)
    assert says in line, line


@pytest.mark.parametrize("args,says", [
    (["run", "--max-new-tokens", "-4"], "--max-new-tokens must be at least 1, not -4"),
    (["run", "--batch-size", "0"], "--batch-size must be at least 1, not 0"),
    (["run", "--budget", "-3%"], "--budget '-3%' must be between 0% and 1000%"),
    (["run", "--host-budget", "0GiB"], "--host-budget must be more than 0 bytes"),
    (["run", "--policy", "fastest"], "unknown policy 'fastest' (known: "),
    (["run", "--set", "nonsense"], "--set takes key=value, not 'nonsense'"),
    (["run", "--policy", "lru", "--set", "alpha=0.3"], "policy 'lru' has no knob 'alpha'"),
    (["run", "--hw", "abacus"], "no hardware profile 'abacus'"),
    (["run", "--prompt", " \n"], "prompt 1 of 1 is only whitespace; give it some text to continue."),
    (["run", "--hw", "gone.hw.json"], "no hardware profile file gone.hw.json (`moetool profile --what timing` writes"),
    (["run", "--device", "gpu"], "--device must be cpu or cuda"),
    (["eval", "ppl", "--limit", "0"], "--limit must be at least 1, not 0"),
    (["eval", "ppl", "--batch-size", "0"], "--batch-size must be at least 1, not 0"),
    (["eval", "ppl", "--context", "1"], "--context must be at least 2 tokens"),
    (["eval", "mmlu", "--num-fewshot", "-1"], "--num-fewshot must be 0 or more"),
    (["eval", "ppl", "--policy", "fastest"], "unknown policy 'fastest' (known: "),
    (["profile", "--seqs", "0"], "--seqs must be at least 1, not 0"),
    (["profile", "--seq-len", "1"], "--seq-len and --ppl-tokens must be at least 2 tokens"),
    (["profile", "--bits", "two"], "--bits takes comma-separated integers"),
])
def test_nonsense_values_are_refused_before_the_model_loads(tiny_ckpt, tmp_path, args, says, monkeypatch):
    import moetool.profile
    import moetool.run

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(moetool.run, "load", no_loading)  # what run and eval load through
    monkeypatch.setattr(moetool.profile, "load_model", no_loading)
    extra = ["--out", str(tmp_path / "x.json")] if args[0] == "profile" else []
    line = _refused(runner.invoke(app, [*args, "--model", str(tiny_ckpt("qwen2_moe")), *extra]), tmp_path, [])
    assert says in line, line
    if "unknown policy" in says:
        assert "dymoe" in line and "resident" in line  # the sentence lists the registered policies


def test_prompts_that_are_not_text(tiny_ckpt, tmp_path):
    binary = tmp_path / "prompts.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)
    line = _one_error_line(runner.invoke(app, ["run", "--model", str(tiny_ckpt("qwen2_moe")), "--prompts", str(binary)]))
    assert f"{binary} is not UTF-8 text" in line
    line = _one_error_line(runner.invoke(app, ["run", "--model", str(tiny_ckpt("qwen2_moe")), "--prompts", str(tmp_path)]))
    assert f"{tmp_path} is a directory; give a file" in line


def test_a_malformed_task_yaml_is_named_as_such_not_as_needing_the_hub(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    bad = tmp_path / "mine.yaml"
    bad.write_text("task: mine\ndoc_to_text: [unclosed\n")
    line = _one_error_line(runner.invoke(app, ["eval", str(bad), "--model", str(tiny_ckpt("qwen2_moe"))]))
    assert f"task file {bad} is not valid YAML" in line and "hub" not in line
    bad.write_text("- just\n- a list\n")
    line = _one_error_line(runner.invoke(app, ["eval", str(bad), "--model", str(tiny_ckpt("qwen2_moe"))]))
    assert f"task file {bad} is not an lm-eval task" in line
    bad.write_bytes(b"task: \x80\xfe")
    line = _one_error_line(runner.invoke(app, ["eval", str(bad), "--model", str(tiny_ckpt("qwen2_moe"))]))
    assert f"task file {bad} is not UTF-8 text" in line


def test_a_tag_of_lm_evals_own_is_not_malformed_yaml(tmp_path):
    from moetool.eval_tasks import _check_task_yaml

    ok = tmp_path / "ok.yaml"
    ok.write_text("task: mine\nprocess_docs: !function utils.process_docs\n")
    _check_task_yaml(ok)  # lm-eval resolves its own tags; only the syntax is checked here


def test_the_entry_point_runs_as_a_module_and_lists_every_command():
    done = subprocess.run([sys.executable, "-m", "moetool.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in ("check", "quantize", "verify", "profile", "fit", "run", "eval", "sweep", "report", "demo"):
        assert f" {name} " in done.stdout, name


def test_a_hub_id_offline_is_one_sentence_without_retries(tmp_path, monkeypatch):
    """No network here: a hub id not in the local cache fails at once, not after a minute of retry lines."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    result = runner.invoke(app, ["check", "no-such-org/no-such-model"])
    line = _one_error_line(result)
    assert "no-such-org/no-such-model" in line and "Retrying" not in result.output


def test_a_precision_the_experts_lack_is_one_sentence(tiny_ckpt, tmp_path):
    for policy in ("lru", "lod", "eap", "static", "smoe"):
        line = _one_error_line(runner.invoke(app, ["run", "--model", str(tiny_ckpt("qwen2_moe")), "--policy", policy,
                                                   "--set", "bits=4", "--out", str(tmp_path / "r.json")]))
        assert f"policy '{policy}' wants 4-bit experts, but the experts it runs from are stored at [16] bits only " \
               "(a checkpoint without --bundle holds its own precision)" in line, line
    assert not (tmp_path / "r.json").exists()


def test_profile_data_that_is_not_text(tiny_ckpt, tmp_path):
    binary = tmp_path / "data.txt"
    binary.write_bytes(bytes(range(256)) * 4)
    line = _one_error_line(runner.invoke(app, ["profile", "--model", str(tiny_ckpt("qwen2_moe")), "--data",
                                               str(binary), "--out", str(tmp_path / "p.json")]))
    assert str(binary) in line and not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("args,says", [
    (["run", "--clock", "simm", "--prompt", "hi"], "'simm' is not one of 'wall', 'sim'"),
    (["run", "--dtype", "int8", "--prompt", "hi"], "'int8' is not one of"),
    (["eval", "ppl", "--mmlu-source", "xyz"], "'xyz' is not one of"),
    (["run", "--no-such-option"], "No such option: --no-such-option"),
    (["fit"], "Missing argument 'profile'"),
    (["no-such-command"], "No such command 'no-such-command'"),
])
def test_a_usage_error_is_one_sentence_and_exit_code_1(args, says):
    """An option value outside its choices, an unknown option or command, a missing argument: bad
    input like any other (one sentence naming the command's --help, exit 1), not click's boxed usage
    text and exit 2. The console script goes through the same group as CliRunner."""
    line = _one_error_line(runner.invoke(app, args))
    assert says in line and "--help` lists the options" in line
    script = subprocess.run([sys.executable, "-m", "moetool.cli", *args], capture_output=True, text=True, timeout=300)
    assert script.returncode == 1 and says in script.stderr and len(script.stderr.strip().splitlines()) == 1


def test_the_policy_names_in_the_help_are_the_registrys():
    from moetool.options import SHIPPED_POLICIES
    from moetool.policies import POLICIES

    # the registry's shipped names (other tests in this process register policies of their own)
    assert sorted(SHIPPED_POLICIES) == sorted(n for n, c in POLICIES.items() if c.__module__.startswith("moetool."))
    shown = " ".join(runner.invoke(app, ["run", "--help"], terminal_width=400).output.split())
    assert all(name in shown for name in SHIPPED_POLICIES)


def test_help_and_no_command_still_show_the_help():
    assert runner.invoke(app, ["--help"]).exit_code == 0
    assert runner.invoke(app, ["run", "--help"]).exit_code == 0
    bare = runner.invoke(app, [])
    assert bare.exit_code == 2 and "Usage" in bare.output

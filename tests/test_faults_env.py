"""A sixth pass over faults of the environment and of the numbers: each test here, but the controls named
`..._still_runs`, failed on the code before it (a traceback, a silent exit code, a misleading sentence, a
bundle of NaN, or a number dropped from a table).

1. The reader of stdout goes away (`moetool run ... | head -1`): a quiet exit with 141, the artifact kept.
2. A directory the environment names (TMPDIR, HOME, TORCHINDUCTOR_CACHE_DIR, MOETOOL_CACHE, ...) that is
   not one: the sentence names the variable.
3. A weight that is not finite (NaN, an infinity) in an expert, a router or a non-expert weight, or one
   whose quantization scale overflows float16: one sentence naming the tensor, no bundle of NaN.
4. A geometry transformers accepts and torch's grouped_mm does not (an expert intermediate size of 1
   or 2): the engine runs it, token for token as the eager loop.
5. A profile prompt the tokenizer maps to no token: one sentence naming it.
6. A narrow terminal (`COLUMNS=20`): a table keeps every number whole.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from helpers import one_error_line
from moetool.app import PIPE_CLOSED, environment_origin, os_sentence, out
from moetool.cli import app
from moetool.quant.format import relative_error
from tiny import save_tiny

runner = CliRunner()


def _cli(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def _moetool(*args: object, env: dict | None = None, **popen) -> subprocess.CompletedProcess:
    """moetool in a fresh interpreter (what an import does, or what a pipe does, cannot be undone in this one)."""
    return subprocess.run([sys.executable, "-m", "moetool.cli", *map(str, args)], env={**os.environ, **(env or {})},
                          timeout=240, **popen)


def _damaged(src: Path, dst: Path, key: str, value: float, at=(3, 5)) -> Path:
    """A copy of checkpoint `src` whose tensor `key` holds `value` at `at`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors[key][at] = value
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# ---- 1. a broken pipe -----------------------------------------------------------------------------

def test_a_closed_stdout_is_a_quiet_exit_141_and_the_artifact_is_kept(tiny_ckpt, tmp_path):
    """`moetool run ... | head -1`: Rich's own handling was exit code 1 without a word (a failure, to a
    script with pipefail); now 141, as `yes | head -1` is, nothing on stderr but the progress lines."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before moetool writes a byte
    save = tmp_path / "r.run.json"
    try:
        done = _moetool("run", "--model", tiny_ckpt("qwen2_moe"), "--prompt", "hi", "--max-new-tokens", "2",
                        "--clock", "sim", "--out", save, stdout=write, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write)
    assert done.returncode == PIPE_CLOSED == 141, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr and "error" not in done.stderr
    assert json.loads(save.read_text())["schema"] == "run"  # written before the summary was printed


# ---- 2. directories the environment names ---------------------------------------------------------

def test_an_inductor_cache_dir_that_is_not_a_directory_is_named(tiny_ckpt, tmp_path):
    """torch makes TORCHINDUCTOR_CACHE_DIR as transformers imports (hqq's torch.compile): the sentence
    named only the path, which the user never typed."""
    (tmp_path / "file").write_text("x")
    done = _moetool("run", "--model", tiny_ckpt("qwen2_moe"), "--prompt", "hi", "--max-new-tokens", "2",
                    env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "file" / "cache")}, capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "$TORCHINDUCTOR_CACHE_DIR" in lines[0], done.stderr


def test_a_moetool_cache_under_a_file_is_named(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("MOETOOL_CACHE", str(tmp_path / "file" / "cache"))
    line = one_error_line(_cli("demo-model"))
    assert "$MOETOOL_CACHE" in line and "Not a directory" in line


def test_a_path_under_a_usable_home_is_not_blamed_on_home(tmp_path, monkeypatch):
    """Only a variable whose own directory is unusable is named: an --out under a good HOME is the user's."""
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "file"))
    assert environment_origin(tmp_path / "file" / "out.json") == "TMPDIR"  # the innermost variable
    monkeypatch.delenv("TMPDIR")
    assert environment_origin(tmp_path / "file" / "out.json") is None
    sentence = os_sentence(NotADirectoryError(errno.ENOTDIR, "Not a directory", str(tmp_path / "file" / "o")))
    assert "$" not in sentence


# ---- 3. weights that are not finite ---------------------------------------------------------------

@pytest.mark.parametrize("key, value, said", [
    ("model.layers.1.mlp.experts.2.up_proj.weight", float("nan"), "NaN in the weight model.layers.1.mlp.experts."
                                                                   "gate_up_proj of expert 2"),
    ("model.layers.0.mlp.experts.1.down_proj.weight", float("inf"), "+Infinity in the weight model.layers.0.mlp."
                                                                     "experts.down_proj of expert 1 at [3, 5]"),
    ("model.layers.0.mlp.gate.weight", float("nan"), "NaN in the weight model.layers.0.mlp.gate.weight at [3, 5]"),
    ("model.layers.1.self_attn.o_proj.weight", float("-inf"), "-Infinity in the weight model.layers.1.self_attn"),
])
def test_a_weight_that_is_not_finite_is_refused_naming_it(tiny_ckpt, tmp_path, key, value, said):
    """An expert's NaN was refused after the work by the bundle's own reader (`rel_error is nan`); a
    router's or an attention weight's made a bundle of NaN (exit 0) and a run of empty text."""
    model = _damaged(tiny_ckpt("qwen2_moe"), tmp_path / "m", key, value)
    bundle = tmp_path / "b"
    line = one_error_line(_cli("quantize", model, "--bits", "4", "--out", bundle))
    assert said in line and "not a finite number" in line
    assert not (bundle / "bundle.json").exists()
    assert said in one_error_line(_cli("run", "--model", model, "--prompt", "hi", "--max-new-tokens", "2",
                                       "--clock", "sim"))


def test_a_finite_weight_past_float16_loaded_as_float16_is_not_called_damage(tiny_ckpt, tmp_path):
    """7e4 in a float32 file is finite; `--dtype float16` made it +Infinity, and the run sent the user after
    "an intact copy" of a file that is fine. The sentence names the cast as the likely cause, and the cure."""
    model = _damaged(tiny_ckpt("qwen2_moe"), tmp_path / "m", "model.layers.1.mlp.experts.2.down_proj.weight", 7e4)
    line = one_error_line(_cli("run", "--model", model, "--dtype", "float16", "--prompt", "hi", "--max-new-tokens", "2",
                               "--clock", "sim"))
    assert "is +Infinity in float16: the file stores an infinity there, or a value past float16's range (65504) that " \
           "--dtype float16 overflowed; run it in bfloat16 or float32 (--dtype)" in line, line
    assert _cli("run", "--model", model, "--prompt", "hi", "--max-new-tokens", "2", "--clock", "sim").exit_code == 0


def test_a_weight_whose_scale_overflows_float16_is_refused(tiny_ckpt, tmp_path):
    """1e30 is a finite weight (fp32, bf16), but its INT8 group scale is not a float16: the bundle would
    store infinity. It was refused by the bundle's reader, after the work, as `rel_error is nan`."""
    model = _damaged(tiny_ckpt("qwen2_moe"), tmp_path / "m", "model.layers.0.mlp.experts.1.down_proj.weight", 1e30)
    line = one_error_line(_cli("quantize", model, "--bits", "8", "--out", tmp_path / "b"))
    assert "expert 1 of layer 0 cannot be stored at 8 bits" in line and "float16" in line
    assert not (tmp_path / "b").exists()


def test_a_group_whose_zero_point_overflows_float16_is_said_as_such():
    """A healthy row near 4 with a spread of 1e-3 (float32): hqq's step clamps at 5e-5, so its zero (the
    minimum over the step) is -8e4, past float16. It was refused as a scale overflow of a damaged weight."""
    from moetool.errors import MoetoolError
    from moetool.model import ExpertWeights
    from moetool.quant import hqq
    from moetool.quant.format import dequantize, encode, make_layout
    from moetool.quant.quantize import _refuse_overflow

    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(64, 64, generator=gen) * 0.02
    gate_up[6] = 4 + torch.randn(64, generator=gen) * 1e-3
    w = ExpertWeights(gate_up=gate_up, down=torch.randn(64, 32, generator=gen) * 0.02)
    layout = make_layout(8, gate_up.shape, w.down.shape, False, 32)
    q = {p.name: hqq.quantize_weight(getattr(w, p.name), 8, p.group_size, 1, "cpu", False) for p in layout.projections}
    blob = encode(layout, w, q)
    with pytest.raises(MoetoolError, match=r"a group of its gate_up projection lies far from 0 for its spread "
                                           r"\(weights up to 4(\.\d+)?\), and its zero point overflows"):
        _refuse_overflow(w, dequantize(blob, layout), layout, 0, 0, blob)


def test_the_relative_error_of_a_large_finite_weight_is_finite():
    w = torch.full((4, 4), 1e30)
    assert relative_error(w, w) == 0.0
    assert 0 < relative_error(w, w * 0.5) < 1


# ---- 4. a geometry torch's grouped_mm refuses -----------------------------------------------------

@pytest.mark.parametrize("intermediate", [1, 2])
def test_an_expert_intermediate_size_of_one_or_two_runs(tmp_path, intermediate):
    """Rows of 4 or 8 bytes: torch's grouped_mm refused them ("strides should be multiple of 16 bytes", a
    traceback asking for a bug report); now the per-group fallback, token for token as the eager loop."""
    from helpers import save_char_tokenizer
    from moetool.quant.quantize import QuantizeConfig, quantize

    model = save_tiny("qwen2_moe", tmp_path / "m", moe_intermediate_size=intermediate)
    save_char_tokenizer(model)
    bundle = tmp_path / "b"
    quantize(QuantizeConfig(model=str(model), out=bundle, bits=(16, 4), dtype="float32", hqq_optimize=False))
    tokens = {}
    for impl in ("grouped_mm", "eager"):
        save = tmp_path / f"{impl}.run.json"
        result = _cli("run", "--bundle", bundle, "--policy", "lru", "--experts-impl", impl, "--prompt", "hello there",
                      "--max-new-tokens", "4", "--clock", "sim", "--out", save)
        assert result.exit_code == 0, result.output
        tokens[impl] = json.loads(save.read_text())["tokens"]
    assert tokens["grouped_mm"] == tokens["eager"]


# ---- 5. a prompt with no tokens -------------------------------------------------------------------

def test_a_profile_prompt_the_tokenizer_drops_is_one_sentence(char_ckpt, tmp_path):
    """A tokenizer whose normalizer strips digits maps "123" to no token: profile ran a forward of 0
    tokens (a reshape error inside transformers); `run` already refused such a prompt."""
    from tokenizers import Regex, Tokenizer, normalizers

    model = shutil.copytree(char_ckpt, tmp_path / "m")
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    tok.normalizer = normalizers.Replace(Regex("[0-9]"), "")
    tok.save(str(model / "tokenizer.json"))
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "abc"}\n{"prompt": "123"}\n')
    save = tmp_path / "p.json"
    line = one_error_line(_cli("profile", "--model", model, "--data", data, "--what", "routing", "--seqs", "2",
                               "--seq-len", "8", "--decode-tokens", "1", "--out", save))
    assert f"prompt 2 of {data} ('123') gives no token of its own under this model's tokenizer" in line \
        and not save.exists()


# ---- 6. a narrow terminal -------------------------------------------------------------------------

def test_a_narrow_terminal_keeps_every_number_of_a_table_whole(tiny_ckpt, monkeypatch):
    """COLUMNS=20: check's routing agreement read "1.…" and run's table lost every number."""
    monkeypatch.setattr(out, "_width", 20)
    result = _cli("check", tiny_ckpt("qwen2_moe"))
    assert result.exit_code == 0, result.output
    assert "1.0000" in result.stdout and "…" not in result.stdout


# ---- 7. the process's filters and encodings (a sixteenth pass) -------------------------------------

def test_a_warning_the_filters_make_an_error_is_one_sentence_naming_the_filter(tiny_ckpt, tmp_path):
    """PYTHONWARNINGS=error made a library's DeprecationWarning at import "a bug in moetool", with a traceback."""
    done = _moetool("run", "--model", tiny_ckpt("qwen2_moe"), "--prompt", "hi", "--max-new-tokens", "2",
                    "--out", tmp_path / "r.json", env={"PYTHONWARNINGS": "error"}, capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: a ") and "was made an error by this process's warning filters" in line, line
    assert not (tmp_path / "r.json").exists()


def test_a_stdout_that_cannot_spell_the_text_escapes_it_and_says_so(tiny_ckpt, tmp_path):
    """PYTHONIOENCODING=ascii: a prompt "café" was a UnicodeEncodeError traceback after the run was saved."""
    save = tmp_path / "r.json"
    done = _moetool("run", "--model", tiny_ckpt("qwen2_moe"), "--prompt", "café", "--max-new-tokens", "2",
                    "--out", save, env={"PYTHONIOENCODING": "ascii", "COLUMNS": "200"}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "caf\\xe9" in done.stdout and "Traceback" not in done.stderr
    assert "note: standard output's encoding (ascii) cannot spell" in " ".join(done.stderr.split())
    assert json.loads(save.read_text())["prompts"] == ["café"]


def test_a_librarys_import_the_environment_breaks_is_one_sentence_naming_the_variable(tiny_ckpt, tmp_path):
    """TORCH_LOGS=bogus: torch's import raised a ValueError inside the command, "a bug in moetool"."""
    done = _moetool("run", "--model", tiny_ckpt("qwen2_moe"), "--prompt", "hi", "--out", tmp_path / "r.json",
                    env={"TORCH_LOGS": "bogus"}, capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: importing torch failed: 'Invalid log settings: bogus") and \
        line.endswith("check or unset TORCH_LOGS=bogus."), line


def test_python_with_docstrings_stripped_is_refused_in_one_sentence(tmp_path):
    """-OO: transformers' model classes are built from docstrings (the error blamed the checkpoint) and every
    --help page lost its text."""
    done = subprocess.run([sys.executable, "-OO", "-m", "moetool", "run", "--help"], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 1 and done.stdout == "", done.stdout
    assert done.stderr.strip() == "error: python -OO (PYTHONOPTIMIZE=2) strips docstrings, which transformers builds " \
        "its model classes from and moetool's --help pages are written in; run moetool without it (-O is fine)."


def test_an_out_on_a_read_only_filesystem_is_said_to_be_one(tmp_path, monkeypatch):
    """It was "permission denied", which root, refused all the same, could not make sense of."""
    from types import SimpleNamespace

    from moetool.app import writable
    from moetool.errors import MoetoolError

    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_flag=os.ST_RDONLY))
    with pytest.raises(MoetoolError, match=r"is not writable \(on a read-only filesystem\)\.$"):
        writable(tmp_path / "r.json")
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_flag=0))
    with pytest.raises(MoetoolError, match=r"is not writable \(permission denied\)\.$"):
        writable(tmp_path / "r.json")


def test_columns_zero_loses_no_line(tmp_path):
    """COLUMNS=0 (what a 0x0 pty exports): every sentence was drawn 0 wide, so a refusal was exit code 1 and
    nothing else, and a help page was empty."""
    done = _moetool("verify", tmp_path / "none", env={"COLUMNS": "0"}, capture_output=True, text=True)
    assert done.returncode == 1 and done.stderr.strip() == f"error: {tmp_path / 'none'} does not exist.", done.stderr
    page = _moetool("run", "--help", env={"COLUMNS": "0"}, capture_output=True, text=True)
    assert page.returncode == 0 and "--max-new-tokens" in page.stdout and "Example" in page.stdout, page.stdout


def test_a_users_transformers_verbosity_is_kept(tiny_ckpt):
    """TRANSFORMERS_VERBOSITY=info (debugging a checkpoint's load) was overwritten with "error" by every command."""
    done = _moetool("check", tiny_ckpt("qwen2_moe"), env={"TRANSFORMERS_VERBOSITY": "info"}, capture_output=True,
                    text=True)
    assert done.returncode == 0, done.stderr
    assert "loading" in done.stderr.lower() or "config" in done.stderr.lower(), done.stderr
    quiet = _moetool("check", tiny_ckpt("qwen2_moe"), capture_output=True, text=True)
    assert len(quiet.stderr) < len(done.stderr)


@pytest.mark.parametrize("umask,file_mode,dir_mode", [(0o077, 0o600, 0o700), (0o002, 0o664, 0o775)])
def test_what_moetool_writes_takes_the_callers_umask(tmp_path, umask, file_mode, dir_mode):
    """Artifacts were 0644 and reports 0755 whatever the umask: a run's prompts and texts readable by all under
    umask 077, a group's write dropped under 002."""
    from moetool.artifacts import atomic_write_bytes, replace_dir

    old = os.umask(umask)
    try:
        atomic_write_bytes(tmp_path / "r.run.json", b"{}")

        def fill(d):
            (d / "summary.md").write_text("x")
            return [d / "summary.md"]

        replace_dir(tmp_path / "rep", fill)
    finally:
        os.umask(old)
    assert (tmp_path / "r.run.json").stat().st_mode & 0o777 == file_mode
    assert (tmp_path / "rep").stat().st_mode & 0o777 == dir_mode


def test_a_directory_that_is_a_mount_point_is_refused_before_the_work(tmp_path, monkeypatch):
    """`report --out /out` (a container's bind mount) drew every figure, then failed "mnt -> mnt: Device or
    resource busy" when it swapped its directory in."""
    from moetool.artifacts import replace_dir
    from moetool.errors import MoetoolError

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == mnt)
    drawn = []
    with pytest.raises(MoetoolError, match=f"{mnt} is a mount point, which cannot be replaced whole .*; give a "
                                           f"directory inside it, e.g. {mnt / 'report'}."):
        replace_dir(mnt, lambda d: drawn.append(d))
    assert drawn == [] and mnt.is_dir()


@pytest.mark.parametrize("spelled", [["--out", "DIR/"], ["--out=DIR/"]])
def test_a_file_output_spelled_as_a_directory_is_refused(tiny_ckpt, tmp_path, spelled):
    """`run --out results/` wrote a file named `results` (Python's Path drops the slash), which `report` then
    passed over without a word."""
    args = [a.replace("DIR", str(tmp_path / "results")) for a in spelled]
    line = one_error_line(_cli("run", "--model", tiny_ckpt("qwen2_moe"), *args))
    assert line == f"error: --out {tmp_path / 'results'}/ names a directory (it ends with /); give the file to " \
        f"write, e.g. {tmp_path / 'results'}/result.json.", line
    assert not (tmp_path / "results").exists()
    assert _cli("report", "--help").exit_code == 0  # a directory output is not refused for its slash

"""Faults the sixth pass left (tests/test_faults_env.py): each test here, but the control named `..._still_...`,
failed on the code before it.

1. A help page into a closed pipe (`moetool --help | true`, `moetool run --help | head -1`): Typer prints it
   through a Rich console of its own, and it exited 1; now 141, quietly, as the rest of moetool's output.
2. An unusable matplotlib config directory (MPLCONFIGDIR a file, HOME under a file): `report` printed
   matplotlib's two warnings; matplotlib's own temp directory is used silently.
3. A NaN in a late layer's expert: the sentence said nothing of the layers kept or what a re-run does; it says
   both, and a re-run continues only on the same weights' fingerprint.
4. Text to a pipe was wrapped at 80 columns (`moetool report out | xargs` read a path split in two); a line
   to a pipe or a file is now whole.
5. A bundle where a checkpoint is asked for (`check BUNDLE`, `--model BUNDLE`, `--model BUNDLE/model`) read as
   a directory without config.json or a checkpoint without experts; it is named, with `--bundle`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers import one_error_line, run_args, synthetic_profile
from moetool.app import PIPE_CLOSED
from moetool.cli import app
from moetool.quant.quantize import JOURNAL
from tiny import save_tiny

runner = CliRunner()


def _moetool(*args: object, env: dict | None = None, **popen) -> subprocess.CompletedProcess:
    """moetool in a fresh interpreter: a closed pipe and matplotlib's import cannot be undone in this one."""
    return subprocess.run([sys.executable, "-m", "moetool.cli", *map(str, args)], env={**os.environ, **(env or {})},
                          timeout=240, **popen)


def _closed_pipe() -> tuple[int, int]:
    """A pipe whose reader is gone before anything is written: (its write end, its read end, closed)."""
    read, write = os.pipe()
    os.close(read)
    return write, read


# ---- 1. a help page into a closed pipe ------------------------------------------------------------

@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["quantize", "--help"], []],
                         ids=["moetool", "run", "quantize", "no-arguments"])
def test_a_help_page_into_a_closed_pipe_is_a_quiet_exit_141(args):
    """Rich's own handling in Typer's console was exit code 1 without a word (`moetool --help | true`)."""
    write, _ = _closed_pipe()
    try:
        done = _moetool(*args, stdout=write, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write)
    assert done.returncode == PIPE_CLOSED == 141 and done.stderr == "", done.stderr


def test_a_reader_gone_before_the_help_pages_last_newline_is_141():
    """click echoes a newline after Typer's page; a reader that went between the two made it a BrokenPipeError,
    which Typer's main turns into exit code 1. The reader here goes once the page is in the pipe."""
    script = ("import os, sys\n"
              "import typer._click.decorators as d\n"
              "read, write = os.pipe()\n"
              "os.dup2(write, 1)\n"
              "os.close(write)\n"
              "echo = d.echo\n"
              "def close_then_echo(*a, **k):\n"
              "    os.close(read)  # the page (a few KiB) sits in the pipe's buffer; its reader goes\n"
              "    return echo(*a, **k)\n"
              "d.echo = close_then_echo\n"
              "from moetool.cli import app\n"
              "sys.argv = ['moetool', 'run', '--help']\n"
              "app()\n")
    done = subprocess.run([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True, timeout=240)
    assert done.returncode == PIPE_CLOSED and done.stderr == "", done.stderr


def test_a_usage_error_whose_sentence_cannot_be_written_still_exits_1():
    """A mistake is exit code 1 even when stderr's reader has gone (docs/failures.md): never 141, no traceback."""
    write, _ = _closed_pipe()
    try:
        done = _moetool("run", "--no-such-option", stdout=subprocess.PIPE, stderr=write, text=True)
    finally:
        os.close(write)
    assert done.returncode == 1 and done.stdout == ""


# ---- 2. matplotlib's config directory -------------------------------------------------------------

def test_a_matplotlib_config_directory_that_is_a_file_is_silent(tmp_path):
    """matplotlib logged "mkdir -p failed ..." and "Matplotlib created a temporary cache directory ...": its
    fallback holds only its font cache, and the report is the same."""
    profile = synthetic_profile().save(tmp_path / "s.profile.json")
    (tmp_path / "file").write_text("x")
    done = _moetool("report", profile, "--out", tmp_path / "rep", env={"MPLCONFIGDIR": str(tmp_path / "file")},
                    capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert (tmp_path / "rep" / "summary.md").is_file() and len(list((tmp_path / "rep").glob("*.png"))) == 3


def test_a_home_under_a_file_is_silent_for_matplotlib(tmp_path):
    """The same fallback from ~/.config/matplotlib and ~/.cache/matplotlib, through moetool's figures module
    alone (a whole `report` imports torch and the engine: the previous test runs one)."""
    (tmp_path / "file").write_text("x")
    draw = ("import sys; from pathlib import Path; from moetool.figures import plt, save; fig, ax = plt.subplots(); "
            "ax.set_title('text needs the font cache'); save(fig, Path(sys.argv[1]))")
    environ = {k: v for k, v in os.environ.items() if k not in ("MPLCONFIGDIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME")}
    done = subprocess.run([sys.executable, "-c", draw, str(tmp_path / "f.png")], env={**environ,
                          "HOME": str(tmp_path / "file")}, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert (tmp_path / "f.png").read_bytes().startswith(b"\x89PNG")


# ---- 3. a weight that is not finite in a late layer -----------------------------------------------

LATE = "model.layers.2.mlp.experts.1.down_proj.weight"  # the last of 3 MoE layers


def _checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    return save_tiny("qwen2_moe", path, seed=seed, num_hidden_layers=3, **overrides)


def _set(model: Path, key: str, value: float, at=(3, 5)) -> float:
    """Write `value` at `at` of tensor `key` in place; what was there before."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(model / "model.safetensors")
    before = float(tensors[key][at])
    tensors[key][at] = value
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    return before


def _quantize(model: Path, bundle: Path):
    return runner.invoke(app, ["quantize", str(model), "--bits", "4", "--no-hqq-optimize", "--out", str(bundle)])


def _refused_late(model: Path, bundle: Path) -> float:
    """Quantize `model` with a NaN in its last layer: refused there, layers 0 and 1 kept; the weight's value."""
    before = _set(model, LATE, float("nan"))
    line = one_error_line(_quantize(model, bundle))
    assert f"NaN in the weight {LATE.replace('.1.down_proj.weight', '.down_proj')} of expert 1" in line
    assert f"{bundle} keeps the 2 of 3 MoE layers finished before this but is no bundle yet (no bundle.json)" in line
    assert "the same command on the fixed checkpoint continues from them, or starts over if the weights' " \
           "fingerprint changed" in line
    assert sorted(p.name for p in bundle.glob("layer-*")) == ["layer-000.safetensors", "layer-001.safetensors"]
    assert set(json.loads((bundle / JOURNAL).read_text())["layers"]) == {"0", "1"}
    assert not (bundle / "bundle.json").exists()
    for shard in bundle.glob("layer-*"):
        os.utime(shard, ns=(1, 1))  # a shard a re-run rewrites has a new mtime; one it continues from keeps this
    return before


def _continued(bundle: Path) -> bool:
    return (bundle / "layer-000.safetensors").stat().st_mtime_ns == 1


def test_a_nan_in_a_late_layer_says_what_is_kept_and_a_fixed_checkpoint_continues(tmp_path):
    """Experts of 32 x 1024: a tensor above 64 KiB is fingerprinted at four sampled points, so the one
    element fixed in place leaves the fingerprint as it was, and the re-run continues from layers 0 and 1."""
    model, bundle = _checkpoint(tmp_path / "m", moe_intermediate_size=1024), tmp_path / "b"
    before = _refused_late(model, bundle)
    _set(model, LATE, before)
    assert _quantize(model, bundle).exit_code == 0
    assert _continued(bundle) and (bundle / "bundle.json").is_file() and not (bundle / JOURNAL).exists()


def test_a_fixed_small_tensor_or_another_checkpoint_starts_over(tmp_path):
    """The default experts (32 x 16) are fingerprinted whole: fixing one changes the fingerprint and the re-run
    starts over, as the sentence says. Another checkpoint of the same config never continues from the
    layers of the first (its weights' fingerprint differs)."""
    model, bundle = _checkpoint(tmp_path / "m"), tmp_path / "b"
    before = _refused_late(model, bundle)
    shutil.copytree(bundle, tmp_path / "b2")
    _set(model, LATE, before)
    assert _quantize(model, bundle).exit_code == 0 and not _continued(bundle)

    other = _checkpoint(tmp_path / "other", seed=1)
    assert (other / "config.json").read_text() == (model / "config.json").read_text()
    done = _quantize(other, tmp_path / "b2")
    assert done.exit_code == 0 and not _continued(tmp_path / "b2")
    assert f"{tmp_path / 'b2'} held 2 finished MoE layer(s) quantized from other weights" in done.stderr


def test_a_resume_with_other_settings_is_refused_and_an_orphan_shard_never_reaches_the_bundle(tmp_path):
    """Resumed with another --bits (a forgotten option), the finished layers were deleted without a word;
    and a shard renamed into place whose journal entry a signal stopped survived into the finished bundle,
    which `verify` then refused ("holds layer-002.safetensors, which its manifest does not list")."""
    model, bundle = _checkpoint(tmp_path / "m", moe_intermediate_size=1024), tmp_path / "b"  # fixed, it continues
    before = _refused_late(model, bundle)
    _set(model, LATE, before)
    other = runner.invoke(app, ["quantize", str(model), "--bits", "8", "--no-hqq-optimize", "--out", str(bundle)])
    assert one_error_line(other) == (f"error: {bundle} holds 2 finished MoE layer(s) of an interrupted quantize of "
                                     "other settings (bits [16, 4] -> [16, 8]); rerun the command that made them to continue, "
                                     "or delete the directory (or give another --out) to start over.")
    assert sorted(p.name for p in bundle.glob("layer-*")) == ["layer-000.safetensors", "layer-001.safetensors"]
    assert f"{bundle} is an unfinished bundle" in one_error_line(runner.invoke(app, ["verify", str(bundle)]))
    shutil.copy(bundle / "layer-001.safetensors", bundle / "layer-007.safetensors")  # on disk, not in the journal
    assert _quantize(model, bundle).exit_code == 0 and _continued(bundle)
    assert runner.invoke(app, ["verify", str(bundle)]).exit_code == 0


def test_a_line_to_a_pipe_is_not_wrapped():
    """What moetool prints to a pipe is read by a program: a path (report's outputs, for `xargs`), generated
    text, a sentence. Each stays one line however long; tables keep their width rules (test_faults_env)."""
    path = "/tmp/" + "a-long-directory/" * 12 + "summary.md"
    text = "the model said " + "something long " * 12
    code = ("from moetool.app import out, err; out.print(%r, highlight=False); out.print(%r); err.print(%r)"
            % (path, text, text))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [path, text.rstrip()] or done.stdout.splitlines() == [path, text]
    assert done.stderr.splitlines()[-1].strip() == text.strip()


# 5. A text file saved as UTF-16 (Windows Notepad's "Unicode") was "not UTF-8 text (byte 0 is not)"; a
#    byte-order mark now says how to read it, for the text moetool alone reads (--data, --prompts, a grid),
#    and a task file, which lm-eval reads again as UTF-8, is told to be saved as UTF-8. UTF-16 saved
#    without its mark, valid UTF-8 with a NUL every other byte, was scored as such; a NUL is now refused.

TEXT = "Ça va? Сказка о рыбаке.\n日本語のテキスト, and plain English text.\n" * 8
ENCODINGS = ["utf-8-sig", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"]


def _with_bom(text: str, encoding: str) -> bytes:
    import codecs

    boms = {"utf-16-le": codecs.BOM_UTF16_LE, "utf-16-be": codecs.BOM_UTF16_BE,
            "utf-32-le": codecs.BOM_UTF32_LE, "utf-32-be": codecs.BOM_UTF32_BE}
    return boms.get(encoding, b"") + text.encode(encoding)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_text_file_with_a_byte_order_mark_reads_as_the_same_text(tmp_path, encoding):
    from moetool.datasets import read_prompts, read_text_file

    data = tmp_path / "t.txt"
    data.write_bytes(_with_bom(TEXT, encoding))
    assert read_text_file(data, "--data") == TEXT
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(_with_bom('{"prompt": "Сказка"}\n{"prompt": "日本語"}\n', encoding))
    assert read_prompts(prompts) == ("Сказка", "日本語")


def test_utf16_without_its_mark_or_broken_after_it_is_one_sentence(tmp_path):
    from moetool.datasets import read_text_file
    from moetool.errors import MoetoolError

    bare = tmp_path / "bare.txt"
    bare.write_bytes("Hello".encode("utf-16-le"))  # no mark: not guessed; valid UTF-8, but "H\0e\0..." is no text
    with pytest.raises(MoetoolError, match=r"holds a NUL character \(character 2\).*UTF-16 saved without its"):
        read_text_file(bare, "--data")
    broken = tmp_path / "broken.txt"
    broken.write_bytes(_with_bom("Hello", "utf-16-le") + b"\x00\xd8")  # a lone high surrogate at the end
    with pytest.raises(MoetoolError, match=r"is not UTF-16 text \(byte \d+ is not, though it starts with a UTF-16"):
        read_text_file(broken, "--data")


def test_eval_ppl_on_a_utf16_file_scores_what_it_scores_on_the_utf8_file(char_ckpt, tmp_path):
    scores = []
    for encoding in ("utf-8", "utf-16-le"):
        data, out = tmp_path / f"{encoding}.txt", tmp_path / f"{encoding}.eval.json"
        data.write_bytes(_with_bom(TEXT, encoding))
        result = runner.invoke(app, ["eval", "ppl", "--model", str(char_ckpt), "--data", str(data),
                                     "--context", "32", "--limit", "96", "--out", str(out)])
        assert result.exit_code == 0, result.output
        doc = json.loads(out.read_text())
        scores.append((doc["n"], doc["metrics"]["ppl"]))
    assert scores[0] == scores[1]


def test_a_utf16_task_file_is_told_to_be_saved_as_utf8(tiny_ckpt, tmp_path):
    task = tmp_path / "mytask.yaml"
    task.write_bytes(_with_bom("task: mytask\n", "utf-16-le"))
    result = runner.invoke(app, ["eval", str(task), "--model", str(tiny_ckpt("qwen2_moe"))])
    line = one_error_line(result)
    assert f"task file {task} is UTF-16 text" in line and "save it as UTF-8" in line


def test_a_bundle_given_where_a_checkpoint_is_asked_for_says_to_give_it_as_bundle(tmp_path):
    """A bundle as `check`'s or `quantize`'s model or as `--model` read as a directory without
    config.json, and its model/ directory as a checkpoint without experts ("incomplete or of another
    model"); both are now named as what they are, with the option that takes them."""
    from helpers import tiny_moe

    bundle = tmp_path / "bundle"
    assert _quantize(tiny_moe(tmp_path / "ckpt"), bundle).exit_code == 0
    for args in (["check", bundle], ["quantize", bundle, "--out", tmp_path / "other"], run_args(bundle, "--model", bundle)):
        line = one_error_line(runner.invoke(app, [str(a) for a in args]))
        assert f"{bundle} is a moetool bundle, not a model checkpoint: give it as --bundle {bundle}" in line
    line = one_error_line(runner.invoke(app, ["run", "--model", str(bundle / "model"), "--policy", "lru"]))
    assert f"{bundle / 'model'} is the model directory of the bundle {bundle}" in line
    assert not (tmp_path / "other").exists()
    begun = tmp_path / "begun"  # a quantize refused in its last layer: no bundle.json, its journal names it
    _refused_late(_checkpoint(tmp_path / "m"), begun)
    assert f"{begun} is an unfinished moetool bundle (its quantize was stopped before it wrote bundle.json), not a " \
           "model checkpoint: rerun the quantize command" in one_error_line(runner.invoke(app, ["check", str(begun)]))


def test_a_ctrl_c_while_moetool_starts_is_one_line_not_an_import_traceback():
    """A Ctrl-C in the first second (torch and transformers being imported) printed a KeyboardInterrupt
    traceback from the import; it is one line and exit code 130, as during a command."""
    code = ("import sys, types\n"
            "class Starting(types.ModuleType):\n"
            "    def __getattr__(self, name): raise KeyboardInterrupt\n"
            "sys.modules['moetool.cli'] = Starting('moetool.cli')\n"
            "from moetool.entry import main\n"
            "main()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 130 and done.stderr == "interrupted (Ctrl-C) while moetool started: nothing was done.\n", \
        done.stderr


def test_a_sweep_stopped_before_its_first_cell_says_so_in_the_words_of_every_command(tmp_path, monkeypatch):
    """It said "interrupted: 0 of ? cells are finished" (the count is learnt from the first cell), where every
    other command says "interrupted (Ctrl-C): ..."."""
    import moetool.sweep

    def stopped(cfg, progress=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(moetool.sweep, "sweep", stopped)
    done = runner.invoke(app, ["sweep", "demo-runs", "--out", str(tmp_path / "s")])
    assert done.exit_code == 130, done.output
    assert done.stderr.strip() == "interrupted (Ctrl-C): no cell had finished; the same command runs them all.", done.stderr


def test_a_journal_left_beside_a_finished_manifest_does_not_fail_verify(tmp_path):
    """A Ctrl-C between writing bundle.json (quantize's last write) and removing the journal left a whole
    bundle that `verify` refused for the journal, and that the command, run again, refused as finished."""
    bundle = tmp_path / "b"
    assert _quantize(_checkpoint(tmp_path / "m"), bundle).exit_code == 0
    (bundle / JOURNAL).write_text(json.dumps({"settings_sha256": "x", "layers": {}}))
    done = runner.invoke(app, ["verify", str(bundle)])
    assert done.exit_code == 0, done.output

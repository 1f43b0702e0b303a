"""Faults of the machine while a command works (the eighth pass, docs/failures.md): each test here
failed on the code before it.

1. A signal stops a command through one cleanup: Ctrl-C, SIGTERM and SIGHUP end `quantize`, `profile`,
   `run`, `eval` and `report` with one line and exit code 128 + the signal, no temp file, lock or half-built
   directory left, and the same --out runs again.
2. Standard output that cannot take the result (full, closed) is named, not taken for the artifact.
3. A file-size limit is one sentence that says so; a rerun once it is lifted works.
4. Memory: a failed allocation is one sentence, an artifact read reserves only what the file holds, and
   the host tiers are refused up front where the machine (or ulimit -v) cannot give what they would hold.
5. A path is named as asked for: a link --out is checked where it leads, and a failure inside a temp
   file of a bundle names the file it stands for.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers import VALID, file_size_limit, run_args, synthetic_profile, write_json
from helpers import one_error_line as error_line
from moetool.cli import app
from moetool.quant.quantize import JOURNAL, LOCK, QuantizeConfig, quantize
from tiny import save_tiny

runner = CliRunner()
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _lines(stderr: str) -> list[str]:
    """What moetool said on stderr (the venv's torchao prints its own import notes: not moetool's)."""
    return [ln for ln in stderr.splitlines() if ln.strip() and "torchao" not in ln and "pytree" not in ln]


def _start(*args: object, **popen) -> subprocess.Popen:
    def child() -> None:  # a test runner may start its workers with SIGINT ignored, which a child inherits
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    return subprocess.Popen([sys.executable, "-m", "moetool.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, preexec_fn=child, **popen)


def _moetool(*args: object, limits: dict[int, int] | None = None, **popen) -> subprocess.CompletedProcess:
    def child() -> None:
        for which, value in (limits or {}).items():
            resource.setrlimit(which, (value, resource.getrlimit(which)[1]))

    popen.setdefault("stdout", subprocess.PIPE)
    return subprocess.run([sys.executable, "-m", "moetool.cli", *map(str, args)], stderr=subprocess.PIPE, text=True,
                          env=ENV, preexec_fn=child, timeout=600, **popen)


def _signal_at_work(proc: subprocess.Popen, at_work: Callable[[], bool], signum: int) -> tuple[int, list[str]]:
    """Send `signum` once `at_work()` says the command is in the middle of its work, and return its exit
    code and what it said."""
    while proc.poll() is None and not at_work():
        time.sleep(0.01)
    assert proc.poll() is None, f"the command ended before it was signalled: {proc.communicate()[1][-2000:]}"
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=300)
    return proc.returncode, _lines(stderr)


def _mapped(proc: subprocess.Popen, name: str) -> Callable[[], bool]:
    """Whether the process has mapped a file named `name` (a bundle's shard: its model is loaded)."""
    def check() -> bool:
        try:
            return name in Path(f"/proc/{proc.pid}/maps").read_text()
        except OSError:
            return False
    return check


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _temp_files(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.name.endswith(".tmp")]


SAID = {signal.SIGINT: "interrupted (Ctrl-C): ", signal.SIGTERM: "terminated (SIGTERM): ",
        signal.SIGHUP: "hung up (SIGHUP): "}


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory) -> Path:
    """A checkpoint whose HQQ quantization takes seconds a layer (16 experts of width 256, 6 layers)."""
    return save_tiny("qwen2_moe", tmp_path_factory.mktemp("wide") / "m", num_experts=16, moe_intermediate_size=256,
                     hidden_size=64, num_hidden_layers=6)


# ---- 1. a signal stops a command through one cleanup -----------------------------------------------------

def _long(command: str, bundle: Path, tmp: Path) -> tuple[list[object], Path]:
    """A run of `command` that works for many seconds once its model is loaded, and its --out."""
    out = tmp / {"run": "x.run.json", "eval": "x.eval.json", "profile": "x.profile.json"}[command]
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"The king said {i}"}) + "\n" for i in range(200)))
    args = {"run": ["run", "--bundle", bundle, "--policy", "lru", "--budget", "50%", "--clock", "sim", "--prompts",
                    prompts, "--max-new-tokens", "64"],
            "eval": ["eval", "ppl", "--bundle", bundle, "--clock", "sim"],
            "profile": ["profile", "--bundle", bundle, "--what", "routing,prefetch", "--seqs", "32", "--seq-len", "96",
                        "--decode-tokens", "8", "--data", "heldout"]}[command]
    return [*args, "--out", out], out


def _quick(command: str, bundle: Path, out: Path) -> list[str]:
    return {"run": run_args(bundle, "--out", str(out)),
            "eval": ["eval", "ppl", "--bundle", str(bundle), "--limit", "16", "--context", "8", "--clock", "sim",
                     "--out", str(out)],
            "profile": ["profile", "--bundle", str(bundle), "--what", "routing", "--seqs", "1", "--seq-len", "8",
                        "--decode-tokens", "1", "--data", "heldout", "--out", str(out)]}[command]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("command", ["run", "eval", "profile"])
def test_a_signal_stops_a_command_with_one_line_and_the_same_out_runs_again(command, signum, char_bundle, tmp_path):
    """Ctrl-C was exit code 130 without a word (Typer's), SIGTERM killed the process where it stood (-15)."""
    args, out = _long(command, char_bundle, tmp_path)
    proc = _start(*args)
    code, lines = _signal_at_work(proc, _mapped(proc, "layer-000.safetensors"), signum)
    assert code == 128 + signum, lines
    assert len(lines) == 1 and lines[0] == SAID[signum] + "no file was left half-written; run the same command again.", lines
    assert not out.exists() and not _temp_files(tmp_path)
    again = runner.invoke(app, _quick(command, char_bundle, out))
    assert again.exit_code == 0, again.output
    assert json.loads(out.read_text())["schema"]


def test_sighup_stops_a_run_as_sigterm_does(char_bundle, tmp_path):
    args, out = _long("run", char_bundle, tmp_path)
    proc = _start(*args)
    code, lines = _signal_at_work(proc, _mapped(proc, "layer-000.safetensors"), signal.SIGHUP)
    assert code == 129 and lines == [SAID[signal.SIGHUP] + "no file was left half-written; run the same command "
                                     "again."], lines
    assert not out.exists() and not _temp_files(tmp_path)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_quantize_stopped_by_a_signal_says_which_layers_it_keeps_and_leaves_no_temp_file_or_lock(
        signum, wide_ckpt, tmp_path):
    """SIGTERM left the shard being written (`.layer-001.safetensors.XXXXXXXX.tmp`) and the lock file."""
    out = tmp_path / "q"
    proc = _start("quantize", wide_ckpt, "--bits", "16,4,2", "--group-size", "16", "--out", out)
    # The journal, not the shard: a signal between the shard's rename and its journal entry keeps no layer.
    code, lines = _signal_at_work(proc, lambda: '"layers": {"' in _text(out / JOURNAL), signum)
    assert code == 128 + signum, lines
    assert len(lines) == 1 and lines[0].startswith(SAID[signum] + f"{out} keeps the "), lines
    assert "of 6 MoE layers finished (no bundle yet); the same command continues from them." in lines[0]
    assert (out / "layer-000.safetensors").is_file() and (out / JOURNAL).is_file()
    assert not (out / LOCK).exists() and not _temp_files(tmp_path)


def test_a_report_stopped_while_it_draws_leaves_neither_its_temp_directory_nor_the_parent_it_made(tmp_path):
    """SIGTERM left `.rep.XXXXXXXX.tmp` with half the figures beside --out, and the directory made for it."""
    arts = tmp_path / "arts"
    arts.mkdir()
    for i in range(4):  # their figures take seconds to draw
        write_json(arts / f"p{i}.profile.json", VALID["profile"])
    made = tmp_path / "made"
    proc = _start("report", arts, "--out", made / "rep")
    code, lines = _signal_at_work(proc, lambda: made.is_dir() and any(made.glob(".rep.*.tmp")), signal.SIGTERM)
    assert code == 143 and lines == [SAID[signal.SIGTERM] + "no file was left half-written; run the same command "
                                     "again."], lines
    assert not made.exists(), sorted(str(p) for p in made.rglob("*"))
    again = runner.invoke(app, ["report", str(arts), "--out", str(made / "rep")])
    assert again.exit_code == 0, again.output
    assert (made / "rep" / "summary.md").is_file() and not _temp_files(tmp_path)


# ---- 2. standard output that cannot take the result ------------------------------------------------------

def test_a_full_stdout_is_named_as_such_and_the_artifact_is_kept(char_bundle, tmp_path):
    """It was "no space left on the device (...)" naming nothing, as if --out had not been written."""
    out = tmp_path / "x.run.json"
    with open("/dev/full", "w") as full:
        done = _moetool(*run_args(char_bundle, "--out", str(out)), stdout=full)
    lines = [ln for ln in _lines(done.stderr) if ln.startswith("error:")]
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: no space left on the device writing standard output (/dev/full); ")
    assert json.loads(out.read_text())["schema"] and "Traceback" not in done.stderr


def test_a_closed_stdout_is_refused_in_one_sentence_not_lost_with_exit_code_0(char_bundle, tmp_path):
    """`moetool run ... >&-` printed its table nowhere (Rich writes to a null file) and exited 0."""
    out = tmp_path / "x.run.json"
    done = subprocess.run([sys.executable, "-m", "moetool.cli", *run_args(char_bundle, "--out", str(out))],
                          stderr=subprocess.PIPE, text=True, env=ENV, preexec_fn=lambda: os.close(1), timeout=600)
    lines = [ln for ln in _lines(done.stderr) if ln.startswith("error:")]
    assert done.returncode == 1 and lines == ["error: standard output is closed (the command was started with `>&-`), "
                                              "so its result cannot be shown; send it to a file or to /dev/null "
                                              "instead."], done.stderr
    assert json.loads(out.read_text())["schema"]


# ---- 3. a file-size limit ---------------------------------------------------------------------------------

WRITERS = {
    "run": lambda b, t: run_args(b, "--out", str(t / "x.run.json")),
    "eval": lambda b, t: ["eval", "ppl", "--bundle", str(b), "--limit", "16", "--context", "8", "--clock", "sim",
                          "--out", str(t / "x.eval.json")],
    "profile": lambda b, t: ["profile", "--bundle", str(b), "--what", "routing", "--seqs", "1", "--seq-len", "8",
                             "--decode-tokens", "1", "--data", "heldout", "--out", str(t / "x.profile.json")],
    "fit": lambda b, t: ["fit", str(t / "in.profile.json"), "--out", str(t / "x.fit.json")],
    "report": lambda b, t: ["report", str(write_json(t / "a.run.json", VALID["run"])), "--out", str(t / "rep")],
}


@pytest.mark.parametrize("command", sorted(WRITERS))
def test_a_file_size_limit_is_one_sentence_saying_so_and_a_rerun_without_it_writes(command, char_bundle, tmp_path):
    """It was "PATH: File too large." (the limit never named), after which a rerun must still write."""
    synthetic_profile().save(tmp_path / "in.profile.json")
    args = WRITERS[command](char_bundle, tmp_path)
    out = Path(args[args.index("--out") + 1])
    with file_size_limit(64):
        line = error_line(runner.invoke(app, args))
    assert line.startswith(f"error: file too large writing {out} (File too large): this process may write files "
                           "of at most 64 B (its file-size limit, ulimit -f)"), line
    assert not out.exists() and not _temp_files(tmp_path)
    again = runner.invoke(app, args)
    assert again.exit_code == 0, again.output
    assert out.exists()


def test_quantize_past_a_file_size_limit_names_the_limit_and_the_shard(char_ckpt, tmp_path):
    """quantize, whose files are the largest, said "File too large (OUT)": the directory twice, no limit."""
    out = tmp_path / "b"
    with file_size_limit(4096):
        line = error_line(runner.invoke(app, ["quantize", str(char_ckpt), "--bits", "4", "--no-reference",
                                              "--out", str(out)]))
    assert line.startswith(f"error: cannot write the bundle in {out}: file too large writing {out}/"), line
    assert "this process may write files of at most 4.0 KiB (its file-size limit, ulimit -f)" in line, line


# ---- 4. memory ----------------------------------------------------------------------------------------------

def test_an_allocation_the_machine_cannot_give_is_one_sentence_not_a_bug(tiny_ckpt, tmp_path):
    """64 GB of random calibration ids under `ulimit -v` 8 GiB: torch's "can't allocate memory" was a
    traceback asking to report a bug in moetool."""
    out = tmp_path / "q"
    done = _moetool("quantize", tiny_ckpt("qwen2_moe"), "--bits", "4", "--group-size", "16", "--calibrate",
                    "--calib-tokens", "8000000000", "--out", out, limits={resource.RLIMIT_AS: 8 << 30})
    lines = _lines(done.stderr)
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: out of host memory allocating 59.6 GiB (RuntimeError); free memory or ask for "
                               "less"), lines[0]
    assert "raise this process's address-space limit (8.0 GiB, ulimit -v)" in lines[0]
    assert not out.exists()


# CUDA's own text (c10/cuda/CUDACachingAllocator.cpp), as torch 2.13 raises it.
CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
            "1.06 GiB is free. Including non-PyTorch memory, this process has 78.12 GiB memory in use. Of the "
            "allocated memory 76.40 GiB is allocated by PyTorch, and 1.20 GiB is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


CUDA_CALL_OOM = ("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API "
                 "call, so the stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1")
CACHING = ("out of device memory (CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
           "79.19 GiB of which 1.06 GiB is free); give a smaller --budget or --batch-size, or free the device "
           "(another process may hold its memory).")


@pytest.mark.parametrize("how,said", [
    ("raised", CACHING),
    ("wrapped-by-a-library", CACHING),
    ("by-a-cuda-call", "out of memory in a CUDA call (CUDA error: out of memory); give a smaller --budget or "
                       "--host-budget (pinned host memory), or free the device (another process may hold its memory)."),
])
def test_a_device_out_of_memory_in_a_step_is_one_sentence_and_no_artifact(char_bundle, tmp_path, monkeypatch,
                                                                            how, said):
    """CUDA's out of memory met in a decode step: as torch's caching allocator raises it, wrapped in another
    error as torch.compile wraps what it meets while it compiles or captures (a traceback asking to report a
    bug), or as a CUDA call outside that allocator raises it (cudaHostAlloc pinning host memory: a bug report
    too). One sentence naming the memory and what to ask for instead, and no artifact."""
    import torch

    from moetool.engine.runtime import Engine

    def out_of_memory(*args, **kwargs):
        if how == "raised":
            raise torch.OutOfMemoryError(CUDA_OOM)
        if how == "by-a-cuda-call":
            raise RuntimeError(CUDA_CALL_OOM)
        try:
            raise torch.OutOfMemoryError(CUDA_OOM)
        except torch.OutOfMemoryError as e:
            raise RuntimeError("the backend failed while it compiled the step") from e

    monkeypatch.setattr(Engine, "run_layer", out_of_memory)
    out = tmp_path / "o.run.json"
    line = error_line(runner.invoke(app, run_args(char_bundle, "--decode", "host", "--out", str(out))))
    assert line == f"error: {said}", line
    assert not out.exists() and not _temp_files(tmp_path)


def _limited(script: str, *args: object, headroom: int) -> subprocess.CompletedProcess:
    """`script` in a Python whose address space may grow `headroom` bytes past what it maps when it calls
    `limit()`."""
    prelude = textwrap.dedent(f"""
        import resource

        def limit():
            mapped = next(int(ln.split()[1]) * 1024 for ln in open("/proc/self/status") if ln.startswith("VmSize:"))
            resource.setrlimit(resource.RLIMIT_AS, (mapped + {headroom}, resource.RLIM_INFINITY))
            return {headroom}
    """)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(script), *map(str, args)],
                          capture_output=True, text=True, env=ENV, timeout=300)


def test_reading_a_small_artifact_reserves_no_more_memory_than_it_holds(tmp_path):
    """`read_bytes` asked for its whole limit (256 MiB) before reading a 1 KiB artifact: a MemoryError
    under `ulimit -v` with room for the file many times over."""
    small = write_json(tmp_path / "a.run.json", VALID["run"])
    done = _limited("""
        import sys
        from moetool.files import ARTIFACT_BYTES, read_bytes
        limit()
        print(len(read_bytes(sys.argv[1], ARTIFACT_BYTES)))
    """, small, headroom=64 << 20)
    assert done.returncode == 0 and int(done.stdout) == small.stat().st_size, done.stderr[-2000:]


def test_host_tiers_the_process_cannot_hold_are_refused_before_the_run(wide_ckpt, tmp_path):
    """The memory a process can allocate counts its ulimit -v (it was the machine's MemAvailable alone), and
    a --host-budget whose tiers would hold more than that is refused when they are set up, not met by a
    MemoryError (or the OOM killer) at a layer deep into the run."""
    bundle = tmp_path / "b"
    quantize(QuantizeConfig(model=str(wide_ckpt), out=bundle, bits=(16,), group_size=16, dtype="float32",
                            hqq_optimize=False))  # 6 layers of 16 experts of 96 KiB: 9 MiB at 16 bits
    done = _limited("""
        import sys
        import torch
        from moetool.engine.store import HostStore
        from moetool.errors import MoetoolError
        from moetool.model import available_memory
        from moetool.quant.bundle import load_bundle_model

        store = HostStore.from_bundle(load_bundle_model(sys.argv[1]).bundle, torch.float32)
        room = limit()
        print("room ok" if available_memory() <= room else f"room {available_memory()} > {room}")
        try:
            store.configure_host(bits=(16,), host_budget=1 << 40, ring_slots=2, page_lock=False)
            print("configured")
        except MoetoolError as e:
            print(e)
    """, bundle, headroom=2 << 20)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and lines[0] == "room ok", (done.stdout, done.stderr[-2000:])
    assert lines[1].startswith("--host-budget 1024.0 GiB would hold 9.2 MiB of experts in host memory, more than "
                               "the "), lines[1]


# ---- 5. a path is named as asked for ------------------------------------------------------------------------

def test_an_out_that_links_under_a_file_is_refused_before_the_work(char_bundle, tmp_path):
    """A dangling link whose target lies under a file passed the check of --out, ran, and failed at the
    write with "/tmp/.../afile: File exists."."""
    (tmp_path / "afile").write_text("x")
    link = tmp_path / "o.run.json"
    link.symlink_to(tmp_path / "afile" / "x.run.json")
    line = error_line(runner.invoke(app, run_args(char_bundle, "--out", str(link))))
    assert line == (f"error: --out {link} (a link to {tmp_path / 'afile' / 'x.run.json'}) lies under "
                    f"{tmp_path / 'afile'}, which is a file, not a directory.")


def test_a_bundle_directory_removed_while_quantize_writes_names_no_temp_file(wide_ckpt, tmp_path):
    """It named the shard's temp file: "... No such file or directory (OUT/.layer-001.safetensors.kn32yhp5.tmp)"."""
    out = tmp_path / "q"
    proc = _start("quantize", wide_ckpt, "--bits", "16,4,2", "--group-size", "16", "--out", out)
    while proc.poll() is None and not (out / "layer-000.safetensors").exists():
        time.sleep(0.01)
    out.rename(tmp_path / "gone")  # as `rm -rf` does, at once: a path under --out no longer leads anywhere
    _, stderr = proc.communicate(timeout=300)
    lines = _lines(stderr)
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert ".tmp" not in lines[0] and str(out) in lines[0], lines[0]

"""Faults that break a resume, messages that break the promise, and saying what runs code (issue 45,
classes 3 to 5): each test here failed on the code before it. `tests/test_faults_inputs.py` holds
classes 1 and 2 (inputs that are not what they claim, reads without bounds).

3. Faults never break a resume: moetool's own temp files are cleaned, not refused; a SIGTERMed sweep
   exits cleanly and a SIGKILLed one leaves no Ray process; a sweep is never written into a bundle.
4. Messages keep the promise: a failed write names its path in every writing command, an --out that
   is a symlink loop is one sentence, a hardware profile a machine cannot have is refused on read.
5. `eval --help` says that task YAML can run Python.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from helpers import VALID, synthetic_profile, write_json
from helpers import SOME, copy, file_size_limit, run_args
from helpers import one_error_line as error_line
from moetool.cli import app
from moetool.engine.clock import HW_DIR, PLAUSIBLE
from moetool.errors import MoetoolError
from moetool.quant.quantize import JOURNAL, QuantizeConfig, quantize

runner = CliRunner()


# ---- 3. faults that break the promise to resume --------------------------------------------------------

@pytest.fixture(scope="module")
def interrupted(char_ckpt, tmp_path_factory) -> Path:
    """A bundle directory as a quantize interrupted after its first layer leaves it (Ctrl-C)."""
    out = tmp_path_factory.mktemp("interrupted") / "q"

    def stop_after_one_layer(p):
        if p.stage == "shard":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize(QuantizeConfig(model=str(char_ckpt), out=out, bits=(16, 4), group_size=16, dtype="float32",
                                hqq_optimize=False), progress=stop_after_one_layer)
    assert (out / JOURNAL).is_file() and [p.name for p in out.glob("layer-*")] == ["layer-000.safetensors"]
    return out


OWN_TEMP = ("..quantize-journal.json", ".bundle.json", ".layer-001.safetensors", ".layer-000.safetensors", ".model")


@SOME
@given(names=st.lists(st.sampled_from(OWN_TEMP), min_size=1, max_size=4),
       suffix=st.text("abcdefghijklmnopqrstuvwxyz0123456789_", min_size=8, max_size=8), body=st.binary(max_size=64))
@example(names=["..quantize-journal.json"], suffix="k3j4h5g6", body=b'{"settings_sha256": "')  # the issue's
def test_a_killed_quantizes_temp_files_never_block_its_resume(interrupted, char_ckpt, tmp_path_factory, names, suffix,
                                                              body):
    out = copy(interrupted, tmp_path_factory.mktemp("resume") / "q")
    finished = (out / "layer-000.safetensors").stat().st_mtime_ns
    for name in names:  # what a SIGKILL in the middle of each of quantize's writes leaves
        leftover = out / f"{name}.{suffix}.tmp"
        if name == ".model":
            leftover.mkdir(exist_ok=True)
            (leftover / "config.json").write_bytes(body)
        else:
            leftover.write_bytes(body)
    result = runner.invoke(app, ["quantize", str(char_ckpt), "--bits", "16,4", "--group-size", "16", "--dtype", "float32",
                                 "--no-hqq-optimize", "--out", str(out)])
    assert result.exit_code == 0, result.output  # it was refused: "not a moetool bundle"
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    assert (out / "layer-000.safetensors").stat().st_mtime_ns == finished  # the finished layer was kept


def test_a_user_file_that_looks_like_a_temp_file_is_never_removed(interrupted, char_ckpt, tmp_path):
    out = copy(interrupted, tmp_path / "q")
    (out / ".notes.abcdefgh.tmp").write_text("mine")
    line = error_line(runner.invoke(app, ["quantize", str(char_ckpt), "--bits", "16,4", "--group-size", "16",
                                          "--dtype", "float32", "--no-hqq-optimize", "--out", str(out)]))
    assert ".notes.abcdefgh.tmp" in line and (out / ".notes.abcdefgh.tmp").read_text() == "mine"


def sweep_grid(char_bundle: Path, path: Path) -> Path:
    path.write_text(yaml.safe_dump({"bundle": str(char_bundle), "stage": "run", "clock": "sim", "prompts": ["hi"],
                                    "max_new_tokens": 2, "grid": {"policy": ["lru", "lod"]}}))
    return path


@SOME
@given(names=st.lists(st.sampled_from(["sweep.json", "lru.run.json", "lod.run.json"]), min_size=1, max_size=3),
       suffix=st.text("abcdefghijklmnopqrstuvwxyz0123456789_", min_size=8, max_size=8))
def test_a_resumed_sweep_leaves_no_temp_file_of_the_killed_one(char_bundle, tmp_path_factory, names, suffix):
    tmp = tmp_path_factory.mktemp("sweep")
    grid, out = sweep_grid(char_bundle, tmp / "g.yaml"), tmp / "out"
    out.mkdir()
    for name in names:
        (out / f".{name}.{suffix}.tmp").write_text('{"schema": "sw')  # a SIGKILL during the atomic write
    (out / ".mine.tmp").write_text("a file of the user's")
    result = runner.invoke(app, ["sweep", str(grid), "--workers", "0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [".mine.tmp", "lod.run.json", "lru.run.json", "sweep.json"]


@pytest.mark.parametrize("under", ["", "sub", "model", "model/deeper"])
def test_a_sweep_is_never_written_inside_a_bundle(char_bundle, tmp_path, under):
    directory = copy(char_bundle, tmp_path / "b")
    before = sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))
    out = directory / under / "sweep" if under else directory
    line = error_line(runner.invoke(app, ["sweep", str(sweep_grid(directory, tmp_path / "g.yaml")), "--workers", "0",
                                          "--out", str(out)]))
    assert "holds a bundle (bundle.json)" in line or "holds a model (config.json)" in line  # model/: either
    assert sorted(str(p.relative_to(directory)) for p in directory.rglob("*")) == before


@pytest.mark.parametrize("inside", ["bundle", "bundle/model", "checkpoint"])
def test_a_bundle_is_never_quantized_inside_a_bundle_or_its_checkpoint(char_ckpt, char_bundle, tmp_path, inside):
    """quantize --out below a bundle or the source checkpoint is refused before any work (its own
    bundle as --out is a resume, tested with the journal)."""
    where = {"bundle": copy(char_bundle, tmp_path / "b"), "checkpoint": copy(char_ckpt, tmp_path / "c")}
    where["bundle/model"] = where["bundle"] / "model"
    directory = where[inside.split("/")[0]]
    before = sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))
    line = error_line(runner.invoke(app, ["quantize", str(where["checkpoint"]), "--bits", "4",
                                          "--out", str(where[inside] / "new")]))
    assert "lies inside" in line and "give the bundle a directory of its own" in line
    assert sorted(str(p.relative_to(directory)) for p in directory.rglob("*")) == before


def test_verify_names_a_shard_truncated_under_a_bundle(char_bundle, tmp_path):
    """A shard truncated while a command has it memory-mapped ends that command with SIGBUS (the
    kernel's answer to reading mapped pages past the end of a file; no sound way to catch it in
    Python): the answer is `verify`, which names the shard."""
    directory = copy(char_bundle, tmp_path / "b")
    shard = directory / "layer-001.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    assert "shard layer-001.safetensors" in error_line(runner.invoke(app, ["verify", str(directory)]))


def _ray_processes_of(pid: int) -> set[int]:
    from moetool.reaper import descendants

    return set(descendants(pid))


def _alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if Path(f"/proc/{pid}").exists()}


def _start_sweep(char_bundle: Path, tmp: Path) -> tuple[subprocess.Popen, Path]:
    tmp.mkdir()
    grid = tmp / "g.yaml"
    grid.write_text(yaml.safe_dump({"bundle": str(char_bundle), "stage": "run", "clock": "sim", "max_new_tokens": 40,
                                    "prompts": ["hello there", "a second prompt"],
                                    "grid": {"policy": ["lru", "lod", "static"], "budget": [f"{b}%" for b in
                                                                                             range(50, 101, 5)]}}))
    out = tmp / "out"
    proc = subprocess.Popen([sys.executable, "-m", "moetool.cli", "sweep", str(grid), "--out", str(out),
                             "--workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while not list(out.glob("*.run.json")) and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read()
    return proc, out


def _gone_within(pids: set[int], seconds: float) -> set[int]:
    deadline = time.monotonic() + seconds
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    return _alive(pids)


def test_the_reaper_kills_the_tree_it_watches_and_nothing_else():
    """What `sweep` relies on when it is SIGKILLed: once its pipe closes, the watcher kills the processes
    it was given and what they started (here a shell and its `sleep`), never another child."""
    from moetool.reaper import Reaper, descendants

    watched, other = (subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300"]) for _ in range(2))
    try:
        while len(descendants(watched.pid)) < 2:
            time.sleep(0.05)
        tree = {watched.pid, *descendants(watched.pid)}
        reaper = Reaper.start({watched.pid})
        time.sleep(1.0)  # a poll or two: the watcher notes the shell's children
        reaper.stop()
        assert watched.wait(timeout=10) == -signal.SIGKILL  # our own child: a zombie until we reap it
        assert not _gone_within(tree - {watched.pid}, 10) and other.poll() is None
    finally:
        for proc in (watched, other):
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_sigterm_stops_a_sweep_cleanly_and_sigkill_leaves_no_ray_process(char_bundle, tmp_path):
    proc, out = _start_sweep(char_bundle, tmp_path / "term")
    ray = _ray_processes_of(proc.pid)
    proc.send_signal(signal.SIGTERM)
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 143 and "SIGTERM received" not in stderr, stderr  # Ray's native crash dump
    assert "terminated (SIGTERM):" in stderr and "the same command runs the rest" in stderr
    assert not _gone_within(ray, 30)
    index = json.loads((out / "sweep.json").read_text())["cells"]
    assert {f"{n}.run.json" for n, c in index.items() if c["status"] == "done"} == \
        {p.name for p in out.glob("*.run.json")}

    proc, out = _start_sweep(char_bundle, tmp_path / "kill")
    ray = _ray_processes_of(proc.pid)
    assert ray  # the head processes, the raylet's agents and the worker
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not _gone_within(ray, 30)  # Ray's agents lived on for minutes, a worker could too


# ---- 4. messages that break the promise ------------------------------------------------------------

WRITERS = {  # every command that writes, with an --out (or --hw-out) it fails to write
    "check": lambda c, b, t: ["check", str(c), "--out", str(t / "c.json")],
    "quantize": lambda c, b, t: ["quantize", str(c), "--bits", "4", "--group-size", "16", "--no-hqq-optimize",
                                 "--out", str(t / "q")],
    "profile": lambda c, b, t: ["profile", "--bundle", str(b), "--what", "routing", "--seqs", "1", "--seq-len", "8",
                                "--decode-tokens", "1", "--data", "heldout", "--out", str(t / "p.profile.json")],
    "fit": lambda c, b, t: ["fit", str(t / "in.profile.json"), "--out", str(t / "f.fit.json")],
    "run": lambda c, b, t: [*run_args(b), "--out", str(t / "r.run.json")],
    "eval": lambda c, b, t: ["eval", "ppl", "--bundle", str(b), "--limit", "16", "--context", "8", "--clock", "sim",
                             "--out", str(t / "e.eval.json")],
    "sweep": lambda c, b, t: ["sweep", str(sweep_grid(b, t / "g.yaml")), "--workers", "0", "--out", str(t / "sw")],
    "report": lambda c, b, t: ["report", str(write_json(t / "a.run.json", VALID["run"])), "--out", str(t / "rep")],
}


@pytest.mark.parametrize("command", sorted(WRITERS))
def test_a_failed_write_names_its_path_in_every_writing_command(command, char_ckpt, char_bundle, tmp_path):
    """The kernel refuses the write (a file size limit, as a full disk refuses one): the sentence names
    the file or directory asked for, never nothing and never moetool's temp file."""
    synthetic_profile().save(tmp_path / "in.profile.json")
    args = WRITERS[command](char_ckpt, char_bundle, tmp_path)
    with file_size_limit(64):
        line = error_line(runner.invoke(app, args))
    out = Path(args[args.index("--out") + 1])
    assert str(out) in line and ".tmp" not in line, line  # it was "File too large (OSError)."


LOOPS = {"self": lambda p: p.symlink_to(p.name), "two links": lambda p: (p.with_name("other").symlink_to(p.name),
                                                                            p.symlink_to("other"))}


@pytest.mark.parametrize("command", ["run", "eval", "fit", "report", "check"])
@pytest.mark.parametrize("loop", sorted(LOOPS))
@pytest.mark.parametrize("below", [False, True])
def test_an_out_that_is_a_symlink_loop_is_one_sentence(command, loop, below, char_ckpt, char_bundle, tmp_path):
    synthetic_profile().save(tmp_path / "in.profile.json")
    looped = tmp_path / "looped"
    LOOPS[loop](looped)
    args = WRITERS[command](char_ckpt, char_bundle, tmp_path)
    args[args.index("--out") + 1] = str(looped / "x.json" if below else looped)
    assert "a symlink that leads back to itself" in error_line(runner.invoke(app, args))  # a RuntimeError traceback


HW_FIELDS = ("h2d_gbps", "gpu_tflops", "gpu_mem_gbps", "cpu_tflops", "cpu_mem_gbps", "kernel_s", "copy_latency_s",
             "t_dense_s", "c_cpu_s")


@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(field=st.sampled_from(HW_FIELDS), value=st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1.0, 1e-300,
                                                                 1e30]))
def test_a_hardware_profile_no_machine_has_is_refused_when_read(field, value, tmp_path_factory):
    from moetool.engine.clock import load_hw

    doc = {**json.loads((HW_DIR / "rtx3090.json").read_text()), field: value}
    path = tmp_path_factory.mktemp("hw") / "x.hw.json"
    path.write_text(json.dumps(doc))
    if field in ("kernel_s", "copy_latency_s", "t_dense_s", "c_cpu_s") and value == 1e-300:
        load_hw(str(path))  # a tiny fixed cost is a fixed cost; it cannot overflow anything
        return
    with pytest.raises(MoetoolError, match=field):
        load_hw(str(path))


def test_an_expert_time_keyed_by_no_precision_is_refused(tmp_path):
    """`t_expert_s: {"17": ...}` was never read: the 16-bit time meant fell back to the FLOP estimate unsaid."""
    from moetool.engine.clock import load_hw

    doc = {**json.loads((HW_DIR / "rtx3090.json").read_text()), "t_expert_s": {"17": 1e-5}}
    path = tmp_path / "x.hw.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(MoetoolError, match=r"t_expert_s\[17\] is keyed by 17, not a stored precision"):
        load_hw(str(path))


@settings(max_examples=60, deadline=None, database=None, derandomize=True)
@given(values=st.fixed_dictionaries({f: st.floats(*PLAUSIBLE[f][:2]) for f in HW_FIELDS}))
def test_every_hardware_profile_accepted_gives_finite_times_for_any_model(values, tmp_path_factory):
    from moetool.engine.clock import CostModel, load_hw

    path = tmp_path_factory.mktemp("hw") / "x.hw.json"
    path.write_text(json.dumps({"name": "x", **values}))
    hw, _ = load_hw(str(path))
    cost = CostModel(hw=hw, expert_bytes={16: 1 << 34, 2: 1}, expert_flops_per_token=1e13, reference_bytes=1 << 34,
                     dense_bytes_per_layer=1e12, dense_flops_per_token_per_layer=1e13)
    times = [cost.t_dense(1 << 20), cost.t_expert(16, 1 << 20), cost.t_expert(2, 1), cost.t_copy(1 << 40),
             cost.c_cpu(1 << 20)]
    assert all(math.isfinite(t) and t >= 0 for t in times)
    assert math.isfinite(sum(times) * 1e6)  # a million steps of the largest model still sum to a number


def test_run_refuses_a_profile_whose_kernel_cost_would_make_its_times_nan(char_bundle, tmp_path):
    doc = {**json.loads((HW_DIR / "rtx3090.json").read_text()), "kernel_s": 1e308}
    out = tmp_path / "r.run.json"
    line = error_line(runner.invoke(app, [*run_args(char_bundle, "--hw", str(write_json(tmp_path / "x.hw.json", doc))),
                                          "--out", str(out)]))
    assert "kernel_s" in line and not out.exists()  # it wrote a run of NaN and Infinity, exit 0


# ---- 5. say what runs code ------------------------------------------------------------------------

def test_eval_help_says_that_task_yaml_can_run_python():
    result = runner.invoke(app, ["eval", "--help"])
    text = " ".join(w for w in result.stdout.split() if w != "│")  # the help panel's borders between its lines
    assert result.exit_code == 0 and "!function" in text and "runs a Python file" in text

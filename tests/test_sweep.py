"""`moetool sweep` on a tiny model: cells on a local Ray, refusals recorded, resume, equality with `moetool run`."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from moetool.cli import app
from moetool.evaluate import EvalConfig, evaluate
from moetool.sweep import INDEX, SweepConfig, run_cell, sweep
from helpers import one_error_line as _one_error_line

runner = CliRunner()
BUDGETS = ["25%", "50%", "10KiB"]  # 10 KiB is below the tiny model's minimum (its KV/activation margin alone is 18 MiB)
PROMPTS = ["abcdefgh", "The capital of France is"]


def write_grid(path: Path, **grid) -> Path:
    path.write_text(yaml.safe_dump(grid))
    return path


def run_grid(model: Path, **axes) -> dict:
    return dict(model=str(model), stage="run", prompts=PROMPTS, max_new_tokens=4, clock="sim", hw="rtx3090",
                grid=axes or {"policy": ["lru", "lod"], "budget": BUDGETS})


def mtimes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir()}


# -- bad input: one sentence each, before any Ray starts ---------------------------------------------

@pytest.mark.parametrize("grid,says", [
    ({"grid": {"policy": ["lru"], "cache_size": [1, 2]}}, "unknown axis or knob 'cache_size'"),
    ({"grid": {"policy": [{"policy": "lru", "set": {"alpha": 0.3}}]}}, "policy 'lru' has no knob 'alpha'"),
    ({"grid": {"policy": ["lru", "dymoe"], "r": [0.5, 0.9]}}, "unknown axis or knob 'r'"),  # not a knob of lru
    ({"grid": {}}, "the grid is empty"),
    ({"grid": {"policy": ["lru"], "budget": []}}, "axis 'budget' of the grid has no values"),
    ({"max_new_token": 4, "grid": {"policy": ["lru"]}}, "unknown setting 'max_new_token'"),
    ({"grid": {"policy": ["lru"], "bundle": ["a", "b"]}}, "'bundle' is one per sweep"),
    # A helper's pass: each was a traceback, a prompt blamed that nobody wrote, or minutes of expansion.
    ({"grid": {"policy": ["lru"], "budget": [None]}}, "axis 'budget' of the grid has an empty value (null)"),
    ({"grid": {"policy": [["lru"]]}}, "unknown policy ['lru'] in the grid"),
    ({"prompts": {"heldout": -1}, "grid": {"policy": ["lru"]}}, "the held-out text gives 1 to "),
    ({"prompts": {"heldout": 10 ** 8}, "grid": {"policy": ["lru"]}}, "prompts, not 100000000"),
    ({"prompts": {"heldout": True}, "grid": {"policy": ["lru"]}}, "prompts, not True"),
    ({"budget": None, "grid": {"policy": ["lru"]}}, "setting 'budget' is empty"),
    ({"grid": {"policy": [{"policy": "lru", "label": "L" * 300}]}}, "makes a file name of 309 bytes"),
    ({"grid": {"policy": ["smoe"], "alpha": [i / 100 for i in range(50)], "window": list(range(50)),
               "budget": [f"{i + 1}%" for i in range(50)]}}, "the grid crosses into 125,000 cells, more than the 10,000"),
])
def test_bad_grids_are_one_sentence(tiny_ckpt, tmp_path, grid, says):
    path = write_grid(tmp_path / "g.yaml", **{**run_grid(tiny_ckpt("qwen2_moe")), **grid})
    line = _one_error_line(runner.invoke(app, ["sweep", str(path), "--out", str(tmp_path / "out")]))
    assert says in line
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_a_grid_that_gives_a_key_twice_is_refused_not_read_as_its_last(tiny_ckpt, tmp_path):
    path = write_grid(tmp_path / "g.yaml", **run_grid(tiny_ckpt("qwen2_moe"), policy=["lru"]))
    path.write_text(path.read_text() + "max_new_tokens: 2\n")  # PyYAML kept the last and ran 2 tokens a cell
    line = _one_error_line(runner.invoke(app, ["sweep", str(path), "--out", str(tmp_path / "out")]))
    assert line == f"error: {path} gives 'max_new_tokens' twice in one mapping (line {len(path.read_text().splitlines())}); keep one of them.", line


def test_a_grid_may_merge_an_anchored_mapping_into_another(tiny_ckpt, tmp_path):
    """`<<: *fate` (YAML's merge key) was refused as "not valid YAML" by the check for repeated keys."""
    from moetool.grid import expand, load_grid

    path = tmp_path / "g.yaml"
    path.write_text(f"model: {tiny_ckpt('qwen2_moe')}\nprompts: [hi]\nmax_new_tokens: 2\ngrid:\n  policy:\n"
                    "    - &fate {policy: fate, set: {L: 1}, label: fate_a}\n"
                    "    - <<: *fate\n      set: {L: 2}\n      label: fate_b\n")
    cells = expand(load_grid(path), tmp_path).cells
    assert {c.name: c.settings["settings"] for c in cells} == {"fate_a": {"L": "1"}, "fate_b": {"L": "2"}}


def test_a_command_line_setting_the_grid_crosses_is_refused(tiny_ckpt, tmp_path):
    """`--with policy=zzz` on a grid with a policy axis ran the axis' policies, zzz never checked."""
    path = write_grid(tmp_path / "g.yaml", **run_grid(tiny_ckpt("qwen2_moe"), policy=["lru"]))
    line = _one_error_line(runner.invoke(app, ["sweep", str(path), "--with", "policy=zzz", "--out",
                                               str(tmp_path / "out")]))
    assert "policy given on the command line replaces a top-level setting of the grid, but the grid crosses " \
           "policy as an axis" in line, line


def test_a_sweep_into_the_directory_of_another_grids_sweep_is_refused(tiny_ckpt, tmp_path):
    """The other grid's index was replaced and its artifacts left beside this grid's, drawn by report as its own;
    a grid that adds cells to the sweep there still resumes it."""
    model = tiny_ckpt("qwen2_moe")
    first = write_grid(tmp_path / "a.yaml", **run_grid(model, policy=["lru", "lod"]))
    assert runner.invoke(app, ["sweep", str(first), "--workers", "0", "--out", str(tmp_path / "out")]).exit_code == 0
    other = write_grid(tmp_path / "b.yaml", **run_grid(model, policy=["eap"]))
    line = _one_error_line(runner.invoke(app, ["sweep", str(other), "--workers", "0", "--out", str(tmp_path / "out")]))
    assert "holds a sweep of another grid, whose cell lru and 1 more this grid does not have" in line, line
    more = write_grid(tmp_path / "c.yaml", **run_grid(model, policy=["lru", "lod", "eap"]))
    result = runner.invoke(app, ["sweep", str(more), "--workers", "0", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0 and "2 reused, 1 done" in result.stderr, result.output


def test_help_has_an_example():
    result = runner.invoke(app, ["sweep", "--help"])
    assert result.exit_code == 0 and "Example" in result.stdout and "--address" in result.stdout


def test_a_bundle_of_another_model_is_refused(tiny_ckpt, tmp_path):
    from moetool.quant.quantize import QuantizeConfig, quantize

    quantize(QuantizeConfig(model=str(tiny_ckpt("qwen2_moe")), out=tmp_path / "b", bits=(16, 4), group_size=16,
                            dtype="float32"))
    path = write_grid(tmp_path / "g.yaml", **run_grid(tiny_ckpt("mixtral")), bundle="b")  # relative to the grid
    line = _one_error_line(runner.invoke(app, ["sweep", str(path), "--out", str(tmp_path / "out")]))
    assert "was made for model" in line


def test_an_unreachable_ray_address_is_one_sentence_in_seconds(tiny_ckpt, tmp_path):
    path = write_grid(tmp_path / "g.yaml", **run_grid(tiny_ckpt("qwen2_moe")))
    line = _one_error_line(runner.invoke(app, ["sweep", str(path), "--out", str(tmp_path / "out"),
                                               "--address", "127.0.0.1:9"]))  # discard port: nothing listens
    assert "cannot reach a Ray cluster at 127.0.0.1:9" in line


@pytest.mark.slow
def test_a_killed_sweep_finishes_only_the_missing_cells(tiny_ckpt, tmp_path):
    """The driver is SIGKILLed half-way (no cleanup at all); the same command then runs only what is missing."""
    grid = run_grid(tiny_ckpt("qwen2_moe"), policy=["lru", "lod", "eap", "resident"], budget=["25%", "50%", "100%"])
    path = write_grid(tmp_path / "g.yaml", **{**grid, "max_new_tokens": 90, "prompts": PROMPTS * 2})
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "moetool.cli", "sweep", str(path), "--out", str(out), "--workers", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while len(list(out.glob("*.run.json"))) < 2 and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = mtimes(out)
    index = json.loads((out / INDEX).read_text())["cells"]
    done = {f"{n}.run.json" for n, c in index.items() if c["status"] == "done"}
    written = {n for n in first if n.endswith(".run.json")}
    # An artifact is saved before the index says so: the kill may land between the two, leaving
    # one artifact the index does not list yet, which the next run must reuse all the same.
    assert done <= written and len(written - done) <= 1
    assert len(written) < len(index)  # killed half-way: some cells never ran

    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert f"{len(written) + sum(c['status'] == 'refused' for c in index.values())} reused" in result.stderr
    assert all(first[n] == (out / n).stat().st_mtime_ns for n in first if n.endswith(".run.json"))
    final = json.loads((out / INDEX).read_text())["cells"]
    assert sorted(c["status"] for c in final.values()) == ["done"] * 10 + ["refused"] * 2


def test_a_cell_out_of_device_memory_is_failed_with_the_sentence_moetool_run_gives(tiny_ckpt, tmp_path, monkeypatch):
    """A cell that runs out of the device's memory is recorded as failed with the sentence `moetool run` would
    print (it was "it raised OutOfMemoryError: CUDA out of memory. Tried to ..." and a traceback), and the
    other cells go on."""
    import torch

    import moetool.run

    real = moetool.run.run

    def run(cfg):
        if cfg.policy == "lod":
            raise RuntimeError("the backend failed while it compiled the step") from torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 15.6 GiB of which "
                "3.2 MiB is free. Including non-PyTorch memory, this process has 15.5 GiB memory in use.")
        return real(cfg)

    monkeypatch.setattr(moetool.run, "run", run)
    out = tmp_path / "sweep"
    sweep(SweepConfig(grid=run_grid(tiny_ckpt("qwen2_moe"), policy=["lru", "lod"], budget=["50%"]), out=out,
                      workers=0))
    cells = json.loads((out / INDEX).read_text())["cells"]
    assert sorted(c["status"] for c in cells.values()) == ["done", "failed"]
    failed = next(c for c in cells.values() if c["status"] == "failed")
    assert failed["reason"] == ("out of device memory (CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a "
                                "total capacity of 15.6 GiB of which 3.2 MiB is free); give a smaller --budget or "
                                "--batch-size, or free the device (another process may hold its memory)."), failed


def test_a_grids_hardware_profile_is_the_grid_files_and_an_edit_to_it_runs_its_cells_again(tiny_ckpt, tmp_path,
                                                                                           monkeypatch):
    """`hw: hw/fast.json` was read from where sweep ran, not beside the grid (another file of that name gave
    10x another TPOT, the artifacts alike), and a resume after an edit to it reused the old figures."""
    from moetool.engine.clock import HW_DIR

    home = tmp_path / "gdir"
    (home / "hw").mkdir(parents=True)
    preset = json.loads((HW_DIR / "rtx3090.json").read_text())
    (home / "hw" / "fast.json").write_text(json.dumps({**preset, "h2d_gbps": 1000.0}))
    (tmp_path / "hw").mkdir()
    (tmp_path / "hw" / "fast.json").write_text(json.dumps({**preset, "h2d_gbps": 0.01}))  # where sweep runs
    settings = run_grid(tiny_ckpt("qwen2_moe"), policy=["lod"], hw=["hw/fast.json"])
    del settings["hw"]  # an axis, not a top setting
    grid = write_grid(home / "g.yaml", **settings)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "sweep"
    index = sweep(SweepConfig(grid=grid, out=out, workers=0))
    assert list(index.cells) == ["lod_hw=hw-fast.json"]  # the name as the grid wrote it
    run = json.loads((out / "lod_hw=hw-fast.json.run.json").read_text())
    assert run["hw"] == str((home / "hw" / "fast.json").resolve())
    assert str((home / "hw" / "fast.json").resolve()) in run["inputs"]
    (home / "hw" / "fast.json").write_text(json.dumps({**preset, "h2d_gbps": 0.05}))
    said = []
    sweep(SweepConfig(grid=grid, out=out, workers=0), progress=lambda name, status, *_: said.append(status))
    assert said == ["done"]  # run again, not "reused"
    slower = json.loads((out / "lod_hw=hw-fast.json.run.json").read_text())
    assert slower["tpot_s"]["mean"] > 2 * run["tpot_s"]["mean"]


def test_a_cell_another_moetool_wrote_runs_again_and_the_sweep_says_so(tiny_ckpt, tmp_path):
    """A resume reused cells written months before under other meanings (DyMoE's r, the Run's batch, the
    sim clock's charges): artifacts record the moetool that wrote them (its source's digest), and a cell of
    another runs again, said once."""
    from moetool.artifacts import code_version

    grid = write_grid(tmp_path / "g.yaml", **run_grid(tiny_ckpt("qwen2_moe"), policy=["lru", "lod"]))
    out = tmp_path / "sweep"
    assert runner.invoke(app, ["sweep", str(grid), "--workers", "0", "--out", str(out)]).exit_code == 0
    cell = out / "lru.run.json"
    art = json.loads(cell.read_text())
    assert art["moetool_version"] == code_version() and code_version().startswith("0.1.0+")
    cell.write_text(json.dumps({**art, "moetool_version": "0.1.0"}))  # as every moetool before this one wrote
    result = runner.invoke(app, ["sweep", str(grid), "--workers", "0", "--out", str(out)])
    assert result.exit_code == 0 and "1 reused, 1 done" in result.stderr, result.output
    assert (f"note: 1 cell(s) of {out} were written by another moetool (0.1.0; this one is {code_version()}), so they "
            "run again rather than being reused.") in " ".join(result.stderr.split()), result.stderr
    assert json.loads(cell.read_text())["moetool_version"] == code_version()


def test_a_path_given_on_the_command_line_is_the_working_directorys(tiny_ckpt, tmp_path, monkeypatch):
    """`sweep --with hw=hw/fast.json` read the file of that name beside the grid, where `run --hw` reads the
    working directory's; the grid's own paths stay its directory's."""
    from moetool.sweep import cells_of

    home = tmp_path / "gdir"
    (home / "hw").mkdir(parents=True)
    (tmp_path / "hw").mkdir()
    for d in (home, tmp_path):
        (d / "hw" / "fast.json").write_text("{}")
    settings = run_grid(tiny_ckpt("qwen2_moe"), policy=["lod"])
    grid = write_grid(home / "g.yaml", **{**settings, "hw": "hw/fast.json"})
    monkeypatch.chdir(tmp_path)
    cells = cells_of(SweepConfig(grid=grid, out=tmp_path / "o"))
    assert cells[0].settings["hw"] == str(home / "hw" / "fast.json")
    cells = cells_of(SweepConfig(grid=grid, out=tmp_path / "o", overrides={"hw": "hw/fast.json"}))
    assert cells[0].settings["hw"] == str(tmp_path / "hw" / "fast.json")


def test_an_hw_axis_on_the_wall_clock_is_said_to_time_nothing(tiny_ckpt, tmp_path):
    """`run --clock wall --hw X` says hw times nothing there; a sweep's hw axis on the wall clock ran the same
    measurement once per profile under two names, unsaid."""
    settings = {**run_grid(tiny_ckpt("qwen2_moe"), policy=["lru"], hw=["rtx3090", "h100sxm"]), "clock": "wall",
                "max_new_tokens": 2}
    del settings["hw"]
    grid = write_grid(tmp_path / "g.yaml", **settings)
    done = runner.invoke(app, ["sweep", str(grid), "--out", str(tmp_path / "o"), "--workers", "0"])
    assert done.exit_code == 0, done.output
    said = " ".join(done.stderr.split())
    assert "note: the hw axis times nothing in the 2 wall-clock cell(s) (lru_hw=rtx3090, ...)" in said, said


# -- on a local Ray with 2 CPUs ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_grid_on_ray_refuses_the_impossible_budget_and_equals_moetool_run(tiny_ckpt, ray_local, tmp_path):
    model = tiny_ckpt("qwen2_moe")
    path = write_grid(tmp_path / "g.yaml", **run_grid(model))
    out = tmp_path / "sweep"
    result = runner.invoke(app, ["sweep", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    index = json.loads((out / INDEX).read_text())["cells"]
    assert sorted(p.name for p in out.glob("*.run.json")) == sorted(
        f"{pol}_budget={b}.run.json" for pol in ("lru", "lod") for b in ("25pct", "50pct"))
    refused = {n: c for n, c in index.items() if c["status"] == "refused"}
    assert set(refused) == {"lru_budget=10KiB", "lod_budget=10KiB"}  # the impossible budget, once per policy
    assert all("below the minimum" in c["reason"] and c["artifact"] is None for c in refused.values())

    # Each cell equals the same settings run with `moetool run`, one by one (the sim clock makes times exact).
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    for name, cell in index.items():
        if cell["status"] != "done":
            continue
        one = tmp_path / f"{name}.one.json"
        args = ["run", "--model", str(model), "--policy", cell["settings"]["policy"], "--budget",
                cell["settings"]["budget"], "--clock", "sim", "--hw", "rtx3090", "--prompts", str(prompts),
                "--max-new-tokens", "4", "--out", str(one)]
        assert runner.invoke(app, args).exit_code == 0
        got, ref = json.loads((out / cell["artifact"]).read_text()), json.loads(one.read_text())
        for key in ("tokens", "hit_rate", "bytes_h2d", "bytes_per_token", "ttft_s", "tpot_s", "stall_s",
                    "peak_device_bytes", "budget_bytes", "params", "summary", "layers"):
            assert got[key] == ref[key], (name, key)
        assert got["inputs"].pop("sweep cell") == cell["digest"] and got["inputs"] == ref["inputs"]

    # A second run re-runs nothing and touches nothing, the index included.
    before = mtimes(out)
    result = runner.invoke(app, ["sweep", str(path), "--out", str(out)])
    assert result.exit_code == 0 and "6 reused" in result.stderr
    assert mtimes(out) == before

    # `moetool report` reads the sweep directory like any artifacts, refusals included.
    assert runner.invoke(app, ["report", str(out), "--out", str(tmp_path / "report")]).exit_code == 0
    md = (tmp_path / "report" / "summary.md").read_text()
    assert "lru_budget=25pct.run.json" in md and "lod_budget=10KiB" in md


def test_an_interrupted_sweep_finishes_only_the_missing_cells(tiny_ckpt, ray_local, tmp_path):
    cfg = SweepConfig(grid=run_grid(tiny_ckpt("qwen2_moe")), out=tmp_path / "sweep")
    seen = []

    def ctrl_c_after_two(name, status, done, total):
        seen.append((name, status))
        if sum(s == "done" for _, s in seen) == 2:
            raise KeyboardInterrupt  # what Ctrl-C raises in the driver while it waits on Ray

    with pytest.raises(KeyboardInterrupt):
        sweep(cfg, progress=ctrl_c_after_two)
    first = {n for n, s in seen if s == "done"}
    index = json.loads((tmp_path / "sweep" / INDEX).read_text())["cells"]
    assert {n for n, c in index.items() if c["status"] == "done"} == first  # the index kept up with each cell
    assert sorted(p.name for p in (tmp_path / "sweep").glob("*.run.json")) == sorted(f"{n}.run.json" for n in first)
    kept = mtimes(tmp_path / "sweep")
    missing = next(n for n, c in index.items() if c["status"] == "pending" and not n.endswith("10KiB"))
    (tmp_path / "sweep" / f"{missing}.run.json").write_text('{"schema": "run", "trunc')  # a torn file is not a result

    again = []
    final = sweep(cfg, progress=lambda name, status, *_: again.append((name, status)))
    recorded = first | {n for n, s in seen if s == "refused"}  # refusals are results too: recorded, not re-run
    assert {n for n, s in again if s == "reused"} == recorded
    assert {n for n, s in again if s != "reused"} == set(final.cells) - recorded
    assert all(kept[f"{n}.run.json"] == (tmp_path / "sweep" / f"{n}.run.json").stat().st_mtime_ns for n in first)
    assert [c["status"] for c in final.cells.values()].count("done") == 4
    assert json.loads((tmp_path / "sweep" / f"{missing}.run.json").read_text())["schema"] == "run"
    assert not [p for p in (tmp_path / "sweep").iterdir() if p.name.endswith(".tmp")]

    # Another setting for a cell (here its token count) makes its artifact stale: that cell runs again.
    changed = SweepConfig(grid={**run_grid(tiny_ckpt("qwen2_moe")), "max_new_tokens": 3}, out=tmp_path / "sweep",
                          only=("lru_budget=25pct",))
    later = []
    sweep(changed, progress=lambda name, status, *_: later.append((name, status)))
    assert later == [("lru_budget=25pct", "done")]
    assert len(json.loads((tmp_path / "sweep" / "lru_budget=25pct.run.json").read_text())["tokens"][0]) == 3


def test_a_worker_that_dies_is_retried_once_then_recorded(tiny_ckpt, ray_local, tmp_path):
    marks = tmp_path / "attempts"
    marks.mkdir()

    def dies_on_50pct(cell, threads=None):  # shipped to the workers by value
        if cell.name.endswith("50pct"):
            (marks / f"{os.getpid()}").write_text(cell.name)
            os._exit(1)  # the worker process dies, as under the OOM killer
        return run_cell(cell, threads)

    cfg = SweepConfig(grid=run_grid(tiny_ckpt("qwen2_moe"), policy=["lru"], budget=["25%", "50%"]),
                      out=tmp_path / "sweep")
    index = sweep(cfg, work=dies_on_50pct)
    assert len(list(marks.iterdir())) == 2  # two worker processes tried it: the first run and one retry
    failed = index.cells["lru_budget=50pct"]
    assert failed["status"] == "failed" and "worker died twice" in failed["reason"]
    assert index.cells["lru_budget=25pct"]["status"] == "done"


def test_an_eval_grid_on_ray_equals_moetool_eval(tiny_ckpt, ray_local, tmp_path):
    model = tiny_ckpt("qwen2_moe")
    grid = dict(model=str(model), stage="eval", limit=96, context=32, clock="sim", budget="50%",
                grid={"policy": [{"policy": "resident", "budget": "100%"}, "lod"], "task": ["ppl"]})
    index = sweep(SweepConfig(grid=grid, out=tmp_path / "sweep"))
    assert [c["status"] for c in index.cells.values()] == ["done", "done"]
    for name, cell in index.cells.items():
        s = cell["settings"]
        ref = evaluate(EvalConfig(task="ppl", model=str(model), policy=s["policy"], budget=s["budget"], limit=96,
                                  context=32, clock="sim")).to_json()
        got = json.loads((tmp_path / "sweep" / cell["artifact"]).read_text())
        assert got["metrics"] == ref["metrics"] and got["samples"] == ref["samples"] and got["summary"] == ref["summary"]


@pytest.mark.parametrize("extra,says", [(["--device", "gpu"], "gpu"), (["--with", "budget=abc"], "abc")])
def test_settings_no_model_could_run_are_refused_before_any_cell(tiny_ckpt, tmp_path, extra, says):
    """A setting every cell gets from the command line (a device this machine lacks, a budget that is
    not a size) is refused in one sentence naming a cell, before any cell runs or the output exists."""
    grid = tmp_path / "g.yaml"
    grid.write_text(yaml.safe_dump({"model": str(tiny_ckpt("qwen2_moe")), "prompts": ["Hello"], "max_new_tokens": 2,
                                    "grid": {"policy": ["lru", "resident"]}}))
    line = _one_error_line(runner.invoke(app, ["sweep", str(grid), "--workers", "0", *extra,
                                               "--out", str(tmp_path / "out")]))
    assert line.startswith("error: cell ") and says in line
    assert not (tmp_path / "out").exists()

"""Reading artifacts needs no torch: `moetool report` imports neither torch nor transformers (nor
triton, lm_eval), neither to start nor to draw a whole report, every paper's part included, so a
report on existing artifacts starts at once. Each check runs in a fresh interpreter: this one has
imported torch long ago."""

import dataclasses
import json
import subprocess
import sys

from moetool.fit import FitConfig, fit
from helpers import FP, VALID, routing_profile, similarity_profile, synthetic_profile, synthetic_run

HEAVY = ("torch", "transformers", "triton", "lm_eval")


def _heavy_after(code: str) -> list[str]:
    """The packages of HEAVY that a fresh interpreter holds after running `code`."""
    probe = f"{code}\nimport sys\nprint('loaded:' + ','.join(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("loaded:"), done.stdout
    return [m for m in line.removeprefix("loaded:").split(",") if m]


def test_importing_the_report_stage_and_the_cli_loads_no_torch():
    assert _heavy_after("import moetool.report, moetool.cli") == []


def test_a_whole_report_is_drawn_without_torch(tmp_path):
    """A profile (every part), a fit, runs of every paper, a perplexity eval and a sweep index: the
    artifacts are read through their schema readers (knobs checked against each policy's Params) and
    every paper's `report` adds its part, all in a process that never imports torch."""
    art = tmp_path / "art"
    art.mkdir()
    prof = dataclasses.replace(synthetic_profile(), routing=routing_profile(), similarity=similarity_profile())
    prof_path = prof.save(art / "s.profile.json")
    runs = [synthetic_run("smoe", {"alpha": a}, 0.1 - 0.1 * a).save(art / f"smoe{a}.run.json") for a in (0.0, 0.2)]
    fit(FitConfig(profile=prof_path, runs=tuple(runs), target_tpot=0.09, budget="50%")).save(art / "s.fit.json")
    for policy, params in (("fate", {"L": 2}), ("dymoe", {"r": 0.9, "config": "4/0"}), ("dynaexq", {"config": "4/2"}),
                           ("lru", {"bits": 16})):
        synthetic_run(policy, params, 0.05).save(art / f"{policy}.run.json")
    (art / "dymoe.eval.json").write_text(json.dumps(
        {"schema": "eval", "schema_version": 2, "model": FP.__dict__, "task": "ppl", "policy": "dymoe",
         "params": {"r": 0.9, "config": "4/0"}, "metrics": {"ppl": 12.5}}))
    (art / "cells").mkdir()
    (art / "cells" / "grid.sweep.json").write_text(json.dumps(VALID["sweep"]))

    out = tmp_path / "rep"
    code = f"from moetool.cli import app\napp(['report', {str(art)!r}, '--out', {str(out)!r}], standalone_mode=False)"
    assert _heavy_after(code) == []
    md = (out / "summary.md").read_text()
    for part in ("## Runs", "Fate Table 1", "DyMoE schedule", "| smoe | alpha |", "## DynaExq", "alpha_tpot.png",
                 "## Sweep cells without an artifact"):
        assert part in md, part

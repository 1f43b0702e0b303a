"""`moetool demo`'s pipeline end to end on a tiny model: every stage, every policy, reuse on a re-run."""

import json

import pytest

from moetool.artifacts import sha256_file
from moetool.pipeline import EVALS_GRID, RUNS_GRID, DemoConfig, demo_pipeline
from moetool.quant.bundle import Bundle
from moetool.grid import load_grid
from moetool.spec import EngineSpec
from helpers import save_char_tokenizer
from tiny import save_tiny

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def piped(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    model = save_tiny("qwen2_moe", root / "model", max_position_embeddings=1024)  # experts 16 neurons wide
    save_char_tokenizer(model)
    cfg = DemoConfig(out=root / "out", engine=EngineSpec(model=str(model)), prompts=2, tokens=4, mc_limit=2,
                     ppl_tokens=128)
    steps = []
    paths = demo_pipeline(cfg, progress=lambda what, done, total: steps.append((what, done, total)))
    return cfg, paths, steps


def test_every_stage_leaves_its_artifact(piped):
    cfg, paths, steps = piped
    assert [d for _, d, _ in steps] == list(range(len(steps))) and steps[-1][0] == "report"
    assert {total for _, _, total in steps} == {len(steps)}  # the total is known from the start
    assert Bundle.open(paths["bundle"]).manifest.group_size == 16  # 64 would not tile the 16-wide down projection
    assert paths["profile"].is_file() and paths["fit"].is_file()
    runs = json.loads((paths["runs"] / "sweep.json").read_text())["cells"]
    labels = [p if isinstance(p, str) else p.get("label", p["policy"]) for p in load_grid(RUNS_GRID)["grid"]["policy"]]
    assert list(runs) == labels  # one cell per policy of the packaged grid, named by its label
    for name, cell in runs.items():  # each policy ran, or its refusal by the budget is recorded in one sentence
        assert (cell["status"] == "done") == (paths["runs"] / f"{name}.run.json").is_file()
        assert cell["status"] == "done" or (cell["status"] == "refused" and cell["reason"].endswith("."))
    assert runs["resident"]["status"] == "done" and runs["lru"]["status"] == "done"
    evals = json.loads((paths["evals"] / "sweep.json").read_text())["cells"]
    tasks = [t["task"] for t in load_grid(EVALS_GRID)["grid"]["task"]]
    assert len(evals) == len(load_grid(EVALS_GRID)["grid"]["policy"]) * len(tasks) == 12
    for name, cell in evals.items():
        assert (cell["status"] == "done") == (paths["evals"] / f"{name}.eval.json").is_file()
        assert cell["status"] in ("done", "refused")
        limit = cfg.ppl_tokens if cell["settings"]["task"] == "ppl" else cfg.mc_limit
        assert cell["settings"]["limit"] == limit and cell["settings"]["task"] in tasks
    assert evals["resident_task=ppl"]["status"] == "done"
    md = (paths["report"] / "summary.md").read_text()
    assert "## Quality under each setting" in md and "## Runs" in md
    assert (paths["report"] / "policies.png").read_bytes()[:8] == PNG


def test_every_evaluated_setting_has_its_run(tmp_path):
    """Each eval cell of the demo has a run cell of the same label, policy, knobs, budget, hardware and
    inputs: the report can pair every quality with a TPOT (the grids cannot drift apart)."""
    from moetool.pipeline import demo_sweeps
    from moetool.sweep import cells_of

    sweeps = demo_sweeps(DemoConfig(out=tmp_path), "demo", tmp_path / "bundle", tmp_path / "demo.fit.json")
    runs = {c.name: c.settings for c in cells_of(sweeps["runs"])}
    evals = cells_of(sweeps["evals"])
    assert evals
    for cell in evals:
        label = cell.name.split("_task=")[0]
        assert label in runs, f"eval {cell.name} has no run {label}"
        for key in ("policy", "settings", "budget", "hw", "model", "bundle", "fit"):
            assert runs[label].get(key) == cell.settings.get(key), (cell.name, key)


def test_the_report_pairs_every_evaluated_setting_with_a_tpot(piped):
    """The policy comparison of the demo's report: one row per eval with a metric, each with the TPOT
    of its own run (the "TPOT vs quality" figure then shows every setting)."""
    import re

    _, paths, _ = piped
    md = (paths["report"] / "summary.md").read_text()
    table = md[md.index("## Policy comparison"):].split("\n\n")[1].splitlines()[2:]
    done = [p for p in paths["evals"].glob("*.eval.json")]
    assert len(table) == len(done) >= 6
    for row in table:
        cells = [c.strip() for c in row.strip("|").split("|")]
        label, tpot, source = cells[0], cells[3], cells[5]
        # the run's file, then what its TPOT was measured on: "x.run.json (sim/rtx3090, host path)"; the demo's
        # evals run on its runs' clock, so no row says its quality came from another
        match = re.fullmatch(r"(.+\.run\.json) \((sim/\w+|wall), (host|captured) path\)", source)
        assert tpot != "-" and match, row
        assert json.loads((paths["runs"] / match.group(1)).read_text())["policy"] == label.split()[0]


def test_a_rerun_reuses_every_valid_artifact(piped):
    cfg, paths, _ = piped
    artifacts = [p for key in ("runs", "evals") for p in paths[key].glob("*.json")] + [paths["profile"], paths["fit"]]
    before = {p: p.stat().st_mtime_ns for p in artifacts}
    demo_pipeline(cfg)
    assert {p: p.stat().st_mtime_ns for p in artifacts} == before


def test_the_report_leaves_out_a_cell_the_grid_no_longer_has(piped):
    """A cell of an earlier version of the demo's grid (another label) keeps its artifact in the sweep
    directory; the report is of this grid's cells only."""
    cfg, paths, _ = piped
    stale = paths["runs"] / "retired-label.run.json"
    stale.write_bytes((paths["runs"] / "lru.run.json").read_bytes())
    try:
        demo_pipeline(cfg)
        md = (paths["report"] / "summary.md").read_text()
        assert "lru.run.json" in md and stale.name not in md
    finally:
        stale.unlink()


def test_a_profile_of_other_settings_is_redone_and_the_fit_after_it(piped):
    """The profile's sensitivity is scored on the demo's perplexity tokens: a rerun asking for another
    count must not reuse the old profile, nor the fit made from it."""
    from dataclasses import replace

    cfg, paths, _ = piped
    before = {p: p.stat().st_mtime_ns for p in (paths["profile"], paths["fit"])}
    demo_pipeline(replace(cfg, ppl_tokens=cfg.ppl_tokens * 2))
    for p, mtime in before.items():
        assert p.stat().st_mtime_ns != mtime, f"{p.name} was reused"
    prof = json.loads(paths["profile"].read_text())
    assert prof["settings"]["ppl_tokens"] == cfg.ppl_tokens * 2
    assert prof["sensitivity"]["tokens"] > cfg.ppl_tokens  # scored on the new count, not the old one
    assert json.loads(paths["fit"].read_text())["inputs"][str(paths["profile"])] == sha256_file(paths["profile"])


def test_other_weights_in_the_same_place_redo_every_stage(piped):
    """The demo model rebuilt from new parameters keeps its directory and config: a re-run must not
    reuse the bundle, profile, fit or cells made from the old weights (runs last: it changes the model)."""
    cfg, paths, _ = piped
    model = paths["model"]
    old = Bundle.open(paths["bundle"]).manifest.model
    runs = list(paths["runs"].glob("*.run.json"))
    before = {p: p.stat().st_mtime_ns for p in [paths["profile"], paths["fit"], *runs]}
    save_tiny("qwen2_moe", model, seed=5, max_position_embeddings=1024)  # same config, new weights
    demo_pipeline(cfg)
    new = Bundle.open(paths["bundle"]).manifest.model
    assert new.config_sha256 == old.config_sha256 and new.weights_sha256 not in ("", old.weights_sha256)
    for p, mtime in before.items():
        assert p.stat().st_mtime_ns != mtime, f"{p.name} was reused"
        assert json.loads(p.read_text())["model"]["weights_sha256"] == new.weights_sha256, p.name

    # Another geometry in the same place (the demo rebuilt with a dense layer and another top-k):
    # the bundle is the pipeline's own, of an earlier version of this model, so it is made again.
    before = {p: p.stat().st_mtime_ns for p in [paths["profile"], paths["fit"]]}
    save_tiny("qwen2_moe", model, seed=5, max_position_embeddings=1024, num_experts_per_tok=1)
    demo_pipeline(cfg)
    third = Bundle.open(paths["bundle"]).manifest.model
    assert third.config_sha256 != new.config_sha256 and third.source == new.source
    for p, mtime in before.items():
        assert p.stat().st_mtime_ns != mtime, f"{p.name} was reused"
        assert json.loads(p.read_text())["model"]["config_sha256"] == third.config_sha256, p.name


def test_relative_paths_are_the_callers_not_the_grid_files(tmp_path, monkeypatch):
    """`moetool demo --out out/demo` (make demo's default) must not resolve against moetool/grids/."""
    from pathlib import Path

    from moetool.pipeline import demo_sweeps
    from moetool.sweep import cells_of

    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    cfg = DemoConfig(out=Path("out/demo"), engine=EngineSpec(model="model"))
    sweeps = demo_sweeps(cfg, "model", Path("out/demo/bundle"), Path("out/demo/demo.fit.json"))
    for name, sweep_cfg in sweeps.items():
        assert sweep_cfg.out == tmp_path / "out" / "demo" / name
        for cell in cells_of(sweep_cfg):
            assert cell.settings["bundle"] == str(tmp_path / "out" / "demo" / "bundle")
            assert cell.settings["fit"] == str(tmp_path / "out" / "demo" / "demo.fit.json")
            assert cell.settings["model"] == str(tmp_path / "model")

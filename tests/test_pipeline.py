"""`moetool demo`'s pipeline end to end on a tiny model: every stage, every policy, reuse on a re-run."""

import pytest

from moetool.pipeline import EVAL_POLICIES, MC_TASK, RUN_POLICIES, DemoConfig, demo_pipeline
from moetool.quant.bundle import Bundle
from test_eval import save_char_tokenizer
from tiny import save_tiny

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def piped(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    model = save_tiny("qwen2_moe", root / "model", max_position_embeddings=1024)  # experts 16 neurons wide
    save_char_tokenizer(model)
    cfg = DemoConfig(out=root / "out", model=str(model), prompts=2, tokens=4, mc_limit=2, ppl_tokens=128)
    steps = []
    paths = demo_pipeline(cfg, progress=lambda what, done, total: steps.append((what, done, total)))
    return cfg, paths, steps


def test_every_stage_leaves_its_artifact(piped):
    cfg, paths, steps = piped
    assert [d for _, d, _ in steps] == list(range(len(steps))) and steps[-1][0] == "report"
    assert Bundle.open(paths["bundle"]).manifest.group_size == 16  # 64 would not tile the 16-wide down projection
    assert paths["profile"].is_file() and paths["fit"].is_file()
    for label, _, _ in RUN_POLICIES:  # each policy ran or says in one sentence why the budget refused it
        assert (paths["runs"] / f"{label}.run.json").is_file() ^ (paths["runs"] / f"{label}.refused.txt").is_file()
    assert (paths["runs"] / "resident.run.json").is_file() and (paths["runs"] / "lru.run.json").is_file()
    for label, _, _, _ in EVAL_POLICIES:
        for task in ("ppl", MC_TASK):
            done = (paths["evals"] / f"{label}.{task}.eval.json").is_file()
            assert done ^ (paths["evals"] / f"{label}.{task}.refused.txt").is_file()
    md = (paths["report"] / "summary.md").read_text()
    assert "## Quality under each setting" in md and "## Runs" in md
    assert (paths["report"] / "policies.png").read_bytes()[:8] == PNG


def test_a_rerun_reuses_every_valid_artifact(piped):
    cfg, paths, _ = piped
    artifacts = [p for key in ("runs", "evals") for p in paths[key].glob("*.json")] + [paths["profile"], paths["fit"]]
    before = {p: p.stat().st_mtime_ns for p in artifacts}
    demo_pipeline(cfg)
    assert {p: p.stat().st_mtime_ns for p in artifacts} == before

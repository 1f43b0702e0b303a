"""moetool report: figures and summary.md from synthetic artifacts."""

import json

import pytest
from typer.testing import CliRunner

from moetool.cli import app
from moetool.errors import MoetoolError
from moetool.fit import FitConfig, fit
from moetool.report import report
from helpers import FP, synthetic_profile, synthetic_run
from helpers import routing_profile as _routing
from helpers import similarity_profile as _similarity

runner = CliRunner()
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def artifacts(tmp_path):
    import dataclasses

    d = tmp_path / "art"
    d.mkdir()
    prof = dataclasses.replace(synthetic_profile(), routing=_routing(), similarity=_similarity())
    prof_path = prof.save(d / "s.profile.json")
    runs = [synthetic_run("smoe", {"alpha": a}, 0.1 - 0.1 * a).save(d / f"smoe{a}.run.json") for a in (0.0, 0.2, 0.4)]
    fit(FitConfig(profile=prof_path, runs=tuple(runs), target_tpot=0.09, budget="50%")).save(d / "s.fit.json")
    ablation = [("lod", {}, 0.28), ("lru", {}, 0.15), ("eap", {}, 0.13),
                ("dymoe", {"r": 0.9, "high": 4, "low": 2, "prefetcher": "none"}, 0.13),
                ("dymoe", {"r": 0.9, "high": 4, "low": 2, "prefetcher": "dymoe"}, 0.115),
                ("dymoe", {"r": 0.9, "high": 4, "low": 0, "prefetcher": "dymoe"}, 0.105)]
    for budget in (16 << 20, 24 << 20):
        for i, (pol, params, tpot) in enumerate(ablation):
            synthetic_run(pol, params, tpot * (16 << 20) / budget, budget=budget).save(d / f"abl{i}-{budget}.run.json")
    for cfg, low in (("4/2", 2), ("4/0", 0)):
        for r, acc in ((0.75, 0.40), (0.9, 0.43), (1.0, 0.44)):
            params = {"r": r, "config": cfg, "high": 4, "low": low, "prefetcher": "dymoe"}
            (d / f"dymoe{cfg.replace('/', '')}-{r}.eval.json").write_text(json.dumps(
                {"schema": "eval", "schema_version": 1, "model": FP.__dict__, "policy": "dymoe", "params": params,
                 "metrics": {"acc": acc - 0.01 * (low == 0)}}))
            synthetic_run("dymoe", params, 0.05 + 0.05 * r, budget=8 << 20).save(
                d / f"dymoe{cfg.replace('/', '')}-{r}.run.json")
    (d / "bundle.json").write_text(json.dumps({"schema": "bundle"}))  # not read by report
    return d


def test_report_writes_figures_and_summary(artifacts, tmp_path):
    paths = report([artifacts], tmp_path / "rep")
    names = {p.name for p in paths}
    expected = {"sensitivity.png", "int2_share.png", "routing_heatmap.png", "gate_scores.png", "similarity.png",
                "prefetch.png", "alpha_tpot.png", "policies.png", "dymoe_retention.png", "summary.md"}
    assert names == expected
    for p in paths:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == PNG and p.stat().st_size > 5000
    md = (tmp_path / "rep" / "summary.md").read_text()
    for text in ("## Ablation in the style of DyMoE Table 3 (clock", "1. Load on Demand", "6. Cache+Dyquant(4/0)+Prefetcher",
                 "TPOT(s) 16 MiB", "TPOT(s) 24 MiB", "## Policy comparison", "Fate Table 1", "DyMoE schedule",
                 "| smoe | alpha |", "Jaccard", "![prefetch](prefetch.png)"):
        assert text in md, text
    row = next(line for line in md.splitlines() if line.startswith("| 5. Cache+Dyquant(4/2)+Prefetcher (dymoe 4/2, r = 0.9)"))
    assert "| 0.115 |" in row and "| 0.076667 |" in row  # 16 MiB and 24 MiB TPOT (8 MiB: the r-sweep runs)
    # one configuration a row: eap and DyMoE at r = 1 (INT4) both stand for row 3, and are not averaged
    rows = [line for line in md.splitlines() if line.startswith("| 3. Cache + Prefetch")]
    assert [r.split("|")[1].strip() for r in rows] == ["3. Cache + Prefetch (dymoe 4/0, r = 1)",
                                                       "3. Cache + Prefetch (dymoe 4/2, r = 1)", "3. Cache + Prefetch (eap)"]


def test_the_ablation_keeps_clocks_and_configurations_apart(tmp_path):
    """Table 3 averaged a 16-bit lru's TPOT with DyMoE's INT4 one at r = 1 (both "2. Cache"), and the sim
    clock's seconds with the wall clock's, into one cell."""
    import dataclasses

    from moetool.policies.dymoe_report import ablation

    sim = synthetic_run("lru", {}, 0.2)
    wall = dataclasses.replace(synthetic_run("lru", {}, 1.0), clock="wall", hw=None)
    dy = synthetic_run("dymoe", {"r": 1.0, "high": 4, "low": 2, "prefetcher": "none"}, 0.04)
    md = ablation(((tmp_path / "sim.json", sim), (tmp_path / "wall.json", wall), (tmp_path / "dy.json", dy)))
    tables = md.split("### ")[1:]
    assert [t.splitlines()[0] for t in tables] == [
        "Ablation in the style of DyMoE Table 3 (clock: sim/rtx3090; a cell averages the runs of one configuration; "
        "a column is an expert cache)",
        "Ablation in the style of DyMoE Table 3 (clock: wall; a cell averages the runs of one configuration; "
        "a column is an expert cache)"]
    cells = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in tables[0].splitlines()
             if line.startswith("| 2.")}
    assert cells == {"2. Cache (dymoe 4/2, r = 1)": "0.04", "2. Cache (lru)": "0.2"}
    assert "| 2. Cache | 0.5 | 1 | wall.json |" in tables[1]


def test_the_ablation_keeps_other_knobs_and_batches_apart(tmp_path):
    """An LRU batch-1 run and an LFU batch-4 run were one "2. Cache" cell, their mean a TPOT neither had."""
    import dataclasses

    from moetool.policies.dymoe_report import ablation

    runs = [("a.json", synthetic_run("lru", {"bits": 16, "eviction": "lru"}, 0.2)),
            ("b.json", synthetic_run("lru", {"bits": 16, "eviction": "lfu"}, 0.4)),
            ("c.json", dataclasses.replace(synthetic_run("lru", {"bits": 16, "eviction": "lru"}, 0.8), batch_size=4)),
            ("d.json", synthetic_run("lru", {"bits": 16, "eviction": "lru"}, 0.4))]
    md = ablation(tuple((tmp_path / name, r) for name, r in runs))
    cells = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in md.splitlines() if line.startswith("| 2.")}
    assert cells == {"2. Cache (lru 16-bit)": "0.3", "2. Cache (lru 16-bit, batch 4)": "0.8",
                     "2. Cache (lru 16-bit, eviction=lfu)": "0.4"}


def test_the_ablation_keeps_runs_of_other_workloads_apart(tmp_path):
    """One prompt of 32 tokens and four of 4 were one "2. Cache" cell: the mean of two workloads' TPOTs."""
    import dataclasses

    from moetool.policies.dymoe_report import ablation

    short = dataclasses.replace(synthetic_run("lru", {"bits": 16}, 0.2), prompts=["a", "b"], tokens=[[1] * 4, [2] * 4])
    runs = [("long.json", dataclasses.replace(synthetic_run("lru", {"bits": 16}, 0.6), tokens=[[1] * 32])),
            ("short.json", short), ("again.json", short)]
    md = ablation(tuple((tmp_path / name, r) for name, r in runs))
    cells = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in md.splitlines() if line.startswith("| 2.")}
    assert len(cells) == 2 and sorted(cells.values()) == ["0.2", "0.6"], cells
    assert any("2 prompt(s) x 4 tokens" in k for k in cells) and any("1 prompt(s) x 32 tokens" in k for k in cells)


def test_artifacts_of_one_file_name_are_told_apart_and_a_copy_is_read_once(tmp_path):
    """Two lru.run.json in other directories were two rows named alike, and a backup copy of a run was averaged
    into the ablation as a second measurement."""
    import shutil

    d = tmp_path / "art"
    (d / "a").mkdir(parents=True)
    (d / "b").mkdir()
    (d / "backup").mkdir()
    synthetic_run("lru", {}, 0.2).save(d / "a" / "lru.run.json")
    synthetic_run("lru", {}, 0.4).save(d / "b" / "lru.run.json")
    shutil.copy(d / "a" / "lru.run.json", d / "backup" / "lru.run.json")
    report([d], tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert f"Read once, as the same bytes as another input: `{d / 'backup' / 'lru.run.json'}` (a copy of " \
           f"`{d / 'a' / 'lru.run.json'}`)." in md
    runs = [line.split("|")[1].strip() for line in md.split("## Runs")[1].split("##")[0].splitlines()
            if line.startswith("| ")][1:]
    assert runs == ["a/lru.run.json", "b/lru.run.json"]
    assert "| 2. Cache | 0.5 | 0.3 | a/lru.run.json, b/lru.run.json |" in md  # TTFT, and TPOT's mean of the two
    # given in the other order on the command line, the same report: the same copy is the one read
    report([d / "backup", d / "b", d / "a"], tmp_path / "rep2")
    again = (tmp_path / "rep2" / "summary.md").read_text()
    assert again.split("Inputs: ")[1].split("\n")[0] == md.split("Inputs: ")[1].split("\n")[0]
    assert "(a copy of `" + str(d / "a" / "lru.run.json") + "`)" in again, again


def test_an_eval_of_one_bundle_is_paired_with_a_run_of_that_bundle_and_not_another(tmp_path):
    """Two bundles of one model (group 16 and group 8): the INT4 eval of one was paired with the run of the other,
    and the two evals of one setting were one cell ("the table shows the second")."""
    import dataclasses

    d = tmp_path / "art"
    d.mkdir()
    for group, tpot, ppl in ((16, 0.2, 40.0), (8, 0.3, 39.0)):
        inputs = {f"/b/g{group}/bundle.json": f"{group:02d}" * 32}
        dataclasses.replace(synthetic_run("static", {"bits": 4}, tpot, budget=8 << 20), inputs=inputs).save(
            d / f"s4_g{group}.run.json")
        e = {**_ppl_eval("static", {"bits": 4}, ppl), "inputs": inputs, "budget_bytes": 8 << 20}
        (d / f"{'a' if group == 8 else 'b'}_g{group}.eval.json").write_text(json.dumps(e))
    report([d], tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "| a_g8.eval.json | s4_g8.run.json (sim/rtx3090, host path) |" in md, md
    assert "| b_g16.eval.json | s4_g16.run.json (sim/rtx3090, host path) |" in md
    assert "static bits=4 (bundle g16)" in md and "static bits=4 (bundle g8)" in md and "Evals of one setting" not in md


def test_bundles_of_one_directory_name_and_machines_of_one_file_name_are_told_apart(tmp_path):
    """`g16/bundle` and `g8/bundle` were both "bundle": their evals one quality row (the g16 one dropped) and
    their runs one Table 3 cell; two experiments' `hw.json` (an RTX 3090's, an H100's) were one clock, averaged.
    A bundle is its manifest's digest, named by the path parts that tell it apart; a machine its file's content,
    and a copy of a shipped preset is that preset."""
    import dataclasses

    from moetool.artifacts import sha256_file
    from moetool.engine.clock import HW_DIR
    from moetool.policies.dymoe_report import ablation

    d = tmp_path / "art"
    d.mkdir()
    runs = []
    for group, tpot, ppl in ((16, 0.2, 40.0), (8, 0.3, 39.0)):
        inputs = {f"/x/g{group}/bundle/bundle.json": f"{group:02d}" * 32}
        run = dataclasses.replace(synthetic_run("lru", {}, tpot), inputs=inputs)
        runs.append((d / f"lru_g{group}.run.json", run))
        e = {**_ppl_eval("static", {"bits": 4}, ppl), "inputs": inputs, "budget_bytes": 8 << 20}
        (d / f"g{group}.eval.json").write_text(json.dumps(e))
    report([d], tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "static bits=4 (bundle g16/bundle)" in md and "static bits=4 (bundle g8/bundle)" in md, md
    assert "Evals of one setting" not in md
    cells = [ln for ln in ablation(tuple(runs)).splitlines() if ln.startswith("| 2.")]
    assert [c.split("|")[1].strip() for c in cells] == ["2. Cache (lru, bundle g16/bundle)", "2. Cache (lru, bundle g8/bundle)"]

    def on(hw: str, digest: str, tpot: float):
        return dataclasses.replace(synthetic_run("lod", {}, tpot), hw=hw, inputs={f"/exp/{hw}": digest})

    preset = sha256_file(HW_DIR / "rtx3090.json")
    two = ablation(((d / "a.run.json", on("hw.json", "a" * 64, 0.12)), (d / "b.run.json", on("hw.json", "b" * 64, 0.09))))
    assert [t.split("(clock: ")[1].split(";")[0] for t in two.split("### ")[1:]] == [
        f"sim/hw.json {'a' * 12}", f"sim/hw.json {'b' * 12}"]  # two machines, two tables: not one averaged cell
    one = ablation(((d / "a.run.json", on("copy.json", preset, 0.1)),
                    (d / "b.run.json", dataclasses.replace(synthetic_run("lod", {}, 0.1),
                                                           inputs={str(HW_DIR / "rtx3090.json"): preset}))))
    assert [t.split("(clock: ")[1].split(";")[0] for t in one.split("### ")[1:]] == ["sim/rtx3090"]


def test_report_refuses_an_empty_input(tmp_path):
    with pytest.raises(MoetoolError, match="no profile, fit, run or eval"):
        report([tmp_path], tmp_path / "rep")


def test_cli_report(artifacts, tmp_path):
    result = runner.invoke(app, ["report", str(artifacts / "s.profile.json"), "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "r" / "summary.md").is_file() and (tmp_path / "r" / "prefetch.png").is_file()
    assert "Example" in runner.invoke(app, ["report", "--help"]).output


def _mc_eval(policy: str, params: dict, picks: list[int], target: int = 0, cache: int = 8 << 20) -> dict:
    samples = [{"doc_id": i, "target": target, "acc": float(p == target),
                "resps": [[-1.0 - abs(c - p), False] for c in range(4)]} for i, p in enumerate(picks)]
    return {"schema": "eval", "schema_version": 1, "model": FP.__dict__, "task": "mc", "policy": policy,
            "params": params, "budget": {"cache_bytes": cache}, "samples": {"mc_leaf": samples},
            "metrics": {"acc": sum(p == target for p in picks) / len(picks)}, "stderr": {"acc": 0.1}}


def test_quality_table_pairs_every_setting_with_resident(tmp_path):
    """Agreement is counted question by question against resident's picks, not from accuracies."""
    d = tmp_path / "evals"
    d.mkdir()
    evals = {"resident": _mc_eval("resident", {"bits": 16}, [0, 1, 2, 3]),
             "lossy": _mc_eval("static", {"bits": 2}, [0, 2, 1, 3]),  # same accuracy as resident, half the picks
             "ppl": {"schema": "eval", "schema_version": 1, "model": FP.__dict__, "task": "ppl", "policy": "static",
                     "params": {"bits": 2}, "budget": {"cache_bytes": 8 << 20}, "metrics": {"ppl": 12.5},
                     "stderr": {}}}
    for name, e in evals.items():
        (d / f"{name}.eval.json").write_text(json.dumps(e))
    report([d], tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "| setting | expert cache MiB | mc | ± stderr | agree w/ resident | ppl |" in md
    assert "| resident bits=16 | 8 | 0.25 | 0.1 | 1 | - |" in md
    assert "| static bits=2 | 8 | 0.25 | 0.1 | 0.5 | 12.5 |" in md  # ppl and mc of one setting share a row


def test_two_task_files_of_one_name_are_two_columns(tmp_path):
    """`eval mc.yaml` run in two directories recorded one task name for two prompts: lossless lru was paired
    question by question with resident on the other task and said to agree on 60%."""
    d = tmp_path / "evals"
    d.mkdir()
    for name, e, files in (("resident", _mc_eval("resident", {"bits": 16}, [0, 1, 2, 3]), "a" * 64),
                           ("lru", _mc_eval("lru", {"bits": 16}, [0, 2, 1, 3]), "b" * 64),
                           ("lru-same", _mc_eval("lru", {"bits": 16}, [0, 1, 2, 3], cache=4 << 20), "a" * 64)):
        (d / f"{name}.eval.json").write_text(json.dumps({**e, "task": "mc.yaml", "options": {"task_files": files}}))
    report([d], tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert ("| setting | expert cache MiB | mc.yaml@aaaaaaaa (default-shot) | ± stderr | agree w/ resident "
            "| mc.yaml@bbbbbbbb (default-shot) | ± stderr |") in md, md
    assert "| lru bits=16 | 4 | 0.25 | 0.1 | 1 | - | - |" in md, md  # paired only with the same task's resident
    assert "| lru bits=16 | 8 | - | - | - | 0.25 | 0.1 |" in md, md
    # an eval written before task files were recorded is of its task's one recorded content
    from moetool.report import _measures

    old, new = (_mc_eval("resident", {"bits": 16}, [0]), _mc_eval("lru", {"bits": 16}, [0]))
    new["options"] = {"task_files": "c" * 64}
    assert len(set(_measures([old, new]).values())) == 1


def test_agreement_on_a_one_continuation_task_is_whether_each_answer_is_the_greedy_one(tmp_path):
    """A loglikelihood task scores one continuation per question: the argmax over its one pair was 0 for any
    policy, so a policy that flipped answers "agreed" with resident on all of them."""
    d = tmp_path / "evals"
    d.mkdir()
    for policy, greedy in (("resident", [True, True, False, True]), ("static", [True, False, False, False])):
        samples = [{"doc_id": i, "target": " x", "acc": float(g), "resps": [[-1.5 - i, g]]} for i, g in enumerate(greedy)]
        e = {**_mc_eval(policy, {"bits": 16 if policy == "resident" else 2}, [0]), "task": "ll",
             "samples": {"ll": samples}, "metrics": {"acc": sum(greedy) / 4}}
        (d / f"{policy}.eval.json").write_text(json.dumps(e))
    report([d], tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "| static bits=2 | 8 | 0.25 | 0.1 | 0.5 |" in md, md


def _ppl_eval(policy: str, params: dict, ppl: float) -> dict:
    return {"schema": "eval", "schema_version": 1, "model": FP.__dict__, "task": "ppl", "policy": policy,
            "params": params, "budget": {"cache_bytes": 8 << 20}, "metrics": {"ppl": ppl}, "stderr": {}}


def test_quality_table_keeps_a_column_per_text_a_task_was_measured_on(tmp_path):
    """Perplexity on three texts showed one number per setting (the last eval read), under "ppl", with
    no word of the other two or of which text it was. One file's two contents are two columns too."""
    d = tmp_path / "evals"
    d.mkdir()
    for i, (data, sha, ppl) in enumerate((("a/bom.txt", "1" * 64, 79.8), ("cjk.txt", "2" * 64, 50.5),
                                          ("b/bom.txt", "3" * 64, 42.0))):
        e = {**_ppl_eval("resident", {"bits": 16}, ppl), "options": {"data": data, "context": 512},
             "inputs": {data: sha}}
        (d / f"e{i}.eval.json").write_text(json.dumps(e))
    report([d], tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    heads = "| setting | expert cache MiB | ppl (bom.txt@11111111, context 512) | ppl (bom.txt@33333333, context 512) " \
            "| ppl (cjk.txt, context 512) |"
    assert heads in md, md
    assert "| resident bits=16 | 8 | 79.8 | 42 | 50.5 |" in md, md


def test_an_eval_of_a_generation_or_rolling_task_has_its_column(tmp_path):
    """An lm-eval generation task (exact_match) or a rolling-loglikelihood one (word_perplexity) was left
    out of every table without a word: only accuracies and perplexity were headline metrics."""
    d = tmp_path / "evals"
    d.mkdir()
    for name, metrics in (("gen", {"exact_match": 0.125}),
                          ("roll", {"word_perplexity": 232.5, "byte_perplexity": 3.1, "bits_per_byte": 1.6}),
                          ("own", {"my_score": 0.75, "my_score_stderr": 0.01})):
        e = {**_ppl_eval("resident", {"bits": 16}, 0.0), "task": name, "metrics": metrics}
        (d / f"{name}.eval.json").write_text(json.dumps(e))
    report([d], tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "| setting | expert cache MiB | gen | own | roll |" in md and "| resident bits=16 | 8 | 0.125 | 0.75 | 232.5 |" in md
    assert "| resident bits=16 | roll word_perplexity | 232.5 |" in md and "| resident bits=16 | own my_score | 0.75 |" in md


def test_trends_table_checks_each_claim_on_the_matching_settings(tmp_path):
    """Each claim compares the settings it names (matched on recorded knobs), and says met or not met."""
    d = tmp_path / "evals"
    d.mkdir()
    evals = {"resident": _ppl_eval("resident", {"bits": 16}, 10.0),
             "int4": _ppl_eval("static", {"bits": 4}, 10.2),
             "int2": _ppl_eval("static", {"bits": 2}, 13.0),
             "smoe-fitted": _ppl_eval("smoe", {"alpha": 0.1, "bits": 16}, 12.0),  # another alpha: not the claim's
             "smoe": _ppl_eval("smoe", {"alpha": 0.3, "bits": 16}, 10.05),
             "dymoe-r75": _ppl_eval("dymoe", {"r": 0.75, "precisions": {"high": 4, "low": 0}}, 11.0),
             "dymoe": _ppl_eval("dymoe", {"r": 0.9, "precisions": {"high": 4, "low": 0}}, 10.5),
             "dynaexq": _ppl_eval("dynaexq", {"precisions": {"high": 4, "low": 2}}, 12.0)}
    for name, e in evals.items():
        (d / f"{name}.eval.json").write_text(json.dumps(e))
    report([d], tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "## The papers' trends on this model" in md
    assert "| SMoE alpha = 0.3 within 1% of resident | 10.050 vs 10.000 | +0.50% | met |" in md
    assert "| DyMoE 4/0 r = 0.9 within 2% of static INT4 | 10.500 vs 10.200 | +2.94% | not met |" in md
    assert "DynaExq 4/2 better than static INT2 (DynaExq's expert cache 8.0 MiB) | 12.000 vs 13.000 | -7.69% | met |" in md


def test_a_claim_compares_evals_of_the_same_text_window_and_limit(tmp_path):
    """A claim took the first eval of each side whatever it had scored: a `--limit` smoke eval of SMoE
    against a full resident one (or an INT2 `resident` against SMoE on bf16 experts) gave a verdict that was
    the difference between the texts, not between the policies."""
    d = tmp_path / "evals"
    d.mkdir()

    def on(e: dict, limit: int | None) -> dict:
        return {**e, "options": {"data": "t.txt", "context": 64, "limit": limit}, "inputs": {"t.txt": "a" * 64}}

    evals = {"a-resident-int2": on(_ppl_eval("resident", {"bits": 2}, 9.0), None),  # first read, not bf16
             "a-resident-bf16-compute": {**on(_ppl_eval("resident", {"bits": 16}, 9.5), None), "dtype": "bfloat16"},
             "b-smoe-smoke": on(_ppl_eval("smoe", {"alpha": 0.3, "bits": 16}, 14.0), 4),
             "c-resident": {**on(_ppl_eval("resident", {"bits": 16}, 10.0), None), "dtype": "float32"},
             "d-smoe": {**on(_ppl_eval("smoe", {"alpha": 0.3, "bits": 16}, 10.05), None), "dtype": "float32"},
             "e-int2-smoke": on(_ppl_eval("static", {"bits": 2}, 20.0), 4),
             "f-dynaexq": on(_ppl_eval("dynaexq", {"precisions": {"high": 4, "low": 2}}, 12.0), None)}
    for name, e in evals.items():
        (d / f"{name}.eval.json").write_text(json.dumps(e))
    report([d], tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "| SMoE alpha = 0.3 within 1% of resident | 10.050 vs 10.000 | +0.50% | met |" in md, md
    assert "DynaExq 4/2 better than static INT2" not in md  # no INT2 eval of the same text and limit
    from moetool.policies.stages import ppl_measurement

    assert ppl_measurement(evals["c-resident"]) != ppl_measurement(evals["b-smoe-smoke"])


def test_trends_table_is_left_out_without_both_sides(tmp_path):
    d = tmp_path / "evals"
    d.mkdir()
    (d / "smoe.eval.json").write_text(json.dumps(_ppl_eval("smoe", {"alpha": 0.3}, 10.0)))
    report([d], tmp_path / "rep")
    assert "papers' trends" not in (tmp_path / "rep" / "summary.md").read_text()


def test_report_reads_peakedness_and_the_int2_depth_trend_from_the_profile(artifacts, tmp_path):
    report([artifacts], tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "top-1 / top-3 score |" in md  # top-2 routing: the best score over the best unselected one
    assert "| 0 | 0.3 | 0.9 | 0.2 | 0.4 | 0.9 | 3 |" in md  # mean sorted scores 0.5, 0.25, 0.1667
    # sensitivity deltas 3.0, 1.0, 0.4, 0.1 over 4 layers: first third (1 layer) vs last third, no spread
    assert ("mean Δppl first 1 layers +3.000, last 1 +0.100 (fewer than 6 MoE layers: no spread to judge by) | "
            "30.00x | inconclusive |") in md


def test_an_eval_takes_no_tpot_from_a_run_at_other_knobs(tmp_path):
    d = tmp_path / "art"
    d.mkdir()
    synthetic_run("static", {"bits": 4}, 0.1).save(d / "int4.run.json")
    (d / "int2.eval.json").write_text(json.dumps(_ppl_eval("static", {"bits": 2}, 12.0)))
    (d / "int4.eval.json").write_text(json.dumps(_ppl_eval("static", {"bits": 4}, 10.0)))
    report([d], tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "| static bits=2 | ppl | 12 | - | int2.eval.json | - |" in md
    assert "| static bits=4 | ppl | 10 | 100 | int4.eval.json | int4.run.json (sim/rtx3090, host path) |" in md


def test_an_eval_takes_its_tpot_from_the_run_of_its_own_budget(tmp_path):
    """Same policy and knobs at another expert cache is another setting: the pair is the run whose
    cache (a share budget) or whole budget (a size budget) is the eval's."""
    import dataclasses

    d = tmp_path / "art"
    d.mkdir()
    for cache, tpot in ((16 << 20, 0.1), (8 << 20, 0.2)):
        run = synthetic_run("lru", {"bits": 16}, tpot)
        dataclasses.replace(run, budget={"cache_bytes": cache}).save(d / f"lru{cache >> 20}.run.json")
    (d / "lru.eval.json").write_text(json.dumps(_ppl_eval("lru", {"bits": 16}, 11.0)))  # an 8 MiB cache
    sized = {**_ppl_eval("static", {"bits": 4}, 10.0), "budget": {"cache_bytes": 1 << 20}, "budget_bytes": 64 << 20}
    (d / "int4.eval.json").write_text(json.dumps(sized))  # a size budget: the run's total is the eval's
    synthetic_run("static", {"bits": 4}, 0.05).save(d / "int4.run.json")
    report([d], tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "| lru bits=16 | ppl | 11 | 200 | lru.eval.json | lru8.run.json (sim/rtx3090, host path) |" in md
    assert "| static bits=4 | ppl | 10 | 50 | int4.eval.json | int4.run.json (sim/rtx3090, host path) |" in md


def test_a_setting_is_labelled_with_what_ran_not_a_derive_sentinel():
    """Two DynaExq runs at other budgets were both labelled "n_hi=-1", and Fate's "n=0" (derive n from the
    costs) hid the transfer cap it ran with."""
    from moetool.figures import setting_label

    assert setting_label("dynaexq", {"n_hi": -1, "n_hi_used": 4}) == "dynaexq n_hi=4"
    assert setting_label("dynaexq", {"n_hi": 2, "n_hi_used": 2}) == "dynaexq n_hi=2"
    assert setting_label("fate", {"L": 3, "n": 0, "transfer_cap": 3, "p": 0.25}) == "fate L=3 p=0.25 n=3"
    assert setting_label("dynaexq", {"n_hi": -1}) == "dynaexq n_hi=-1"  # an older record: what it has


def test_the_policy_comparison_keeps_perplexities_of_other_windows_apart(tmp_path):
    """The comparison table and policies.png put a perplexity at context 256 and one at context 64 of the
    same setting under one "ppl", on one axis, while the quality table kept them apart."""
    from moetool.report import _joined

    def ev(context: int, ppl: float) -> dict:
        return {**_ppl_eval("resident", {"bits": 16}, ppl), "options": {"data": "t.txt", "context": context},
                "inputs": {"t.txt": "a" * 64}}

    rows = _joined([], [(tmp_path / "a.json", ev(256, 49.26)), (tmp_path / "b.json", ev(64, 73.46))])
    assert [x["metric"] for x in rows] == ["ppl (t.txt, context 256)", "ppl (t.txt, context 64)"]
    one = _joined([], [(tmp_path / "a.json", ev(256, 49.26))])
    assert [x["metric"] for x in one] == ["ppl"]  # measured one way: the task's name as before


def test_table3_and_the_runs_table_keep_decode_paths_apart_and_head_columns_by_expert_cache(tmp_path):
    """A host and a captured run of one setting were averaged into one Table 3 cell whenever their
    budgets matched, and the runs table showed neither the path nor the expert cache a budget left."""
    import dataclasses

    from moetool.policies.dymoe_report import ablation

    lru = synthetic_run("lru", {}, 0.2, budget=40 << 20)
    host = dataclasses.replace(lru, budget={"cache_bytes": 2 << 20}, summary={"path": "host"})
    captured = dataclasses.replace(lru, budget={"cache_bytes": 2 << 20}, summary={"path": "captured"}, tpot_s={
        "mean": 0.1, "p50": 0.1, "p99": 0.1, "n": 8})
    md = ablation(((tmp_path / "h.json", host), (tmp_path / "c.json", captured)))
    tables = md.split("### ")[1:]
    assert [t.splitlines()[0].split("(clock: ")[1].split(";")[0] for t in tables] == [
        "sim/rtx3090, captured path", "sim/rtx3090, host path"]
    assert all("TPOT(s) 2 MiB" in t for t in tables)  # the expert cache, not the 40 MiB budget
    d = tmp_path / "runs"
    d.mkdir()
    host.save(d / "h.run.json")
    captured.save(d / "c.run.json")
    report([d], tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in md.splitlines() if line.startswith("| h.run.json") or line.startswith("| c.run.json")}
    assert rows["h.run.json"][2:6] == ["host", "1 x 1", "2", "40"] and rows["c.run.json"][2:6] == [
        "captured", "1 x 1", "2", "40"]  # the workload (prompts x tokens) beside the cache and budget


@pytest.mark.parametrize("deltas, verdict", [
    ([0.9, 1.1, 1.0, 0.5, 0.5, 0.5, 0.1, 0.2, 0.1], "met"),  # shallow far above deep, layers agree
    ([0.2, 0.35, 0.25, 0.3, 0.3, 0.3, 0.3, 0.25, 0.35], "inconclusive"),  # within the layers' own spread
    ([0.1, 0.1, 0.2, 0.5, 0.5, 0.5, 0.9, 1.1, 1.0], "not met"),
    ([0.9, 0.5, 0.1], "inconclusive"),  # one layer a third: no spread to judge by
])
def test_dymoe_depth_claim_gives_a_verdict_only_beyond_the_layers_noise(deltas, verdict):
    """Fig. 5's trend was the sign of a difference of means, 'met' on perplexity deltas within noise."""
    from moetool.policies.dymoe_report import depth_claim
    from moetool.profile_artifact import LayerSensitivity, SensitivityProfile

    layers = tuple(LayerSensitivity(layer=i, ppl={2: 10 + d}, delta={2: d}) for i, d in enumerate(deltas))
    s = SensitivityProfile(base_ppl=10.0, tokens=512, data="x", source="hqq", bits=(2,), layers=layers, int2_share={})
    row = depth_claim(s, "p.json")
    assert row[-1] == verdict, row


def test_dynaexq_with_no_expert_at_4_bits_is_no_evidence_against_static_int2(tmp_path):
    """At a budget where DynaExq's hot set is empty (n_hi = 0) it runs as static INT2: the claim was
    scored 'not met' from two runs of one thing."""
    d = tmp_path / "evals"
    d.mkdir()
    for name, e in {"int2": _ppl_eval("static", {"bits": 2}, 13.0),
                    "dynaexq": _ppl_eval("dynaexq", {"precisions": {"high": 4, "low": 2}, "n_hi_used": 0}, 13.0)}.items():
        (d / f"{name}.eval.json").write_text(json.dumps(e))
    report([d], tmp_path / "rep")
    row = next(line for line in (tmp_path / "rep" / "summary.md").read_text().splitlines()
               if line.startswith("| DynaExq 4/2 better than static INT2"))
    assert "held no expert at 4 bits (n_hi = 0)" in row and row.endswith("| inconclusive |")


def test_evals_take_their_tpot_from_runs_of_one_clock_and_path(tmp_path):
    """Two runs match each eval (host and captured path): every row takes the timing most runs have,
    not the first file name, and says which it took, and that the eval's quality is the host path's (a
    policy that reads residency decides a token late on the captured one: SMoE's tokens part there)."""
    import dataclasses

    d = tmp_path / "art"
    d.mkdir()
    for pol, params in (("lru", {"bits": 16}), ("eap", {"bits": 16})):
        run = synthetic_run(pol, params, 0.1, budget=8 << 20)
        dataclasses.replace(run, summary={"path": "host"}, tpot_s={"mean": 0.3, "p50": 0.3, "p99": 0.3, "n": 8}).save(
            d / f"a-{pol}-host.run.json")
        dataclasses.replace(run, summary={"path": "captured"}).save(d / f"b-{pol}-captured.run.json")
        dataclasses.replace(run, summary={"path": "captured"}, ttft_s=0.011).save(d / f"c-{pol}-captured.run.json")
        e = _ppl_eval(pol, params, 11.0)
        e["budget_bytes"] = 8 << 20
        (d / f"{pol}.eval.json").write_text(json.dumps(e))
    report([d], tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    for pol in ("lru", "eap"):
        assert (f"| {pol}.eval.json | b-{pol}-captured.run.json (sim/rtx3090, captured path); quality on the host "
                f"path |") in md, md


def test_evals_of_one_setting_on_two_clocks_are_two_rows_and_a_pairing_across_clocks_is_said(tmp_path):
    """A policy that reads the residency computes other things on the sim clock (fills land when the
    modelled link finishes) than on a CPU's wall clock (at once): two such evals of one setting were one
    cell ("Evals of one setting ... the table shows the second"), and a wall-clock eval was paired with a
    sim-clock run's TPOT without a word."""
    d = tmp_path / "art"
    d.mkdir()
    synthetic_run("smoe", {"alpha": 0.3}, 0.1, budget=8 << 20).save(d / "smoe.run.json")
    for clock, hw, ppl in (("wall", None, 40.0), ("sim", "rtx3090", 41.0)):
        e = {**_ppl_eval("smoe", {"alpha": 0.3}, ppl), "clock": clock, "hw": hw, "budget_bytes": 8 << 20}
        (d / f"smoe-{clock}.eval.json").write_text(json.dumps(e))
    report([d], tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "Evals of one setting" not in md, md
    assert "| smoe alpha=0.3 (wall clock) |" in md and "| smoe alpha=0.3 (sim/rtx3090 clock) |" in md, md
    assert "| smoe-wall.eval.json | smoe.run.json (sim/rtx3090, host path); quality on the wall clock |" in md, md
    assert "| smoe-sim.eval.json | smoe.run.json (sim/rtx3090, host path) |" in md, md


def test_a_link_loop_and_an_integer_past_64_bits_are_one_sentence(tmp_path):
    """`report DIR` over a tree holding two links to each other (pathlib raises RuntimeError there on
    Python 3.11) and over a run whose budget_bytes has 400 digits (a float overflow in the runs table)
    ended in a traceback and "this is a bug in moetool"."""
    from helpers import one_error_line

    loop = tmp_path / "loop"
    loop.mkdir()
    synthetic_run("lru", {}, 0.001).save(loop / "lru.run.json")
    (loop / "b.run.json").symlink_to("a.run.json")
    (loop / "a.run.json").symlink_to("b.run.json")
    line = one_error_line(runner.invoke(app, ["report", str(loop), "--out", str(tmp_path / "r1")]))
    assert "is a symlink that leads back to itself (a loop)" in line and "run.json" in line
    big = tmp_path / "big"
    big.mkdir()
    synthetic_run("lru", {}, 0.001).save(big / "x.run.json")
    data = json.loads((big / "x.run.json").read_text())
    data["budget_bytes"] = 10**400
    (big / "x.run.json").write_text(json.dumps(data))
    line = one_error_line(runner.invoke(app, ["report", str(big), "--out", str(tmp_path / "r2")]))
    assert "budget_bytes is an integer of 401 digits" in line, line
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()


def test_a_done_sweep_cell_whose_artifact_is_gone_is_named(tmp_path):
    """A cell the sweep index calls done, its artifact deleted (or the directory copied in part), was
    missing from every table without a word: the sweeps table listed only cells not done."""
    from moetool.sweep import Sweep

    d = tmp_path / "sw"
    d.mkdir()
    synthetic_run("lru", {}, 0.001).save(d / "lru_budget=25pct.run.json")
    cells = {name: {"status": "done", "artifact": f"{name}.run.json"} for name in ("lru_budget=25pct", "lru_budget=50pct")}
    Sweep(model=FP, inputs={}, stage="run", grid={"policy": ["lru"], "budget": ["25%", "50%"]},
          cells=cells).save(d / "sweep.json")
    report([d], tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "## Sweep cells without an artifact" in md
    assert f"| lru_budget=50pct | done, artifact missing | lru_budget=50pct.run.json is not in {d} |" in md, md
    assert "lru_budget=25pct |" not in md.split("## Sweep cells without an artifact")[1]


def test_a_report_of_a_sweep_under_way_shows_a_written_cell_once_and_says_so(tmp_path):
    """A report made while a sweep wrote listed a cell both as a run and as "pending, without an artifact"."""
    from moetool.files import DirectoryLock
    from moetool.sweep import LOCK, Sweep

    d = tmp_path / "sw"
    d.mkdir()
    synthetic_run("lru", {}, 0.001).save(d / "lru_budget=25pct.run.json")  # written; the index not yet
    cells = {name: {"status": "pending"} for name in ("lru_budget=25pct", "lru_budget=50pct")}
    Sweep(model=FP, inputs={}, stage="run", grid={"policy": ["lru"], "budget": ["25%", "50%"]},
          cells=cells).save(d / "sweep.json")
    with DirectoryLock(d, LOCK, "busy"):
        report([d], tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    table = md.split("## Sweep cells without an artifact")[1]
    assert "| lru_budget=50pct | pending |" in table and "lru_budget=25pct" not in table, md
    assert f"A sweep is still writing {d}: this report shows it part-way." in md


def test_a_ppl_limit_past_the_texts_end_is_the_same_measurement_as_none(tmp_path):
    """`eval ppl --limit 99999999999999999999` read the whole text, as an eval with no limit does, and the
    report gave each its own column ("..., 99999999999999999999 tokens") with one number twice."""
    d = tmp_path / "evals"
    d.mkdir()
    windows = [{"start": 0, "tokens": 127, "nll": 1.0}, {"start": 128, "tokens": 40, "nll": 1.0}]  # 169 tokens read
    for i, (policy, limit) in enumerate((("resident", None), ("lru", 10**20), ("static", 100))):
        e = {**_ppl_eval(policy, {"bits": 16}, 12.5 + i), "options": {"data": "t.txt", "context": 128, "limit": limit},
             "samples": {"ppl": windows if limit != 100 else [{"start": 0, "tokens": 99, "nll": 1.0}]}}
        (d / f"e{i}.eval.json").write_text(json.dumps(e))
    report([d], tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "| setting | expert cache MiB | ppl (t.txt, context 128) | ppl (t.txt, context 128, 100 tokens) |" in md, md


def test_two_evals_of_one_cell_are_said_and_dtypes_kept_apart(tmp_path):
    """Two evals of one setting and measure became one cell showing one of them, without a word; a bf16
    and an fp32 eval of one setting shared a row."""
    d = tmp_path / "evals"
    d.mkdir()
    for name, ppl, dtype in (("a", 12.5, "float32"), ("b", 12.6, "float32"), ("c", 12.9, "bfloat16")):
        (d / f"{name}.eval.json").write_text(json.dumps({**_ppl_eval("lru", {"bits": 16}, ppl), "dtype": dtype}))
    report([d], tmp_path / "rep")
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "| lru bits=16 (bfloat16) | 8 | 12.9 |" in md and "| lru bits=16 (float32) | 8 | 12.6 |" in md, md
    assert "Evals of one setting and measure: `a.eval.json` and `b.eval.json` (lru bits=16 (float32), ppl: the " \
           "table shows the second)." in md, md


def test_the_runs_table_says_the_device_and_threads_a_wall_clock_time_was_measured_with(tmp_path):
    """Two CPU wall-clock runs at 1 and 16 threads, and a CUDA one, were three rows all saying "wall"."""
    import dataclasses

    from moetool.report import _runs_tables

    runs = [(tmp_path / f"{name}.run.json", dataclasses.replace(synthetic_run("lru", {}, 0.1), clock="wall", hw=None,
                                                                 device=device, summary=summary))
            for name, device, summary in (("one", "cpu", {"host_threads": 1}), ("many", "cpu", {"host_threads": 16}),
                                          ("gpu", "cuda", {"host_threads": 16}), ("old", "cpu", {}))]
    runs.append((tmp_path / "sim.run.json", synthetic_run("lru", {}, 0.1)))
    md = _runs_tables(runs, [])
    for name, clock in (("one", "wall/cpu, 1 thread"), ("many", "wall/cpu, 16 threads"), ("gpu", "wall/cuda"),
                        ("old", "wall/cpu"), ("sim", "sim/rtx3090")):
        assert f"| {name}.run.json | lru | {clock} |" in md, md

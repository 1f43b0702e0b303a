"""moetool fit: the alpha polynomial and eq. 5, Fate's L/n/p, DyMoE's lambda, DynaExq's n_hi."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from moetool.artifacts import ModelFingerprint
from moetool.fit_artifact import Fit
from moetool.cli import app
from moetool.errors import MoetoolError
from moetool.evaluate import Eval
from moetool.fit import FitConfig, cache_bytes, fit
from moetool.options import parse_seconds
from moetool.policies.dymoe_knobs import budget_retention, critical_share, retention, schedule_table, solve_lambda
from moetool.policies.dynaexq_knobs import budget_n_hi
from moetool.policies.knobs import Sizing
from moetool.policies.fate_knobs import boundary_L, int2_share, transfer_n
from moetool.policies.smoe_fit import choose_alpha, fit_polynomial, measured_guard
from moetool.run import RunConfig
from helpers import FP, INFO, synthetic_profile, synthetic_run

runner = CliRunner()
OTHER = ModelFingerprint(source="other", model_type="qwen2_moe", config_sha256="b" * 64)
def synthetic_eval(policy: str, params: dict, metrics: dict, model=FP) -> Eval:
    return Eval(model=model, inputs={}, policy=policy, params=params, clock="wall", hw=None, device="cpu",
                budget_bytes=64 << 20, budget={}, peak_device_bytes=0, summary={}, layers={}, task="mc",
                metrics=metrics, stderr={}, n=10, unit="examples", subtasks={}, samples={}, options={})


def test_polynomial_degree_by_leave_one_out_and_eq5_selection():
    a = np.linspace(0, 0.5, 6)
    quad = fit_polynomial(list(a), list(0.1 - 0.2 * a + 0.3 * a**2))
    assert quad["degree"] == 2 and quad["coefficients"] == pytest.approx([0.3, -0.2, 0.1], abs=1e-9)
    lin = fit_polynomial(list(a), list(0.1 - 0.1 * a))
    assert lin["degree"] == 1 and max(map(abs, lin["residuals"])) < 1e-12
    noisy = fit_polynomial(list(a), list(0.1 - 0.1 * a + np.array([1, -1, 1, -1, 1, -1]) * 1e-3))
    assert noisy["degree"] == min(map(int, noisy["loo_rmse"]), key=lambda d: noisy["loo_rmse"][str(d)])
    assert set(noisy["loo_rmse"]) == {"0", "1", "2", "3"} and noisy["degree"] < 3  # a cubic chases the noise
    pick = choose_alpha(lin["coefficients"], 0.0, 0.5, 0.07)
    assert pick["feasible"] and pick["alpha"] == pytest.approx(0.3, abs=0.005)
    assert all(t > 0.07 for g, t in zip(pick["grid"], pick["predicted"]) if g < pick["alpha"] - 1e-9)
    too_fast = choose_alpha(lin["coefficients"], 0.0, 0.5, 0.01)
    assert too_fast["feasible"] is False and too_fast["alpha"] == pytest.approx(0.5)
    assert choose_alpha(lin["coefficients"], 0.0, 0.5, None)["alpha"] is None


def test_a_step_in_tpot_is_not_hidden_by_a_flat_polynomial(tmp_path):
    """The demo's trace: alpha 0 is slow, every alpha > 0 equally fast. LOO picks a flat fit that
    meets R everywhere, so eq. 5 alone would answer alpha = 0, which was measured at 5 ms > R."""
    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    step = [(0.0, 0.005), (0.1, 0.00226), (0.2, 0.00226), (0.3, 0.00226), (0.4, 0.00226), (0.5, 0.00226)]
    runs = tuple(synthetic_run("smoe", {"alpha": a}, t).save(tmp_path / f"a{a}.run.json") for a, t in step)
    result = fit(FitConfig(profile=prof, runs=runs, target_tpot=0.003))
    ev = result.evidence["smoe"]["alpha"]
    assert ev["degree"] == 0 and ev["alpha"] == 0.0  # what the polynomial alone chooses
    assert result.params["smoe"]["alpha"] == 0.1 and ev["guarded"] == 0.1
    assert any("smallest measured alpha that meets R" in w for w in result.evidence["warnings"])
    # a smooth trace the polynomial fits is left alone
    assert measured_guard(0.25, [(0.0, 0.1, ""), (0.2, 0.08, ""), (0.3, 0.07, "")], 0.075) == (0.25, True)
    # and so is a convex one, where a line between measured alphas lies above the curve: the guard used to
    # take alpha = 0.2 where every run is on T(alpha) = 10 - 20 a + 20 a^2 ms and eq. 5 gives 0.184
    convex = [(a, 0.010 - 0.020 * a + 0.020 * a * a) for a in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)]
    runs = tuple(synthetic_run("smoe", {"alpha": a}, t).save(tmp_path / f"c{a}.run.json") for a, t in convex)
    result = fit(FitConfig(profile=prof, runs=runs, target_tpot=0.007))
    ev = result.evidence["smoe"]["alpha"]
    assert result.params["smoe"]["alpha"] == pytest.approx(0.1838, abs=0.006) and "guarded" not in ev
    # a choice past the last measured alpha is checked against it
    assert measured_guard(0.6, [(0.0, 0.1, ""), (0.5, 0.09, "")], 0.08) == (0.6, False)  # nothing met R: it stands
    assert measured_guard(0.3, [(0.0, 0.1, ""), (0.2, 0.07, ""), (0.4, 0.09, "")], 0.08) == (0.2, True)
    # runs flat around R: the fitted line's intercept under R at alpha = 0, every run over it (h1's trace)
    flat = [(0.0, 57.147e-6), (0.1, 57.15e-6), (0.2, 57.12e-6), (0.3, 57.82e-6), (0.4, 57.47e-6), (0.5, 57.75e-6)]
    runs = tuple(synthetic_run("smoe", {"alpha": a}, t).save(tmp_path / f"f{a}.run.json") for a, t in flat)
    result = fit(FitConfig(profile=prof, runs=runs, target_tpot=57.1e-6))
    ev = result.evidence["smoe"]["alpha"]
    assert ev["feasible"] is False and result.params["smoe"]["alpha"] == ev["alpha"]
    assert any("no run met it" in w for w in result.evidence["warnings"]), result.evidence["warnings"]


def test_boundary_L_on_a_synthetic_accuracy_curve():
    assert boundary_L([None, 0.5, 0.9, 0.7, 0.85, 0.9, 0.95], 0.8) == 4
    assert boundary_L([None, 0.9, 0.95], 0.8) == 1  # the first layer has no predictor: always shallow
    assert boundary_L([None, 0.9, 0.5], 0.8) == 3
    assert transfer_n(1e-3, 3e-4, 64) == 3 and transfer_n(1e-5, 1e-3, 64) == 1
    assert transfer_n(1.0, 1e-6, 64) == 64


def test_int2_share_stops_at_the_first_loss_over_the_limit():
    losses = {0.0: 0.0, 0.125: 0.002, 0.25: 0.008, 0.375: 0.02, 0.5: 0.005}
    assert int2_share(losses, 0.01) == 0.25
    assert int2_share({0.0: 0.0, 0.25: 0.5}, 0.01) == 0.0


def test_lambda_solved_for_r():
    """lam for Table 2's r: the least whose mean t_l / M over the layers (eq. 5) reaches r."""
    for r in (0.75, 0.9, 1.0):
        got, table = schedule_table(r, 8, 4)
        assert got == solve_lambda(r, 8, 4)
        kept = np.mean([row["t"] for row in table]) / 4
        assert kept >= r and kept == critical_share(got, 8, 4) and critical_share(max(0.0, got - 2e-6), 8, 4) < r or got == 0
        assert table[0]["r"] == pytest.approx(1.0) and table[-1]["r"] == pytest.approx(got)
        assert all(row["t"] == min(4, int(np.ceil(retention(row["position"], 8, got) * 4 - 1e-9))) for row in table)
    assert schedule_table(0.3, 8, 4)[0] == 0.0  # below the schedule's floor: lam = 0 (fit warns)


def test_budget_to_retention_and_n_hi():
    n = 4 * 8
    cache = n * (INFO.expert_bytes[4] + INFO.expert_bytes[2]) // 2  # half the experts at INT4
    assert budget_retention(cache, INFO, 4, 2) == pytest.approx(0.5, abs=1e-3)
    assert budget_retention(10**9, INFO, 4, 2) == 1.0
    cache = n * INFO.expert_bytes[4] + 4 * 3 * INFO.expert_bytes[16]
    assert budget_n_hi(cache, 4, 8, INFO.expert_bytes[4], INFO.expert_bytes[16]) == 3
    assert budget_n_hi(0, 4, 8, INFO.expert_bytes[4], INFO.expert_bytes[16]) == 0
    assert cache_bytes("50%", INFO) == n * 4096 // 2
    reserved = INFO.non_expert_bytes + INFO.kv_margin_bytes + INFO.staging_bytes
    assert cache_bytes("4MiB", INFO) == (4 << 20) - reserved


def test_fit_end_to_end_with_evidence_and_round_trip(tmp_path):
    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    runs = [synthetic_run("smoe", {"alpha": a}, 0.1 - 0.1 * a).save(tmp_path / f"a{a}.run.json")
            for a in (0.0, 0.1, 0.2, 0.3, 0.4)]
    result = fit(FitConfig(profile=prof, runs=tuple(runs), target_tpot=0.075, budget="50%"))
    assert result.params["smoe"]["alpha"] == pytest.approx(0.25, abs=0.006)
    assert result.params["fate"] == {"L": 2, "n": 2, "p": 0.25}  # n = 300 us // 128 us
    # T = t_moe + t_attn: the timed MoE block holds its router, so t_gate is not added again (310 us)
    assert result.evidence["fate"]["n"]["T_s"] == pytest.approx(2e-4 + 1e-4)
    r, lam = result.params["dymoe"]["r"], result.params["dymoe"]["lam"]
    assert lam == pytest.approx(solve_lambda(r, 4, 2), abs=1e-4) and critical_share(lam, 4, 2) >= r
    assert result.params["dynaexq"]["n_hi"] == budget_n_hi(cache_bytes("50%", INFO), 4, 8, INFO.expert_bytes[4],
                                                           INFO.expert_bytes[16])
    ev = result.evidence
    assert ev["smoe"]["alpha"]["from"] == "runs" and len(ev["smoe"]["alpha"]["points"]) == 5
    assert ev["fate"]["L"]["threshold"] == 0.7 and ev["fate"]["L"]["accuracy"] == [None, 0.6, 0.9, 0.95]
    assert "profile.sensitivity.int2_share" in ev["fate"]["p"]["from"]
    assert set(result.inputs) == {str(prof), *map(str, runs)}
    saved = result.save(tmp_path / "s.fit.json")
    assert Fit.load(saved, model=FP) == result
    # what a run at another budget or tiers checks before it takes n_hi and r (`stale_fitted`)
    cache = cache_bytes("50%", INFO)
    assert Fit.load(saved, model=FP).sizing("dynaexq") == {"n_hi": Sizing("50%", cache, {"b_hi": 16, "b_lo": 4})}
    assert result.sizing("dymoe") == {"r": Sizing("50%", cache, {"high_bits": 4, "low_bits": 2})}
    # SMoE's T(alpha) holds for its runs' machine (their --hw's link; synthetic runs record no cache or knobs)
    assert result.sizing("smoe")["alpha"].costs.keys() == {"t_load.16"} and result.sizing("lru") == {}


def test_a_fit_edited_to_hold_knobs_no_paper_fits_is_refused_not_run_quietly(tmp_path):
    """A fit with `params.lru = {bits: 4}` ran lru at INT4 while the run said the fit changed nothing for it."""
    from moetool.options import fit_note
    from moetool.run import fitted_knobs

    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    made = fit(FitConfig(profile=prof, budget="50%"))
    edited = dataclasses.replace(made, params={**made.params, "lru": {"bits": 4}})
    path = edited.save(tmp_path / "e.fit.json")
    with pytest.raises(MoetoolError, match=r"e.fit.json holds knobs of policy 'lru' \(bits=4\), which no paper's fit "
                                           r"sets \(moetool fit never writes them\); give them with --set instead."):
        fitted_knobs(Fit.load(path), "lru", path)
    assert fit_note(path, "lru") is None  # no "changes nothing" before the refusal
    assert fitted_knobs(Fit.load(path), "dymoe", path) == made.params["dymoe"]
    assert "changes nothing" in fit_note(made.save(tmp_path / "m.fit.json"), "lru")


def test_smoe_alpha_from_given_runs_holds_for_their_cache_knobs_and_machine(tmp_path):
    """Eq. 5's T(alpha) through runs one gives is theirs: one expert cache, one set of the other knobs, one
    machine. A run with another cache (--budget), other knobs or another --hw's link took the alpha as it
    was, without a word (a sweep's alpha already recorded this; given runs record bytes, not --budget)."""
    from moetool.engine.clock import load_hw
    from moetool.policies import POLICIES
    from moetool.policies.knobs import stale_fitted

    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    knobs = {"window": 3, "bits": 16, "cpu_assist": True}
    runs = [dataclasses.replace(synthetic_run("smoe", {"alpha": a, **knobs}, 0.1 - 0.1 * a),
                                budget={"cache_bytes": 1 << 20}).save(tmp_path / f"a{a}.run.json") for a in (0.0, 0.2, 0.4)]
    result = fit(FitConfig(profile=prof, runs=tuple(runs), target_tpot=0.075))
    sized = Fit.load(result.save(tmp_path / "f.fit.json"), model=FP).sizing("smoe")["alpha"]
    hw = load_hw("rtx3090")[0]
    t_load = INFO.expert_bytes[16] / (hw.h2d_gbps * 1e9) + hw.copy_latency_s
    assert (sized.budget, sized.cache_bytes, sized.knobs) == (None, 1 << 20, knobs)
    assert sized.costs == {"t_load.16": pytest.approx(t_load)}
    fitted, same = result.params["smoe"], (lambda b: True)

    def drops(settings=None, cache=1 << 20, t=t_load):
        return stale_fitted(POLICIES["smoe"], settings or {}, fitted, {"alpha": sized}, same, "25%", {"t_load.16": t},
                            "h200", cache)

    assert drops() == {} and drops(cache=(1 << 20) - 4096) == {}  # a run of a few more tokens: the same cache
    assert drops(cache=2 << 20) == {"alpha": "sized for the expert cache of the runs it was fitted from, 1.0 MiB, and this "
                                             "run's is 2.0 MiB"}
    assert drops({"window": "5"}) == {"alpha": "sized for window=3, and this run has window=5"}
    assert set(drops(t=t_load / 4)) == {"alpha"}
    # T(alpha) of host-path runs: a captured run (the policy a step late, misses read in place) missed R unsaid
    assert sized.path == "host"
    assert stale_fitted(POLICIES["smoe"], {}, fitted, {"alpha": sized}, same, "25%", {"t_load.16": t_load}, "h200",
                        1 << 20, path="captured") == {
        "alpha": "sized for a decode step on the host path, and this run decodes on the captured path"}
    # runs on a machine fit cannot read (a --hw file since moved): fitted, and said to be unchecked
    gone = [dataclasses.replace(synthetic_run("smoe", {"alpha": a}, 0.1 - 0.1 * a), hw=str(tmp_path / "moved.json"))
            .save(tmp_path / f"g{a}.run.json") for a in (0.0, 0.2)]
    result = fit(FitConfig(profile=prof, runs=tuple(gone), target_tpot=0.075))
    assert "alpha" in result.params["smoe"] and result.sizing("smoe")["alpha"].costs is None  # cache, knobs still held
    assert any("hardware profile could not be read" in w for w in result.evidence["warnings"])
    # the copy time the runs' policy decided with is theirs (a checkpoint's fp32 slots copy twice the profile's
    # bf16 bytes): a rerun of their own setting dropped the alpha fitted from them
    fp32 = [dataclasses.replace(synthetic_run("smoe", {"alpha": a, **knobs, "c_load": 2 * t_load}, 0.1 - 0.1 * a),
                                budget={"cache_bytes": 1 << 20}).save(tmp_path / f"f{a}.run.json") for a in (0.0, 0.2)]
    got = fit(FitConfig(profile=prof, runs=tuple(fp32), target_tpot=0.075)).sizing("smoe")["alpha"]
    assert got.costs == {"t_load.16": pytest.approx(2 * t_load)}


@pytest.mark.parametrize("other,said", [
    (dict(params={"alpha": 0.4, "bits": 2}), "bits=None / bits=2"),  # a knob (the others did not set it)
    (dict(params={"alpha": 0.4}, budget=32 << 20), "budget 67108864 B / budget 33554432 B"),
    (dict(params={"alpha": 0.4}, batch_size=4), "batch 1 / batch 4"),  # the Run did not record its batch
    # the workload and, on the wall clock, the device: routing follows the prompts and their length
    (dict(params={"alpha": 0.4}, replace=dict(prompts=["y"])), "1 prompt(s) 2d711642b726 / 1 prompt(s) a1fce4363854"),
    (dict(params={"alpha": 0.4}, replace=dict(tokens=[[1, 2]])), "1 tokens a prompt / 2 tokens a prompt"),
    (dict(params={"alpha": 0.4}, replace=dict(dtype="bfloat16")), "dtype float32 / dtype bfloat16"),
])
def test_smoe_runs_that_differ_in_more_than_alpha_fit_no_alpha_and_say_how(tmp_path, other, said):
    """T(alpha) was fitted through runs of different bits, cpu_assist, hardware, budget, prompts, lengths or
    dtype, without a word for the knobs (and with a warning but an alpha anyway for the rest): a curve of
    no one setting."""
    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    runs = [synthetic_run("smoe", {"alpha": a}, 0.1 - 0.1 * a).save(tmp_path / f"a{a}.run.json") for a in (0.0, 0.2)]
    other = dict(other)
    changes = other.pop("replace", {})
    odd = dataclasses.replace(synthetic_run("smoe", tpot=0.06, **other), **changes)
    runs.append(odd.save(tmp_path / "odd.run.json"))
    result = fit(FitConfig(profile=prof, runs=tuple(runs), target_tpot=0.075))
    assert "smoe" not in result.params
    why = result.evidence["skipped"]["smoe.alpha"]
    assert why == f"the smoe runs differ in more than alpha ({said}); T(alpha) is fitted through runs that differ " \
                  "only in alpha", why


def test_smoe_runs_that_timed_no_decode_step_are_named_as_such(tmp_path):
    """Runs of one token (tpot_s null) at two alphas were fitted as "needs runs at two or more alphas"; a
    --sweep of one token a run was a traceback."""
    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    runs = [dataclasses.replace(synthetic_run("smoe", {"alpha": a}, 0.1), tpot_s=None).save(tmp_path / f"a{a}.run.json")
            for a in (0.0, 0.2)]
    result = fit(FitConfig(profile=prof, runs=tuple(runs), target_tpot=0.075))
    assert "2 run(s) given timed no decode step (one token: no TPOT)" in result.evidence["skipped"]["smoe.alpha"]
    with pytest.raises(MoetoolError, match="--max-new-tokens 1 gives the --sweep runs no decode step to time"):
        fit(FitConfig(profile=prof, sweep=RunConfig(max_new_tokens=1), alphas=(0.0, 0.2)))


def test_smoe_runs_on_two_hardware_files_of_one_name_are_two_machines(tmp_path):
    """Runs made with `--hw hw.json` in two experiments' directories were one T(alpha) curve: the run records the
    path as typed, and fit compared that text. The file's content (the run's inputs) tells them apart."""
    prof = synthetic_profile().save(tmp_path / "s.profile.json")

    def on(a: float, digest: str) -> Path:
        r = dataclasses.replace(synthetic_run("smoe", {"alpha": a}, 0.1 - 0.1 * a), hw="hw.json",
                                inputs={f"/exp{digest}/hw.json": digest * 64})
        return r.save(tmp_path / f"{digest}{a}.run.json")

    two = fit(FitConfig(profile=prof, runs=(on(0.0, "a"), on(0.2, "b"), on(0.4, "a")), target_tpot=0.09))
    assert "differ in more than alpha (hw hw.json aaaaaaaaaaaa / hw hw.json bbbbbbbbbbbb)" in \
        two.evidence["skipped"]["smoe.alpha"]
    one = fit(FitConfig(profile=prof, runs=(on(0.0, "a"), on(0.2, "a"), on(0.4, "a")), target_tpot=0.09))
    assert "alpha" in one.params["smoe"]
    # the decode path is part of the setting: a host run at alpha 0 and a captured one at 0.8 were one curve
    paths = [dataclasses.replace(synthetic_run("smoe", {"alpha": a}, 0.1 - 0.1 * a), summary={"path": path}).save(
        tmp_path / f"{path}{a}.run.json") for a, path in ((0.0, "host"), (0.8, "captured"))]
    mixed = fit(FitConfig(profile=prof, runs=tuple(paths), target_tpot=0.09))
    assert "differ in more than alpha (host path / captured path)" in mixed.evidence["skipped"]["smoe.alpha"]


def test_a_profiles_bundle_is_recorded_whole_and_one_gone_is_said_as_such(tmp_path, monkeypatch):
    """A profile made with `--bundle robundle` recorded the relative path, so `fit --sweep` from another directory
    fell back to the bundle's model `ckpt` (relative too) and said "ckpt does not exist"."""
    from moetool.profile import ProfileConfig

    (tmp_path / "robundle").mkdir()
    monkeypatch.chdir(tmp_path)
    assert ProfileConfig(bundle=Path("robundle")).recorded()["bundle"] == str(tmp_path / "robundle")
    prof = dataclasses.replace(synthetic_profile(), settings={"bundle": "robundle"},
                               model=dataclasses.replace(FP, source="ckpt")).save(tmp_path / "s.profile.json")
    with pytest.raises(MoetoolError, match="the profile was made on the bundle robundle, which is not there now, and "
                                           "its model ckpt is not found either"):
        fit(FitConfig(profile=prof, sweep=RunConfig(max_new_tokens=2), alphas=(0.0, 0.2)))


def test_fit_without_runs_or_budget_skips_and_says_why(tmp_path):
    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    result = fit(FitConfig(profile=prof))
    assert "smoe" not in result.params and "dynaexq" not in result.params
    assert result.params["dymoe"] == {"r": 0.75, "lam": 1e-6}  # 4 top-2 layers: t_l = 2, 2, 1, 1
    assert set(result.evidence["skipped"]) == {"smoe.alpha", "dynaexq.n_hi"}


def test_runs_of_another_model_are_refused(tmp_path):
    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    run = synthetic_run("smoe", {"alpha": 0.1}, 0.1, model=OTHER).save(tmp_path / "o.run.json")
    with pytest.raises(MoetoolError, match="was made for model other"):
        fit(FitConfig(profile=prof, runs=(run,)))


def test_fate_p_from_eval_artifacts(tmp_path):
    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    evals = []
    for p, acc in ((0.0, 0.50), (0.25, 0.497), (0.5, 0.45)):
        path = tmp_path / f"fate{p}.eval.json"
        evals.append(synthetic_eval("fate", {"p": p}, {"acc": acc}).save(path))
    result = fit(FitConfig(profile=prof, runs=tuple(evals)))
    assert result.params["fate"]["p"] == 0.25 and result.evidence["fate"]["p"]["metric"] == "acc"
    # evals at a budget that holds every expert at 16 bits moved nothing at INT2 (§4.5): every "loss" was 0,
    # and the fit took the largest p, a loss nobody measured
    idle = [synthetic_eval("fate", {"p": p, "int2_prefill": p == 0.0}, {"acc": 0.5}).save(tmp_path / f"i{p}.eval.json")
            for p in (0.0, 0.25, 0.5)]
    result = fit(FitConfig(profile=prof, runs=tuple(idle)))
    assert "evals" not in str(result.evidence["fate"].get("p", {}).get("from", ""))
    assert any("moved nothing at INT2" in w for w in result.evidence["warnings"])


@pytest.mark.parametrize("odd,said", [
    (dict(task="ppl", metrics={"ppl": 128.6}), "task mc / task ppl; metric acc / metric ppl"),  # a perplexity as an acc
    (dict(params={"p": 0.25, "cache_bits": 8}), "cache_bits=None / cache_bits=8"),
    (dict(options={"num_fewshot": 5}), "num_fewshot=None / num_fewshot=5"),
    (dict(params={"p": 0.0}), "two evals at p=0 in"),  # the second was read over the first
])
def test_fate_evals_that_differ_in_more_than_p_fit_no_p_and_say_how(tmp_path, odd, said):
    """Fate's p was fitted from an accuracy at one p and a perplexity at another (a "loss" of -99.7%),
    or from evals of other precisions or shots, without a word."""
    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    evals = [synthetic_eval("fate", {"p": p}, {"acc": acc}).save(tmp_path / f"fate{p}.eval.json")
             for p, acc in ((0.0, 0.50), (0.5, 0.45))]
    other = dataclasses.replace(synthetic_eval("fate", {"p": 0.25}, {"acc": 0.49}), **odd)
    evals.append(other.save(tmp_path / "odd.eval.json"))
    result = fit(FitConfig(profile=prof, runs=tuple(evals)))
    assert "p" not in result.params["fate"]
    why = result.evidence["skipped"]["fate.p"]
    assert why.startswith("the fate evals differ in more than p (") and said in why, why


def test_fate_L_is_fitted_from_decode_recall_only(tmp_path):
    """A profile of --decode-tokens 0 has prefill recall alone: L was fitted from it, its evidence saying decode."""
    prof = synthetic_profile()
    layers = tuple(dataclasses.replace(lp, recall_topk={"prefill": 1.0}) for lp in prof.prefetch.layers)
    path = dataclasses.replace(prof, prefetch=dataclasses.replace(prof.prefetch, layers=layers)).save(
        tmp_path / "s.profile.json")
    result = fit(FitConfig(profile=path))
    assert "L" not in result.params["fate"]
    assert result.evidence["skipped"]["fate.L"] == ("the profile's prefetch part has no decode recall (it was profiled "
                                                    "with --decode-tokens 0)")


def test_cli_fit(tmp_path):
    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    runs = [str(synthetic_run("smoe", {"alpha": a}, 0.1 - 0.1 * a).save(tmp_path / f"a{a}.run.json"))
            for a in (0.0, 0.2, 0.4)]
    out = tmp_path / "s.fit.json"
    result = runner.invoke(app, ["fit", str(prof), "--runs", *runs, "--target-tpot", "80ms", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert Fit.load(out).params["smoe"]["alpha"] == pytest.approx(0.2, abs=0.006)
    assert parse_seconds("50ms") == pytest.approx(0.05) and parse_seconds("0.1") == 0.1
    assert "Example" in runner.invoke(app, ["fit", "--help"]).output


def test_sweep_refuses_a_model_other_than_the_profiles(tiny_ckpt, tmp_path):
    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    with pytest.raises(MoetoolError, match="is not the model"):
        fit(FitConfig(profile=prof, sweep=RunConfig(model=str(tiny_ckpt("qwen2_moe")))))


def test_sweep_runs_smoe_on_the_sim_clock(tiny_ckpt, tmp_path):
    from moetool.profile import ProfileConfig, profile

    path = str(tiny_ckpt("qwen2_moe"))
    prof = profile(ProfileConfig(model=path, data=("heldout",), seqs_per_data=1, seq_len=8, decode_tokens=1,
                                 what=("prefetch",))).save(tmp_path / "t.profile.json")
    result = fit(FitConfig(profile=prof, sweep=RunConfig(max_new_tokens=2), alphas=(0.0, 0.2, 0.4), target_tpot=1.0))
    a = result.evidence["smoe"]["alpha"]
    assert [p[0] for p in a["points"]] == [0.0, 0.2, 0.4] and all(p[1] > 0 for p in a["points"])
    assert a["from"].startswith("sweep: sim clock") and result.params["smoe"]["alpha"] == 0.0  # R = 1 s: any alpha
    # T(alpha) is the sweep's budget's and its knobs': a run at another budget or with other knobs does not take it
    sized = result.sizing("smoe")["alpha"]
    assert (sized.budget, sized.knobs["bits"], sized.knobs["cpu_assist"]) == (RunConfig().budget, 16, True)
    assert "alpha" not in sized.knobs
    from moetool.policies import POLICIES
    from moetool.policies.knobs import stale_fitted

    fitted, same, here = result.params["smoe"], (lambda b: b == RunConfig().budget), RunConfig().budget
    # and the sweep's machine's: one bf16 expert's copy on rtx3090's link (the sweep's --hw)
    from moetool.engine.clock import load_hw

    hw = load_hw(RunConfig().hw)[0]
    from moetool.profile_artifact import Profile

    # the sweep's runs read the checkpoint: their 16-bit slots are fp32 on a CPU, twice the profile's bf16
    t_load = 2 * Profile.load(prof).info.expert_bytes[16] / (hw.h2d_gbps * 1e9) + hw.copy_latency_s
    assert sized.costs == {"t_load.16": pytest.approx(t_load)}
    costs = {"t_load.16": t_load * 1.05}  # within COST_TOLERANCE: the same machine's
    assert stale_fitted(POLICIES["smoe"], {}, fitted, {"alpha": sized}, same, here, costs) == {}
    assert stale_fitted(POLICIES["smoe"], {"cpu_assist": "false"}, fitted, {"alpha": sized}, lambda b: False, "x",
                        costs) == {"alpha": f"sized for --budget {here}, and this run has --budget x"}
    assert stale_fitted(POLICIES["smoe"], {"cpu_assist": "false"}, fitted, {"alpha": sized}, same, here, costs) == {
        "alpha": "sized for cpu_assist=true, and this run has cpu_assist=false"}
    faster = {"t_load.16": t_load / 4}  # an H200's link, say
    assert stale_fitted(POLICIES["smoe"], {}, fitted, {"alpha": sized}, same, here, faster, "h200") == {
        "alpha": f"sized for t_load.16 = {t_load * 1e3:.3g} ms, and this run's costs (h200) give "
                 f"{t_load / 4 * 1e3:.3g} ms"}


def test_the_stage_asks_each_paper_once_and_takes_only_its_knobs(tmp_path):
    """fit() loops over the registry: a subclass registered under another name does not fit again
    (it inherits the paper's `fit`), and a fit that returns something not a knob is a bug, refused."""
    from moetool.policies.base import POLICIES, register
    from moetool.policies.dymoe import DyMoE
    from moetool.policies.stages import Fitted

    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    register("dymoe-variant")(type("DyMoEVariant", (DyMoE,), {}))
    try:
        assert set(fit(FitConfig(profile=prof)).params) == {"fate", "dymoe"}
    finally:
        POLICIES.pop("dymoe-variant")
    register("typo")(type("Typo", (DyMoE,), {"fit": classmethod(lambda cls, inputs: Fitted(knobs={"lamda": 0.5}))}))
    try:
        with pytest.raises(MoetoolError, match=r"policy 'typo' fitted \['lamda'\], which are not its knobs: a bug in its fit"):
            fit(FitConfig(profile=prof))
    finally:
        POLICIES.pop("typo")


def test_eq5_with_two_alphas_fits_the_line_through_them(tmp_path):
    """SMoE §V-C: T(alpha) is a low-degree polynomial, TPOT "generally decreases linearly" in alpha.
    Runs at alpha 0 (100 ms) and 0.5 (50 ms), R = 75 ms: the line T = 0.1 - 0.1 alpha meets R from
    alpha = 0.25 on. Leave-one-out cannot check a line on two alphas, and a constant (75 ms, "met
    everywhere") would make eq. 5 answer alpha = 0, measured at 100 ms."""
    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    runs = tuple(synthetic_run("smoe", {"alpha": a}, t).save(tmp_path / f"a{a}.run.json")
                 for a, t in ((0.0, 0.1), (0.5, 0.05)))
    result = fit(FitConfig(profile=prof, runs=runs, target_tpot=0.075))
    ev = result.evidence["smoe"]["alpha"]
    assert ev["degree"] == 1 and ev["coefficients"] == pytest.approx([-0.1, 0.1])
    assert result.params["smoe"]["alpha"] == pytest.approx(0.25, abs=0.006) and "guarded" not in ev


def test_eq5_leave_one_out_leaves_out_an_alpha_with_all_its_runs():
    """Two runs at alpha 0 and one at 0.5: leaving out one run at a time once left a fold with a
    single alpha to fit a line through (numpy's least squares failed). Leaving out one alpha keeps
    every fold fittable; with two distinct alphas the fit is their line, T = 0.1 - 0.1 alpha."""
    poly = fit_polynomial([0.0, 0.0, 0.5], [0.1, 0.1, 0.05])
    assert poly["degree"] == 1 and poly["coefficients"] == pytest.approx([-0.1, 0.1])
    assert choose_alpha(poly["coefficients"], 0.0, 0.5, 0.075)["alpha"] == pytest.approx(0.25, abs=0.006)
    # three alphas, one run twice: degrees 0 and 1 are checked on folds of two alphas each
    three = fit_polynomial([0.0, 0.25, 0.25, 0.5], [0.1, 0.075, 0.075, 0.05])
    assert set(three["loo_rmse"]) == {"0", "1"} and three["degree"] == 1


def test_alphas_the_policy_refuses_are_refused_before_the_sweep(tmp_path):
    """`SMoE.Params` takes alpha in [0, 1): a sweep with alpha = 1 used to pass the check and stop
    at that alpha's run, the alphas before it already run, with the policy's refusal."""
    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    with pytest.raises(MoetoolError, match=r"--alphas are SMoE thresholds between 0 and 1 \(1 excluded\), not 0, 1"):
        FitConfig(profile=prof, sweep=RunConfig(max_new_tokens=2), alphas=(0.0, 1.0)).check()
    FitConfig(profile=prof, sweep=RunConfig(max_new_tokens=2), alphas=(0.0, 0.99)).check()


def test_a_sweep_of_one_alpha_is_refused_before_it_runs(tmp_path):
    """`--sweep --alphas 0.3` ran its one alpha, then said eq. 5 needs two: minutes of runs for nothing."""
    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    for alphas in ((0.3,), (0.3, 0.3)):
        with pytest.raises(MoetoolError, match=r"gives the --sweep one point of SMoE's T\(alpha\)"):
            FitConfig(profile=prof, sweep=RunConfig(max_new_tokens=2), alphas=alphas).check()
    run = synthetic_run("smoe", {"alpha": 0.1}, 0.09).save(tmp_path / "a.run.json")  # a second point from a run
    FitConfig(profile=prof, runs=(run,), sweep=RunConfig(max_new_tokens=2), alphas=(0.3,)).check()


def test_an_r_given_wins_over_the_budgets_for_dymoe(tmp_path):
    """`fit --r 0.9 --budget 50%` took the budget's r over the 0.9 asked for, without a word; the
    budget still sizes DynaExq's n_hi. Without --r the budget sizes r, and without either r is §6.2's."""
    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    asked = fit(FitConfig(profile=prof, r=0.9, budget="50%"))
    assert asked.params["dymoe"]["r"] == 0.9 and "n_hi" in asked.params["dynaexq"]
    assert asked.sizing("dymoe") == {"r": Sizing()}  # recorded as holding anywhere
    assert asked.evidence["dymoe"]["r"]["from"] == "--r (target share of critical experts)"
    sized = fit(FitConfig(profile=prof, budget="50%"))
    assert sized.params["dymoe"]["r"] == pytest.approx(budget_retention(cache_bytes("50%", INFO), INFO, 4, 2), abs=1e-4)
    bare = fit(FitConfig(profile=prof))
    assert bare.params["dymoe"]["r"] == 0.75 and "no --budget" in bare.evidence["dymoe"]["r"]["from"]


def test_runs_no_fit_reads_are_said(tmp_path):
    """`fit --runs` with an lru run: recorded among the fit's inputs, and nothing said of it."""
    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    lru = synthetic_run("lru", {}, 0.01).save(tmp_path / "lru.run.json")
    smoe = synthetic_run("smoe", {"alpha": 0.1}, 0.01).save(tmp_path / "smoe.run.json")
    result = fit(FitConfig(profile=prof, runs=(lru, smoe)))
    said = [w for w in result.evidence["warnings"] if "no paper's fit reads" in w]
    assert said == [f"{lru} is a run of policy 'lru', which no paper's fit reads; nothing was fitted from it."]


def test_fate_evals_of_one_path_but_two_texts_fit_no_p(tmp_path):
    """Two ppl evals of `t.txt`, rewritten between them: p = 0.5 was fitted from a "loss" that was the
    difference of the two texts, though each eval recorded its text's sha256."""
    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    evals = []
    for p, ppl, sha in ((0.0, 20.0, "a" * 64), (0.5, 20.1, "b" * 64)):
        e = dataclasses.replace(synthetic_eval("fate", {"p": p}, {"ppl": ppl}), task="ppl",
                                options={"data": "t.txt"}, inputs={"t.txt": sha})
        evals.append(e.save(tmp_path / f"fate{p}.eval.json"))
    result = fit(FitConfig(profile=prof, runs=tuple(evals)))
    assert "p" not in result.params["fate"]
    assert "text sha256 aaaaaaaaaaaa / text sha256 bbbbbbbbbbbb" in result.evidence["skipped"]["fate.p"]


def test_fates_n_holds_for_the_link_it_was_divided_by(tmp_path):
    """§4.3's n = T / t_expert is the profiled machine's: a run whose costs give another copy time (a sim
    run on another --hw) took it as it was, without a word. It now derives n from its own costs (the
    default n = 0), and a fitted n beside `--set prefetcher=none` (which reads no n), or on the captured
    step, whose layer time it did not divide, is not taken either."""
    from moetool.policies import POLICIES
    from moetool.policies.knobs import stale_fitted

    result = fit(FitConfig(profile=synthetic_profile().save(tmp_path / "s.profile.json")))
    sized = result.sizing("fate")["n"]
    t_io = result.evidence["fate"]["n"]["t_expert_s"]
    assert sized.costs == {"t_load.4": t_io} and sized.knobs == {"cache_bits": 4} and sized.budget is None
    assert sized.path == "host"  # T is the host path's layer, timed by hooks on the eager forward
    # the synthetic profile timed a CPU and took the preset's link: said, since the record holds the copy alone
    assert any("divides the layer time measured on cpu by the link of hw preset x" in w
               for w in result.evidence["warnings"]), result.evidence["warnings"]
    fitted, same = result.params["fate"], (lambda b: True)
    assert stale_fitted(POLICIES["fate"], {}, fitted, {"n": sized}, same, "25%", {"t_load.4": t_io}) == {}
    assert set(stale_fitted(POLICIES["fate"], {}, fitted, {"n": sized}, same, "25%", {"t_load.4": t_io / 3},
                            "h200")) == {"n"}
    assert stale_fitted(POLICIES["fate"], {"prefetcher": "none"}, fitted, {"n": sized}, same, "25%",
                        {"t_load.4": t_io}) == {"n": "read only with prefetcher=fate (§4.3's cap on its transfers), "
                                                     "and this run has prefetcher=none"}
    # The captured step's layer is shorter (0.16 against 1.6 ms on an H100), so its own n is smaller: a
    # captured run took the host path's n (8 where its rule gave 2), unsaid.
    assert stale_fitted(POLICIES["fate"], {}, fitted, {"n": sized}, same, "25%", {"t_load.4": t_io},
                        path="captured") == {"n": "sized for a decode step on the host path, and this run decodes "
                                                  "on the captured path"}


def test_a_sweep_over_a_bundle_runs_the_bundles_model_as_run_does(tiny_ckpt, bundle, tmp_path, monkeypatch):
    """`fit --sweep --bundle B` ran each point with the profile's checkpoint as --model, so its non-expert
    weights were the checkpoint's, not the bundle's: T(alpha) was 0.3-0.5% off `run --bundle B`'s."""
    import moetool.run
    from moetool.profile import ProfileConfig, profile

    prof = profile(ProfileConfig(model=str(tiny_ckpt("qwen2_moe")), data=("heldout",), seqs_per_data=1, seq_len=8,
                                 decode_tokens=1, what=("prefetch",))).save(tmp_path / "t.profile.json")
    seen, real = [], moetool.run.run
    monkeypatch.setattr(moetool.run, "run", lambda cfg, *a, **k: seen.append(cfg) or real(cfg, *a, **k))
    fit(FitConfig(profile=prof, sweep=RunConfig(bundle=bundle, max_new_tokens=2), alphas=(0.0, 0.2), target_tpot=1.0))
    assert [(c.model, c.bundle) for c in seen] == [(None, bundle)] * 2


def test_a_sweep_given_neither_model_nor_bundle_runs_the_bundle_the_profile_measured(tiny_ckpt, bundle, tmp_path,
                                                                                   monkeypatch):
    """README's pipeline profiles a bundle, then fits with `--sweep` alone: the sweep ran the checkpoint
    (fp32 experts on a CPU), so T(alpha) was sized for another link time and every `run --bundle` over
    the fit dropped the alpha. It runs the profile's bundle now; a bundle gone since is said."""
    import shutil

    import moetool.run
    from moetool.profile import ProfileConfig, profile

    mine = tmp_path / "b"
    shutil.copytree(bundle, mine)
    prof = profile(ProfileConfig(bundle=mine, data=("heldout",), seqs_per_data=1, seq_len=8, decode_tokens=1,
                                 what=("prefetch",))).save(tmp_path / "t.profile.json")
    seen, real = [], moetool.run.run
    monkeypatch.setattr(moetool.run, "run", lambda cfg, *a, **k: seen.append(cfg) or real(cfg, *a, **k))
    got = fit(FitConfig(profile=prof, sweep=RunConfig(max_new_tokens=2), alphas=(0.0, 0.2), target_tpot=1.0))
    assert [(c.model, c.bundle) for c in seen] == [(None, str(mine))] * 2
    assert got.evidence["smoe"]["alpha"]["from"].endswith(f"bundle {mine}")
    assert not got.evidence["warnings"]
    seen.clear()
    shutil.rmtree(mine)
    got = fit(FitConfig(profile=prof, sweep=RunConfig(max_new_tokens=2), alphas=(0.0, 0.2), target_tpot=1.0))
    assert [(c.model, c.bundle) for c in seen] == [(str(tiny_ckpt("qwen2_moe")), None)] * 2  # the profile's model
    assert any(w.startswith(f"the profile was made on the bundle {mine}, which is not there now")
               for w in got.evidence["warnings"])


def test_a_knob_fitted_for_a_size_budget_holds_for_the_cache_it_left():
    """`--budget 12GiB` leaves the fit (its profile's 4,096-token KV margin) another expert cache than a run
    (its own margin): DynaExq's n_hi fitted 1 where the run's cache held 16, kept because the text matched."""
    from moetool.policies import POLICIES
    from moetool.policies.knobs import stale_fitted

    sized = {"n_hi": Sizing("1GiB", 1000, {"b_hi": 16, "b_lo": 4})}
    fitted = {"n_hi": 1}

    def drops(cache):
        return stale_fitted(POLICIES["dynaexq"], {}, fitted, sized, lambda b: True, "1GiB", cache_bytes=cache)

    assert drops(1000) == {} and drops(1050) == {}  # within 10%: a GB budget's margins differ by MB
    assert drops(5000) == {"n_hi": "sized for the expert cache --budget 1GiB left the fit (1000 B), and this run's is "
                                   "4.9 KiB"}
    # and the fit says so when it sizes for a size
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        prof = synthetic_profile().save(Path(d) / "s.profile.json")
        warned = fit(FitConfig(profile=prof, budget="1GiB")).evidence["warnings"]
    assert any(w.startswith("--budget 1GiB is a size: the fit plans the profile's KV margin (up to 4,096 tokens)") for w in warned)
    shares = {"n_hi": Sizing("25%", 1000, {"b_hi": 16, "b_lo": 4})}  # a share: the same share of the experts
    assert stale_fitted(POLICIES["dynaexq"], {}, fitted, shares, lambda b: True, "25%", cache_bytes=5000) == {}



def test_fate_evals_at_two_expert_caches_fit_no_p(tmp_path):
    """Fate's INT4 cache holds more experts at a larger budget, and a held expert runs at INT4, not INT2:
    at one p the demo scored 33.609 at 25% and 33.545 at 50%. p = 0 at 25% beside p = 0.25 at 50% fitted
    p from that difference, without a word."""
    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    evals = []
    for p, ppl, cache in ((0.0, 33.545, 8 << 20), (0.25, 33.545, 16 << 20)):
        e = dataclasses.replace(synthetic_eval("fate", {"p": p}, {"ppl": ppl}), task="ppl",
                                budget={"cache_bytes": cache})
        evals.append(e.save(tmp_path / f"fate{p}.eval.json"))
    result = fit(FitConfig(profile=prof, runs=tuple(evals), max_loss=0.001))
    assert "p" not in result.params.get("fate", {})
    assert f"expert cache {8 << 20} B / expert cache {16 << 20} B" in result.evidence["skipped"]["fate.p"]
    same = [dataclasses.replace(synthetic_eval("fate", {"p": p}, {"ppl": v}), task="ppl",
                                budget={"cache_bytes": 8 << 20}).save(tmp_path / f"same{p}.eval.json")
            for p, v in ((0.0, 33.545), (0.25, 33.609))]
    assert fit(FitConfig(profile=prof, runs=tuple(same), max_loss=0.001)).params["fate"]["p"] == 0.0


def test_one_run_given_twice_is_one_point_of_t_alpha(tmp_path):
    """SMoE's T(alpha) took a run given twice (or a copy of it) as two points: the curve weighted and its
    degree's fit looking better than it is. It is read once, and said."""
    import shutil

    prof = synthetic_profile().save(tmp_path / "s.profile.json")
    runs = [synthetic_run("smoe", {"alpha": a}, t).save(tmp_path / f"smoe{a}.run.json")
            for a, t in ((0.0, 0.010), (0.2, 0.008), (0.4, 0.007))]
    copy = shutil.copy(runs[1], tmp_path / "copy.run.json")
    once = fit(FitConfig(profile=prof, runs=tuple(runs), target_tpot=0.009))
    twice = fit(FitConfig(profile=prof, runs=(*runs, runs[1], copy), target_tpot=0.009))
    assert twice.evidence["smoe"]["alpha"]["points"] == once.evidence["smoe"]["alpha"]["points"]
    assert twice.params["smoe"] == once.params["smoe"]
    assert f"{copy} is the same artifact as {runs[1]}; it is read once." in twice.evidence["warnings"]

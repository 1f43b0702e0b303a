"""The fit stage: policy knobs from a profile (and runs), each with the evidence it came from.

- SMoE `alpha` (eq. 5): a polynomial T(alpha) of degree <= 3, chosen by leave-one-out residual, fitted
  to (alpha, mean TPOT) of `smoe` runs (given, or swept here on the sim clock); the smallest alpha on
  the fitted curve with T(alpha) <= R;
- Fate `L` (§4.4): the shallowest MoE depth after which per-layer decode prefetch recall stays at or
  above a threshold; `n` = T / t_expert (§4.3) from the profile's timings; `p` (§4.5): the largest
  INT2 share whose loss stays within `max_loss`, scanning shares upward and stopping at the first
  that exceeds it (from fate eval artifacts at several p if given, else the profile's perplexity);
- DyMoE `lam` (eq. 4) for a target mean retention r, or for the r a memory budget allows, with the
  r(l) and t_l table (eq. 4-5);
- DynaExq `n_hi` (§3.1): high-precision experts per layer that the budget holds beside every expert
  at low precision and the reserved non-expert memory.

    result = fit(FitConfig(profile=Path("demo.profile.json"), runs=(Path("a0.run.json"), ...), target_tpot=0.05))
    result.params["smoe"]["alpha"], result.evidence["smoe"]["alpha"]["coefficients"]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moetool.artifacts import read_json, sha256_file
from moetool.errors import MoetoolError
from moetool.evaluate import Eval
from moetool.policies.dymoe import critical_count, retention, solve_lambda
from moetool.policies.fate import transfer_n
from moetool.profile import Profile
from moetool.run import Fit, Run, RunConfig
from moetool.spec import check_budget

ALPHAS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)  # SMoE §VI-B explores 0.25-0.35; the sweep brackets it
GRID_POINTS = 101
FATE_BITS = (4, 2)  # cache / low precision (Fate §4.5)
DYMOE_BITS = (4, 2)  # "4/2"
DYNAEXQ_BITS = (16, 4)  # DynaExq's defaults (b_hi, b_lo)
RETENTION_FLOOR = 0.5  # the cosine schedule's mean at lam = 0 (eq. 4)
SWEEP_TOKENS = 16  # tokens per smoe run of the alpha sweep: enough decode steps for a mean TPOT


@dataclass(frozen=True, kw_only=True)
class FitConfig:
    profile: Path
    runs: tuple[Path, ...] = ()  # run artifacts (smoe at several alpha) and eval artifacts (fate at several p)
    # Run smoe at `alphas` instead of (or beside) given runs: this config's engine, prompts and tokens,
    # with the sweep's own policy (smoe at each alpha) and clock (sim); its model defaults to the profile's.
    sweep: RunConfig | None = None
    alphas: tuple[float, ...] = ALPHAS
    target_tpot: float | None = None  # R of SMoE eq. 5, seconds
    max_loss: float = 0.01  # Fate p: relative loss allowed (1% in §4.5)
    l_threshold: float = 0.7  # Fate L: decode prefetch recall every deeper layer keeps (Fate reports 77-79% mean)
    r: float = 0.75  # DyMoE target mean retention (§6.2's default), used without a budget
    budget: str | None = None  # device budget (12GiB) or expert cache share (25%), for DyMoE and DynaExq

    def check(self) -> None:
        """Refuse in one sentence, before the profile is read, values no fit could use."""
        if not (math.isfinite(self.max_loss) and self.max_loss >= 0):
            raise MoetoolError(f"--max-loss is a relative loss, 0 or more (0.01 = 1%), not {self.max_loss:g}.")
        if not 0 <= self.l_threshold <= 1:
            raise MoetoolError(f"--l-threshold is a recall between 0 and 1, not {self.l_threshold:g}.")
        if not RETENTION_FLOOR <= self.r <= 1:
            raise MoetoolError(f"--r is a mean retention between {RETENTION_FLOOR:g} (the cosine schedule's floor, "
                               f"DyMoE eq. 4) and 1, not {self.r:g}.")
        if self.target_tpot is not None and not (math.isfinite(self.target_tpot) and self.target_tpot > 0):
            raise MoetoolError(f"--target-tpot must be more than 0 seconds, not {self.target_tpot:g}.")
        if self.budget is not None:
            check_budget(self.budget)
        if self.sweep is not None:
            if not self.alphas or not all(0 <= a <= 1 for a in self.alphas):
                raise MoetoolError(f"--alphas are SMoE thresholds between 0 and 1, not "
                                   f"{', '.join(f'{a:g}' for a in self.alphas) or 'none'}.")
            check_budget(self.sweep.budget, "--sweep-budget")
            self.sweep_run(self.sweep.model, 0.0).check()

    def sweep_run(self, model: str | None, alpha: float) -> RunConfig:
        """The smoe run of the sweep at `alpha`."""
        return dataclasses.replace(self.sweep, model=model, policy="smoe", settings={"alpha": str(alpha)}, clock="sim")


# -- SMoE eq. 5 ------------------------------------------------------------------------------------


def fit_polynomial(x: list[float], y: list[float], max_degree: int = 3) -> dict[str, Any]:
    """numpy.polyfit of the degree (<= max_degree) with the smallest leave-one-out RMSE (ties: lower)."""
    x_arr, y_arr = np.asarray(x, float), np.asarray(y, float)
    n = len(x_arr)
    distinct = len(set(x_arr.tolist()))
    if n == 0:
        raise MoetoolError("no (alpha, TPOT) points to fit.")
    loo: dict[str, float] = {}
    for d in range(0, min(max_degree, distinct - 1, n - 2) + 1):
        errs = []
        for i in range(n):
            keep = np.arange(n) != i
            coef = np.polyfit(x_arr[keep], y_arr[keep], d)
            errs.append(float(np.polyval(coef, x_arr[i]) - y_arr[i]))
        loo[str(d)] = float(np.sqrt(np.mean(np.square(errs))))
    best = min(loo.values()) if loo else 0.0
    # Ties (within rounding: exact data fits every degree above its own) go to the lower degree.
    degree = next((d for d in loo if loo[d] <= best * (1 + 1e-6) + 1e-12 * (1 + float(np.abs(y_arr).max()))), "0")
    coef = np.polyfit(x_arr, y_arr, int(degree))
    return {"degree": int(degree), "coefficients": [float(c) for c in coef], "loo_rmse": loo,
            "residuals": [float(r) for r in y_arr - np.polyval(coef, x_arr)]}


def choose_alpha(coefficients: list[float], lo: float, hi: float, target: float | None) -> dict[str, Any]:
    """Smallest alpha in [lo, hi] whose fitted T(alpha) <= target (SMoE eq. 5), on a 101-point grid."""
    grid = np.linspace(lo, hi, GRID_POINTS)
    pred = np.polyval(coefficients, grid)
    out: dict[str, Any] = {"grid": [float(a) for a in grid], "predicted": [float(t) for t in pred],
                           "target_tpot": target, "alpha": None, "feasible": None}
    if target is None:
        return out
    ok = np.nonzero(pred <= target)[0]
    if len(ok):
        out.update(alpha=float(grid[ok[0]]), feasible=True)
    else:  # no alpha meets R: the fastest one, flagged
        out.update(alpha=float(grid[int(np.argmin(pred))]), feasible=False)
    return out


# -- Fate ------------------------------------------------------------------------------------------


def boundary_L(accuracy: list[float | None], threshold: float) -> int:
    """Fate §4.4: MoE layers before the first depth from which every layer's accuracy is >= threshold.

    accuracy[j] is the prefetch recall of MoE layer j (None for the first, which has no predictor and
    so always counts as shallow).
    """
    L = len(accuracy)
    for j in range(len(accuracy) - 1, -1, -1):
        if accuracy[j] is None or accuracy[j] < threshold:
            break
        L = j
    return L


def int2_share(losses: dict[float, float], max_loss: float) -> float:
    """Fate §4.5's heuristic search: scan shares upward, keep the last one whose loss <= max_loss."""
    best = 0.0
    for p in sorted(losses):
        if losses[p] > max_loss:
            break
        best = p
    return best


# -- DyMoE and DynaExq -----------------------------------------------------------------------------


def dymoe_schedule(r: float, L: int, M: int) -> tuple[float, list[dict[str, float]]]:
    """(lam, rows of {position, r, t}) for mean retention r over L MoE layers of M experts (eq. 4-5)."""
    lam = solve_lambda(r, L)
    return lam, [{"position": l, "r": retention(l, L, lam), "t": critical_count(retention(l, L, lam), M)}
                 for l in range(L)]


def cache_bytes(budget: str, info) -> int:
    """Device bytes left for experts, split as the engine splits a budget (`engine.budget.split_budget`)."""
    from moetool.engine.budget import split_budget

    plan = split_budget(budget, n_experts=len(info.moe_layers) * info.num_experts,
                        expert_bytes=info.expert_bytes,
                        non_expert_bytes=info.non_expert_bytes, margin_bytes=info.kv_margin_bytes)
    return plan.cache_bytes


def budget_retention(cache: int, info, high: int, low: int) -> float:
    """The mean retention at which every expert fits on the device, a share r at `high` bits and the
    rest at `low` (0: not stored): L E (r b_hi + (1 - r) b_lo) <= cache."""
    n = len(info.moe_layers) * info.num_experts
    hb, lb = info.expert_bytes[high], info.expert_bytes[low] if low else 0
    return float(min(1.0, max(0.0, (cache / n - lb) / (hb - lb))))


def dynaexq_n_hi(cache: int, info, hi: int, lo: int) -> int:
    """DynaExq §3.1 budget initialization, as the policy computes it (`policies.dynaexq.budget_n_hi`)."""
    from moetool.policies.dynaexq import budget_n_hi

    return budget_n_hi(cache, len(info.moe_layers), info.num_experts, info.expert_bytes[lo],
                       info.expert_bytes[hi])


# -- the stage -------------------------------------------------------------------------------------


def primary_metric(metrics: dict[str, Any]) -> tuple[str, float, bool] | None:
    """(name, value, higher is better) of an eval's headline number: accuracy first, else perplexity."""
    flat: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            flat[k] = float(v)
        elif isinstance(v, dict):
            flat.update({f"{k}.{kk}": float(vv) for kk, vv in v.items() if isinstance(vv, (int, float))})
    for key in ("accuracy", "acc", "acc_norm", "mean_accuracy", "perplexity", "ppl"):
        for name, value in flat.items():
            if name == key or name.endswith("." + key):
                return name, value, key not in ("perplexity", "ppl")
    return None


def fit(cfg: FitConfig, progress: Callable[[str, int, int], None] | None = None) -> Fit:
    cfg.check()
    prof = Profile.load(Path(cfg.profile))
    inputs = {str(cfg.profile): sha256_file(Path(cfg.profile))}
    runs, evals = [], []
    for path in cfg.runs:
        if _schema(Path(path)) == "eval":
            evals.append((str(path), Eval.load(Path(path), model=prof.model)))
        else:
            runs.append((str(path), Run.load(Path(path), model=prof.model)))
        inputs[str(path)] = sha256_file(Path(path))
    params: dict[str, dict[str, Any]] = {}
    ev: dict[str, Any] = {"warnings": [], "skipped": {}}
    _fit_smoe(cfg, prof, runs, params, ev, progress)
    _fit_fate(cfg, prof, evals, params, ev)
    _fit_dymoe_dynaexq(cfg, prof, params, ev)
    return Fit(model=prof.model, inputs=inputs, params=params, evidence=ev)


def _schema(path: Path) -> str | None:
    """The schema an artifact file names (None when unreadable: `Run.load` then says why in one sentence)."""
    try:
        data = read_json(path)  # bounded: a FIFO or /dev/zero named like a run is refused, not read forever
    except MoetoolError:
        return None
    return data.get("schema") if isinstance(data, dict) else None


def _fit_smoe(cfg: FitConfig, prof: Profile, runs: list, params: dict, ev: dict, progress) -> None:
    points = [(float(r.params["alpha"]), float(r.tpot_s["mean"]), path) for path, r in runs
              if r.policy == "smoe" and r.tpot_s and "alpha" in r.params]
    setting = {f"{r.clock}/{r.hw}/{r.budget_bytes}" for _, r in runs if r.policy == "smoe"}
    if len(setting) > 1:
        ev["warnings"].append(f"smoe runs mix clocks, hardware or budgets ({', '.join(sorted(setting))}).")
    if cfg.sweep is not None:
        from moetool.model import load_config, model_fingerprint, resolve_source
        from moetool.run import run

        source = resolve_source(cfg.sweep.model or prof.model.source)
        if not model_fingerprint(load_config(source), source).same_model(prof.model):
            raise MoetoolError(f"--model {source} is not the model {cfg.profile} was made for ({prof.model.source}).")
        for i, a in enumerate(cfg.alphas):
            r = run(cfg.sweep_run(source, a))
            points.append((float(a), float(r.tpot_s["mean"]), f"sweep alpha={a:g}"))
            if progress:
                progress("sweep", i + 1, len(cfg.alphas))
        sw = cfg.sweep
        setting_note = f"sweep: sim clock on {sw.hw}, budget {sw.budget}, {sw.max_new_tokens} tokens"
    else:
        setting_note = "runs"
    if len({a for a, _, _ in points}) < 2:
        ev["skipped"]["smoe.alpha"] = "needs smoe runs at two or more alphas (--runs) or --sweep"
        return
    x, y = [p[0] for p in points], [p[1] for p in points]
    poly = fit_polynomial(x, y)
    choice = choose_alpha(poly["coefficients"], min(x), max(x), cfg.target_tpot)
    ev["smoe"] = {"alpha": {**poly, **choice, "points": [list(p) for p in points], "tpot": "tpot_s.mean",
                            "from": setting_note, "rule": "SMoE eq. 5: smallest alpha with fitted T(alpha) <= R"}}
    if choice["alpha"] is None:
        ev["warnings"].append("no --target-tpot: T(alpha) is fitted but alpha is not chosen.")
        return
    if not choice["feasible"]:
        ev["warnings"].append(f"no alpha in [{min(x):g}, {max(x):g}] meets TPOT {cfg.target_tpot:g} s; "
                              f"chose the fastest, alpha={choice['alpha']:.3f}.")
    alpha = measured_guard(choice["alpha"], points, cfg.target_tpot)
    if alpha != choice["alpha"]:
        ev["smoe"]["alpha"]["guarded"] = alpha
        ev["warnings"].append(f"the degree-{poly['degree']} T(alpha) chose alpha={choice['alpha']:.3f}, but the runs "
                              f"measured around it put T above R = {cfg.target_tpot:g} s; alpha={alpha:g}, the smallest "
                              "measured alpha that meets R, is used instead.")
    params["smoe"] = {"alpha": round(alpha, 4)}


def measured_guard(alpha: float, points: list[tuple[float, float, Any]], target: float) -> float:
    """Our addition to SMoE eq. 5: never choose an alpha the measurements contradict.

    The paper fits a polynomial T(alpha) and takes the smallest alpha with T(alpha) <= R. When TPOT
    is a step in alpha (a near-uniform router: any alpha > 0 substitutes almost every miss), the
    best polynomial by leave-one-out is flat and can choose an alpha that was measured slower than
    R. So the choice is checked against the runs themselves, interpolated linearly between measured
    alphas (mean TPOT where one alpha was run more than once): if they put it above R, the smallest
    measured alpha that met R is taken instead; otherwise the polynomial's choice stands.
    """
    by_alpha: dict[float, list[float]] = {}
    for a, t, _ in points:
        by_alpha.setdefault(float(a), []).append(float(t))
    xs = sorted(by_alpha)
    measured = float(np.interp(alpha, xs, [float(np.mean(by_alpha[a])) for a in xs]))
    meets = [a for a in xs if np.mean(by_alpha[a]) <= target]
    if measured > target * (1 + 1e-9) and meets:
        return meets[0]
    return alpha


def _fit_fate(cfg: FitConfig, prof: Profile, evals: list, params: dict, ev: dict) -> None:
    fate: dict[str, Any] = {}
    info = prof.info
    if prof.prefetch is not None:
        recall = {lp.layer: lp.recall_topk.get("decode", lp.recall_topk.get("prefill")) for lp in prof.prefetch.layers}
        acc = [recall.get(layer) for layer in info.moe_layers]
        L = boundary_L(acc, cfg.l_threshold)
        fate["L"] = {"value": L, "threshold": cfg.l_threshold, "accuracy": acc,
                     "from": "profile.prefetch.layers[].recall_topk.decode (next router on this gate input)"}
    else:
        ev["skipped"]["fate.L"] = "the profile has no prefetch part (--what prefetch)"
    if prof.timing is not None and (prof.timing.h2d_gbps or (prof.hw or {}).get("h2d_gbps")):
        t = prof.timing
        window = sum(x.t_moe + x.t_attn + x.t_gate for x in t.layers) / max(1, len(t.layers))
        h2d = t.h2d_gbps or (prof.hw or {}).get("h2d_gbps")
        latency = (prof.hw or {}).get("copy_latency_s", 0.0)
        nbytes = info.expert_bytes[FATE_BITS[0]]
        t_io = nbytes / (h2d * 1e9) + latency
        fate["n"] = {"value": transfer_n(window, t_io, info.num_experts), "T_s": window, "t_expert_s": t_io,
                     "expert_bytes": nbytes, "bits": FATE_BITS[0], "h2d_gbps": h2d,
                     "from": f"profile.timing.layers (T = t_moe + t_attn + t_gate, decode, measured on {t.device}); "
                             f"t_expert = INT4 blob / h2d ({'measured' if t.h2d_gbps else 'hw preset ' + str(prof.settings.get('hw_base'))})"}
    else:
        ev["skipped"]["fate.n"] = "the profile has no timing part with a host-to-device bandwidth (--what timing)"
    by_p = {}
    for path, e in evals:
        m = primary_metric(e.metrics)
        if e.policy == "fate" and m and "p" in e.params:
            by_p[float(e.params["p"])] = (m, path)
    if len(by_p) >= 2 and 0.0 in by_p:
        (name, base, higher), _ = by_p[0.0]
        losses = {p: ((base - v) / base if higher else (v - base) / base) for p, ((_, v, _), _) in by_p.items()}
        fate["p"] = {"value": int2_share(losses, cfg.max_loss), "max_loss": cfg.max_loss,
                     "losses": {f"{p:g}": v for p, v in losses.items()}, "metric": name, "from": [path for _, path in by_p.values()]}
    elif prof.sensitivity is not None and prof.sensitivity.int2_share:
        curve = {float(k): v for k, v in prof.sensitivity.int2_share.items()}
        base = curve.get(0.0)
        losses = {p: (v - base) / base for p, v in curve.items()} if base else {}
        fate["p"] = {"value": int2_share(losses, cfg.max_loss), "max_loss": cfg.max_loss,
                     "losses": {f"{p:g}": v for p, v in losses.items()}, "metric": "held-out perplexity",
                     "from": "profile.sensitivity.int2_share (INT4 cache, least popular share at INT2)"}
    else:
        ev["skipped"]["fate.p"] = "needs fate eval artifacts at p=0 and another p, or a profile with sensitivity"
    if fate:
        params["fate"] = {k: v["value"] for k, v in fate.items()}
        ev["fate"] = fate


def _fit_dymoe_dynaexq(cfg: FitConfig, prof: Profile, params: dict, ev: dict) -> None:
    info = prof.info
    L, E = len(info.moe_layers), info.num_experts
    r, how = cfg.r, "--r (target mean retention)"
    cache = cache_bytes(cfg.budget, info) if cfg.budget else None
    if cache is not None and all(b in info.expert_bytes for b in DYMOE_BITS):
        r = budget_retention(cache, info, *DYMOE_BITS)
        how = (f"--budget {cfg.budget}: the largest r at which every expert fits, r of them at INT4 and the rest "
               f"at INT2 ({cache} bytes for experts after profile.info's reserved memory)")
        if r < RETENTION_FLOOR:
            ev["warnings"].append(f"the budget allows a retention of only {r:.3f}; the cosine schedule needs >= 0.5, "
                                  "so r = 0.5 (the budget will not hold every expert).")
            r = RETENTION_FLOOR
    lam, table = dymoe_schedule(r, L, info.top_k)
    params["dymoe"] = {"r": round(r, 4), "lam": round(lam, 4)}
    ev["dymoe"] = {"r": {"value": r, "from": how},
                   "lam": {"value": lam, "r": r, "from": f"r = {r:.4f} via eq. 4", "M": info.top_k, "schedule": table,
                           "rule": "DyMoE eq. 4 mean over MoE layers = r; t_l = ceil(r(l) M) (eq. 5), M = top-k"}}
    if cache is None:
        ev["skipped"]["dynaexq.n_hi"] = "needs --budget"
        return
    hi, lo = DYNAEXQ_BITS
    n_hi = dynaexq_n_hi(cache, info, hi, lo)
    if cache < L * E * info.expert_bytes[lo]:
        ev["warnings"].append(f"--budget {cfg.budget} cannot hold every expert at {lo} bits: DynaExq will refuse it.")
    params["dynaexq"] = {"n_hi": n_hi}
    ev["dynaexq"] = {"n_hi": {"value": n_hi, "cache_bytes": cache, "b_hi": hi, "b_lo": lo,
                              "expert_bytes": {str(b): n for b, n in info.expert_bytes.items()}, "reserved": {
                                  "non_expert": info.non_expert_bytes, "kv_margin": info.kv_margin_bytes,
                                  "staging": info.staging_bytes},
                              "from": f"--budget {cfg.budget}, profile.info ({info.expert_bytes_source})",
                              "rule": "DynaExq §3.1: (cache - L E b_lo) // b_hi // L, at most E"}}


__all__ = ["Fit", "FitConfig", "fit"]

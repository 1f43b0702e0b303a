"""SMoE's alpha fit (eq. 5): a low-degree polynomial T(alpha) through smoe runs at several alphas, the
smallest alpha on it with T(alpha) <= R, checked against the runs, and its figure. `SMoE.fit` calls it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from moetool.errors import MoetoolError

ALPHAS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)  # the fit's sweep: §VI-B runs at 0.25-0.35 (Table IV 0-0.6); brackets it
GRID_POINTS = 101  # alphas at which eq. 5 reads the fitted T(alpha)


def fit_polynomial(x: list[float], y: list[float], max_degree: int = 3) -> dict[str, Any]:
    """numpy.polyfit of the degree (<= max_degree) with the smallest leave-one-out RMSE (ties: lower).

    The paper fits "a low-degree polynomial" T(alpha) without a degree (§V-C); leave-one-out picks one
    the points support. What is left out is one alpha with all its runs (the same as one point when
    no alpha repeats), so every fold still has d + 1 distinct alphas for a degree d <= distinct - 2.
    With two distinct alphas no degree above 0 can be checked that way: the fit is then the line
    through them, §V-C's observation that TPOT "generally decreases linearly with the value of alpha"
    (a constant would make eq. 5's search answer the lower end, or nothing, whatever the runs say).
    """
    x_arr, y_arr = np.asarray(x, float), np.asarray(y, float)
    n = len(x_arr)
    alphas = sorted(set(x_arr.tolist()))
    distinct = len(alphas)
    if n == 0:
        raise MoetoolError("no (alpha, TPOT) points to fit.")
    loo: dict[str, float] = {}
    for d in range(min(max_degree, distinct - 2) + 1):
        errs: list[float] = []
        for a in alphas:
            out = x_arr == a
            coef = np.polyfit(x_arr[~out], y_arr[~out], d)
            errs.extend((np.polyval(coef, x_arr[out]) - y_arr[out]).tolist())
        loo[str(d)] = float(np.sqrt(np.mean(np.square(errs))))
    if distinct == 2:
        degree = "1"  # the line through the two alphas (see above)
    else:
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


def measured_guard(alpha: float, points: list[tuple[float, float, Any]], target: float) -> tuple[float, bool]:
    """Our addition to SMoE eq. 5: never choose an alpha the measurements contradict.

    The paper fits a polynomial T(alpha) and takes the smallest alpha with T(alpha) <= R. When TPOT
    is a step in alpha (a near-uniform router: any alpha > 0 substitutes almost every miss), the
    best polynomial by leave-one-out is flat and can choose an alpha that was measured slower than
    R. So the choice is checked against the runs themselves: T falls as alpha grows (more
    substitution, fewer loads), so if the first measured alpha at or above the choice (mean TPOT
    where one alpha was run more than once) was slower than R, so is the choice, and the smallest
    measured alpha that met R is taken instead. Otherwise the polynomial's choice stands: between
    two measured alphas the runs say nothing against it (a line between them would, wherever T is
    convex, and would replace the paper's choice by the next measured alpha where every run lies on
    the fitted curve). Returns the alpha and whether the runs say it meets R: where the run at or above
    the choice was slower than R and no run met it, the fitted curve's "feasible" was under every
    measurement (runs flat within 1% around R: the intercept sat 0.1% below the one at alpha = 0, which
    `run --fit` then reproduced over R, unsaid), and the choice stands flagged as not meeting R.
    """
    by_alpha: dict[float, list[float]] = {}
    for a, t, _ in points:
        by_alpha.setdefault(float(a), []).append(float(t))
    xs = sorted(by_alpha)
    at_or_above = next((a for a in xs if a >= alpha - 1e-12), xs[-1])
    meets = [a for a in xs if np.mean(by_alpha[a]) <= target]
    if float(np.mean(by_alpha[at_or_above])) > target * (1 + 1e-9):
        return (meets[0], True) if meets else (alpha, False)
    return alpha, True


def alpha_figure(a: dict[str, Any], path: Path) -> Path:
    """Eq. 5 as fitted: the measured (alpha, TPOT) points, T(alpha), R and the chosen alpha."""
    from moetool.figures import save, subplots

    fig, ax = subplots(figsize=(6, 4))
    pts = np.array([p[:2] for p in a["points"]], float)
    ax.plot(pts[:, 0], pts[:, 1] * 1e3, "o", label="measured TPOT")
    ax.plot(a["grid"], np.array(a["predicted"]) * 1e3, "-", label=f"degree-{a['degree']} fit (LOO)")
    if a.get("target_tpot") is not None:
        ax.axhline(a["target_tpot"] * 1e3, color="gray", ls=":", label=f"R = {a['target_tpot'] * 1e3:.3g} ms")
    if a.get("guarded") is not None:  # the fitted knob: the runs overruled the polynomial's choice
        ax.axvline(a["alpha"], color="gray", ls="--", label=f"T(alpha)'s choice = {a['alpha']:.3f} (measured above R)")
        ax.axvline(a["guarded"], color="red", ls="--", label=f"chosen alpha = {a['guarded']:.3f}")
    elif a.get("alpha") is not None:
        ax.axvline(a["alpha"], color="red", ls="--", label=f"chosen alpha = {a['alpha']:.3f}")
    ax.set(xlabel="alpha (SMoE substitution threshold)", ylabel="mean TPOT (ms)", title="T(alpha) (SMoE eq. 5)")
    ax.legend(fontsize=8)
    return save(fig, path)

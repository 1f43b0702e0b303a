"""SMoE's knobs, how `moetool fit` sets alpha (eq. 5, from `smoe_fit.py`), and its part of the report
(Fig. 4, T(alpha), §VI-B's claim); its engine half (Algorithms 1-2, eq. 3, the prefetch) is `smoe.py`.

    SMoEKnobs.Params(alpha=0.25).window     # 3: eq. 3's n, Fig. 6's reuse horizon
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from moetool.policies.knobs import Knobs, Params, register
from moetool.policies.smoe_fit import alpha_figure, choose_alpha, fit_polynomial, measured_guard
from moetool.policies.stages import FitInputs, Fitted, ReportInputs, Section, differences


@dataclass(frozen=True)
class AlphaEvidence:
    """What the report draws of a fit's alpha (`alpha_figure`): the measured points, the fitted curve."""

    points: tuple[tuple[float, float, str], ...]  # (alpha, mean TPOT, where it was measured)
    grid: tuple[float, ...]
    predicted: tuple[float, ...]  # T(alpha) on `grid`
    degree: int
    target_tpot: float | None = None
    alpha: float | None = None

    def validate(self) -> None:
        from moetool.schema import SchemaError

        if not self.points:
            raise SchemaError("points", "is empty; T(alpha) is fitted through measured points")
        if len(self.grid) != len(self.predicted):
            raise SchemaError("predicted", f"holds T(alpha) at {len(self.predicted)} alphas, not one per grid alpha "
                                           f"({len(self.grid)})")


@register("smoe")
class SMoEKnobs(Knobs):
    """SMoE's knobs (Algorithm 1's alpha, eq. 3's window, Algorithm 2's rule), its fit and its report."""

    evidence = {"alpha": AlphaEvidence}
    applies = {"window": ("eviction", lambda v: v == "score", "eviction=score (eq. 3's window of scores)"),
               "cpu_rule": ("cpu_assist", bool, "cpu_assist=true (Algorithm 2 picks the CPU's experts)")}
    sized = ("alpha",)  # eq. 5's T(alpha) is one budget's and one machine's

    @dataclass(frozen=True)
    class Params(Params):
        alpha: float = 0.3  # substitution threshold (§VI-B sets 0.25-0.35 per setting; fit it with eq. 5)
        # eq. 3's n: the mean runs over iterations max(1, j-n) .. j, up to n + 1 of them. The paper gives
        # no n; 3 is Fig. 6's reuse horizon. (Renamed: a fit's `n` is Fate's transfer count.)
        window: int = 3
        bits: int = 16  # SMoE runs unquantized experts
        eviction: str = "score"  # eq. 3; any name in EVICTIONS
        prefetcher: str = "smoe"  # "smoe" (top-score), "fate" (75th percentile, n cap) or "none"
        cpu_assist: bool = True  # Algorithm 2; off: every miss is loaded
        cpu_rule: str = "alg2"  # "alg2" (the printed two-pointer loop) or "eq4" (eq. 4's exact minimum)

        def __post_init__(self) -> None:
            # The paper bounds alpha nowhere (Table IV: 0-0.6). At alpha = 1, R = (1 - alpha) S_{k+1} = 0:
            # any usable inactive expert would substitute however low its score, not the "comparable"
            # one of §IV-A's C3, so 1 is refused (as `moetool fit --alphas` refuses it, `fit.py`).
            if not 0.0 <= self.alpha < 1.0 or self.window < 0:
                raise ValueError("alpha must be in [0, 1) and window >= 0")
            if self.cpu_rule not in ("alg2", "eq4"):
                raise ValueError(f"cpu_rule must be 'alg2' or 'eq4', not '{self.cpu_rule}'")
            if self.prefetcher not in ("smoe", "fate", "none"):
                raise ValueError(f"prefetcher must be 'smoe', 'fate' or 'none', not '{self.prefetcher}'")

    # -- fit and report --------------------------------------------------------------------------
    @classmethod
    def fit(cls, inputs: FitInputs) -> Fitted:
        """Eq. 5: a polynomial T(alpha) through (alpha, mean TPOT) of smoe runs (given, or swept at
        `config.alphas`), then the smallest alpha on it with T(alpha) <= R (`--target-tpot`),
        checked against the runs themselves (`measured_guard`)."""
        cfg, out = inputs.config, Fitted()
        mine = [(path, r) for path, r in inputs.runs if r.policy == cls.name and "alpha" in r.params]
        untimed = [path for path, r in mine if not r.tpot_s]  # a run of one token: no decode step timed
        mine = [(path, r) for path, r in mine if r.tpot_s]
        source = "runs"
        if inputs.sweep is not None:
            for i, a in enumerate(cfg.alphas):
                mine.append((f"sweep alpha={a:g}", inputs.sweep({"alpha": str(a)})))
                if inputs.progress:
                    inputs.progress("sweep", i + 1, len(cfg.alphas))
            source = inputs.sweep_note
        # Eq. 5's T(alpha) is one setting's TPOT as alpha varies: runs that differ in anything else (the
        # clock, the hardware, the budget, another knob: bits, cpu_assist...) are not points of one curve.
        differ = differences([_setting(r) for _, r in mine])
        if differ:
            runs = "the smoe runs given and swept" if inputs.sweep is not None and len(mine) > len(cfg.alphas) \
                else "the smoe runs"
            why = f"{runs} differ in more than alpha ({differ}); T(alpha) is fitted through runs that differ only in alpha"
            out.skipped["alpha"] = why
            out.warnings.append(why + ".")
            return out
        points = [(float(r.params["alpha"]), float(r.tpot_s["mean"]), path) for path, r in mine]
        if len({a for a, _, _ in points}) < 2:
            out.skipped["alpha"] = "needs smoe runs at two or more alphas (--runs, or --sweep with two or more --alphas)" + (
                f"; {len(untimed)} run(s) given timed no decode step (one token: no TPOT), e.g. {untimed[0]}"
                if untimed else "")
            return out
        x, y = [p[0] for p in points], [p[1] for p in points]
        poly = fit_polynomial(x, y)
        choice = choose_alpha(poly["coefficients"], min(x), max(x), cfg.target_tpot)
        ev = out.evidence["alpha"] = {**poly, **choice, "points": [list(p) for p in points], "tpot": "tpot_s.mean",
                                      "from": source, "rule": "SMoE eq. 5: smallest alpha with fitted T(alpha) <= R"}
        if choice["alpha"] is None:
            out.warnings.append("no --target-tpot: T(alpha) is fitted but alpha is not chosen.")
            return out
        if not choice["feasible"]:
            out.warnings.append(f"no alpha in [{min(x):g}, {max(x):g}] meets TPOT {cfg.target_tpot:g} s; "
                                f"chose the fastest, alpha={choice['alpha']:.3f}.")
        alpha, met = measured_guard(choice["alpha"], points, cfg.target_tpot)
        if choice["feasible"] and not met:
            ev["feasible"] = False
            out.warnings.append(f"the degree-{poly['degree']} T(alpha) puts alpha={alpha:.3f} at or under TPOT "
                                f"{cfg.target_tpot:g} s, but no run met it (the one at or above it measured "
                                f"more); alpha={alpha:.3f} is used, not meeting R.")
        elif alpha != choice["alpha"]:
            ev["guarded"] = alpha
            out.warnings.append(f"the degree-{poly['degree']} T(alpha) chose alpha={choice['alpha']:.3f}, but the runs "
                                f"measured around it put T above R = {cfg.target_tpot:g} s; alpha={alpha:g}, the smallest "
                                "measured alpha that meets R, is used instead.")
        out.knobs["alpha"] = round(alpha, 4)
        # T(alpha) is one budget's and one machine's, at the knobs its runs ran (they differ in alpha
        # alone, above): a run elsewhere takes the paper's alpha (`knobs.stale_fitted`).
        ev["sized_for"] = sized = _sized_for(cls, inputs, mine[0][1])
        if "costs" not in sized and mine[0][1].clock == "sim":
            out.warnings.append("the smoe runs' hardware profile could not be read, so a run on another machine's "
                                "costs would take the fitted alpha; give the runs' --hw where fit can read it.")
        return out

    @classmethod
    def report(cls, inputs: ReportInputs) -> Section:
        """Fig. 4 (gate scores of selected vs unselected experts) per profile, T(alpha) per fit, and
        §VI-B's claim: substitution at alpha = 0.3 costs little quality."""
        part = Section()
        for path, prof in inputs.profiles:
            if prof.routing:
                fig = inputs.out_dir / f"gate_scores{inputs.tag(path)}.png"
                part.figures.append(_gate_scores_figure(prof.routing, fig))
        for path, f in inputs.fits:
            if f.evidence.get(cls.name, {}).get("alpha"):
                part.figures.append(alpha_figure(f.evidence[cls.name]["alpha"],
                                                 inputs.out_dir / f"alpha_tpot{inputs.tag(path)}.png"))
        # both on the bf16 experts: a resident eval of INT2 experts is no baseline for substitution's cost
        if pair := inputs.ppl_pair((cls.name, {"alpha": 0.3, "bits": 16}), ("resident", {"bits": 16})):
            smoe, resident = pair
            a, b = smoe["metrics"]["ppl"], resident["metrics"]["ppl"]
            d = a / b - 1
            part.claims.append(["SMoE alpha = 0.3 within 1% of resident", f"{a:.3f} vs {b:.3f}", f"{100 * d:+.2f}%",
                                "met" if d <= 0.01 else "not met"])
        return part


def _sized_for(cls: type[Knobs], inputs: FitInputs, run: Any) -> dict[str, Any]:
    """What the fitted alpha holds for (`knobs.Sizing`): the sweep's --budget, default knobs and --hw,
    or, for T(alpha) through given runs alone (one `_setting`, `run` one of them), their expert cache
    (a Run records bytes, not the --budget option) and knobs, and on the sim clock the copy time their
    policy decided with (`c_load`, their slots' bytes on their --hw's link; else from the profile's bytes
    and the --hw, none when that cannot be read). Runs on the wall clock name no machine to compare:
    their alpha is kept wherever the cache and knobs are the same (as a sweep's is on any machine whose
    link is the sweep's --hw's)."""
    from moetool.engine.clock import load_hw
    from moetool.errors import MoetoolError

    info, sweep = inputs.profile.info, inputs.sweep_sized
    if sweep is not None:  # the sweep ran at its own budget and --hw, and given runs must match it
        knobs = {f.name: getattr(cls.Params(), f.name) for f in fields(cls.Params) if f.name != "alpha"}
        # the cache its runs had (a size budget leaves a run another than the profile's estimate)
        cache = run.budget.get("cache_bytes", sweep["cache_bytes"])
        sized, link = {"budget": sweep["budget"], "cache_bytes": cache}, sweep["link"]
    else:
        knobs = {f.name: run.params[f.name] for f in fields(cls.Params) if f.name != "alpha" and f.name in run.params}
        sized = {"cache_bytes": run.budget.get("cache_bytes")}
        link = None
        if run.clock == "sim":
            try:
                hw = load_hw(run.hw)[0]
                link = {"h2d_gbps": hw.h2d_gbps, "copy_latency_s": hw.copy_latency_s}
            except MoetoolError:  # the runs' recorded copy time (below) still says the machine, if they have it
                pass
    sized["knobs"] = knobs
    sized["path"] = (run.summary or {}).get("path", "host")  # T(alpha) of the runs' decode step
    bits = knobs.get("bits", cls.Params().bits)
    recorded = run.params.get("c_load")  # the copy time the runs' policy decided with: their slots' bytes
    if isinstance(recorded, (int, float)) and not isinstance(recorded, bool) and recorded > 0 and run.clock == "sim":
        sized["costs"] = {f"t_load.{bits}": float(recorded)}  # a checkpoint's fp32 slot is twice the profile's bf16
    elif link is not None and bits in info.expert_bytes:
        sized["costs"] = {f"t_load.{bits}": info.expert_bytes[bits] / (link["h2d_gbps"] * 1e9) + link["copy_latency_s"]}
    return sized


def _setting(run: Any) -> dict[str, str]:
    """What a smoe run's TPOT depends on besides alpha: its clock, hardware (and on the wall clock the
    device), budget, batch, dtype, workload (the prompts, the tokens generated a prompt: routing, so hits
    and substitutions, follows them) and other knobs."""
    import hashlib

    knobs = {f.name: f"{f.name}={run.params.get(f.name)!r}" for f in fields(SMoEKnobs.Params) if f.name != "alpha"}
    prompts = hashlib.sha256("\x00".join(run.prompts).encode("utf-8", "surrogatepass")).hexdigest()[:12]
    lengths = sorted({len(t) for t in run.tokens})
    # a user's hardware profile by its content (`stages.machine`): two files named hw.json in two experiments
    # were one machine, one file reached by two paths two
    from moetool.policies.stages import machine

    hw = (machine(run.clock, run.hw, run.inputs) or "").partition("/")[2]
    return {"clock": f"{run.clock} clock", "hw": f"hw {hw}", "budget": f"budget {run.budget_bytes} B",
            "batch": f"batch {run.batch_size}", "dtype": f"dtype {run.dtype}",
            "device": f"device {run.device.split(':')[0] if run.clock == 'sim' else run.device}",
            # the decode path (the captured step runs the host half a step late, and reads misses in place) and
            # the expert cache it left (the captured plan reserves a workspace out of one budget)
            "path": f"{(run.summary or {}).get('path', 'host')} path",
            "cache": f"expert cache {(run.budget or {}).get('cache_bytes')} B",
            "prompts": f"{len(run.prompts)} prompt(s) {prompts}", "tokens": f"{'/'.join(map(str, lengths))} tokens a prompt",
            **knobs}


def _gate_scores_figure(r: Any, path: Path) -> Path:
    """Fig. 4: mean gate score by rank (shallow, middle, deep layer) and the score distribution of
    selected vs unselected experts, from the profile's routing part."""
    from moetool.figures import MaxNLocator, save, subplots

    fig, (ax, ax2) = subplots(1, 2, figsize=(11, 4))
    for i in sorted({0, len(r.layers) // 2, len(r.layers) - 1}):
        ax.plot(range(1, r.num_experts + 1), r.layers[i].mean_sorted_score, label=f"layer {r.layers[i].layer}")
    ax.axvline(r.top_k + 0.5, color="gray", ls="--", label=f"top-k = {r.top_k}")
    ax.axhline(1 / r.num_experts, color="black", lw=0.5, ls=":", label=f"uniform 1/E = {1 / r.num_experts:.3g}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="expert rank by gate score", ylabel="mean gate score (decode)", yscale="log",
           title="Mean gate score by rank")
    ax.legend()
    edges = np.array(r.score_bins)
    for name in ("selected", "unselected"):
        counts = np.array(r.score_hist[name], float)
        ax2.stairs(counts / max(1.0, counts.sum()), np.maximum(edges, 1e-5), label=f"{name} experts")
    ax2.set(xscale="log", xlabel="gate score (softmax)", ylabel="share of (token, expert) pairs",
            title="Score distribution, all layers, decode")
    ax2.legend()
    fig.suptitle("Gate scores of selected vs unselected experts (SMoE Fig. 4)")
    return save(fig, path)

"""DyMoE's knobs, its depth schedule (eq. 4-5), how `moetool fit` sets lambda, and its part of the
report (the fitted schedule, Table 3, Fig. 5, Fig. 11); its engine half is `dymoe.py`.

    schedule_table(0.75, L=4, M=2)      # (1e-06, [{"position": 0, "r": 1.0, "t": 2}, ...]): t = 2, 2, 1, 1
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from moetool.policies.dymoe_report import ablation, depth_claim, retention_figure, sensitivity_figure
from moetool.policies.knobs import Knobs, Params, parse_tiers, register
from moetool.policies.stages import FitInputs, Fitted, ReportInputs, Section, table

EPS = 1e-9  # r(l) * M is computed in floats: 0.75 * 4 must give 3, not 4
RETENTION_FLOOR = 0.5  # the cosine schedule's mean at lam = 0 (eq. 4): no share below it is kept, whatever M
R_DECIMALS = 5e-5  # half the last place of the r a fit writes (4 decimals): a share that close is the fit's


# -- depth-aware precision scheduling (§4.3) -------------------------------------------------------


def retention(l: int, L: int, lam: float) -> float:
    """DyMoE eq. 4: r(l) = (1 - lam) * (cos(pi * l / (L - 1)) + 1) / 2 + lam, l = 0 .. L-1 MoE layers."""
    x = l / (L - 1) if L > 1 else 0.0  # eq. 4 is undefined for L = 1; our choice: r(0) = 1, keep everything
    return (1.0 - lam) * (math.cos(math.pi * x) + 1.0) / 2.0 + lam


def critical_count(r_l: float, M: int) -> int:
    """DyMoE eq. 5: t_l = ceil(r(l) * M)."""
    return min(M, math.ceil(r_l * M - EPS))


def critical_share(lam: float, L: int, M: int) -> float:
    """Table 2's retention ratio r, "the average proportion of Critical experts preserved across layers",
    at `lam`: the mean over the L MoE layers of t_l / M (eq. 5). M is the experts a decode token selects
    (top-k): the step DyMoE's r is reported for. Because t_l rounds up, it exceeds the mean of r(l) where
    M is small (top-2, r(l) = 0.6 keeps both experts), and it only moves in steps of 1 / (L M)."""
    return sum(critical_count(retention(l, L, lam), M) for l in range(L)) / (L * M)


def solve_lambda(r: float, L: int, M: int) -> float:
    """The smallest lam in [0, 1] that preserves a share of at least `r` of the M selected experts,
    averaged over L layers (`critical_share`; the paper names r so and gives lam no formula). 0 when even
    lam = 0 keeps more than r (the schedule's floor: 0.73 on top-2 models of 32 layers, 0.97 on top-1
    ones, whose last layer, r = 0, keeps none);
    the caller records the share that ran. Our choice: the least lam that reaches r, as the share is a
    step function of lam (Mixtral's 32 top-2 layers at r = 0.75: lam = 1e-6, both experts critical in
    the first half's layers and one in the rest, Table 2's 0.75 exactly; at lam = 0 the last layer, r = 0,
    keeps none).
    """
    if critical_share(0.0, L, M) >= r - EPS:
        return 0.0
    lo, hi = 0.0, 1.0  # share(lo) < r <= share(hi) = 1; the share is nondecreasing in lam
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if critical_share(mid, L, M) >= r - EPS else (mid, hi)
    # a step begins where some r(l) M crosses a whole number and is reached just past it: lam is given to
    # 1e-6, rounded up onto the step (so 1e-6 where any lam above 0 reaches r, not 5e-10)
    return min(1.0, math.ceil(hi * 1e6) / 1e6)


def schedule_table(r: float, L: int, M: int) -> tuple[float, list[dict[str, float]]]:
    """(lam, rows of {position, r, t}) for a share r of critical experts over L MoE layers of M (eq. 4-5)."""
    lam = solve_lambda(r, L, M)
    return lam, [{"position": l, "r": retention(l, L, lam), "t": critical_count(retention(l, L, lam), M)}
                 for l in range(L)]


def budget_retention(cache: int, info: Any, high: int, low: int) -> float:
    """The share r at which every expert fits on the device, a share r at `high` bits and the
    rest at `low` (0: not stored): L E (r b_hi + (1 - r) b_lo) <= cache."""
    n = len(info.moe_layers) * info.num_experts
    hb, lb = info.expert_bytes[high], info.expert_bytes[low] if low else 0
    return float(min(1.0, max(0.0, (cache / n - lb) / (hb - lb))))


@dataclass(frozen=True)
class ScheduleRow:
    position: int  # MoE position
    r: float  # r(l), eq. 4
    t: int  # t_l, eq. 5


@dataclass(frozen=True)
class LamEvidence:
    """What the report tabulates of a fit's lam: the schedule it solved for."""

    value: float
    r: float
    M: int
    schedule: tuple[ScheduleRow, ...]


@register("dymoe")
class DyMoEKnobs(Knobs):
    """DyMoE's knobs (Table 2's tiers, eq. 2's heavy hitters, eq. 4's r and lambda), its fit and its report."""

    derived = {"lam": ("r",)}  # `--set r=0.9` with `--fit F`: lam is solved for 0.9, not taken from F
    evidence = {"lam": LamEvidence}
    # lam given wins over r, and the run records the r that lam gives (eq. 4)
    applies = {"r": ("lam", lambda v: v < 0, "lam < 0 (lam is solved from r; a lam given wins)")}
    shorthands = {"config": ("high_bits", "low_bits")}
    sized = ("r",)  # from --budget, for its tiers; an r given with --r, or the paper's, holds anywhere

    @dataclass(frozen=True)
    class Params(Params):
        # Table 2's retention ratio: the average share of a decode token's selected experts kept critical
        # (`critical_share`; §6.2's default); solved into lam (eq. 4). Not the mean of r(l): eq. 5 rounds up.
        r: float = 0.75
        lam: float = -1.0  # eq. 4's lambda in [0, 1]; < 0 = solve it from r
        high_bits: int = 4  # critical experts (Tables 2-3: Int4)
        low_bits: int = 2  # sub-critical experts; 0 = skip them ("0-bit")
        config: str = ""  # Table 2's "High / Low": "4/2" or "4/0" (overrides high_bits / low_bits)
        # share of prompt tokens that are heavy hitters (T_imp of eq. 2): the paper's T_imp is "the top-k
        # tokens with the highest s_i", its k unnamed; ceil(hh_ratio * T) tokens, 0.2, is our choice
        hh_ratio: float = 0.2
        eviction: str = "lru"  # §4.4.2 extends LRU; any name in EVICTIONS
        prefetcher: str = "dymoe"  # "dymoe" (eq. 6-8), "fate", or "none" (Table 3 rows 2 and 4)

        def __post_init__(self) -> None:
            if self.lam > 1.0 or not 0.0 < self.r <= 1.0 or not 0.0 < self.hh_ratio <= 1.0:
                raise ValueError("lam must be <= 1 (negative: solve from r), r and hh_ratio in (0, 1]")
            parse_tiers(self.config, "'4/2' or '4/0'")
            if self.prefetcher not in ("dymoe", "fate", "none"):
                raise ValueError(f"prefetcher must be 'dymoe', 'fate' or 'none', not '{self.prefetcher}'")

    # -- fit and report --------------------------------------------------------------------------
    @classmethod
    def fitted_disagree(cls, fitted: dict[str, Any], moe_layers: int, top_k: int) -> dict[str, str]:
        """A fit's lam is solved for its r (eq. 4-5): where they disagree, r was edited by hand, and lam (which
        wins) ran the old setting unsaid. r is taken, lam solved again from it."""
        r, lam = fitted.get("r"), fitted.get("lam")
        if not isinstance(r, (int, float)) or not isinstance(lam, (int, float)) or lam < 0 or not moe_layers:
            return {}
        got, step = critical_share(lam, moe_layers, top_k), 1 / (moe_layers * top_k)
        # lam gives the least share of at least r, in steps of 1 / (L M); the fit writes r to 4 decimals, so a
        # share it rounded up (0.5598958 as 0.5599 at the cosine floor, most real depths) is the fit's own
        if r - R_DECIMALS - 1e-9 <= got < r + step - 1e-9:
            return {}
        return {"lam": f"it gives r = {got:.6g} on this model, not the fit's r = {r:.6g} beside it (edited?): lam is "
                       "solved again from r"}

    @classmethod
    def fit(cls, inputs: FitInputs) -> Fitted:
        """lam (eq. 4-5) for the target share of critical experts `--r` (Table 2 r); without it, for the largest r at which every
        expert fits `--budget`, r of them at high bits and the rest at low (the defaults' 4/2), or for
        §6.2's r = 0.75 without a budget. An `--r` given wins over the budget's."""
        info, cfg, out = inputs.profile.info, inputs.config, Fitted()
        high, low = cls.Params().high_bits, cls.Params().low_bits
        r, how, cache, sized = cfg.r, "--r (target share of critical experts)", inputs.cache_for((high, low)), {"sized_for": {}}
        sizable = cache is not None and all(b in info.expert_bytes for b in (high, low))
        if r is None and not sizable:
            why = "no --budget" if cache is None else f"the profile gives no size of a {high}- or {low}-bit expert"
            r, how = cls.Params().r, f"the paper's default r (§6.2): no --r, and {why} to size r with"
        elif r is None:
            r = budget_retention(cache, info, high, low)
            how = (f"--budget {cfg.budget}: the largest r at which every expert fits, r of them at INT4 and the rest "
                   f"at INT2 ({cache} bytes for experts after profile.info's reserved memory)")
            floor = critical_share(0.0, len(info.moe_layers), info.top_k)
            if r < floor:
                out.warnings.append(f"the budget allows a retention of only {r:.3f}; the cosine schedule keeps at least "
                                    f"{floor:.3f} of a token's top-{info.top_k} critical over {len(info.moe_layers)} "
                                    f"layers, so r = {floor:.3f} (the budget will not hold every expert).")
                how += f"; raised to {floor:.3f}, the least the schedule keeps, which the budget does not hold"
                r = floor
            # r holds for this budget and these tiers only: a run at another takes the paper's r (`stale_fitted`)
            sized = {"sized_for": {"budget": cfg.budget, "cache_bytes": cache, "knobs": {"high_bits": high, "low_bits": low}}}
        floor = critical_share(0.0, len(info.moe_layers), info.top_k)
        if r < floor - EPS:  # an --r below what eq. 4-5 keep on this model: lam = 0 keeps more
            out.warnings.append(f"--r {r:g} is below the {floor:.3f} the cosine schedule keeps at least of a token's "
                                f"top-{info.top_k} over {len(info.moe_layers)} layers; lam = 0 keeps {floor:.3f}.")
        lam, rows = schedule_table(r, len(info.moe_layers), info.top_k)
        out.knobs = {"r": round(r, 4), "lam": lam}  # lam: to 1e-6 and just past its step (`solve_lambda`); r: R_DECIMALS
        out.evidence = {"r": {"value": r, "from": how, **sized},
                        "lam": {"value": lam, "r": r, "from": f"r = {r:.4f} via eq. 4-5", "M": info.top_k,
                                "share": critical_share(lam, len(info.moe_layers), info.top_k), "schedule": rows,
                                "rule": "DyMoE Table 2's r: the least lam whose mean over MoE layers of t_l / M is >= r; "
                                        "t_l = ceil(r(l) M) (eq. 5), M = top-k"}}
        return out

    @classmethod
    def report(cls, inputs: ReportInputs) -> Section:
        """The fitted schedule (eq. 4-5) per fit; Table 3's ablation from the runs; Fig. 5 per
        profile; Fig. 11 from the evals; the claims of Table 2 (4/0 at r = 0.9 near INT4) and Fig. 5
        (INT2 in a shallow layer costs more than in a deep one)."""
        part, md = Section(), []
        for path, f in inputs.fits:
            lam = f.evidence.get(cls.name, {}).get("lam")
            if lam:
                head = (f"DyMoE schedule (eq. 4-5) of `{inputs.shown(path)}`, lam = {lam['value']:.4f}, r = {lam['r']:.4f}, "
                        f"M = {lam['M']}")
                md += [head + ":\n\n", table(["MoE position", "r(l)", "t_l"],
                                               [[x["position"], x["r"], x["t"]] for x in lam["schedule"]]), "\n"]
        md.append(ablation(inputs.runs, inputs.shown))
        for path, prof in inputs.profiles:
            s = prof.sensitivity
            if s and s.layers:
                part.figures.append(sensitivity_figure(s, inputs.out_dir / f"sensitivity{inputs.tag(path)}.png"))
            if s and 2 in s.bits and len(s.layers) >= 3:
                part.claims.append(depth_claim(s, inputs.shown(path)))
        if (fig := retention_figure(inputs.rows, inputs.out_dir / "dymoe_retention.png")) is not None:
            part.figures.append(fig)
        if pair := inputs.ppl_pair((cls.name, {"r": 0.9, "precisions": {"high": 4, "low": 0}}), ("static", {"bits": 4})):
            dymoe, int4 = pair
            a, b = dymoe["metrics"]["ppl"], int4["metrics"]["ppl"]
            part.claims.insert(0, ["DyMoE 4/0 r = 0.9 within 2% of static INT4", f"{a:.3f} vs {b:.3f}",
                                   f"{100 * (a / b - 1):+.2f}%", "met" if a / b - 1 <= 0.02 else "not met"])
        if "".join(md):
            part.markdown = "## DyMoE (Huang et al., 2026)\n\n" + "".join(md)
        return part

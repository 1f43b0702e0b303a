"""DynaExq's knobs, how `moetool fit` sizes n_hi for a budget (§3.1), and its part of the report (Fig. 2,
Tables 1-2, §5's claim); its engine half (hotness, tiers, migrations) is `dynaexq.py`.

    budget_n_hi(60_000, L=4, E=8, lo_bytes=1280, hi_bytes=4096)     # 1: one expert per layer at b_hi
"""

from __future__ import annotations

from dataclasses import dataclass

from moetool.policies.knobs import Knobs, Params, parse_tiers, register
from moetool.policies.stages import FitInputs, Fitted, ReportInputs, Section, table


def budget_n_hi(cache_bytes: int, L: int, E: int, lo_bytes: int, hi_bytes: int) -> int:
    """§3.1 budget initialization: every expert at b_lo, then n_hi = (cache - L E b_lo) // b_hi // L
    high-precision experts per layer, within [0, E]. `fit` sizes n_hi with the same function.

    The paper gives no formula, only that n_{hi,l} comes from the budget once; this one follows from
    the low tier staying resident (`dynaexq.py`'s docstring), the same n_hi for every layer."""
    return int(min(E, max(0, (cache_bytes - L * E * lo_bytes) // hi_bytes // L)))


@register("dynaexq")
class DynaExqKnobs(Knobs):
    """DynaExq's knobs (its tiers, n_hi, §3.5's hotness EMA and hysteresis), its fit and its report."""

    # a fitted n_hi was sized for the fit's tiers (16/4 by default), not for `--set config=4/2`
    derived = {"n_hi": ("config", "b_hi", "b_lo")}
    shorthands = {"config": ("b_hi", "b_lo")}
    sized = ("n_hi",)  # §3.1's count of high-precision experts a budget holds at these tiers

    @dataclass(frozen=True)
    class Params(Params):
        b_hi: int = 16  # hot experts (FP16 for Qwen3-30B / Phi-3.5-MoE, §5.1)
        b_lo: int = 4  # cold experts (INT4; "4/2" for Qwen3-80B)
        config: str = ""  # "HI/LO" shorthand, e.g. "16/4" or "4/2" (overrides b_hi / b_lo)
        n_hi: int = -1  # high-precision experts per layer; < 0 = the most the budget holds
        ema: float = 0.9  # the EMA's alpha in S <- alpha S + (1 - alpha) c (§3.5; the paper gives no value)
        interval_tokens: int = 32  # T_u, in tokens (§3.5 measures it in time and gives no value)
        hysteresis: float = 1.0  # additive margin on S, one of §3.5's two forms (it gives no value)

        def __post_init__(self) -> None:
            if not 0.0 <= self.ema < 1.0 or self.interval_tokens < 1 or self.hysteresis < 0:
                raise ValueError("ema must be in [0, 1), interval_tokens >= 1 and hysteresis >= 0")
            parse_tiers(self.config, "'16/4' or '4/2'")

    # -- fit and report --------------------------------------------------------------------------
    @classmethod
    def fit(cls, inputs: FitInputs) -> Fitted:
        """n_hi (§3.1) for `--budget`, at the default tiers (16/4), as the policy derives it at start."""
        from moetool.engine.budget import staging_bytes

        info, budget, out = inputs.profile.info, inputs.config.budget, Fitted()
        hi, lo = cls.Params().b_hi, cls.Params().b_lo
        cache = inputs.cache_for((hi, lo))  # a run stages these two precisions only
        if cache is None:
            out.skipped["n_hi"] = "needs --budget"
            return out
        L, E = len(info.moe_layers), info.num_experts
        n_hi = budget_n_hi(cache, L, E, info.expert_bytes[lo], info.expert_bytes[hi])
        if cache < L * E * info.expert_bytes[lo]:
            out.warnings.append(f"--budget {budget} cannot hold every expert at {lo} bits: DynaExq will refuse it.")
        out.knobs["n_hi"] = n_hi
        out.evidence["n_hi"] = {"value": n_hi, "cache_bytes": cache, "b_hi": hi, "b_lo": lo,
                                "expert_bytes": {str(b): n for b, n in info.expert_bytes.items()}, "reserved": {
                                    "non_expert": info.non_expert_bytes, "kv_margin": info.kv_margin_bytes,
                                    "staging": staging_bytes({b: info.expert_bytes[b] for b in (hi, lo)})},
                                "from": f"--budget {budget}, profile.info ({info.expert_bytes_source})",
                                "sized_for": {"budget": budget, "cache_bytes": cache, "knobs": {"b_hi": hi, "b_lo": lo}},
                                "rule": "DynaExq §3.1: (cache - L E b_lo) // b_hi // L, at most E"}
        return out

    @classmethod
    def report(cls, inputs: ReportInputs) -> Section:
        """Per profile, the routing measurements DynaExq argues from: hot sets shift between workloads
        (Fig. 2) and few experts are active at small batches (Tables 1-2); §5's claim from the evals."""
        part, md = Section(), []
        for path, prof in inputs.profiles:
            r = prof.routing
            if r and r.jaccard:
                head = (f"Workload shift (DynaExq Fig. 2) in `{inputs.shown(path)}`: mean Jaccard of per-layer top-{r.hot_k} "
                        "hot sets.")
                md += [head + "\n\n", table(["data sets", "Jaccard"], [[k.replace("|", " vs "), v]
                                                                       for k, v in r.jaccard.items()]), "\n"]
            if r and r.activation_ratio:
                sizes = sorted({int(b) for d in r.activation_ratio.values() for b in d})
                head = (f"Expert activation ratio (%) vs batch size in `{inputs.shown(path)}` (DynaExq Tables 1-2; decode "
                        "batches are random decode tokens, prefill batches random prompts).")
                md += [head + "\n\n",
                       table(["phase", *map(str, sizes)],
                             [[ph, *[100 * d[str(b)] if str(b) in d else None for b in sizes]]
                              for ph, d in r.activation_ratio.items()]), "\n"]
        if md:
            part.markdown = "## DynaExq (Chu et al., 2026)\n\n" + "".join(md)
        if pair := inputs.ppl_pair((cls.name, {"precisions": {"high": 4, "low": 2}}), ("static", {"bits": 2})):
            mixed, int2 = pair
            a, b = mixed["metrics"]["ppl"], int2["metrics"]["ppl"]
            budget = (mixed.get("budget") or {}).get("cache_bytes")
            at = f" (DynaExq's expert cache {budget / 2**20:.1f} MiB)" if budget else ""
            verdict = "met" if a < b else "not met"
            if (mixed.get("params") or {}).get("n_hi_used") == 0:  # no expert at 4 bits: it ran as static INT2
                verdict, at = "inconclusive", at + ", its budget held no expert at 4 bits (n_hi = 0)"
            part.claims.append([f"DynaExq 4/2 better than static INT2{at}", f"{a:.3f} vs {b:.3f}",
                                f"{100 * (a / b - 1):+.2f}%", verdict])
        return part

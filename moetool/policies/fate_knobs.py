"""Fate's knobs, how `moetool fit` sets them (L, n, p: §4.3-4.5) and its part of the report (Table 1,
Fig. 7, Fig. 10); its engine half (prefetch, cache, INT2 transfers) is `fate.py`.

    FateKnobs.Params(L=3, p=0.25).cache_bits        # 4: Fate caches experts at INT4 (§4.5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moetool.policies.knobs import Knobs, Params, register
from moetool.policies.stages import FitInputs, Fitted, ReportInputs, Section, differences, primary_metric, table


def transfer_n(window_s: float, t_io_s: float, num_experts: int) -> int:
    """Fate §4.3: n = T / t_expert, the decode transfers that overlap one layer's compute window T.

    Floored, but at least 1 (a transfer that half overlaps still helps) and at most every expert of
    a layer. `fit` calls it with a measured window, the policy with the hardware profile's.
    """
    return int(min(num_experts, max(1, math.floor(window_s / t_io_s)))) if t_io_s > 0 else num_experts


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


@dataclass(frozen=True)
class LEvidence:
    """What the report draws of a fit's L (`_prefetch_figure`)."""

    value: int
    threshold: float


@register("fate")
class FateKnobs(Knobs):
    """Fate's knobs (§4.2-4.5), its fit and its report."""

    evidence = {"L": LEvidence}
    applies = {"n": ("prefetcher", lambda v: v == "fate", "prefetcher=fate (§4.3's cap on its transfers)"),
               "percentile": ("prefetcher", lambda v: v == "fate", "prefetcher=fate (§4.2's decode rule)"),
               "low_bits": ("p", lambda v: v > 0, "p > 0 (§4.5's share of prefill experts at INT2)")}
    sized = ("n",)  # §4.3's n divides by one machine's copy time

    @dataclass(frozen=True)
    class Params(Params):
        L: int = 3  # shallow/deep boundary in MoE layers (Qwen1.5-MoE's value, §4.4)
        p: float = 0.25  # share of prefill experts moved at INT2, least popular first (§4.5)
        n: int = 0  # decode transfers per layer; 0 = T / t_expert from the hardware profile (§4.3)
        percentile: float = 0.75  # decode prefetch: predicted score above this quantile (§4.2)
        cache_bits: int = 4  # precision of cached experts (HQQ INT4, §4.5)
        # §4.5 "employs int4 quantization when memory resources are insufficient": "auto" caches at 16
        # bits where the expert cache holds every expert at 16 bits (and the bundle stores them), else at
        # cache_bits; "always" caches at cache_bits whatever the budget. Only the default cache_bits is
        # upgraded: another given (INT2, INT8) is kept; give quantize_cache=always to keep INT4 itself
        quantize_cache: str = "auto"
        low_bits: int = 2  # precision of the unpopular prefill experts (INT2, §4.5)
        position: int = 2  # Table 1 input position for prediction; the engine provides position 2 only
        eviction: str = "arc"  # per-layer eviction (§4.4)
        prefetcher: str = "fate"  # "fate" or "none" (ablation, Fig. 14)

        def __post_init__(self) -> None:
            if self.position not in (1, 2, 3):
                raise ValueError("position must be 1, 2 or 3 (Fate Table 1)")
            if self.position != 2:
                raise ValueError(f"position {self.position} is not available: the engine predicts from the "
                                 "gate input of the previous layer (position 2) only")
            if not 0.0 <= self.p <= 1.0 or not 0.0 <= self.percentile < 1.0:
                raise ValueError("p must be in [0, 1] and percentile in [0, 1)")
            if self.low_bits > self.cache_bits:  # §4.5: the unpopular share moves at fewer bits than the cache
                raise ValueError(f"low_bits must not exceed cache_bits, not {self.low_bits}/{self.cache_bits}")
            if self.prefetcher not in ("fate", "none"):
                raise ValueError(f"prefetcher must be 'fate' or 'none', not '{self.prefetcher}'")
            if self.quantize_cache not in ("auto", "always"):
                raise ValueError(f"quantize_cache must be 'auto' or 'always', not '{self.quantize_cache}'")

    # -- fit and report --------------------------------------------------------------------------
    @classmethod
    def fit(cls, inputs: FitInputs) -> Fitted:
        """L (§4.4) from the profile's per-layer decode prefetch recall; n (§4.3) from its timings;
        p (§4.5) from fate evals at several p (p = 0 among them), else the profile's INT2-share
        perplexity curve."""
        cfg, prof, out = inputs.config, inputs.profile, Fitted()
        info, fate = prof.info, out.evidence
        # §4.4's boundary is where decode prefetch stops being accurate: the decode recall, and only it (a
        # profile of --decode-tokens 0 has the prefill's alone, another number under the same name).
        recall = {lp.layer: lp.recall_topk["decode"] for lp in prof.prefetch.layers
                  if "decode" in lp.recall_topk} if prof.prefetch is not None else {}
        if recall:
            acc = [recall.get(layer) for layer in info.moe_layers]
            fate["L"] = {"value": boundary_L(acc, cfg.l_threshold), "threshold": cfg.l_threshold, "accuracy": acc,
                         "from": "profile.prefetch.layers[].recall_topk.decode (next router on this gate input)"}
        elif prof.prefetch is not None:
            out.skipped["L"] = "the profile's prefetch part has no decode recall (it was profiled with --decode-tokens 0)"
        else:
            out.skipped["L"] = "the profile has no prefetch part (--what prefetch)"
        hw = prof.hw or {}
        if prof.timing is not None and (prof.timing.h2d_gbps or hw.get("h2d_gbps")):
            t, bits = prof.timing, cls.Params().cache_bits  # n for the INT4 cache's transfers
            # §4.3's T = t_moe + t_attn + t_gate: the profile's t_moe is the whole MoE block, its router
            # (t_gate, timed inside it) included, so T is t_moe + t_attn (adding t_gate counted it twice)
            window = sum(x.t_moe + x.t_attn for x in t.layers) / max(1, len(t.layers))
            h2d = t.h2d_gbps or hw.get("h2d_gbps")
            nbytes = info.expert_bytes[bits]
            t_io = nbytes / (h2d * 1e9) + hw.get("copy_latency_s", 0.0)
            h2d_from = "measured" if t.h2d_gbps else "hw preset " + str(prof.settings.get("hw_base"))
            fate["n"] = {"value": transfer_n(window, t_io, info.num_experts), "T_s": window, "t_expert_s": t_io,
                         "expert_bytes": nbytes, "bits": bits, "h2d_gbps": h2d,
                         # §4.3's n is the machine's whose link it divides by: a run whose costs give
                         # another copy time takes n from its own (the default n = 0), `knobs.stale_fitted`
                         # and T is the host path's layer (hooks on the eager forward): the captured step's is shorter
                         "sized_for": {"knobs": {"cache_bits": bits}, "costs": {f"t_load.{bits}": t_io}, "path": "host"},
                         "from": f"profile.timing.layers (T = t_moe + t_attn, the MoE block holding the gate, decode, "
                                 f"measured on {t.device}); "
                                 f"t_expert = INT4 blob / h2d ({h2d_from})"}
            if not t.h2d_gbps:  # T is this machine's compute, the link another's: no one machine's §4.3 ratio
                out.warnings.append(f"Fate's n = {fate['n']['value']} divides the layer time measured on {t.device} "
                                    f"by the link of {h2d_from}; a run is held to that link's copy time only, so on "
                                    "a machine of other compute give it --set n=0 (n from that run's own costs).")
        else:
            out.skipped["n"] = "the profile has no timing part with a host-to-device bandwidth (--what timing)"
        by_p, settings, twice, idle = {}, [], None, []
        for path, e in inputs.evals:
            m = primary_metric(e.metrics)
            if e.policy == cls.name and m and "p" in e.params and e.params.get("int2_prefill") is False \
                    and float(e.params["p"]) > 0:
                idle.append(path)  # every expert cached at 16 bits (a budget that holds them): p moved nothing
                continue
            if e.policy == cls.name and m and "p" in e.params:
                if float(e.params["p"]) in by_p:
                    twice = twice or f"p={float(e.params['p']):g} in {by_p[float(e.params['p'])][1]} and {path}"
                by_p[float(e.params["p"])] = (m, path)
                settings.append(_eval_setting(e, m[0]))
        # Losses are one task's metric as p varies: evals of another task, metric, text or knob (or two at
        # one p, the second read over the first) are not points of one curve.
        if idle:
            out.warnings.append(f"{len(idle)} fate eval(s) moved nothing at INT2 whatever their p (their budget holds "
                                f"every expert at 16 bits, §4.5), e.g. {idle[0]}; p is fitted from evals at a budget "
                                "that does not (25%).")
        differ = differences(settings) or (twice and f"two evals at {twice}")
        if differ:
            out.skipped["p"] = (f"the fate evals differ in more than p ({differ}); p is fitted from evals of one "
                                "task that differ only in p")
            out.warnings.append(out.skipped["p"] + ".")
        elif len(by_p) >= 2 and 0.0 in by_p:
            (name, base, higher), _ = by_p[0.0]
            losses = {p: ((base - v) / base if higher else (v - base) / base) for p, ((_, v, _), _) in by_p.items()}
            fate["p"] = {"value": int2_share(losses, cfg.max_loss), "max_loss": cfg.max_loss,
                         "losses": {f"{p:g}": v for p, v in losses.items()}, "metric": name,
                         "from": [path for _, path in by_p.values()]}
        elif prof.sensitivity is not None and prof.sensitivity.int2_share:
            curve = {float(k): v for k, v in prof.sensitivity.int2_share.items()}
            base = curve.get(0.0)
            losses = {p: (v - base) / base for p, v in curve.items()} if base else {}
            fate["p"] = {"value": int2_share(losses, cfg.max_loss), "max_loss": cfg.max_loss,
                         "losses": {f"{p:g}": v for p, v in losses.items()}, "metric": "held-out perplexity",
                         "from": "profile.sensitivity.int2_share (INT4 cache, least popular share at INT2)"}
        else:
            out.skipped["p"] = "needs fate eval artifacts at p=0 and another p, or a profile with sensitivity"
        out.knobs = {k: v["value"] for k, v in fate.items()}
        return out

    @classmethod
    def report(cls, inputs: ReportInputs) -> Section:
        """Per profile: Table 1 (which input predicts the next gate), the INT2-share curve (Fig. 10,
        the fitted p marked) and per-layer prefetch recall (Fig. 7, the fitted L marked)."""
        part, md = Section(), []
        for path, prof in inputs.profiles:
            tag, fits = inputs.tag(path), inputs.fits_for(prof)
            if prof.similarity and prof.similarity.positions:
                pf = prof.prefetch.positions if prof.prefetch else {}
                md += [f"### Fate Table 1 (positions vs Gate_in(i+1)), `{inputs.shown(path)}`\n\n",
                       table(["position", "mean cosine", "prefetch recall prefill", "prefetch recall decode"],
                             [[pos, v, pf.get(pos, {}).get("prefill"), pf.get(pos, {}).get("decode")]
                              for pos, v in prof.similarity.positions.items()]), "\n"]
            if prof.sensitivity and prof.sensitivity.int2_share:
                md += [f"### INT2 share (Fate Fig. 10), INT4 otherwise, `{inputs.shown(path)}`\n\n",
                       table(["share p", "perplexity"], [[k, v] for k, v in prof.sensitivity.int2_share.items()]), "\n"]
                part.figures.append(_int2_figure(prof, fits, inputs.out_dir / f"int2_share{tag}.png"))
            if prof.prefetch and prof.prefetch.layers:
                part.figures.append(_prefetch_figure(prof, fits, inputs.out_dir / f"prefetch{tag}.png"))
        if md:
            part.markdown = "## Fate (Fang et al., 2025)\n\n" + "".join(md)
        return part


def _eval_setting(e: Any, metric: str) -> dict[str, str]:
    """What a fate eval's quality depends on besides p: its task, metric, text and scoring, the
    precisions of §4.5 (cache_bits, low_bits) and the expert cache: an expert the INT4 cache holds runs
    at INT4, not INT2, so a larger cache moves fewer experts at INT2 (at one p, 25% and 50% of the demo
    scored 33.609 and 33.545). L, n, the percentile, the eviction and the prefetcher move experts sooner
    or later, not at another precision; the clock changes its speed."""
    knobs = {k: f"{k}={e.params.get(k)!r}" for k in ("cache_bits", "low_bits")}
    cache = (getattr(e, "budget", None) or {}).get("cache_bytes")
    if cache is not None:
        knobs["cache"] = f"expert cache {cache} B"
    scoring = {k: f"{k}={e.options.get(k)!r}" for k in ("data", "limit", "num_fewshot", "context", "stepwise")}
    # the text's content, not only its path: a file rewritten between two evals is another text
    text = (e.inputs or {}).get(str(e.options.get("data")))
    return {"task": f"task {e.task}", "metric": f"metric {metric}", **scoring,
            **({"text": f"text sha256 {text[:12]}"} if text else {}), **knobs}


def _int2_figure(prof: Any, fits: list, path: Path) -> Path:
    from moetool.figures import save, subplots

    curve = sorted((float(k), v) for k, v in prof.sensitivity.int2_share.items())
    fig, ax = subplots(figsize=(6, 4))
    ax.plot([100 * p for p, _ in curve], [v for _, v in curve], "o-")
    for f in fits:
        if "p" in f.params.get("fate", {}):
            ax.axvline(100 * f.params["fate"]["p"], color="red", ls="--", label=f"fitted p = {f.params['fate']['p']:g}")
            ax.legend()
    ax.set(xlabel="% of active experts at INT2 (least popular first), rest INT4", ylabel="held-out perplexity",
           title="Perplexity vs INT2 share (Fate Fig. 10)")
    return save(fig, path)


def _prefetch_figure(prof: Any, fits: list, path: Path) -> Path:
    from moetool.figures import int_axis, save, subplots

    p, layers = prof.prefetch, list(prof.info.moe_layers)
    fig, ax = subplots(figsize=(6.5, 4))
    xs = [lp.layer for lp in p.layers]
    for name, style, get in (("decode, top-k", "o-", lambda lp: lp.recall_topk.get("decode")),
                             ("decode, 75th pct", "s--", lambda lp: lp.recall_p75.get("decode")),
                             ("prefill, top-k", "^:", lambda lp: lp.recall_topk.get("prefill"))):
        ax.plot(xs, [get(lp) if get(lp) is not None else np.nan for lp in p.layers], style, label=name)
    int_axis(ax, layers[0], layers[-1])
    for f in fits:
        fl = f.evidence.get("fate", {}).get("L")
        if fl:
            ax.axhline(fl["threshold"], color="gray", ls=":", label=f"threshold {fl['threshold']:g}")
            if fl["value"] < len(layers):
                ax.axvline(layers[fl["value"]] - 0.5, color="red", ls="--", label=f"fitted L = {fl['value']}")
    ax.set(xlabel="predicted MoE layer", ylabel="recall of the true experts", ylim=(0, 1.05),
           title="Cross-layer prefetch accuracy (Fate Fig. 7)")
    ax.legend(fontsize=7)
    return save(fig, path)

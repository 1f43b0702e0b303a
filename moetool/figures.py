"""The report's figures (matplotlib, Agg), one function per figure family, and the labels they share.

Per-layer quantization sensitivity (DyMoE Fig. 5), the routing heat map, adjacent-layer similarity
(DyMoE Fig. 6, Fate Table 1), per-layer prefetch recall with the fitted L (Fate Fig. 7), perplexity
vs INT2 share (Fate Fig. 10), gate scores by rank (SMoE Fig. 4), the alpha-TPOT polynomial (SMoE
eq. 5), TPOT vs accuracy per policy, accuracy vs DyMoE retention (DyMoE Fig. 11). `report.py` calls
them and writes the tables.

    out: list[Path] = []; profile_figures(prof, fits, Path("out/report"), "", out)
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from moetool.profile import Profile  # noqa: E402
from moetool.run import Fit  # noqa: E402

LABEL_KEYS = ("config", "bits", "alpha", "r", "L", "p", "n", "n_hi", "prefetcher")


def setting_label(policy: str, params: dict[str, Any]) -> str:
    knobs = [f"{k}={params[k]}" for k in LABEL_KEYS if k in params and params[k] not in ("", None)]
    return f"{policy} " + " ".join(knobs) if knobs else policy


def precisions(params: dict[str, Any]) -> tuple[int, int]:
    """(high, low) bits a policy ran at: every policy records them as `precisions` (`Policy.describe`);
    artifacts written before that carry DyMoE's `high`/`low` or its knobs `high_bits`/`low_bits`."""
    if isinstance(params.get("precisions"), dict):
        return int(params["precisions"]["high"]), int(params["precisions"]["low"])
    return (int(params.get("high", params.get("high_bits", 4))), int(params.get("low", params.get("low_bits", 2))))


def save(fig, path: Path, out: list[Path]) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    out.append(path)


def int_axis(ax, lo: float, hi: float) -> None:
    ax.set_xlim(lo - 0.5, hi + 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def profile_figures(prof: Profile, fits: list[Fit], out_dir: Path, tag: str, out: list[Path]) -> None:
    layers = list(prof.info.moe_layers)
    if prof.sensitivity and prof.sensitivity.layers:
        s = prof.sensitivity
        fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(layers) + 3), 4))
        width = 0.8 / len(s.bits)
        for i, b in enumerate(s.bits):
            ax.bar(np.arange(len(s.layers)) + i * width, [ls.delta[b] for ls in s.layers], width,
                   label=f"INT{b}")
        ax.set_xticks(np.arange(len(s.layers)) + 0.4 - width / 2, [str(ls.layer) for ls in s.layers], fontsize=7)
        ax.set(xlabel="MoE layer quantized (others at full precision)", ylabel="Δ held-out perplexity",
               title=f"Per-layer quantization sensitivity (DyMoE Fig. 5)\nbase perplexity {s.base_ppl:.3f} "
                     f"on {s.tokens} {s.data} tokens")
        ax.axhline(0, color="black", lw=0.5)
        ax.legend()
        save(fig, out_dir / f"sensitivity{tag}.png", out)
    if prof.sensitivity and prof.sensitivity.int2_share:
        curve = sorted((float(k), v) for k, v in prof.sensitivity.int2_share.items())
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([100 * p for p, _ in curve], [v for _, v in curve], "o-")
        for f in fits:
            if "p" in f.params.get("fate", {}):
                ax.axvline(100 * f.params["fate"]["p"], color="red", ls="--", label=f"fitted p = {f.params['fate']['p']:g}")
                ax.legend()
        ax.set(xlabel="% of active experts at INT2 (least popular first), rest INT4", ylabel="held-out perplexity",
               title="Perplexity vs INT2 share (Fate Fig. 10)")
        save(fig, out_dir / f"int2_share{tag}.png", out)
    if prof.routing:
        r = prof.routing
        load = np.array([np.add(lr.prefill, lr.decode) for lr in r.layers], float)
        load = load / np.maximum(load.sum(1, keepdims=True), 1)
        fig, ax = plt.subplots(figsize=(max(6, 0.12 * r.num_experts + 3), max(3.5, 0.2 * len(layers) + 1.5)))
        im = ax.imshow(load, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_yticks(range(len(layers)), [str(x) for x in layers], fontsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="expert", ylabel="MoE layer", title="Routing load per layer (prefill + decode)")
        fig.colorbar(im, ax=ax, label="share of the layer's routed tokens")
        save(fig, out_dir / f"routing_heatmap{tag}.png", out)
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
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
        save(fig, out_dir / f"gate_scores{tag}.png", out)
    if prof.similarity and prof.similarity.adjacent:
        s = prof.similarity
        fig, ax = plt.subplots(figsize=(6.5, 4))
        ax.plot(range(len(s.adjacent)), s.adjacent, "o-", label="h(l) vs h(l+1), decoder layer outputs")
        for pos, name in (("1", "Attn_in(i+1)"), ("2", "Gate_in(i)"), ("3", "Attn_in(i)")):
            ax.plot([ls.previous for ls in s.layers], [ls.positions[pos] for ls in s.layers], ".--",
                    label=f"Fate pos. {pos}: {name} vs Gate_in(i+1)")
        int_axis(ax, 0, max(len(s.adjacent) - 1, *[ls.previous for ls in s.layers]))
        ax.set(xlabel="layer l (i)", ylabel="mean cosine similarity",
               title="Adjacent-layer similarity (DyMoE Fig. 6, Fate Table 1)")
        ax.legend(fontsize=7)
        save(fig, out_dir / f"similarity{tag}.png", out)
    if prof.prefetch and prof.prefetch.layers:
        p = prof.prefetch
        fig, ax = plt.subplots(figsize=(6.5, 4))
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
        save(fig, out_dir / f"prefetch{tag}.png", out)


def fit_figure(fit: Fit, out_dir: Path, tag: str, out: list[Path]) -> None:
    a = fit.evidence.get("smoe", {}).get("alpha")
    if not a:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    pts = np.array([p[:2] for p in a["points"]], float)
    ax.plot(pts[:, 0], pts[:, 1] * 1e3, "o", label="measured TPOT")
    ax.plot(a["grid"], np.array(a["predicted"]) * 1e3, "-", label=f"degree-{a['degree']} fit (LOO)")
    if a.get("target_tpot") is not None:
        ax.axhline(a["target_tpot"] * 1e3, color="gray", ls=":", label=f"R = {a['target_tpot'] * 1e3:.3g} ms")
    if a.get("alpha") is not None:
        ax.axvline(a["alpha"], color="red", ls="--", label=f"chosen alpha = {a['alpha']:.3f}")
    ax.set(xlabel="alpha (SMoE substitution threshold)", ylabel="mean TPOT (ms)", title="T(alpha) (SMoE eq. 5)")
    ax.legend(fontsize=8)
    save(fig, out_dir / f"alpha_tpot{tag}.png", out)


def metric_axes(metrics: list[str], width: float, height: float):
    """One panel per metric side by side: accuracy and perplexity never share a y axis."""
    fig, axes = plt.subplots(1, len(metrics), figsize=(width * len(metrics), height), squeeze=False)
    return fig, dict(zip(metrics, axes[0]))


def ylabel(rows: list[dict], metric: str) -> str:
    higher = next(x["higher"] for x in rows if x["metric"] == metric)
    return f"{metric} ({'higher' if higher else 'lower'} is better)"


def comparison_figures(rows: list[dict], out_dir: Path, out: list[Path]) -> None:
    pts = [x for x in rows if x["tpot"] is not None]
    if pts:
        metrics = sorted({x["metric"] for x in pts})
        labels = sorted({x["label"] for x in pts})
        style = {lab: (f"C{i % 10}", "osD^v<>ph*"[i // 10 % 10]) for i, lab in enumerate(labels)}
        fig, axes = metric_axes(metrics, 5.5, 4.5)
        for x in pts:  # same setting, same colour and marker in every panel; one legend for all
            color, marker = style[x["label"]]
            axes[x["metric"]].scatter(x["tpot"] * 1e3, x["value"], color=color, marker=marker, s=40, label=x["label"])
        for metric, ax in axes.items():
            ax.set(xlabel="mean TPOT (ms)", ylabel=ylabel(pts, metric), title=metric)
            ax.margins(x=0.12, y=0.12)
            ax.grid(alpha=0.3)
        handles = [plt.Line2D([], [], color=c, marker=m, linestyle="", label=lab) for lab, (c, m) in style.items()]
        fig.legend(handles=handles, loc="lower center", ncol=min(3, len(handles)), fontsize=8, frameon=False)
        fig.suptitle("Policies: TPOT vs quality (one point per setting)")
        fig.tight_layout(rect=(0, 0.07 * ((len(handles) + 2) // 3), 1, 1))
        fig.savefig(out_dir / "policies.png", dpi=120)
        plt.close(fig)
        out.append(out_dir / "policies.png")
    dy: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for x in rows:
        if x["policy"] == "dymoe" and "r" in x["params"]:
            high, low = precisions(x["params"])
            cfg = x["params"].get("config") or f"{high}/{low}"
            dy[x["metric"]][cfg].append((float(x["params"]["r"]), x["value"]))
    if dy:
        fig, axes = metric_axes(sorted(dy), 5, 4)
        for metric, ax in axes.items():
            for cfg, pts_ in sorted(dy[metric].items()):
                pts_.sort()
                ax.plot([p for p, _ in pts_], [v for _, v in pts_], "o-", label=f"DyMoE {cfg}")
            ax.set(xlabel="retention ratio r", ylabel=ylabel(rows, metric), title=metric)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle("Quality vs retention (DyMoE Fig. 11)")
        save(fig, out_dir / "dymoe_retention.png", out)

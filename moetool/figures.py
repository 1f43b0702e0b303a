"""The report's general figures (matplotlib, saved through Agg, without pyplot), the helpers a paper's own figures use, and labels.

Drawn here: the routing heat map and adjacent-layer similarity of a profile (DyMoE Fig. 6 and Fate
Table 1 share it), and TPOT vs quality with one point per evaluated setting. A figure built for one
paper (SMoE Fig. 4 and T(alpha), Fate Fig. 7 and 10, DyMoE Fig. 5 and 11) is drawn by that paper's
`report` (`policies/<paper>.py`) with `save` and the axes helpers below. `report.py` calls both.

    out: list[Path] = []; profile_figures(prof, Path("out/report"), "", out)
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

# matplotlib settles its config and cache directory as it imports ($MPLCONFIGDIR, else under $HOME or
# the XDG directories). When that one cannot be written it makes a temp directory of its own (removed
# at exit) and logs two warnings; the figures need only its font cache from there, so they are the same
# (the font list is rebuilt on each run). The fallback is silent, as Python's tempfile's is: only the
# import's own messages are dropped, not those of the drawing.
_mpl_log = logging.getLogger("matplotlib")
_level = _mpl_log.level
_mpl_log.setLevel(logging.ERROR)
try:
    # Figures are made without pyplot: pyplot's backend and its list of open figures are the process's,
    # and a report drawn from a notebook had switched the notebook's backend to Agg (`matplotlib.use`). A
    # Figure alone saves a PNG through Agg whatever backend the caller has.
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator
finally:
    _mpl_log.setLevel(_level)

if TYPE_CHECKING:  # the papers' report hooks draw with this module: it sits below the profile stage too
    from moetool.policies.stages import ProfileRecord

LABEL_KEYS = ("config", "bits", "alpha", "r", "L", "p", "n", "n_hi", "prefetcher")


# A knob whose recorded value is a "derive it" sentinel, and where the policy records what it derived:
# the label shows what ran (two DynaExq runs at other budgets were both "n_hi=-1").
RESOLVED = {"n_hi": ("n_hi_used", lambda v: isinstance(v, (int, float)) and v < 0),
            "n": ("transfer_cap", lambda v: v == 0)}


def setting_label(policy: str, params: dict[str, Any]) -> str:
    def shown(k: str) -> Any:
        used, sentinel = RESOLVED.get(k, (None, None))
        if used is not None and sentinel(params[k]) and params.get(used) is not None:
            return params[used]
        return params[k]

    knobs = [f"{k}={shown(k)}" for k in LABEL_KEYS if k in params and params[k] not in ("", None)]
    knobs += [f"{k}={params[k]}" for k in off_default(policy, params)]
    return f"{policy} " + " ".join(knobs) if knobs else policy


def off_default(policy: str, params: dict[str, Any]) -> list[str]:
    """The knobs beyond LABEL_KEYS whose recorded value is not the policy's default (LRU's eviction=arc,
    SMoE's window, a researcher's own knob): two settings that differ there were one label, one row of
    the quality table and one colour. Knobs a shorthand set (`config` spells DyMoE's tiers) are in it;
    a policy this process does not know shows every scalar knob it recorded."""
    import dataclasses
    import sys

    # The registry as this process has it (report, fit and the papers' hooks have loaded it): read, not
    # imported, since the policies draw with this module and sit above it.
    knobs = sys.modules.get("moetool.policies.knobs")
    try:
        knobs.load_user_policies() if knobs is not None else None
    except Exception:  # noqa: BLE001 - a label is no place to refuse a module: the policy is drawn as unknown
        pass
    cls = knobs.POLICIES.get(policy) if knobs is not None else None
    if cls is None:
        return [k for k, v in params.items() if k not in LABEL_KEYS and isinstance(v, (str, int, float, bool))
                and k not in {used for used, _ in RESOLVED.values()}]
    spelled = {k for short, keys in cls.shorthands.items() if params.get(short) for k in keys}
    return [f.name for f in dataclasses.fields(cls.Params) if f.name not in LABEL_KEYS and f.name not in spelled
            and f.default is not dataclasses.MISSING and f.name in params and params[f.name] != f.default]


def subplots(*args: Any, figsize: tuple[float, float] | None = None, **kwargs: Any) -> tuple[Any, Any]:
    """A figure and its axes, as `pyplot.subplots` gives them, made without pyplot (see the imports)."""
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(*args, **kwargs)


# A report hook written with pyplot's names (`plt.subplots`) draws the same way, without pyplot.
plt = SimpleNamespace(subplots=subplots, Line2D=Line2D, close=lambda fig=None: None)


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def int_axis(ax, lo: float, hi: float) -> None:
    ax.set_xlim(lo - 0.5, hi + 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def profile_figures(prof: ProfileRecord, out_dir: Path, tag: str, out: list[Path]) -> None:
    """The profile's parts no one paper owns: the routing load per layer, adjacent-layer similarity."""
    if prof.routing:
        r, layers = prof.routing, list(prof.info.moe_layers)
        load = np.array([np.add(lr.prefill, lr.decode) for lr in r.layers], float)
        load = load / np.maximum(load.sum(1, keepdims=True), 1)
        fig, ax = subplots(figsize=(max(6, 0.12 * r.num_experts + 3), max(3.5, 0.2 * len(layers) + 1.5)))
        im = ax.imshow(load, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_yticks(range(len(layers)), [str(x) for x in layers], fontsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="expert", ylabel="MoE layer", title="Routing load per layer (prefill + decode)")
        fig.colorbar(im, ax=ax, label="share of the layer's routed tokens")
        out.append(save(fig, out_dir / f"routing_heatmap{tag}.png"))
    if prof.similarity and prof.similarity.adjacent:
        s = prof.similarity
        fig, ax = subplots(figsize=(6.5, 4))
        ax.plot(range(len(s.adjacent)), s.adjacent, "o-", label="h(l) vs h(l+1), decoder layer outputs")
        for pos, name in (("1", "Attn_in(i+1)"), ("2", "Gate_in(i)"), ("3", "Attn_in(i)")):
            ax.plot([ls.previous for ls in s.layers], [ls.positions[pos] for ls in s.layers], ".--",
                    label=f"Fate pos. {pos}: {name} vs Gate_in(i+1)")
        int_axis(ax, 0, max(len(s.adjacent) - 1, *[ls.previous for ls in s.layers]))
        ax.set(xlabel="layer l (i)", ylabel="mean cosine similarity",
               title="Adjacent-layer similarity (DyMoE Fig. 6, Fate Table 1)")
        ax.legend(fontsize=7)
        out.append(save(fig, out_dir / f"similarity{tag}.png"))


def metric_axes(metrics: list[str], width: float, height: float):
    """One panel per metric side by side: accuracy and perplexity never share a y axis."""
    fig, axes = subplots(1, len(metrics), figsize=(width * len(metrics), height), squeeze=False)
    return fig, dict(zip(metrics, axes[0]))


def ylabel(rows: list[dict], metric: str) -> str:
    higher = next(x["higher"] for x in rows if x["metric"] == metric)
    return f"{metric} ({'higher' if higher else 'lower'} is better)"


def comparison_figures(rows: list[dict], out_dir: Path, out: list[Path]) -> None:
    """TPOT vs quality, one point per evaluated setting paired with a run (`ReportInputs.rows`)."""
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
        handles = [Line2D([], [], color=c, marker=m, linestyle="", label=lab) for lab, (c, m) in style.items()]
        fig.legend(handles=handles, loc="lower center", ncol=min(3, len(handles)), fontsize=8, frameon=False)
        fig.suptitle("Policies: TPOT vs quality (one point per setting)")
        fig.tight_layout(rect=(0, 0.07 * ((len(handles) + 2) // 3), 1, 1))
        fig.savefig(out_dir / "policies.png", dpi=120)
        out.append(out_dir / "policies.png")

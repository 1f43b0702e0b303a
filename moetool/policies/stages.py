"""The policy contract's two optional stage hooks: a paper's own fitting and its own report pieces.

`moetool fit` calls `fit(FitInputs)` on every registered policy class that defines one (`Knobs.fit`,
`knobs.hooked`) and writes what it returns (`Fitted`: knobs, their evidence, warnings, what could not
be fitted and why) into the fit artifact under the policy's name. `moetool report` calls
`report(ReportInputs)` and places what it returns (`Section`: the paper's tables, the figures it
drew, rows for the report's table of the papers' claims). Neither stage names a paper: a fifth paper's fit and report
live in its own files, as its `plan` does (a shipped paper's in `<paper>_knobs.py`, without torch).

    got = POLICIES["smoe"].fit(inputs)          # Fitted(knobs={"alpha": 0.1}, evidence={...})
    part = POLICIES["dymoe"].report(arts)       # Section(markdown="## DyMoE ...", figures=[...])

Nothing here imports a stage (fit, run, report, matplotlib): the engine imports every policy file.
The hooks read the profile, fit, run and eval artifacts through protocols (`ProfileRecord`,
`FitRecord`, `RunRecord`, `EvalRecord`): what a hook may rely on of the real classes,
moetool.profile_artifact.Profile, moetool.fit_artifact.Fit, moetool.run_artifact.Run and
moetool.eval_artifact.Eval, which the stages make (the profile measures with the papers' equations;
a fit's read checks its knobs against this registry; run and eval build the engine, which imports
every policy file).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from moetool.artifacts import ModelFingerprint


# -- the artifacts the hooks read (the module's docstring says why protocols) ---------------------
# Each names what `ReportInputs`' helpers and the policies' `fit` and `report` read; the real
# artifacts carry more.


class FitRecord(Protocol):
    """`moetool.fit_artifact.Fit`: the knobs a fit wrote per policy, and the model it fitted them on."""

    @property
    def model(self) -> ModelFingerprint: ...
    @property
    def params(self) -> dict[str, dict[str, Any]]: ...
    @property
    def evidence(self) -> dict[str, Any]: ...


class ModelInfoRecord(Protocol):
    """`moetool.profile_artifact.ModelInfo`: the model's shapes and memory, which fit sizes budgets with."""

    @property
    def moe_layers(self) -> tuple[int, ...]: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def expert_bytes(self) -> dict[int, int]: ...  # bits -> one expert's blob
    @property
    def expert_bytes_source(self) -> str: ...  # "bundle DIR" or "layout (not quantized)"
    @property
    def non_expert_bytes(self) -> int: ...
    @property
    def kv_margin_bytes(self) -> int: ...
    @property
    def staging_bytes(self) -> int: ...


class ProfileRecord(Protocol):
    """`moetool.profile_artifact.Profile`: one model's measurements. A part not measured is None; the
    parts are the dataclasses beside it (`RoutingProfile`, `SensitivityProfile`, `SimilarityProfile`,
    `PrefetchProfile`, `TimingProfile`), each measured by a module of `moetool/profile/`."""

    @property
    def model(self) -> ModelFingerprint: ...
    @property
    def settings(self) -> dict[str, Any]: ...  # the ProfileConfig it ran with (hw_base, ...)
    @property
    def info(self) -> ModelInfoRecord: ...
    @property
    def routing(self) -> Any: ...  # RoutingProfile | None
    @property
    def sensitivity(self) -> Any: ...  # SensitivityProfile | None
    @property
    def similarity(self) -> Any: ...  # SimilarityProfile | None
    @property
    def prefetch(self) -> Any: ...  # PrefetchProfile | None
    @property
    def timing(self) -> Any: ...  # TimingProfile | None
    @property
    def hw(self) -> dict[str, Any] | None: ...  # the hardware profile written from `timing`


class RunRecord(Protocol):
    """`moetool.run_artifact.Run`: one setting's run, times in seconds on `clock` (wall, or sim on `hw`)."""

    @property
    def policy(self) -> str: ...
    @property
    def params(self) -> dict[str, Any]: ...  # the policy's knobs as it ran
    @property
    def clock(self) -> str: ...
    @property
    def hw(self) -> str | None: ...
    @property
    def budget_bytes(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def ttft_s(self) -> float | None: ...
    @property
    def tpot_s(self) -> dict[str, float] | None: ...  # mean, p50, p99, n
    @property
    def summary(self) -> dict[str, Any]: ...  # every engine counter (hit rate, skips, precision mix, ...)


class EvalRecord(Protocol):
    """`moetool.eval_artifact.Eval`: one setting's task metrics (`primary_metric` picks the headline)."""

    @property
    def policy(self) -> str: ...
    @property
    def params(self) -> dict[str, Any]: ...
    @property
    def metrics(self) -> dict[str, float]: ...
    @property
    def task(self) -> str: ...
    @property
    def options(self) -> dict[str, Any]: ...  # how it was scored (data, context, limit, few-shot, ...)
    @property
    def inputs(self) -> dict[str, str]: ...  # sha256 of the files it read, a ppl text's among them


# -- fit -------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class FitTargets:
    """What the user asks of the fits (`FitInputs.config`); `fit.FitConfig` adds the inputs, the sweep
    and the refusals of values no fit could use."""

    alphas: tuple[float, ...] = ()  # SMoE: the sweep's alphas (FitConfig's default: smoe_fit.ALPHAS)
    target_tpot: float | None = None  # R of SMoE eq. 5, seconds
    max_loss: float = 0.01  # Fate p: relative loss allowed (1% in §4.5)
    l_threshold: float = 0.7  # Fate L: decode prefetch recall every deeper layer keeps (Fate reports 77-79% mean)
    r: float | None = None  # DyMoE target share of critical experts (Table 2 r); None: what `budget` holds, else §6.2's 0.75
    budget: str | None = None  # device budget (12GiB) or expert cache share (25%), for DyMoE and DynaExq


@dataclass(frozen=True)
class FitInputs:
    """What `moetool fit` hands one policy's `fit`: the profile, the run and eval artifacts given
    (of the profile's model, in the order given), the user's targets, and the sweep.

    `sweep(settings)` runs this policy with `settings` on the `--sweep` engine (the sim clock, the
    sweep's budget, hardware and prompts) and returns the `Run`; it is None without `--sweep`.
    """

    policy: str  # the name the policy is registered under
    profile: ProfileRecord
    runs: tuple[tuple[str, RunRecord], ...]  # (path, run)
    evals: tuple[tuple[str, EvalRecord], ...]  # (path, eval)
    config: FitTargets  # the targets: target_tpot, max_loss, l_threshold, r, budget, alphas
    cache_bytes: int | None  # device bytes `--budget` leaves for experts, as the engine splits it (None: no budget)
    sweep: Callable[[dict[str, str]], RunRecord] | None = None
    sweep_note: str = ""  # how the sweep ran, for the evidence's "from"
    # what the sweep's runs ran at: its --budget and the expert cache it leaves, and its --hw's link
    # ("h2d_gbps", "copy_latency_s"): a knob fitted from them holds there (`knobs.Sizing`)
    sweep_sized: dict[str, Any] | None = None
    progress: Callable[[str, int, int], None] | None = None  # (part, done, total)
    # the cache `--budget` leaves where only these precisions are staged, as a run of a policy that
    # loads only them stages (`Policy.bits_in_use`); None: no budget
    staged_cache: Callable[[tuple[int, ...]], int] | None = None

    def cache_for(self, bits: tuple[int, ...]) -> int | None:
        """The expert cache a run of a policy loading `bits` (stored ones) gets from `--budget`."""
        if self.staged_cache is None:
            return self.cache_bytes
        stored = tuple(b for b in bits if b in self.profile.info.expert_bytes)
        return self.staged_cache(stored)


@dataclass
class Fitted:
    """What a policy's `fit` found: knobs (Params fields) and, per knob, the evidence it came from.

    `skipped` says, per knob, why it could not be fitted from these inputs (written as
    "<policy>.<knob>" beside the other policies'); `warnings` are fitted-but-doubtful notes.
    Evidence without knobs is kept (SMoE's T(alpha) fitted without a target to choose alpha from).
    """

    knobs: dict[str, Any] = field(default_factory=dict)
    evidence: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


# An eval's headline metric, in this order: accuracy, perplexity, then lm-eval's other usual ones
# (generation tasks' exact_match, loglikelihood_rolling's word_perplexity), then its first number.
_HEADLINES = ("accuracy", "acc", "acc_norm", "mean_accuracy", "perplexity", "ppl", "exact_match", "f1", "bleu",
              "mcc", "word_perplexity", "byte_perplexity", "bits_per_byte")
_LOWER_IS_BETTER = ("perplexity", "ppl", "bits_per_byte", "loss", "nll", "error", "ter")  # parts of a name


def primary_metric(metrics: dict[str, Any]) -> tuple[str, float, bool] | None:
    """(name, value, higher is better) of an eval's headline number (`_HEADLINES`), else its first number
    that is no standard error (a task's own metric: a report leaves no eval out for its name); a name
    that reads as a loss, perplexity or error is lower-better."""
    flat: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            flat[k] = float(v)
        elif isinstance(v, dict):
            flat.update({f"{k}.{kk}": float(vv) for kk, vv in v.items()
                         if isinstance(vv, (int, float)) and not isinstance(vv, bool)})
    pick = next((name for key in _HEADLINES for name in flat if name == key or name.endswith("." + key)), None)
    if pick is None:
        pick = next((name for name in flat if "stderr" not in name), None)
    if pick is None:
        return None
    last = pick.rsplit(".", 1)[-1]
    lower = last in _LOWER_IS_BETTER or "perplexity" in last or any(w in _LOWER_IS_BETTER for w in last.split("_"))
    return pick, flat[pick], not lower


def differences(settings: list[dict[str, str]]) -> str:
    """The parts of `settings` (each a dict of the same keys, its values as text) that are not all the same, as "hw rtx3090 / hw h100sxm; ..." ("" if none)."""
    parts = []
    for key in settings[0] if settings else ():
        values = list(dict.fromkeys(s[key] for s in settings))
        if len(values) > 1:
            parts.append(" / ".join(values))
    return "; ".join(parts)


# -- report ----------------------------------------------------------------------------------------

_PRESETS = Path(__file__).resolve().parents[1] / "hw_presets"  # engine.clock.HW_DIR, without torch


@functools.cache
def _presets_by_digest() -> dict[str, str]:
    from moetool.artifacts import sha256_file

    return {sha256_file(f): f.stem for f in sorted(_PRESETS.glob("*.json"))}


def machine(clock: str | None, hw: str | None, inputs: dict[str, str] | None) -> str | None:
    """The clock a run's or an eval's times are on, as report and fit tell machines apart: "wall", a
    shipped preset by its name ("sim/rtx3090", however it was given), a profile of one's own by its file
    name and content ("sim/hw.json 3f9c2a1b7d4e": two experiments' hw.json were one machine, averaged into
    one Table 3 cell). The content is the file's sha256 among the artifact's inputs (`run.prepare`); an
    artifact that does not record it is known by the name as given. None: no clock recorded."""
    if not clock:
        return None
    if not hw:
        return clock
    name = Path(hw).name
    digest = next((v for k, v in (inputs or {}).items() if Path(k).name in (name, f"{name}.json")), None)
    if digest is None:
        return f"{clock}/{hw}"
    preset = _presets_by_digest().get(digest)
    return f"{clock}/{preset}" if preset else f"{clock}/{name} {digest[:12]}"


def bundle_of(inputs: dict[str, str] | None) -> str | None:
    """The bundle an artifact ran, by its manifest's sha256 (None: experts from a checkpoint)."""
    key = next((k for k in (inputs or {}) if Path(k).name == "bundle.json"), None)
    return None if key is None else (inputs or {})[key]


def bundle_names(inputs: list[dict[str, str] | None]) -> dict[str | None, str]:
    """How a report names each bundle among artifacts' `inputs`: by as many last parts of its directory as
    tell it from the others' (g16/bundle, g8/bundle: both "bundle" had been one row), with its digest
    where one directory held two (quantized again); "none" for experts read from a checkpoint."""
    dirs: dict[str, Path] = {}
    for i in inputs:
        key = next((k for k in (i or {}) if Path(k).name == "bundle.json"), None)
        if key is not None:
            dirs.setdefault((i or {})[key], Path(key).parent)
    shown = shown_names(list(dict.fromkeys(dirs.values())))
    twice = {d for d in dirs.values() if list(dirs.values()).count(d) > 1}
    names: dict[str | None, str] = {None: "none"}
    names.update({sha: shown[d] + (f" {sha[:12]}" if d in twice else "") for sha, d in dirs.items()})
    return names


def shown_names(paths: list[Path]) -> dict[Path, str]:
    """How a report names each artifact: its file name, or where several share one, as many of their
    last path parts as tell them apart (`a/lru.run.json`, `backup/lru.run.json`)."""
    by_name: dict[str, list[Path]] = {}
    for p in dict.fromkeys(paths):
        by_name.setdefault(p.name, []).append(p)
    names = {}
    for same in by_name.values():
        for p in same:
            n = 1
            while n < len(p.parts) and any(q.parts[-n:] == p.parts[-n:] for q in same if q != p):
                n += 1
            names[p] = "/".join(p.parts[-n:])
    return names


@dataclass(frozen=True)
class ReportInputs:
    """What `moetool report` hands one policy's `report`: the artifacts of one model, in the order
    found, and the directory its figures go to. Evals stay dicts (report takes hand-made ones).

    `rows` pairs each eval that has a headline metric with the run of the same setting and budget:
    {"label", "policy", "params", "metric", "value", "higher", "tpot" (None: no such run), "eval", "run"}.
    """

    profiles: tuple[tuple[Path, ProfileRecord], ...]
    fits: tuple[tuple[Path, FitRecord], ...]
    runs: tuple[tuple[Path, RunRecord], ...]
    evals: tuple[tuple[Path, dict], ...]
    rows: tuple[dict[str, Any], ...]
    out_dir: Path
    names: dict[Path, str] = field(default_factory=dict)  # how the report names each artifact (`shown_names`)

    def shown(self, path: Path) -> str:
        """How the report names the artifact at `path`: its file name, or its last path parts where two
        artifacts share a file name (`backup/lru.run.json`)."""
        return self.names.get(path, path.name)

    def tag(self, path: Path) -> str:
        """The suffix of a figure drawn for one profile or fit: "" when the report has one of that
        kind, else "-<its shown name, less the suffixes>" (sensitivity-a.png, sensitivity-b.png;
        two a.profile.json in other directories drew over each other's)."""
        import re

        many = len(self.profiles) > 1 if any(p == path for p, _ in self.profiles) else len(self.fits) > 1
        stem = self.shown(path).removesuffix(".json").removesuffix(".profile").removesuffix(".fit")
        return "-" + re.sub(r"[^A-Za-z0-9_.-]", "_", stem) if many else ""

    def fits_for(self, prof: ProfileRecord) -> list[FitRecord]:
        """The fits made for `prof`'s model (what a profile figure may mark its fitted knob on)."""
        return [f for _, f in self.fits if f.model.same_model(prof.model)]

    def ppl_pair(self, a: tuple[str, dict[str, Any]], b: tuple[str, dict[str, Any]]) -> tuple[dict, dict] | None:
        """Two perplexity evals to compare in a claim: one of policy a[0] and one of b[0], each with its
        recorded params including the knobs given (floats to 1e-9), that measured the same thing
        (`ppl_measurement`: one text's content, window, limit, stepwise). A claim divided one by the
        other whatever each had scored, so a `--limit` smoke eval beside a full one reversed verdicts.
        Of several such pairs, the one that scored the most text (no limit first), in file order."""
        def matches(policy: str, knobs: dict[str, Any]) -> list[dict]:
            return [e for _, e in self.evals if e.get("task") == "ppl" and e.get("policy") == policy
                    and _includes(e.get("params") or {}, knobs)]

        pairs = [(x, y) for x in matches(*a) for y in matches(*b) if ppl_measurement(x) == ppl_measurement(y)
                 and _weights(x) == _weights(y)]
        if not pairs:
            return None
        return max(pairs, key=lambda p: (p[0].get("options", {}).get("limit") is None,
                                         p[0].get("options", {}).get("limit") or 0))


def ppl_measurement(e: dict) -> tuple:
    """What a perplexity eval measured: its text (name and content digest), window, token limit, and
    whether it was scored a token at a time (`report` gives each its own column)."""
    o, inputs = e.get("options") or {}, e.get("inputs") or {}
    data = str(o.get("data", ""))
    limit = o.get("limit")
    windows = [w for w in ((e.get("samples") or {}).get("ppl") or []) if isinstance(w, dict)]
    try:  # a limit past the text's end read the whole text: one measurement with the eval given none
        read = max(int(w["start"]) + int(w["tokens"]) + 1 for w in windows) if windows else None
    except (KeyError, TypeError, ValueError):
        read = None
    if isinstance(limit, int) and read is not None and read < limit:
        limit = None
    return (Path(data).name, inputs.get(data, ""), o.get("context"), limit, bool(o.get("stepwise")))


def _weights(e: dict) -> tuple:
    """What a claim's two evals must share besides the text: the compute dtype and the weights read (the
    bundle's digest, or none for a checkpoint's own): bf16 against fp32 moves a perplexity by tenths of a
    percent, the size of the claims' margins."""
    bundles = tuple(sorted(v for k, v in (e.get("inputs") or {}).items() if str(k).endswith("bundle.json")))
    return e.get("dtype", "float32"), bundles  # an eval from before dtype was recorded ran in fp32


def _includes(params: dict[str, Any], knobs: dict[str, Any]) -> bool:
    import math

    def same(x: Any, y: Any) -> bool:
        if isinstance(y, dict):
            return isinstance(x, dict) and all(same(x.get(k), v) for k, v in y.items())
        if isinstance(y, float) and isinstance(x, (int, float)):
            return math.isclose(x, y, rel_tol=1e-9)
        return x == y

    return same(params, knobs)


@dataclass
class Section:
    """A paper's part of the report. `markdown` goes under its own `## ` heading (the paper's tables:
    an ablation, a fitted schedule, a table of its profile parts); `figures` are the PNGs it wrote
    into `ReportInputs.out_dir`; `claims` are rows of the report's "papers' trends" table, each
    [claim, measured, difference, "met", "not met" or "inconclusive"]."""

    markdown: str = ""
    figures: list[Path] = field(default_factory=list)
    claims: list[list[str]] = field(default_factory=list)


def cache_bytes(r: Any) -> int:
    """The device bytes a run left its experts (what `--budget` chose for them), else its whole budget: the
    KV and activation margin beside them can be most of a small model's budget."""
    cache = (r.budget or {}).get("cache_bytes")
    return int(cache) if isinstance(cache, int) else r.budget_bytes


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table; floats to 5 significant digits, None as "-"."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:.5g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]) + "\n"


__all__ = ["cache_bytes", "EvalRecord", "FitInputs", "FitTargets", "Fitted", "ModelInfoRecord", "ProfileRecord", "ReportInputs", "RunRecord",
           "Section", "primary_metric", "table"]

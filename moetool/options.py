"""The CLI options several commands share, declared once as `Annotated` aliases, and their parsers.

    @command
    def run(model: ModelOpt = None, bundle: BundleOpt = None, policy: PolicyOpt = "lru", ...) -> None:

Defaults stay at each command's parameter (eval's budget is 100%, run's 25%); the help, the type
and the choices live here. Values are checked by the configs they fill (`EngineSpec.check`, ...),
so a command, a grid cell and a Python caller are refused with the same sentence.
"""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from moetool.errors import MoetoolError
from moetool.spec import CLOCKS, COMPUTE_DTYPES, DECODE_PATHS, DEFAULT_BUDGET, DEFAULT_HW, EXPERTS_IMPLS

Clock = Enum("Clock", {c: c for c in CLOCKS}, type=str)  # a `str, Enum`: Typer shows and checks the choices
Dtype = Enum("Dtype", {d: d for d in ("auto", *COMPUTE_DTYPES)}, type=str)
ExpertsImpl = Enum("ExpertsImpl", {i: i for i in EXPERTS_IMPLS}, type=str)
Decode = Enum("Decode", {d: d for d in DECODE_PATHS}, type=str)


ModelArg = Annotated[str, typer.Argument(help="A local Hugging Face model directory, a hub id, or 'demo'.")]
ModelOpt = Annotated[str | None, typer.Option(help="Model: a local directory, a hub id, or 'demo' (default: the "
                                              "--bundle's own model, else demo).")]
BundleOpt = Annotated[Path | None, typer.Option(help="Quantized bundle directory; it holds the whole model, so "
                                                "--model is optional (default: experts from the checkpoint).")]
# The shipped policies' names, written out: the registry's import (numpy and every paper's knobs) is a
# cost `--help` should not pay; `tests/test_cli.py` checks the two agree. `EngineSpec.check` refuses an
# unknown name with a sentence that lists every registered one (a policy of your own included).
SHIPPED_POLICIES = ("resident", "static", "lod", "lru", "eap", "fate", "dymoe", "dynaexq", "smoe")
PolicyOpt = Annotated[str, typer.Option(metavar="POLICY", help=f"Policy: {', '.join(SHIPPED_POLICIES[:5])} (baselines), "
                                        f"{', '.join(SHIPPED_POLICIES[5:])} (the papers), or one you registered; "
                                        "README's policy table has their knobs.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="Policy knob key=value (repeatable).")]
FitOpt = Annotated[Path | None, typer.Option(help="Fit artifact whose knobs for this policy are used (--set wins).")]
BudgetOpt = Annotated[str, typer.Option(help=f"Device budget: a size (12GiB) or the expert cache as a share of the "
                                        f"experts at 16 bits ({DEFAULT_BUDGET}; bf16 from a bundle, the compute dtype "
                                        "without one).")]
ClockOpt = Annotated[Clock, typer.Option(help="wall (measured) or sim (modelled on --hw).")]
HwOpt = Annotated[str, typer.Option(help=f"Hardware profile for the sim clock: a preset name ({DEFAULT_HW}, ...) "
                                    f"or a profile JSON.")]
DeviceOpt = Annotated[str, typer.Option(help="cpu or cuda (cuda:N).")]
DtypeOpt = Annotated[Dtype, typer.Option(help="Compute dtype; auto: bf16 on CUDA, fp32 on CPU.")]
HostBudgetOpt = Annotated[str | None, typer.Option(help="Host memory for pinned experts and the staging ring (e.g. "
                                                   "32GiB; default on CUDA: free memory less a margin; on a CPU, "
                                                   "experts are read from the mapped bundle unless given).")]
ExpertsImplOpt = Annotated[ExpertsImpl, typer.Option(help="Expert compute: grouped_mm (grouped GEMMs, bit-exact "
                                                 "against transformers' default kernel) or eager (one expert at a "
                                                 "time, bit-exact against its eager loop).")]
DecodeOpt = Annotated[Decode, typer.Option(help="Decode path: captured (the whole step as one compiled program, "
                                           "a CUDA graph on a GPU; the policy's host half one step behind), host "
                                           "(the engine driven per layer from the host), or auto (the faster on the "
                                           "device: captured on CUDA, host on a CPU). The run records which ran and why.")]
BatchOpt = Annotated[int, typer.Option(help="Sequences per forward (prompts per batch).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON instead of a table.")]


def parse_settings(pairs: list[str] | None, option: str = "--set") -> dict[str, str]:
    """`["a=1", "b=x"]` -> {"a": "1", "b": "x"}."""
    settings: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise MoetoolError(f"{option} takes key=value, not '{pair}'.")
        if key.strip() in settings:  # the last would win without a word
            raise MoetoolError(f"{option} gives {key.strip()} twice ({settings[key.strip()]} and {value.strip()}); "
                               "give it once.")
        settings[key.strip()] = value.strip()
    return settings


def parse_seconds(text: str | None, option: str = "--target-tpot") -> float | None:
    """'0.05', '0.05s' or '50ms' -> seconds."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(ms|s)?\s*", text)
    if not m:
        raise MoetoolError(f"{option} takes seconds such as 0.05 or 50ms, not '{text}'.")
    return float(m.group(1)) * (1e-3 if m.group(2) == "ms" else 1.0)


def parse_numbers(text: str, option: str, kind: type = float) -> tuple[Any, ...]:
    """'8,4,2' -> (8, 4, 2), or one sentence naming `option`."""
    what = "integers" if kind is int else "numbers"
    try:
        values = tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise MoetoolError(f"{option} takes comma-separated {what}, not '{text}'.") from None
    if not values:  # `--bits=` would otherwise quietly mean "none of them"
        raise MoetoolError(f"{option} takes one or more comma-separated {what}, not an empty list.")
    return values


def spec_fields(model: str | None, bundle: Path | None, policy: str, set_: list[str] | None, fit: Path | None,
                budget: str, clock: Clock, hw: str, device: str, dtype: Dtype,
                host_budget: str | None, experts_impl: ExpertsImpl = ExpertsImpl.grouped_mm,
                decode: Decode = Decode.auto) -> dict[str, Any]:
    """The `EngineSpec` fields of the shared options, as run and eval take them."""
    return dict(model=model, bundle=bundle, policy=policy, settings=parse_settings(set_), fit=fit, budget=budget,
                clock=Clock(clock).value, hw=hw, device=device, dtype=Dtype(dtype).value, host_budget=host_budget,
                experts_impl=ExpertsImpl(experts_impl).value, decode=Decode(decode).value)


def fit_note(fit: Path | None, policy: str) -> str | None:
    """What to say when `--fit` holds no knob for `policy` though its paper fits some (`moetool fit`
    skipped them: SMoE's alpha without runs, DynaExq's n_hi without --budget): the run takes the
    policy's defaults, which it would otherwise do without a word while recording the fit as an input.
    Said too for a policy no fit is for (lru): the fit is an input it never reads. None where the fit
    holds some, or cannot be read (the run says why)."""
    from moetool.fit_artifact import Fit
    from moetool.policies import POLICIES
    from moetool.policies.knobs import hooked

    if fit is None or policy not in POLICIES:
        return None
    try:
        loaded = Fit.load(Path(fit))
    except MoetoolError:
        return None
    if loaded.params.get(policy):  # the run takes them, or refuses knobs no fit writes (`run.fitted_knobs`)
        return None
    if not any(issubclass(POLICIES[policy], cls) for _, cls in hooked("fit")):  # lru, lod, resident...
        return f"policy '{policy}' has no fitted knobs (no paper's fit is its), so --fit changes nothing for it."
    why = [f"{k}: {v}" for k, v in loaded.evidence.get("skipped", {}).items() if k.startswith(f"{policy}.")]
    said = f" (it says {why[0]})" if why else ""
    return f"{fit} holds no fitted knob of policy '{policy}'{said}; it runs on its defaults."



def engine_notes(wall_hw: bool, hw: str, fit: Path | None, policy: str, summary: dict[str, Any]) -> list[str]:
    """What `run` and `eval` say after the work of how their engine options were taken: `--hw` given on
    the wall clock (`wall_hw`), a count knob's default clamped to the model (`policies.base.check_at_most`),
    a fit with nothing for the policy, fitted knobs the run did not take."""
    said = [wall_hw_note(hw)] if wall_hw else []
    said += [f"{why.rstrip('.')}: its default ran clamped to that (recorded under summary.clamped)."
             for why in (summary.get("clamped") or {}).values()]
    said += list(summary.get("policy_notes") or []) + list(summary.get("text_notes") or [])
    for key in ("host_budget_unread", "hw_measured_elsewhere", "hw_measured_implausible"):
        if summary.get(key):
            said.append(f"{summary[key]} (recorded under summary.{key}).")
    unmatched = summary.get("router_scores_unmatched")
    if unmatched:
        said.append(f"the routers of MoE layers {', '.join(map(str, unmatched))} choose by a rule moetool does not "
                    f"reproduce (e.g. by token id), so '{policy}' reads their scores as softmax(logits) there "
                    "(recorded under summary.router_scores_unmatched).")
    return said + [n for n in (fit_note(fit, policy), fit_dropped_note(fit, policy, summary)) if n is not None]


def wall_hw_note(hw: str) -> str:
    """What `--hw` does on the wall clock, where nothing is simulated: the times are this machine's,
    and the run records no `hw`; only the costs a cost-aware policy decides with are the preset's."""
    return (f"--hw {hw} on the wall clock times nothing (the times are this machine's); it gives only the costs "
            "that cost-aware policies decide with (Fate's n, SMoE's load-or-compute), recorded as "
            "summary.policy_hw. Add --clock sim to simulate that machine.")

def fit_dropped_note(fit: Path | None, policy: str, summary: dict[str, Any]) -> str | None:
    """What to say when the run did not take some of `--fit`'s knobs (`summary["fit_dropped"]`): they
    were sized for another budget or tiers, and the policy's defaults ran in their place."""
    dropped = summary.get("fit_dropped") or {}
    if not dropped:
        return None
    why = "; ".join(f"{k} ({v})" for k, v in dropped.items())
    hint = " (`moetool fit --budget` fits for this run's budget)" if "--budget" in why else ""
    return (f"{fit} fitted for policy '{policy}': {why}; this run takes the policy's default for "
            f"{'it' if len(dropped) == 1 else 'them'}{hint}.")

__all__ = ["BatchOpt", "BudgetOpt", "BundleOpt", "Clock", "ClockOpt", "Decode", "DecodeOpt", "DeviceOpt", "Dtype", "DtypeOpt", "FitOpt",
           "ExpertsImpl", "ExpertsImplOpt", "HostBudgetOpt", "HwOpt", "JsonOpt", "ModelArg", "ModelOpt", "PolicyOpt", "SetOpt",
           "engine_notes", "fit_dropped_note", "fit_note", "wall_hw_note", "parse_numbers", "parse_seconds", "parse_settings", "spec_fields"]

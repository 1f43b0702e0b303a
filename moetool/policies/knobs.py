"""The half of the policy contract the engine does not need: the registry, each policy's knobs and its
fit and report hooks, without torch.

`moetool report`, `moetool fit` and the checks of `--set` and of an artifact's knobs read only this
half, so they never wait for torch. A shipped policy is registered twice under its name: first its
knobs (`Knobs`, in `<paper>_knobs.py`, which `moetool.policies` imports), then its engine half (a
`Policy` subclassing those knobs, in `<paper>.py`, which `make_policy` imports) takes their place. A
policy written in one file (`README.md`) subclasses `Policy` and registers once.

    parse_params(POLICIES["fate"], {"L": "4"})      # Fate's Params(L=4, ...), or one sentence
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from moetool.errors import MoetoolError, article, quote, size_text

if TYPE_CHECKING:
    from moetool.policies.stages import FitInputs, Fitted, ReportInputs, Section

K = TypeVar("K", bound="type[Knobs]")


@dataclass(frozen=True)
class Params:
    """Base of each policy's knobs; subclasses add fields named as in the paper."""


class Knobs:
    """A policy as the stages that do not run it see it: its registered `name`, its knobs (`Params`),
    the knobs derived from others, and two optional hooks, `fit` (its knobs from a profile, runs and
    evals) and `report` (its tables, figures and claims), found through the registry by `moetool fit`
    and `moetool report` (`policies/stages.py`). `Policy` (`base.py`) adds what the engine calls."""

    name: ClassVar[str] = "base"
    Params: ClassVar[type[Params]] = Params
    # knob -> the knobs it is derived from: a fitted value of the former is dropped when `--set`
    # gives one of the latter (a fit's DyMoE lam was solved for the fit's r, not for the r asked for).
    derived: ClassVar[dict[str, tuple[str, ...]]] = {}
    # knob -> a dataclass of the evidence fields this policy's `report` reads of a fit's evidence for it:
    # a fit artifact's evidence is checked against it when read, so a hand-edited one is a sentence,
    # not a traceback in the middle of drawing (other evidence fields are free-form).
    evidence: ClassVar[dict[str, type]] = {}
    # shorthand knob -> the knobs it sets (DyMoE's `config` "4/2" sets high_bits and low_bits): `--set`
    # giving both is refused, since the shorthand wins and the other was dropped without a word.
    shorthands: ClassVar[dict[str, tuple[str, ...]]] = {}
    # knob -> (another knob, the test its value passes when the first is read, that test in words):
    # `--set window=9` beside `eviction=lru` changed nothing while the run recorded window=9, so a knob
    # `--set` gives where its policy never reads it is refused (a fit's knobs are all the fit's).
    applies: ClassVar[dict[str, tuple[str, Callable[[Any], bool], str]]] = {}
    # knobs whose `fit` records what each value holds for under evidence "sized_for" (`Sizing`; an empty
    # one holds anywhere): a fitted value without it (a fit written before sizes were recorded) cannot be
    # checked against a run's budget, tiers or machine, so the run takes the default and says so.
    sized: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def fit(cls, inputs: FitInputs) -> Fitted | None:
        """`moetool fit`: the knobs this paper fits from a profile, runs and evals, each with its
        evidence; None where it fits nothing. Called once per fit, under the first name it is registered with."""
        return None

    @classmethod
    def report(cls, inputs: ReportInputs) -> Section | None:
        """`moetool report`: this paper's tables, figures and claims; None where it adds nothing."""
        return None

    @classmethod
    def fitted_disagree(cls, fitted: dict[str, Any], moe_layers: int, top_k: int) -> dict[str, str]:
        """Fitted knobs another knob of the same fit contradicts (one of a derived pair edited by hand),
        knob -> why the run drops it; the run takes the other and says so."""
        return {}


POLICIES: dict[str, type[Knobs]] = {}


def register(name: str) -> Callable[[K], K]:
    """Register a policy class under `name`. A name is taken once, except by the engine half of the
    knobs registered under it (a subclass of a class with no `plan`): a policy's engine half takes the
    place of its knobs. A subclass of a whole policy registered under that policy's name would run as it,
    recorded as it (a lossy tweak of `lru` recorded as the lossless baseline). A researcher's class defined
    again where it was (a notebook cell run again after an edit) replaces itself."""
    def deco(cls: K) -> K:
        have = POLICIES.get(name)
        again = (have is not None and (have.__module__, have.__qualname__) == (cls.__module__, cls.__qualname__)
                 and not have.__module__.startswith("moetool."))
        if have is not None and have is not cls and not again and (not issubclass(cls, have) or hasattr(have, "plan")):
            raise MoetoolError(f"the policy name {name!r} is taken (by {have.__module__}.{have.__qualname__}); register "
                               f"{cls.__qualname__} under a name of its own.")
        cls.name = name
        POLICIES[name] = cls
        return cls
    return deco


USER_POLICIES = "MOETOOL_POLICIES"  # the environment variable naming a researcher's policy modules
_loaded: set[str] = set()


def load_user_policies() -> None:
    """Import the modules MOETOOL_POLICIES names (comma-separated: importable module names, or paths of
    .py files), so that the policies they register answer to `--policy NAME` in every command, and in
    a sweep's Ray workers, which inherit the variable. Each once; one sentence for one that fails."""
    import importlib
    import importlib.util
    import os
    import sys
    from pathlib import Path

    for entry in (e.strip() for e in os.environ.get(USER_POLICIES, "").split(",")):
        if not entry or entry in _loaded:
            continue
        try:
            if entry.endswith(".py"):
                path = Path(entry).expanduser()
                spec = importlib.util.spec_from_file_location(path.stem, path)
                if spec is None or spec.loader is None or not path.is_file():
                    raise FileNotFoundError(f"no file {path}")
                module = importlib.util.module_from_spec(spec)
                sys.modules[path.stem] = module
                spec.loader.exec_module(module)
            else:
                importlib.import_module(entry)
        except MoetoolError:
            raise
        except Exception as e:  # noqa: BLE001 - the researcher's module: its error, named, in one sentence
            raise MoetoolError(f"{USER_POLICIES} names {entry!r}, which does not import: {type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}".rstrip(": ") + ".") from None
        _loaded.add(entry)


def raised_in_a_policy(e: BaseException) -> str | None:
    """The sentence for an error raised in a researcher's policy (a registered class's file outside
    moetool), naming it and the line: "a bug in moetool" sent them to report their own code."""
    import inspect
    import traceback

    files = {}
    for name, cls in POLICIES.items():
        try:
            source = None if cls.__module__.startswith("moetool.") else inspect.getsourcefile(cls)
        except TypeError:  # a class defined where no file is (a notebook's cell, `python -c`)
            source = None
        if source:
            files.setdefault(source, name)
    frame = next((f for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename in files), None)
    return None if frame is None else (f"the error above was raised in policy '{files[frame.filename]}' "
                                       f"({frame.filename}:{frame.lineno}), the policy's own code, not moetool's.")


def user_modules() -> set[str]:
    """The module names of what MOETOOL_POLICIES named and `load_user_policies` imported."""
    return {e[:-3].replace("\\", "/").rsplit("/", 1)[-1] if e.endswith(".py") else e for e in _loaded}


def hooked(hook: str) -> list[tuple[str, type[Knobs]]]:
    """(name, class) of each registered policy whose `hook` ("fit" or "report") a stage calls: each
    paper's once, under the first name registered with it (a variant subclassing DyMoE does not fit
    DyMoE again, nor does DyMoE's engine half), and none that only inherits the default."""
    load_user_policies()
    seen, out = {getattr(Knobs, hook).__func__}, []
    for name, cls in POLICIES.items():
        fn = getattr(cls, hook).__func__
        if fn not in seen:
            seen.add(fn)
            out.append((name, cls))
    return out


def parse_tiers(config: str, examples: str) -> tuple[int, int] | None:
    """(high, low) bits of a "HIGH/LOW" shorthand as the papers' tables write tiers ("4/2", "16/4";
    DyMoE's "4/0" skips the low tier), or None for "" (the policy's two bits knobs then hold).
    A `ValueError` (one sentence at the CLI, from `Params.__post_init__`) for anything else."""
    if not config:
        return None
    parts = config.split("/")
    if len(parts) != 2 or not all(x.strip().isdigit() for x in parts):
        raise ValueError(f"config takes 'HIGH/LOW' bits such as {examples}, not {quote(config)}")
    return int(parts[0]), int(parts[1])


def parse_params(cls: type[Knobs], settings: dict[str, str], fitted: dict[str, Any] | None = None) -> Params:
    """Build `cls.Params` from fitted values overridden by `--set key=value` strings."""
    fields = {f.name: f for f in dataclasses.fields(cls.Params)}
    for short, spelled in cls.shorthands.items():
        both = [k for k in spelled if k in settings]
        if settings.get(short) and both:
            raise MoetoolError(f"policy '{cls.name}': --set {short}={settings[short]} sets {' and '.join(spelled)}, "
                               f"and --set {both[0]}={settings[both[0]]} sets it too; give one of them.")
    values: dict[str, Any] = {}
    fitted = {k: v for k, v in (fitted or {}).items()
              if not (k in cls.derived and any(d in settings for d in cls.derived[k]) and k not in settings)}
    for source, items in (("fit", fitted), ("--set", settings)):
        for key, raw in items.items():
            if key not in fields:
                known = ", ".join(sorted(fields)) or "none"
                if source == "fit":
                    continue  # a fit artifact carries knobs for several policies
                raise MoetoolError(f"policy '{cls.name}' has no knob {quote(key)} (its knobs: {known}).")
            values[key] = _coerce(cls.name, key, fields[key].type, raw)
    for key, value in values.items():
        _check_range(cls, key, value)
    try:
        params = cls.Params(**values)
    except (TypeError, ValueError) as e:
        raise MoetoolError(f"invalid knobs for policy '{cls.name}': {str(e).rstrip('.')}.") from None
    for key in settings:
        if key in cls.applies:
            other, reads, when = cls.applies[key]
            if not reads(getattr(params, other)):
                raise MoetoolError(f"policy '{cls.name}': --set {key}={settings[key]} changes nothing with "
                                   f"{other}={_spelled(getattr(params, other))}, since {key} is read only with {when}; "
                                   f"leave {key} out, or change {other}.")
    return params


def _spelled(value: Any) -> str:
    """A knob's value as `--set` spells it (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class Sizing:
    """What a fitted knob was sized for, in its evidence under "sized_for": the --budget (and the expert
    cache it left, for the record), the values of the knobs the size assumed (the tiers), and the costs
    it assumed (`t_load.<bits>`: one expert's copy, seconds). DynaExq's n_hi (§3.1) and DyMoE's
    budget-derived r hold for one budget and tiers, Fate's n (§4.3) for one link, SMoE's alpha for the
    budget, knobs and machine of the runs its T(alpha) went through; `stale_fitted` drops them from a
    run that has others. Without a --budget (runs record the bytes, not the option), `cache_bytes` is
    what is compared."""

    budget: str | None = None
    cache_bytes: int | None = None
    knobs: dict[str, Any] | None = None
    costs: dict[str, float] | None = None
    # The decode path whose step the knob was sized on (Fate's n divides a layer's time, which the
    # captured step shortens; SMoE's alpha was read off runs of one path): None, any path.
    path: str | None = None


COST_TOLERANCE = 0.1  # relative: a cost within it is the same machine's (a hw profile written from a profile)
CACHE_TOLERANCE = 0.02  # relative: runs' expert caches within it are one budget's (margins of a few tokens apart)


def resolved(cls: type[Knobs], params: Params) -> dict[str, Any]:
    """`params` as the policy reads them: a shorthand ("config" "4/0") in place of the knobs it sets."""
    values = dataclasses.asdict(params)
    for short, spelled in cls.shorthands.items():
        tiers = parse_tiers(values.get(short) or "", "")
        if tiers is not None:
            values.update(zip(spelled, tiers))
    return values


def stale_fitted(cls: type[Knobs], settings: dict[str, str], fitted: dict[str, Any],
                 sizing: dict[str, Sizing],
                 same_budget: Callable[[str], bool], budget: str, costs: dict[str, float] | None = None,
                 machine: str = "", cache_bytes: int | None = None, path: str = "host") -> dict[str, str]:
    """The fitted knobs a run does not take, each with why: sized (`Sizing`) for another --budget than
    `budget` (`same_budget` compares them as the engine reads budgets; without one, for another expert
    cache than `cache_bytes`), for another decode `path`, for other values of the knobs the size assumed than this run's, or
    for other costs than `costs` (this run's, of `machine`) beyond
    COST_TOLERANCE; then any fitted knob `derived` from one of those, and any the
    policy does not read beside this run's other knobs (`Knobs.applies`). A knob `--set`
    gives is not the fit's and stays. The policy's default takes a dropped knob's place (DynaExq's
    n_hi < 0 derives it from this run's budget), and the run says so."""
    fitted = {k: v for k, v in fitted.items() if k not in settings}
    kept = {k: v for k, v in fitted.items() if k not in sizing}
    here = resolved(cls, parse_params(cls, settings, kept))
    drops: dict[str, str] = {knob: "recorded without what it was sized for (budget, tiers, machine), so this run "
                                   "cannot tell that it holds here; a fit written now records it (re-run moetool fit)"
                             for knob in cls.sized if knob in fitted and knob not in sizing}
    for knob, size in sizing.items():
        if knob not in fitted:
            continue
        if size.budget is not None and not same_budget(size.budget):
            drops[knob] = f"sized for --budget {size.budget}, and this run has --budget {budget}"
            continue
        if size.budget is not None and not size.budget.strip().endswith("%") and size.cache_bytes is not None \
                and cache_bytes is not None and abs(size.cache_bytes - cache_bytes) > COST_TOLERANCE * max(
                    size.cache_bytes, cache_bytes):
            # one size, another split: the fit planned the profile's KV margin (4,096 tokens), a run its own;
            # within COST_TOLERANCE the knob holds (a GB budget's margins differ by MB), beyond it not
            drops[knob] = (f"sized for the expert cache --budget {size.budget} left the fit "
                           f"({size_text(size.cache_bytes)}), and this run's is {size_text(cache_bytes)}")
            continue
        if size.budget is None and size.cache_bytes is not None and cache_bytes is not None \
                and abs(size.cache_bytes - cache_bytes) > CACHE_TOLERANCE * max(size.cache_bytes, cache_bytes):
            # within CACHE_TOLERANCE the knob holds: a run of a few more tokens plans a little more KV margin;
            # a share of 27% against the runs' 25% does not
            drops[knob] = (f"sized for the expert cache of the runs it was fitted from, {size_text(size.cache_bytes)}, "
                           f"and this run's is {size_text(cache_bytes)}")
            continue
        if size.path is not None and size.path != path:
            drops[knob] = f"sized for a decode step on the {size.path} path, and this run decodes on the {path} path"
            continue
        asked = size.knobs or {}
        other = [f"{k}={_spelled(v)}" for k, v in asked.items() if here.get(k, v) != v]
        if other:
            now = ", ".join(f"{k}={_spelled(here.get(k))}" for k in asked if here.get(k, asked[k]) != asked[k])
            drops[knob] = f"sized for {', '.join(other)}, and this run has {now}"
            continue
        for key, then in (size.costs or {}).items():
            now = (costs or {}).get(key)
            if now is None or abs(now - then) > COST_TOLERANCE * max(abs(now), abs(then)):
                drops[knob] = (f"sized for {key} = {then * 1e3:.3g} ms, and this run's costs ({machine or 'its --hw'}) "
                               f"give {'none' if now is None else f'{now * 1e3:.3g} ms'}")
                break
    for knob, sources in cls.derived.items():
        gone = [d for d in sources if d in drops]
        if knob in fitted and knob not in drops and gone:
            drops[knob] = f"derived from the fit's {gone[0]}, which this run does not take"
    for knob in fitted:  # a fitted knob this run never reads (Fate's n with --set prefetcher=none); a fit's
        if knob in cls.applies and knob not in drops:  # own pair (DyMoE's r and the lam solved from it) is one
            other, reads, when = cls.applies[knob]
            if other in settings and not reads(here.get(other)):
                drops[knob] = f"read only with {when}, and this run has {other}={_spelled(here.get(other))}"
    return drops


def _check_range(cls: type[Knobs], key: str, value: Any) -> None:
    """The rules every policy's knobs share: counts, layers and bits are not negative (unless the
    knob's default is negative, its documented 'derive it' sentinel, as DynaExq's n_hi = -1), and
    a real number is finite. Each Params' own __post_init__ checks its paper's ranges."""
    default = next(f.default for f in dataclasses.fields(cls.Params) if f.name == key)
    if isinstance(value, bool):
        return
    if isinstance(value, int) and value < 0 and not (isinstance(default, (int, float)) and default < 0):
        raise MoetoolError(f"knob '{key}' of policy '{cls.name}' cannot be negative (got {value}).")
    if isinstance(value, float) and not math.isfinite(value):
        raise MoetoolError(f"knob '{key}' of policy '{cls.name}' must be a finite number, not {value}.")


# What a typed value (a fit artifact's JSON, a Python caller's) may be for each knob type: a bool is
# an int to Python, and JSON's 4 for a float knob is an int, so both are spelled out.
_MISSING = object()
_TYPED = {"bool": lambda v: isinstance(v, bool), "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "str": lambda v: isinstance(v, str)}


def _json_prefix(value: Any, limit: int = 60) -> str:
    """A fit artifact's value as its JSON spells it (true, null), at most `limit` characters: the
    artifact was read within a size bound and JSON has no aliases, so the whole text is bounded."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _knob_type(tp: Any) -> tuple[Any, bool]:
    """(the type a knob's value has, whether None is one too) of its annotation: `int`, `float | None`,
    `Optional[str]`, `Literal["a", "b"]`, a string of one under `from __future__ import annotations`."""
    import types
    import typing

    if isinstance(tp, str):
        names = {"bool": bool, "int": int, "float": float, "str": str, "None": None, "Literal": typing.Literal,
                 "Optional": typing.Optional, "Union": typing.Union, "typing": typing}
        try:
            tp = eval(tp, {"__builtins__": {}}, names)  # noqa: S307 - an annotation in the policy's own source
        except Exception:  # noqa: BLE001 - a type --set cannot spell (tuple, list, a class): refused by the caller
            return tp, False
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else tp), True
    return tp, tp is None


def _coerce(policy: str, key: str, tp: Any, raw: Any) -> Any:
    import typing

    tp, optional = _knob_type(tp)
    if optional and (raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null"))):
        return None
    if typing.get_origin(tp) is typing.Literal:
        choices = typing.get_args(tp)
        got = next((c for c in choices if c == raw or str(c).lower() == str(raw).lower()), _MISSING)
        if got is _MISSING:
            raise MoetoolError(f"knob '{key}' of policy '{policy}' takes one of {', '.join(map(str, choices))}, "
                               f"not {quote(raw)}.")
        return got
    name = tp if isinstance(tp, str) else getattr(tp, "__name__", str(tp))
    if name not in _TYPED:  # a string passed through as a tuple, a list, a class: the policy would read it as one
        raise MoetoolError(f"knob '{key}' of policy '{policy}' is typed {name}, which --set and a fit cannot give "
                           "(a knob is an int, float, bool or str, a Literal of them, or one of these | None).")
    if not isinstance(raw, str):
        if name in _TYPED and not _TYPED[name](raw):
            raise MoetoolError(f"knob '{key}' of policy '{policy}' takes {article(name)} {name}, not {_json_prefix(raw)} "
                               "(a value in a fit artifact).")
        return float(raw) if name == "float" else raw
    try:
        if name == "bool":
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if "_" in raw and name in ("int", "float"):  # Python's digit grouping: `bits=1_6` is no 16 a user meant
            raise ValueError(raw)
        if name == "int":
            return int(raw)
        if name == "float":
            return float(raw)
    except ValueError:
        raise MoetoolError(f"knob '{key}' of policy '{policy}' takes {article(name)} {name}, not {quote(raw)}.") from None
    return raw


__all__ = ["Knobs", "POLICIES", "Params", "Sizing", "hooked", "parse_params", "parse_tiers", "register", "resolved",
           "stale_fitted", "COST_TOLERANCE"]

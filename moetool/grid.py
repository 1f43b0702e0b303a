"""Grid files: the settings every cell shares and the axes to cross, expanded into cells.

    cells = expand(load_grid("compare-policies") | {"bundle": "out/bundle"}).cells
    cells[0].name, cells[0].config()     # "lod", RunConfig(policy="lod", budget="25%", ...)

A grid file (YAML) holds the settings every cell shares and, under `grid:`, the axes to cross:

    model: path/to/checkpoint          # and/or bundle: path/to/bundle; fit: path/to/fit.json
    stage: run                         # or eval (with task: ppl | bigbench-mc | ... or a task axis)
    prompts: ["The capital of France is"]   # or {file: prompts.jsonl} or {heldout: 8}
    max_new_tokens: 16
    set: {eviction: arc}               # knobs every cell gets
    grid:
      policy: [lru, {policy: dymoe, set: {config: 4/0}}, {policy: fate, grid: {L: [2, 3]}}]
      budget: ["25%", "50%"]

Top-level keys are the fields of the stage's config (`RunConfig` / `EvalConfig`: the engine spec's
and the stage's own), so a new field is a grid setting without a change here. An axis is any of
those fields (policy, budget, hw, clock, task, batch_size, ...) or a policy knob; knobs are checked
by the policy registry, so an unknown axis or knob is refused before anything runs. An axis value
may be a mapping naming the value plus settings that go with it (`{task: ppl, limit: 2048}`,
`{policy: resident, budget: 100%}`); a policy entry may also hold `label`, `set` (its knobs) and
`grid` (its knobs to cross). A cell is named by its policy's label, then `axis=value` for every
other axis in the grid's order (`fate_L=2_budget=25pct`); paths in a grid file are relative to the
file.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetool.artifacts import ModelFingerprint
from moetool.datasets import decode_text
from moetool.errors import MoetoolError, quote, yaml_error
from moetool.files import GRID_BYTES, read_bytes

GRIDS_DIR = Path(__file__).with_name("grids")  # packaged grids, named by file stem
STAGES = ("run", "eval")
ONE_PER_SWEEP = ("model", "bundle", "fit")  # artifacts of one sweep share one model fingerprint
POLICY_ENTRY_KEYS = ("policy", "label", "set", "grid")
MAX_CELLS = 10_000  # a sweep of more runs for days on one machine; a grid that crosses into more is a slip
NAME_BYTES = 255  # a file name's longest on the common file systems (ext4, xfs, btrfs, APFS)


@dataclass(frozen=True)
class Cell:
    """One point of the grid: the keyword arguments of its stage's config, JSON-able."""

    name: str
    stage: str
    settings: dict[str, Any]  # config fields; paths as strings, policy knobs under "settings"

    @property
    def digest(self) -> str:
        blob = json.dumps({"stage": self.stage, "settings": self.settings}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    @property
    def artifact(self) -> str:
        return f"{self.name}.{self.stage}.json"

    def config(self) -> Any:
        cls = _config_class(self.stage)
        kinds = {f.name: str(f.type) for f in dataclasses.fields(cls)}
        kwargs = {k: Path(v) if v is not None and "Path" in kinds[k] else tuple(v) if k == "prompts" else v
                  for k, v in self.settings.items()}
        return cls(**kwargs)


@dataclass(frozen=True)
class Expansion:
    stage: str
    model: ModelFingerprint
    cells: tuple[Cell, ...]


def packaged_grids() -> list[str]:
    return sorted(p.stem for p in GRIDS_DIR.glob("*.yaml"))


def grid_path(source: str | Path) -> Path:
    """A grid file, or the packaged grid of that name."""
    p = Path(source)
    if p.exists():  # a directory or FIFO given as a grid file is refused by name when read, not taken for a name
        return p
    if (GRIDS_DIR / f"{source}.yaml").is_file():
        return GRIDS_DIR / f"{source}.yaml"
    raise MoetoolError(f"{source} is neither a grid file nor a packaged grid ({', '.join(packaged_grids())}).")


def load_grid(source: str | Path) -> dict[str, Any]:
    import yaml

    path = grid_path(source)
    raw = read_bytes(path, GRID_BYTES, "grid file")
    try:
        data = yaml.load(decode_text(raw, str(path), "; a grid is a YAML file."), Loader=_loader())
    except _RepeatedKey as e:  # PyYAML keeps the last: a grid edited twice ran what its last line said
        raise MoetoolError(f"{path} gives {quote(e.key)} twice in one mapping (line {e.line}); keep one of them.") \
            from None
    except yaml.YAMLError as e:
        raise yaml_error(str(path), e) from None
    except RecursionError:  # lists nested thousands deep
        raise MoetoolError(f"{path} is nested too deeply to be a grid.") from None
    check_expansion(data, str(path))
    if not isinstance(data, dict):
        raise MoetoolError(f"{path} must be a YAML mapping of settings with a `grid:` of axes.")
    return data


class _RepeatedKey(Exception):
    def __init__(self, key: Any, line: int):
        self.key, self.line = key, line


def _loader() -> type:
    """PyYAML's safe loader, refusing a mapping that gives a key twice."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: merged by SafeLoader, own keys win
                    continue
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, (str, int, float, bool)):
                    if key in seen:
                        raise _RepeatedKey(key, key_node.start_mark.line + 1)
                    seen.add(key)
            return super().construct_mapping(node, deep)

    return UniqueKeys


# What a grid may expand to: YAML aliases (`*name`) repeat what their anchor holds, so ten lines can
# stand for billions of values (an "alias bomb") that a cell's digest, name or refusal would expand.
EXPANDED_SIZE = 1 << 22  # nodes plus characters of their text, aliases expanded: ~4x the largest grid file


def check_expansion(data: object, where: str, limit: int = EXPANDED_SIZE) -> None:
    """Refuse YAML whose aliases expand it past `limit` (each node counts 1 plus the length of its
    text), walking at most `limit` steps whatever it holds (a self-referencing alias included)."""
    budget, stack = limit, [data]
    while stack:
        node = stack.pop()
        budget -= 1 + (len(node) if isinstance(node, (str, bytes)) else 0)
        if budget < 0:
            raise MoetoolError(f"{where} expands to more than {limit:,} values and characters once its YAML aliases "
                               "are resolved; a grid is a few settings and axes.")
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple, set)):
            stack.extend(node)


def _config_class(stage: str) -> type:
    if stage == "run":
        from moetool.run import RunConfig

        return RunConfig
    from moetool.evaluate import EvalConfig

    return EvalConfig


def _slug(value: Any) -> str:
    """A file-name-safe spelling of a value: 25% -> 25pct, 4/2 -> 4-2."""
    text = str(value).replace("%", "pct").replace("/", "-")
    return re.sub(r"[^A-Za-z0-9._=+-]+", "-", text).strip("-.") or "x"


def _knob_text(value: Any) -> str:
    """Knobs travel as `--set` strings; the policy registry coerces them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        raise MoetoolError(f"a knob value must be a single value, not {quote(value)}.")
    return str(value)


class _Grid:
    """Expands one grid dict into cells, checking each setting and knob as it goes."""

    def __init__(self, grid: dict[str, Any], base: Path):
        self.base = base
        self.written: dict[str, str] = {}  # a hardware profile's or task file's path as resolved -> as written
        check_expansion(grid, "the grid")  # again after --with overrides, and for a grid given as a dict
        grid = dict(grid)
        self.stage = grid.pop("stage", "run")
        if self.stage not in STAGES:
            raise MoetoolError(f"stage must be run or eval, not {quote(self.stage)}.")
        cls = _config_class(self.stage)
        self.kinds = {f.name: str(f.type) for f in dataclasses.fields(cls) if f.name != "settings"}
        self.defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
        defaults = self.defaults
        self.axes = grid.pop("grid", None)
        self.knobs = self._knobs(grid.pop("set", None) or {}, "set")
        prompts = grid.pop("prompts", None)
        self.top = {key: self.setting(key, value) for key, value in grid.items()}
        if prompts is not None:
            self.top["prompts"] = self._prompts(prompts)
        self.default_policy = self.top.get("policy", defaults.get("policy"))

    def setting(self, key: str, value: Any) -> Any:
        """A config field's value from YAML, type-checked; relative paths are the grid file's."""
        if key not in self.kinds:
            raise MoetoolError(f"unknown setting {quote(key)} for stage {self.stage} (settings: "
                               f"{', '.join(sorted(self.kinds))}, set, grid).")
        kind = self.kinds[key]
        if value is None:
            if self.defaults.get(key) is not None:  # `budget:` (or `--with budget=`) with nothing after it
                raise MoetoolError(f"setting {quote(key)} is empty; give it a value, or leave it out for its default "
                                   f"({quote(self.defaults[key])}).")
            return None
        if key == "model":
            return str(self.base / str(value)) if (self.base / str(value)).exists() else str(value)
        if key == "task" and isinstance(value, str) and value.endswith((".yaml", ".yml")):  # the grid's file
            self.written[str((self.base / value).resolve())] = value  # named as written in a cell's name
            return str((self.base / value).resolve())
        if key == "hw" and isinstance(value, str):  # a path or a name of the grid's, not of where sweep runs
            from moetool.engine.clock import HW_DIR, USER_HW_DIR

            mine = self.base / USER_HW_DIR / f"{value}.json"
            if (self.base / value).exists() or value.endswith(".json") or "/" in value or "\\" in value:
                self.written[str((self.base / value).resolve())] = value  # a cell's name spells it as written
            elif not (HW_DIR / f"{value}.json").exists() and mine.exists():
                self.written[str(mine.resolve())] = value
            return next((k for k, v in self.written.items() if v == value), value)
        ok = {"Path": isinstance(value, str), "tuple": isinstance(value, list) and all(isinstance(v, str) for v in value),
              "dict": isinstance(value, dict), "bool": isinstance(value, bool),
              "int": isinstance(value, int) and not isinstance(value, bool),
              "float": isinstance(value, (int, float)) and not isinstance(value, bool),
              "str": isinstance(value, (str, int, float)) and not isinstance(value, bool)}
        expected = next((k for k in ok if k in kind), None)
        if expected is not None and not ok[expected]:
            raise MoetoolError(f"setting {quote(key)} takes {kind.replace(' | None', '')}, not {quote(value)}.")
        if expected == "Path":
            return str((self.base / value).resolve())
        return str(value) if expected == "str" else value

    def _prompts(self, value: Any) -> list[str]:
        if self.stage != "run":
            raise MoetoolError("prompts are a run setting; an eval grid takes a task.")
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return value
        if isinstance(value, dict) and set(value) == {"file"}:
            from moetool.datasets import read_prompts

            return list(read_prompts(self.base / str(value["file"]), "prompts file"))
        if isinstance(value, dict) and set(value) == {"heldout"}:
            from moetool.datasets import heldout_prompts

            return list(heldout_prompts(value["heldout"]))
        raise MoetoolError("prompts must be a list of strings, {file: prompts.jsonl} or {heldout: N}.")

    def _knobs(self, knobs: Any, where: str) -> dict[str, str]:
        if not isinstance(knobs, dict):
            raise MoetoolError(f"`{where}` must map knob names to values, not {quote(knobs)}.")
        return {str(k): _knob_text(v) for k, v in knobs.items()}

    def _values(self, axis: str, values: Any) -> list[Any]:
        values = values if isinstance(values, list) else [values]
        if not values:
            raise MoetoolError(f"axis {quote(axis)} of the grid has no values.")
        if any(v is None for v in values):
            raise MoetoolError(f"axis {quote(axis)} of the grid has an empty value (null); give each of its values.")
        return values

    def _policies(self) -> list[tuple[str, str, dict[str, str], dict[str, Any]]]:
        """(label, policy, knobs, settings pinned by the entry) for every choice of the policy axis."""
        from moetool.policies import POLICIES, load_user_policies

        load_user_policies()

        entries = self._values("policy", self.axes["policy"]) if "policy" in self.axes else [self.default_policy]
        out = []
        for entry in entries:
            spec = entry if isinstance(entry, dict) else {"policy": entry}
            name = spec.get("policy")
            if not isinstance(name, str) or name not in POLICIES:
                raise MoetoolError(f"unknown policy {quote(name)} in the grid (known: {', '.join(sorted(POLICIES))}).")
            fixed = self._knobs(spec.get("set") or {}, f"set of {name}")
            label = str(spec.get("label") or "_".join([name, *(f"{k}={v}" for k, v in fixed.items())]))
            pinned = {k: self.setting(k, v) for k, v in spec.items() if k not in POLICY_ENTRY_KEYS}
            crossed = spec.get("grid") or {}
            if not isinstance(crossed, dict):
                raise MoetoolError(f"the grid of policy entry {quote(label)} must map knobs to lists of values.")
            keys = list(crossed)
            for combo in itertools.product(*(self._values(k, crossed[k]) for k in keys)):
                knobs = {**fixed, **{k: _knob_text(v) for k, v in zip(keys, combo)}}
                parts = [label, *(f"{k}={knobs[k]}" for k in keys)]
                out.append(("_".join(parts), name, knobs, pinned))
        return out

    def _check_knobs(self, policy: str, knobs: dict[str, str], axis_knobs: set[str]) -> None:
        """The registry decides what a policy's knobs are; an unknown axis is an unknown knob."""
        from moetool.policies import POLICIES
        from moetool.policies.base import parse_params

        cls = POLICIES[policy]
        known = {f.name for f in dataclasses.fields(cls.Params)}
        for key in knobs:
            if key not in known:
                what = f"axis or knob {quote(key)}" if key in axis_knobs else f"knob {quote(key)}"
                raise MoetoolError(f"unknown {what}: it is not a {self.stage} setting, and policy '{policy}' has no "
                                   f"knob {quote(key)} (its knobs: {', '.join(sorted(known)) or 'none'}).")
        parse_params(cls, knobs)  # values too: a float knob given 'abc' is refused before anything runs

    def cells(self) -> list[Cell]:
        if not isinstance(self.axes, dict) or not self.axes:
            raise MoetoolError("the grid is empty: give `grid:` at least one axis with values, e.g. "
                               "`grid: {policy: [lru, fate]}`.")
        for key in self.axes:
            if key in ONE_PER_SWEEP:
                raise MoetoolError(f"{quote(key)} is one per sweep (its artifacts share one model), not an axis.")
        self._check_size()
        policies = self._policies()
        names = [k for k in self.axes if k != "policy"]
        axis_knobs = {k for k in names if k not in self.kinds}
        choices = [self._axis_choices(k) for k in names]
        cells: dict[str, Cell] = {}
        for (label, policy, knobs, pinned), *combo in itertools.product(policies, *choices):
            settings = {**self.top, "policy": policy}
            cell_knobs = {**self.knobs, **knobs}
            extras: dict[str, Any] = dict(pinned)
            for key, (value, more) in zip(names, combo):
                if key in axis_knobs:
                    cell_knobs[key] = value
                else:
                    settings[key] = value
                for k, v in more.items():
                    if k in extras and extras[k] != v:
                        raise MoetoolError(f"two axes of the grid pin {quote(k)} to different values "
                                           f"({quote(extras[k])}, {quote(v)}).")
                    extras[k] = v
            settings.update(extras)  # an entry's own settings win over the axes (resident at 100% whatever the budget axis)
            self._check_knobs(policy, cell_knobs, axis_knobs)
            if self.stage == "eval" and not settings.get("task"):
                raise MoetoolError("an eval grid needs a task: give `task:` or a task axis.")
            settings["settings"] = cell_knobs
            parts = [label, *(f"{k}={cell_knobs[k] if k in axis_knobs else self._written(k, settings[k])}"
                              for k in names)]
            cell = Cell(name=_slug("_".join(parts)), stage=self.stage, settings=settings)
            if len(cell.artifact.encode()) > NAME_BYTES:  # found at its write, after the index: refused here
                raise MoetoolError(f"cell {quote(cell.name, 40)} makes a file name of {len(cell.artifact.encode())} "
                                   f"bytes, more than a file system takes ({NAME_BYTES}); give its policy entry a "
                                   "shorter label.")
            if cell.name in cells and cells[cell.name].digest != cell.digest:
                raise MoetoolError(f"two cells of the grid would both be named {quote(cell.name)}; give their policy "
                                   f"entries distinct labels.")
            cells[cell.name] = cell  # the same cell twice (a pinned setting crossing an axis) runs once
        return list(cells.values())

    def _check_size(self) -> None:
        """Refuse, from the axes' lengths alone, a grid of more than MAX_CELLS cells: a few lines of YAML
        cross into millions of cells, expanded (minutes, gigabytes) before the first one runs."""
        entries = self.axes.get("policy", [self.default_policy])
        count = 0
        for entry in entries if isinstance(entries, list) else [entries]:
            crossed = entry.get("grid") if isinstance(entry, dict) else None
            count += math.prod(len(v) if isinstance(v, list) else 1 for v in crossed.values()) \
                if isinstance(crossed, dict) else 1
        for key, values in self.axes.items():
            if key != "policy":
                count *= len(values) if isinstance(values, list) else 1
        if count > MAX_CELLS:
            raise MoetoolError(f"the grid crosses into {count:,} cells, more than the {MAX_CELLS:,} a sweep runs; "
                               "split it into smaller grids, or narrow its axes.")

    def _written(self, key: str, value: Any) -> Any:
        """A setting as the grid wrote it, for a cell's name: a hardware profile's path as given, not resolved."""
        return self.written.get(value, value) if key in ("hw", "task") else value

    def _axis_choices(self, key: str) -> list[tuple[Any, dict[str, Any]]]:
        """(value, settings pinned with it) for each value of a non-policy axis."""
        out = []
        for value in self._values(key, self.axes[key]):
            more: dict[str, Any] = {}
            if isinstance(value, dict):
                if key not in value:
                    raise MoetoolError(f"an entry of axis {quote(key)} that is a mapping must name its {key}: "
                                       f"{quote(value)}.")
                more = {k: self.setting(k, v) for k, v in value.items() if k != key}
                value = value[key]
            out.append((self.setting(key, value) if key in self.kinds else _knob_text(value), more))
        return out

    def fingerprint(self) -> ModelFingerprint:
        """The one model of the sweep; refuses a bundle or fit of another model, before anything runs."""
        model, bundle, fit = (self.top.get(k) for k in ONE_PER_SWEEP)
        if model is None and bundle is None:
            raise MoetoolError("the grid names no model: give `model:` or `bundle:` (or --model / --bundle).")
        fp = None
        if model is not None:
            from moetool.model import model_fingerprint
            from moetool.source import load_config, resolve_source

            fp = model_fingerprint(load_config(resolve_source(model)), model)
        if bundle is not None:
            from moetool.quant.bundle import MANIFEST, Bundle

            if not (Path(bundle) / MANIFEST).is_file():
                raise MoetoolError(f"bundle {bundle} is not a bundle directory (no {MANIFEST} in it).")
            manifest = Bundle.load(Path(bundle) / MANIFEST, model=fp)  # refuses a bundle of another model
            fp = fp or manifest.model
        if fit is not None:
            from moetool.fit_artifact import Fit

            Fit.load(Path(fit), model=fp)
        return fp


def select(cells: list[Cell], only: tuple[str, ...]) -> list[Cell]:
    if not only:
        return cells
    chosen = [c for c in cells if any(fnmatch.fnmatchcase(c.name, p) for p in only)]
    if not chosen:
        raise MoetoolError(f"no cell of the grid matches {', '.join(only)}.")
    return chosen


def expand(grid: dict[str, Any], base: Path = Path("."), only: tuple[str, ...] = ()) -> Expansion:
    """The cells of `grid` (paths in it are relative to `base`), checked against the policy registry,
    and its model, bundle and fit checked against each other."""
    g = _Grid(grid, Path(base))
    cells = select(g.cells(), only)
    return Expansion(stage=g.stage, model=g.fingerprint(), cells=tuple(cells))


def grid_cells(grid: dict[str, Any], base: Path = Path(".")) -> list[Cell]:
    """The cells of `grid` without opening its model, bundle or fit (which need not exist yet)."""
    return _Grid(grid, Path(base)).cells()


__all__ = ["Cell", "Expansion", "GRIDS_DIR", "expand", "grid_cells", "grid_path", "load_grid", "packaged_grids",
           "select"]

"""What a stage asks of the engine (`EngineSpec`) and what the engine reports back (`EngineRecord`).

`RunConfig` and `EvalConfig` are engine specs with their workload added; `FitConfig` (its smoe
sweep) and `DemoConfig` hold one. `Run` and `Eval` are engine records with their measurements
added, filled by `moetool.run.engine_record`. So an option such as `--host-budget` is declared
here once and reaches every stage, grid cell and artifact that runs the engine.

    spec = EngineSpec(bundle=Path("out/bundle"), policy="fate", budget="25%", clock="sim")
    spec.check()                        # one-sentence refusals before any model is loaded
    RunConfig(**spec.engine_fields(), prompts=("Hello",))
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetool.errors import MoetoolError, not_a_file

from moetool.defaults import CLOCKS, COMPUTE_DTYPES, DECODE_PATHS, DEFAULT_BUDGET, DEFAULT_HW, EXPERTS_IMPLS  # noqa: F401 (re-exported for commands)


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """The model, experts, policy and device budget an engine is built from (`run.prepare`)."""

    model: str | None = None  # checkpoint; None: the bundle's own model, or the demo model without a bundle
    bundle: Path | None = None  # quantized experts (and the whole model); None: experts from the checkpoint
    policy: str = "lru"  # a name in moetool.policies.POLICIES
    settings: dict[str, str] = field(default_factory=dict)  # policy knobs as `--set key=value` strings
    fit: Path | None = None  # fit artifact whose knobs for `policy` are used (`settings` win)
    budget: str = DEFAULT_BUDGET  # whole device budget (12GiB) or expert cache share of the 16-bit experts (25%)
    clock: str = "wall"  # one of CLOCKS
    hw: str = DEFAULT_HW  # hardware profile of the sim clock: a preset name or a profile JSON
    device: str = "cpu"
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU; else one of COMPUTE_DTYPES
    host_budget: str | None = None  # host bytes for pinned experts and the staging ring (default: free memory less a margin)
    experts_impl: str = "grouped_mm"  # one of EXPERTS_IMPLS: grouped GEMMs, or one expert at a time ("eager")
    # The decode path of `run` (DECODE_PATHS): the captured step, the host-driven engine, or the one
    # faster on the device (`engine.decode.choose_path`). `eval` and `model.generate` keep the host path.
    decode: str = "auto"

    def engine_fields(self) -> dict[str, Any]:
        """This spec's own fields (not a subclass's workload), e.g. to build another config from it."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineSpec)}

    def check(self) -> None:
        """Refuse in one sentence, before anything loads, what no model could run with."""
        from moetool.engine.clock import load_hw
        from moetool.policies import POLICIES
        from moetool.policies.knobs import load_user_policies, parse_params

        check_types(self)
        load_user_policies()
        if self.policy not in POLICIES:
            raise MoetoolError(f"unknown policy '{self.policy}' (known: {', '.join(sorted(POLICIES))}).")
        parse_params(POLICIES[self.policy], self.settings)  # unknown knobs and bad values, before the model loads
        check_budget(self.budget)
        if self.clock not in CLOCKS:
            raise MoetoolError(f"--clock must be {' or '.join(CLOCKS)}, not '{self.clock}'.")
        load_hw(self.hw)  # the engine's cost model reads it whatever the clock
        check_device(self.device)
        resolve_dtype(self.dtype, self.device)
        if self.host_budget is not None and check_size(self.host_budget, "--host-budget") == 0:
            raise MoetoolError(f"--host-budget must be more than 0 bytes, not '{self.host_budget}'.")
        if self.experts_impl not in EXPERTS_IMPLS:
            raise MoetoolError(f"--experts-impl must be {' or '.join(EXPERTS_IMPLS)}, not '{self.experts_impl}'.")
        if self.decode not in DECODE_PATHS:
            raise MoetoolError(f"--decode must be {', '.join(DECODE_PATHS[:-1])} or {DECODE_PATHS[-1]}, not '{self.decode}'.")
        if self.fit is not None and not Path(self.fit).is_file():
            raise not_a_file(self.fit, "--fit")


NAMES_A_FILE = ("model",)  # text fields a caller may give as a path: a checkpoint directory


def check_types(cfg: Any) -> None:
    """Each field of a config built in Python (a notebook, a script) holds what its type hint says, or
    one sentence naming it: the CLI's options are typed as they are parsed, a caller's values are not
    (`prompts="Hello"` ran five one-letter prompts, `max_new_tokens=2.5` three tokens, `budget=0.25`
    failed inside the planner). A path may be text; a knob's value any scalar, as `--set` text is read."""
    import os
    import typing

    from moetool.schema import SchemaError, build

    def lenient(hint: Any, name: str = "") -> Any:
        if hint is Path or hint is str and name in NAMES_A_FILE:
            return str | os.PathLike
        args = typing.get_args(hint)
        if typing.get_origin(hint) in (typing.Union, type(str | None)):
            return typing.Union[tuple(lenient(a, name) for a in args)]
        if typing.get_origin(hint) is dict and args == (str, str):
            return dict[str, str | int | float | bool]
        return hint

    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, hint = getattr(cfg, f.name), lenient(hints[f.name], f.name)
        if isinstance(value, str) and typing.get_origin(hint) in (tuple, list):
            raise MoetoolError(f"{f.name} is one string, {value[:40]!r}; give a tuple of them, such as "
                               f"{f.name}=({value[:40]!r},).")
        try:
            build(hint, value, f.name)
        except SchemaError as e:
            raise MoetoolError(f"{type(cfg).__name__}.{e}.") from None
        whole = int in (hints[f.name], *typing.get_args(hints[f.name])) and float not in typing.get_args(hints[f.name])
        if isinstance(value, float) and whole:  # build takes 3.0 for 3 (JSON's); a config holds 3
            raise MoetoolError(f"{type(cfg).__name__}.{f.name} must be an integer, not {value!r}.")


def check_positive(**values: int) -> None:
    """Each count (max_new_tokens=0, ...) is at least 1, or one sentence naming its option."""
    for name, value in values.items():
        if value < 1:
            raise MoetoolError(f"--{name.replace('_', '-')} must be at least 1, not {value}.")


def check_size(text: str, option: str) -> int:
    """Bytes of a size such as 12GiB or 500MB, or one sentence naming `option`."""
    from moetool.engine import parse_size

    return parse_size(text, option)


def check_budget(text: str, option: str = "--budget") -> None:
    """A size (12GiB) or a share of the 16-bit experts (25%), as the engine's budget planner reads it."""
    from moetool.engine.budget import parse_budget

    parse_budget(text, option)


def parse_device(device: str) -> Any:
    """`device` as a torch.device, or one sentence."""
    import torch

    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise MoetoolError(f"--device must be cpu or cuda (cuda:N), not '{device}'.") from None


def check_device(device: str) -> None:
    """A device torch knows, and CUDA only on a machine that has it."""
    import torch

    kind = parse_device(device).type
    if kind not in ("cpu", "cuda"):  # torch knows meta, mps, xpu, ...: the engine runs on a CPU or a CUDA GPU
        raise MoetoolError(f"--device must be cpu or cuda (cuda:N), not '{device}'.")
    if kind == "cuda" and not torch.cuda.is_available():
        raise MoetoolError(f"--device {device} asks for CUDA, but this machine has no usable CUDA device.")


def resolve_dtype(name: str, device: str) -> Any:
    """The torch dtype of `name` on `device`: `auto` is bf16 on CUDA (what the kernels and the bundles
    are made for) and fp32 on a CPU (exact against transformers, and CPU bf16 matmuls are slow)."""
    import torch

    if name == "auto":
        return torch.bfloat16 if parse_device(device).type == "cuda" else torch.float32
    if name not in COMPUTE_DTYPES:
        raise MoetoolError(f"--dtype must be auto or one of {', '.join(COMPUTE_DTYPES)}, not '{name}'.")
    return getattr(torch, name)


@dataclass(frozen=True, kw_only=True)
class EngineRecord:
    """What the engine ran and counted: the fields `Run` and `Eval` share (their JSON keys, one to one).

    Filled by `moetool.run.engine_record` after the engine has run, so a run and an evaluation of
    the same spec report the same things in the same places.
    """

    policy: str
    params: dict[str, Any]  # the policy's knobs as it ran (defaults, fit, --set)
    clock: str
    hw: str | None  # the sim clock's hardware profile; None on the wall clock
    device: str
    dtype: str = "float32"  # the compute dtype (`auto` resolved); artifacts from before it was recorded ran in fp32
    budget_bytes: int
    budget: dict[str, int]  # how the budget is spent (BudgetSplit)
    peak_device_bytes: int
    summary: dict[str, Any]  # every engine counter (hit rate, substitutions, skips, CPU experts, precision mix, ...)
    layers: dict[str, dict[str, Any]]  # per MoE layer

    def validate(self) -> None:
        from moetool.schema import SchemaError

        EngineRecord.check_params(self.policy, self.params)
        # Every counter the engine wrote, per layer and in the budget too: a share in [0, 1], none NaN.
        for where in ("summary", "layers", "budget"):
            EngineRecord.check_counters(getattr(self, where), where)
        for name, allowed in (("clock", CLOCKS), ("dtype", COMPUTE_DTYPES)):
            if getattr(self, name) not in allowed:
                raise SchemaError(name, f"is {getattr(self, name)!r}, not one of {', '.join(allowed)}")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise SchemaError("device", f"is {self.device!r}, not a device moetool runs on (cpu, cuda)")

    @staticmethod
    def check_counters(counters: Any, where: str) -> None:
        """On read: the engine's counters follow the rules every artifact's fields do (`schema`: a
        rate or share in [0, 1]; a size, count or time not negative), and none is NaN or infinite,
        nested objects and lists included (the TPOT statistics, the precision mix)."""
        from moetool.schema import SchemaError, check_named_number

        if isinstance(counters, dict):
            for key, value in counters.items():
                path = f"{where}[{key!r}]"
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    if not math.isfinite(value):
                        raise SchemaError(path, f"is {value}; a counter is a finite number")
                    check_named_number(str(key), value, path)
                else:
                    EngineRecord.check_counters(value, path)
        elif isinstance(counters, list):
            EngineRecord.check_counters({i: v for i, v in enumerate(counters)}, where)

    @staticmethod
    def check_params(policy: Any, params: Any) -> None:
        """On read: `params` are knobs `policy` accepts (types and the paper's ranges), so `fit` and
        `report` can use them as numbers; a policy this version does not know is left as it is."""
        from moetool.policies import POLICIES  # the knobs, without torch: report reads runs and evals
        from moetool.policies.knobs import parse_params
        from moetool.schema import SchemaError

        if isinstance(policy, str) and policy in POLICIES and isinstance(params, dict):
            try:
                parse_params(POLICIES[policy], {}, params)
            except MoetoolError as e:
                raise SchemaError("params", f"holds a knob the policy refuses: {str(e).rstrip('.')}") from None


__all__ = ["CLOCKS", "COMPUTE_DTYPES", "DECODE_PATHS", "DEFAULT_BUDGET", "DEFAULT_HW", "EngineRecord", "EngineSpec", "check_budget",
           "check_device", "check_positive", "check_size", "parse_device", "resolve_dtype"]

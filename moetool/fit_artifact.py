"""The fit stage's artifact: fitted policy knobs per policy name, with their evidence.

`moetool fit` writes it; `run --fit`, `eval --fit`, `report` and the grids read it. It sits above the
policies' registry (a read checks each knob is its policy's own) and below every stage, so the
policies' fit and report hooks name it by protocol (`policies.stages.FitRecord`), not by import.

    Fit(model=fp, inputs={}, params={"smoe": {"alpha": 0.1}}).save(Path("out/fit.json"))
    Fit.load(Path("out/fit.json")).params["smoe"]["alpha"]  # 0.1
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from moetool.artifacts import Artifact, _text
from moetool.policies import POLICIES  # the registry, without torch: report reads fits
from moetool.policies.knobs import Sizing
from moetool.schema import SchemaError, build


@dataclass(frozen=True)
class Fit(Artifact):
    """Fitted policy knobs, per policy name (written by `moetool fit`, read by `--fit`), with their evidence.

    `evidence` holds "warnings" (a list), "skipped" ("<policy>.<knob>" -> why it was not fitted)
    and, per policy name, that policy's evidence per knob (`policies.stages.Fitted.evidence`).
    """

    SCHEMA: ClassVar[str] = "fit"
    SCHEMA_VERSION: ClassVar[int] = 1

    params: dict[str, dict[str, Any]]  # policy -> knob -> value
    evidence: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """On read: the knobs are the policies' own (a name the policy lacks, a hand edit's `alpah`, was
        passed over and the default ran), the warnings and reasons are text, no number is NaN, and the
        evidence a policy's report draws has the shape it draws (`Knobs.evidence`), as has what a knob was
        sized for (`Sizing`), which a run compares with its own."""
        for policy, knobs in self.params.items():
            if policy in POLICIES:
                known = {f.name for f in fields(POLICIES[policy].Params)}
                unknown = sorted(set(knobs) - known)
                if unknown:
                    raise SchemaError(f"params[{policy!r}]", f"names {_text(unknown[0])!r}, which is no knob of policy "
                                                             f"'{policy}' (its knobs: {', '.join(sorted(known))})")
        ev = self.evidence
        build(list[str], ev.get("warnings", []), "evidence.warnings")
        build(dict[str, str], ev.get("skipped", {}), "evidence.skipped")
        _finite_numbers(ev, "evidence")
        for policy, cls in POLICIES.items():
            mine = ev.get(policy)
            if mine is None:
                continue
            if not isinstance(mine, dict):
                raise SchemaError(f"evidence[{policy!r}]", "must be an object of the evidence per knob")
            for knob, schema in cls.evidence.items():
                if mine.get(knob) is not None:
                    build(schema, mine[knob], f"evidence[{policy!r}][{knob!r}]")
            for knob, of_knob in mine.items():  # what a run compares its budget and tiers with
                if isinstance(of_knob, dict) and "sized_for" in of_knob:
                    build(Sizing, of_knob["sized_for"], f"evidence[{policy!r}][{knob!r}]['sized_for']")

    def sizing(self, policy: str) -> dict[str, Sizing]:
        """`policy`'s fitted knobs that hold for one budget, tiers or machine only (`policies.knobs.Sizing`)."""
        mine = self.evidence.get(policy) or {}
        return {knob: build(Sizing, ev["sized_for"], knob) for knob, ev in mine.items()
                if knob in self.params.get(policy, {}) and isinstance(ev, dict) and "sized_for" in ev}


def _finite_numbers(value: Any, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise SchemaError(where, f"is {value}; a fitted number is finite")
    if isinstance(value, dict):
        for k, v in value.items():
            _finite_numbers(v, f"{where}[{k!r}]")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _finite_numbers(v, f"{where}[{i}]")

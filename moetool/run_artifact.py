"""The artifact of `moetool run` (`Run`): what one run measured beside the engine's record, read without
torch (`moetool report`, `moetool fit`); the run stage itself is `run.py`.

    Run.load(Path("out/fate.run.json")).tpot_s["p50"]
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from moetool.artifacts import Artifact
from moetool.schema import SchemaError
from moetool.spec import EngineRecord


@dataclass(frozen=True)
class Run(EngineRecord, Artifact):
    """What one `moetool run` measured, beside the engine's record. Times are seconds on `clock`
    (wall, or sim on `hw`)."""

    SCHEMA: ClassVar[str] = "run"
    SCHEMA_VERSION: ClassVar[int] = 1

    ttft_s: float | None
    tpot_s: dict[str, float] | None  # mean, p50, p99, n
    hit_rate: float | None
    bytes_h2d: int
    bytes_per_token: float
    stall_s: float
    prompts: list[str]
    tokens: list[list[int]]  # generated token ids per prompt
    texts: list[str]
    # prompts decoded together: hits, TPOT and bytes per token all change with it (`upgrade` reads it
    # from a run written before it was recorded)
    batch_size: int = 1

    @classmethod
    def upgrade(cls, data: dict[str, Any], version: int) -> dict[str, Any]:
        """A run written before `batch_size` was recorded: one prompt was a batch of one, and a batch the
        captured step could not take is in its path_reason ("... not a batch of 2"). Several prompts run
        otherwise may have been batched on the host path (`--batch-size`): that is not known, and read as 1
        it put a batched run's TPOT in a batch-1 table cell, so it is refused with what to add."""
        if "batch_size" in data:
            return data
        reason = str((data.get("summary") or {}).get("path_reason") or "")
        said = re.search(r"not a batch of (\d+)", reason)
        prompts = data.get("prompts")
        if said:
            data["batch_size"] = int(said.group(1))
        elif isinstance(prompts, list) and len(prompts) > 1:
            raise SchemaError("batch_size", f"is missing, and the run's {len(prompts)} prompts may have been decoded "
                                            "together (it was written before runs recorded their batch); add "
                                            '"batch_size": N with the run\'s --batch-size (1 by default), or run it again')
        return data

    def validate(self) -> None:
        """On read: the TPOT statistics `fit` and `report` use are all there, finite and not negative."""
        super().validate()
        for key in ("mean", "p50", "p99", "n") if self.tpot_s is not None else ():
            v = self.tpot_s.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise SchemaError(f"tpot_s['{key}']", "is missing" if v is None else f"is {v!r}, not a number",
                                  missing=v is None)
            if not math.isfinite(v) or v < 0:
                raise SchemaError(f"tpot_s['{key}']", f"is {v}; a time or count is finite and not negative")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise SchemaError("batch_size", f"is {self.batch_size!r}; it counts the prompts decoded together, 1 or more")
        n = self.tpot_s["n"] if self.tpot_s is not None else None
        if n is not None and (n != int(n) or n < 1):  # a run of one token has no TPOT: tpot_s is null
            raise SchemaError("tpot_s['n']", f"is {n}; it counts the decode steps timed, a whole number of at least 1")
        for name in ("ttft_s", "tpot_s", "hit_rate", "bytes_h2d", "bytes_per_token", "stall_s"):
            # `run` copies these from the engine's summary: two values are a hand edit of one, and fit and
            # report would read the top-level one while the summary's table shows the other
            if name in self.summary and self.summary[name] != getattr(self, name):
                raise SchemaError(name, f"is {getattr(self, name)!r}, but summary[{name!r}] is {self.summary[name]!r}; "
                                        "run writes them equal")
        for name in ("bytes_per_token", "stall_s", "ttft_s"):
            v = getattr(self, name)
            if v is not None and not math.isfinite(v):
                raise SchemaError(name, f"is {v}; a measurement is a finite number")

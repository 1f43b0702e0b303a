"""What `moetool sweep` (and `moetool demo`, which runs packaged grids) says of a sweep's cells once they
are written: cells another moetool wrote, run again (`other_moetool_cells`), and cells whose policy did
not take some of a fit's knobs (`fit_dropped_cells`), each in one line rather than once a cell."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moetool.artifacts import code_version
from moetool.sweep import INDEX


def other_moetool_cells(out_dir: Path) -> str | None:
    """The done cells of the sweep in `out_dir` that another moetool wrote (`code_version`), in one line:
    they run again rather than being reused, and a sweep that reruns its whole grid says why. None for none."""
    try:
        cells = json.loads((out_dir / INDEX).read_text()).get("cells") or {}
    except (OSError, ValueError, AttributeError):
        return None
    other: dict[str, str] = {}
    for name, cell in cells.items():
        artifact = cell.get("artifact") if isinstance(cell, dict) else None
        if cell.get("status") == "done" and isinstance(artifact, str):
            try:
                version = json.loads((out_dir / artifact).read_text()).get("moetool_version")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(version, str) and version != code_version():
                other[name] = version
    if not other:
        return None
    versions = sorted(set(other.values()))
    return (f"{len(other)} cell(s) of {out_dir} were written by another moetool ({', '.join(versions[:2])}"
            f"{', ...' if len(versions) > 2 else ''}; this one is {code_version()}), so they run again rather "
            "than being reused.")


def fit_dropped_cells(out_dir: Path, cells: dict[str, dict[str, Any]]) -> str | None:
    """The cells whose policy did not take some of the fit's knobs (`summary.fit_dropped`), in one line:
    a grid runs many budgets and knobs over one fit, and `run` says it of one."""
    dropped = {}
    for name, cell in cells.items():
        if cell["status"] == "done" and cell["artifact"]:
            try:
                summary = json.loads((out_dir / cell["artifact"]).read_text()).get("summary") or {}
            except (OSError, ValueError, AttributeError):
                continue  # the index names it; `report` reads it strictly
            if summary.get("fit_dropped"):
                dropped[name] = summary["fit_dropped"]
    if not dropped:
        return None
    first, why = next(iter(dropped.items()))
    knob, reason = next(iter(why.items()))
    return (f"{len(dropped)} cell(s) ran their policy's default for fitted knobs that do not hold there (e.g. "
            f"{first}: {knob}, {reason}); each artifact says which and why under summary.fit_dropped.")

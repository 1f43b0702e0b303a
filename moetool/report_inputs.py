"""What a report draws: the artifacts under the paths it is given, read through their schemas, copies
read once, grouped by model (`moetool.report`).

    found = collect([Path("out/")], copies := {})   # {"run": [(path, Run), ...], "eval": [...], ...}
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from moetool.artifacts import ModelFingerprint, read_json, sha256_file
from moetool.errors import MoetoolError
from moetool.eval_artifact import Eval
from moetool.fit_artifact import Fit
from moetool.profile_artifact import Profile
from moetool.run_artifact import Run
from moetool.schema import SchemaError, build, build_fields
from moetool.spec import EngineRecord
from moetool.sweep import Sweep

Found = dict[str, list[tuple[Path, Any]]]  # schema -> (file, artifact), in the order found


def _read_eval(data: Any, where: str) -> dict[str, Any]:
    """Evals stay dicts: report takes hand-made eval records too (a few of Eval's fields), so only
    the fields present are checked against Eval's types, and `model` is required."""
    Eval.check_header(data, where)
    try:
        fields = build_fields(Eval, data, required=("model",))
        Eval.check_present(fields)
        Eval.check_metrics(fields.get("metrics", {}))
        Eval.check_scores(fields)
        Eval.check_params(fields.get("policy"), fields.get("params"))
    except SchemaError as e:
        raise MoetoolError(f"{where} is not a valid eval artifact: {e.sentence()}.") from None
    return data


def _read_fit(data: Any, where: str) -> Fit:
    """A fit whose knobs are what `run --fit` takes (types, the papers' ranges), so the report shows
    what would run; a policy this version does not know is left as it is."""
    fit = Fit.from_json(data, where=where)
    for policy, knobs in fit.params.items():
        try:
            EngineRecord.check_params(policy, knobs)
        except SchemaError as e:
            raise MoetoolError(f"{where} is not a valid fit artifact: params[{policy!r}] "
                               f"{e.problem}.") from None
    return fit


READERS = {"profile": Profile.from_json, "fit": _read_fit, "run": Run.from_json, "eval": _read_eval,
           "sweep": Sweep.from_json}  # a sweep index: its cells without artifacts
ARTIFACT_NAMES = tuple(f".{schema}.json" for schema in READERS)  # what moetool names the files it writes


def collect(inputs: list[Path], copies: dict[Path, Path] | None = None) -> Found:
    """Every artifact under `inputs`. A file found in a directory that is not an artifact report
    draws (other JSON: configs, tokenizers, bundle manifests) is passed over; a file named on the
    command line must be one, and so must a file named like one (`*.run.json`, ...): a damaged run
    is an error, not a row missing from the tables without a word. A copy of a file read before (its
    bytes) is read once and put in `copies` (copy -> the file read): it was a second measurement."""
    files: list[tuple[Path, bool]] = []  # (file, must be an artifact)
    for p in map(Path, inputs):
        if p.is_dir():
            files += [(f, f.name.endswith(ARTIFACT_NAMES)) for f in _json_files(p)]
        elif p.is_file():
            files.append((p, True))
        else:
            raise MoetoolError(f"{p} does not exist.")
    # by path, whatever order the command line gave them in: which of two copies is read, and so named,
    # is the same for `report A B` and `report B A`
    files.sort(key=lambda pair: str(pair[0]))
    found: Found = defaultdict(list)
    seen: set[Path] = set()
    digests: dict[str, Path] = {}
    for f, named in files:
        if f.resolve() in seen:  # one file reached twice (a directory and its subdirectory): one artifact
            continue
        seen.add(f.resolve())
        try:
            data = read_json(f)
        except MoetoolError:
            if named:
                raise
            continue
        schema = data.get("schema") if isinstance(data, dict) else None
        if isinstance(schema, str) and schema in READERS and (first := digests.setdefault(sha256_file(f), f)) != f:
            if copies is not None:
                copies[f] = first
        elif isinstance(schema, str) and schema in READERS:
            found[schema].append((f, READERS[schema](data, where=str(f))))
        elif named:
            raise MoetoolError(f"{f} is not an artifact report draws (a {', '.join(READERS)} artifact).")
    if not found:
        raise MoetoolError(f"no profile, fit, run or eval artifacts in {', '.join(map(str, inputs))}.")
    for listed in found.values():  # by path, as a directory lists them: files given in another order, the same report
        listed.sort(key=lambda pair: str(pair[0]))
    return found


def _json_files(directory: Path) -> list[Path]:
    """The .json files under `directory`, sorted. A subdirectory that cannot be listed is refused:
    `Path.rglob` passed over it, and its artifacts went missing from the report without a word."""
    def refuse(e: OSError) -> None:
        raise MoetoolError(f"cannot list {e.filename} ({e.strerror}), so its artifacts would be missing from the "
                           "report; make it readable, or give the artifacts outside it.")

    found = []
    for root, dirs, names in os.walk(directory, onerror=refuse):  # a directory named like a run is refused by name
        found += [Path(root) / n for n in (*names, *dirs) if n.endswith(".json")]
    return sorted(found)


def _model(art: Any) -> ModelFingerprint:
    return build(ModelFingerprint, art["model"]) if isinstance(art, dict) else art.model


def group_by_model(found: Found) -> dict[str, tuple[ModelFingerprint, Found]]:
    """A name for each model -> (the model, its artifacts), in the order the models were found. Models are
    told apart as fit and run tell them (`ModelFingerprint.same_model`): the same config with other
    weights is another model, and an artifact whose weights digest is unknown joins the first model of
    its config. The name is `<model_type>-<config hash>`, with the weights' hash where that is not enough."""
    groups: dict[str, tuple[ModelFingerprint, Found]] = {}
    for schema, items in found.items():
        for path, art in items:
            fp = _model(art)
            name = next((n for n, (other, _) in groups.items() if other.same_model(fp)), None)
            if name is None:
                name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{fp.model_type}-{fp.config_sha256[:12]}")
                if name in groups:
                    name += f"-weights-{fp.weights_sha256[:12]}"
                groups[name] = (fp, defaultdict(list))
            groups[name][1][schema].append((path, art))
    return groups


__all__ = ["ARTIFACT_NAMES", "Found", "READERS", "collect", "group_by_model"]

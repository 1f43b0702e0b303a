"""The JSON artifacts that stages hand each other, as frozen dataclasses.

Every artifact carries its schema name and version, the moetool version that wrote it, the
fingerprint of the model it describes, and the sha256 of the files it was made from. Writes are
atomic (temp file + rename) so an interrupted stage never leaves a half-written artifact; reads
are strict and fail with one sentence.

    fp = ModelFingerprint.of_config("ckpt", {"model_type": "qwen2_moe", "hidden_size": 64})
    report = CheckReport(model=fp, inputs={}, prompt="Hi", passed=True, max_abs_diff=0.0, layers=())
    report.save(Path("out/check.json"))
    CheckReport.load(Path("out/check.json"), model=fp)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from moetool import __version__
from moetool.errors import MoetoolError

A = TypeVar("A", bound="Artifact")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of a file, streamed so multi-GB shards don't need to fit in memory."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; artifacts are ordinary readable files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class ModelFingerprint:
    """Which model an artifact belongs to: where it came from and a hash of its config.

    Two checkpoints with the same config hash have the same architecture and shapes; the source
    is informational (a local copy of a hub model keeps the same config hash).
    """

    source: str
    model_type: str
    config_sha256: str

    @classmethod
    def of_config(cls, source: str, config_dict: dict[str, Any]) -> "ModelFingerprint":
        # Keys that describe how the config was saved or run, not the model itself.
        volatile = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "_experts_implementation",
                    "_attn_implementation", "architectures", "use_cache", "output_attentions", "output_router_logits"}
        stable = {k: v for k, v in config_dict.items() if k not in volatile}
        blob = json.dumps(stable, sort_keys=True, default=str).encode()
        return cls(source=source, model_type=str(config_dict.get("model_type", "?")),
                   config_sha256=hashlib.sha256(blob).hexdigest())

    def same_model(self, other: "ModelFingerprint") -> bool:
        return self.model_type == other.model_type and self.config_sha256 == other.config_sha256


@dataclass(frozen=True)
class Artifact:
    """Base of every JSON artifact: subclasses add fields, and set SCHEMA and SCHEMA_VERSION.

    Fields map one to one onto JSON keys. Nested frozen dataclasses and tuples of them are
    rebuilt from their type hints on load. `upgrade` is the place to migrate older versions.
    """

    SCHEMA: ClassVar[str] = "artifact"
    SCHEMA_VERSION: ClassVar[int] = 1

    model: ModelFingerprint
    inputs: dict[str, str]  # name or path of each input file -> its sha256
    moetool_version: str = field(default=__version__, kw_only=True)

    def to_json(self) -> dict[str, Any]:
        body = dataclasses.asdict(self)
        return {"schema": self.SCHEMA, "schema_version": self.SCHEMA_VERSION, **body}

    @classmethod
    def upgrade(cls, data: dict[str, Any], version: int) -> dict[str, Any]:
        """Migrate a dict written at an older `version` to the current one (none yet)."""
        return data

    @classmethod
    def from_json(cls: type[A], data: dict[str, Any], *, where: str = "artifact") -> A:
        schema, version = data.get("schema"), data.get("schema_version")
        if schema != cls.SCHEMA:
            raise MoetoolError(f"{where} is a '{schema}' artifact, not the '{cls.SCHEMA}' this command needs.")
        if not isinstance(version, int) or version > cls.SCHEMA_VERSION:
            raise MoetoolError(f"{where} has {cls.SCHEMA} schema version {version}, newer than this moetool "
                               f"({__version__}) reads (≤ {cls.SCHEMA_VERSION}); upgrade moetool.")
        data = cls.upgrade(dict(data), version)
        try:
            return _build(cls, {k: v for k, v in data.items() if k not in ("schema", "schema_version")})
        except (TypeError, KeyError, ValueError) as e:
            raise MoetoolError(f"{where} is not a valid {cls.SCHEMA} artifact ({e}).") from None

    def save(self, path: Path) -> Path:
        atomic_write_bytes(path, (json.dumps(self.to_json(), indent=1) + "\n").encode())
        return path

    @classmethod
    def load(cls: type[A], path: Path, *, model: ModelFingerprint | None = None) -> A:
        """Read `path`; with `model`, refuse an artifact made for another model."""
        path = Path(path)
        if not path.is_file():
            raise MoetoolError(f"{path} does not exist.")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MoetoolError(f"{path} is not valid JSON ({e.__class__.__name__} at {getattr(e, 'pos', '?')}).") from None
        art = cls.from_json(data, where=str(path))
        if model is not None and not art.model.same_model(model):
            raise MoetoolError(f"{path} was made for model {art.model.source} ({art.model.model_type}, config "
                               f"{art.model.config_sha256[:12]}), not for {model.source} "
                               f"(config {model.config_sha256[:12]}).")
        return art


def _build(tp: Any, value: Any) -> Any:
    """Rebuild a value of type `tp` from its JSON form (dataclasses, tuples, lists, dicts, Optionals)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp) if f.init}
        missing = [n for n in names if n not in value and _required(tp, n)]
        if missing:
            raise KeyError(f"missing {', '.join(sorted(missing))}")
        return tp(**{k: _build(hints[k], v) for k, v in value.items() if k in names})
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v) for v in value)
        return tuple(_build(a, v) for a, v in zip(args, value))
    if origin is list:
        (arg,) = typing.get_args(tp)
        return [_build(arg, v) for v in value]
    if origin is dict:
        _, varg = typing.get_args(tp)
        return {k: _build(varg, v) for k, v in value.items()}
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _build(args[0], value) if len(args) == 1 else value
    return value


def _required(tp: Any, name: str) -> bool:
    f = next(f for f in dataclasses.fields(tp) if f.name == name)
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


@dataclass(frozen=True)
class LayerCheck:
    """One MoE layer's agreement between plain transformers and moetool's experts module."""

    layer: int
    routing_agreement: float  # share of (token, slot) expert choices that match exactly
    max_abs_diff: float  # max |moe block output(reference) - moe block output(moetool)|


@dataclass(frozen=True)
class CheckReport(Artifact):
    """What `moetool check` measured: fp32 CPU forward of a fixed prompt, both ways."""

    SCHEMA: ClassVar[str] = "check"
    SCHEMA_VERSION: ClassVar[int] = 1

    prompt: str
    passed: bool
    max_abs_diff: float  # on the final logits
    layers: tuple[LayerCheck, ...]
    tolerance: float = 1e-5

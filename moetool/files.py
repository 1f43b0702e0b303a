"""The files moetool reads whole, read with bounds; the temp files it writes, told by name; a directory lock.

A FIFO blocks a read forever, a link to /dev/zero never ends, and a 1 GiB file named like a
prompts file would be read whole before anything looked at it. So every file moetool reads whole
goes through `read_bytes` (and every file transformers reads whole for it, through `check_file`):
the file is opened without blocking, the opened file (not its name, which could change between a
check and the read) must be a regular file of at most `limit` bytes, and at most `limit` bytes
are read.

    data = read_bytes(Path("a.run.json"), ARTIFACT_BYTES)   # or one sentence: "... is a FIFO, not a regular file"
    with DirectoryLock(out, "another moetool sweep is writing in out"): ...

Temp files: `artifacts.atomic_write_bytes` writes `.NAME.XXXXXXXX.tmp` beside NAME and renames it
over NAME; a process killed in between leaves the temp file. `temp_file_of` tells such a file by its
name, so a resumed command removes its own leftovers and never a user's file.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import stat
from pathlib import Path

from moetool.errors import MoetoolError, not_a_file, size_text

# Limits of what moetool reads whole, by kind of file. Each is far above what moetool writes or a
# person writes by hand, and far below what would exhaust memory or stall for minutes.
ARTIFACT_BYTES = 256 << 20  # JSON artifacts and bundle manifests: a manifest of a 384-expert, 60-layer model is ~40 MiB
TEXT_BYTES = 256 << 20  # text to score, profile or calibrate on (the packaged held-out text is 0.6 MiB)
PROMPTS_BYTES = 16 << 20  # a prompts file: each prompt is generated from, one by one
CONFIG_BYTES = 64 << 20  # config.json, a safetensors index (~10 MiB for the largest MoE checkpoints), task YAML
TOKENIZER_BYTES = 256 << 20  # tokenizer.json of a 256k vocabulary is ~30 MiB
GRID_BYTES = 1 << 20  # grid files and hardware profiles are written by hand



def _open_regular(path: Path, limit: int, what: str) -> tuple[int, int]:
    """(fd, size) of `path` opened for reading, once the opened file is known to be a regular file of
    at most `limit` bytes; otherwise one sentence naming `what` and `path`."""
    name = f"{what} {path}".strip()
    try:
        # O_NONBLOCK: opening a FIFO for reading would wait for a writer; regular files ignore it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MoetoolError(f"{name} does not exist.") from None
    except IsADirectoryError:
        raise MoetoolError(f"{name} is a directory; give a file.") from None
    except OSError as e:  # a symlink loop, no permission: what the OS says, about this path
        raise MoetoolError(f"{name} cannot be read ({e.strerror or type(e).__name__}).") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_a_file(path, what)  # a directory, a FIFO, a device, a socket: named as such
        if st.st_size > limit:
            raise MoetoolError(f"{name} is {size_text(st.st_size)}, more than the {size_text(limit)} moetool reads "
                               "of such a file; give the right file, or a smaller one.")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_bytes(path: Path | str, limit: int, what: str = "") -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes, or one sentence saying what it is
    instead (missing, a directory, a FIFO, a device, a socket, too large). `what` names the option
    or role ("--prompts")."""
    fd, size = _open_regular(Path(path), limit, what)
    with os.fdopen(fd, "rb") as f:
        # The size the file has, and one byte more to see it grow: `read(n)` allocates n bytes before it
        # reads, so reading `limit + 1` at once took 256 MiB of address space for every 1 KiB artifact
        # (a MemoryError under `ulimit -v`). A file that grows is read on, a MiB at a time, to the limit.
        data = f.read(size + 1)
        if len(data) > size:
            parts, n = [data], len(data)
            while n <= limit and (part := f.read(min(1 << 20, limit + 1 - n))):
                parts.append(part)
                n += len(part)
            data = b"".join(parts)
    if len(data) > limit:
        raise MoetoolError(f"{what} {path} grew past {size_text(limit)} while it was read; give a file that is not "
                           "being written.".strip())
    return data


def check_file(path: Path | str, limit: int, what: str = "") -> None:
    """Refuse, as `read_bytes` would, a file another library reads whole (transformers: config.json,
    tokenizer files), without reading it."""
    fd, _ = _open_regular(Path(path), limit, what)
    os.close(fd)


def temp_file_of(name: str, names: set[str] | frozenset[str]) -> bool:
    """Whether `name` is a temp file `atomic_write_bytes` or `replace_dir` makes for one of `names`
    (".NAME.XXXXXXXX.tmp", ".NAME.old.XXXXXXXX.tmp"): what a killed write leaves behind."""
    return any(name.startswith(f".{short_name(n)}.") and _TEMP_TAIL.fullmatch(name[len(short_name(n)) + 2:])
               for n in names)


_TEMP_TAIL = re.compile(r"(old\.)?[A-Za-z0-9_]+\.tmp")  # after ".NAME.": mkstemp's random part, then .tmp
_TEMP_NAME = re.compile(r"\.(.+?)\.(?:old\.)?[a-z0-9_]{8}\.tmp")  # ".NAME.XXXXXXXX.tmp": NAME (short_name'd)


def target_of_temp(path: str | bytes | os.PathLike) -> str:
    """`path` with each of moetool's temp files or directories in it (".NAME.XXXXXXXX.tmp", made beside
    NAME by `atomic_write_bytes`, `replace_dir`, a bundle's shard and model/ writers) named as the NAME
    it stands for, so that a failure (a full disk, a directory removed) names the file the user asked
    for, never a temp name: ".layer-001.safetensors.kn32yhp5.tmp" -> "layer-001.safetensors". A name of
    255 bytes, whose temp name is cut (`short_name`), is named by its cut prefix."""
    text = os.fsdecode(path)
    parts = [m[1] if (m := _TEMP_NAME.fullmatch(part)) else part for part in text.split(os.sep)]
    return os.sep.join(parts)


def temp_path(target: Path, old: bool = False) -> Path:
    """A fresh name for a temp file or directory beside `target` (".NAME.XXXXXXXX.tmp", ".NAME.old.XXXXXXXX.tmp"),
    chosen before it is made: the caller makes it (`O_EXCL`, `mkdir`) inside the block whose cleanup removes
    it, so an interruption (Ctrl-C, SIGTERM) that lands right after the making still finds it by name;
    `tempfile.mkstemp` names it only once it has returned."""
    return target.parent / f".{short_name(target.name)}.{'old.' if old else ''}{secrets.token_hex(4)}.tmp"


def short_name(name: str, limit: int = 200) -> str:
    """`name` cut to `limit` UTF-8 bytes: a temp name adds ~15 to it, and a name may be 255 long.
    A name's bytes need not be UTF-8 (Python keeps such a byte as a lone surrogate): they are cut
    as the filesystem stores them, and a byte that is not UTF-8 is left out of the temp name."""
    return os.fsencode(name)[:limit].decode(errors="ignore")


def text_bytes(text: str) -> bytes:
    """`text` as UTF-8 for a file moetool writes (a report's markdown). A file name that is not UTF-8
    reaches Python as lone surrogates: they are written back as the name's own bytes, so a link to
    the file still finds it; any other lone surrogate is written as its escape."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace")


def symlink_loop(path: Path | str) -> Path | None:
    """The first component of `path` (itself or a directory above it) that is a symlink loop, or None.
    pathlib calls such a path missing, and resolving it raises RuntimeError (Python < 3.13)."""
    try:
        os.stat(path)
        return None
    except OSError as e:
        if e.errno != errno.ELOOP:
            return None  # missing or unreadable: the write itself says so, naming the path
    p = Path(path)
    for part in reversed((p, *p.parents)):
        try:
            os.stat(part)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return part
    return p


class DirectoryLock:
    """An exclusive lock on a directory (the file `lock` in it) while one command writes there: a second
    command into the same directory is refused at once with `busy` instead of racing the first (whose
    cleanup of stale temp files would delete the other's). `flock` is dropped by the kernel when a
    process dies, so a killed run's lock file never blocks the next run."""

    def __init__(self, directory: Path, lock: str, busy: str, tries: int = 3):
        self.path, self.busy = Path(directory) / lock, busy
        for _ in range(tries):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise MoetoolError(busy) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return
            os.close(fd)  # the holder finished and removed the file between our open and our lock: again
        raise MoetoolError(busy)

    def __enter__(self) -> "DirectoryLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.path.unlink(missing_ok=True)  # while still held, so a waiter's inode check sees it gone
        os.close(self.fd)


def umask_mode(directory: bool = False) -> int:
    """The mode any program gives a new file (0o666) or directory (0o777) under this process's umask: what
    moetool's writes get once their private temp file (mkstemp's 0600) is whole. A fixed 0644 ignored a
    umask 077 (a cluster user's unpublished prompts and licensed weights) and 002's group write."""
    try:  # read, not set: os.umask alone cannot read it without changing it for every thread a moment
        with open("/proc/self/status", encoding="ascii") as f:
            mask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


# The options that name one file a command writes (the others name directories: quantize, report, sweep).
FILE_OUTS = {"run": ("--out",), "eval": ("--out",), "profile": ("--out", "--hw-out"), "fit": ("--out",),
             "check": ("--out",)}


def directory_spelled(args: list[str]) -> str | None:
    """The sentence for a file output given with a trailing separator (`--out results/`), or None: Python's
    Path drops the slash, so the artifact was written as a file named `results`, which `report results/..`
    then passed over (it reads *.json)."""
    options = FILE_OUTS.get(next((a for a in args if not a.startswith("-")), ""), ())
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in options and (value if eq else (args[i + 1] if i + 1 < len(args) else "")).endswith(("/", os.sep)):
            given = value if eq else args[i + 1]
            return (f"{name} {given} names a directory (it ends with {given[-1]}); give the file to write, e.g. "
                    f"{given}result.json.")
    return None


def lock_held(path: Path) -> bool:
    """Whether a live process holds the `DirectoryLock` file `path` now (one a killed process left is not
    held: the kernel dropped its flock)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


__all__ = ["ARTIFACT_BYTES", "CONFIG_BYTES", "DirectoryLock", "GRID_BYTES", "PROMPTS_BYTES", "TEXT_BYTES",
           "TOKENIZER_BYTES", "check_file", "directory_spelled", "lock_held", "read_bytes", "umask_mode", "short_name", "symlink_loop", "target_of_temp", "temp_file_of",
           "temp_path", "text_bytes"]


def not_inside_a_model(out: Path | str, whose: str, itself: bool = True) -> None:
    """Refuse an --out that lies inside (or, with `itself`, is) a bundle or a model directory: files
    written there would mix with its own (and a bundle is exactly what its manifest lists). A
    directory above --out counts as one by its marker and its contents (a bundle's model/, a
    checkpoint's safetensors), since a project's own config.json is no checkpoint. `whose`: "the sweep", ..."""
    try:
        where = Path(out).resolve()
    except (OSError, RuntimeError):  # a symlink loop: the write names it
        return
    for d in (where, *where.parents) if itself else where.parents:
        for marker, what, contents in (("bundle.json", "a bundle", "model"), ("config.json", "a model", "*.safetensors")):
            if (d / marker).is_file() and (d == where or any(d.glob(contents))):
                inside = "holds" if d == where else f"lies inside {d}, which holds"
                raise MoetoolError(f"--out {out} {inside} {what} ({marker}); give {whose} a directory of its own.")


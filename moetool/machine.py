"""Faults of the machine while a command works: a signal that stops it, an allocation that fails, a
standard stream it was started without. `moetool.app.command` uses these around every command.

    with signals_raise():          # SIGTERM and SIGHUP raise `Terminated`, as Ctrl-C raises KeyboardInterrupt
        ...
    memory_sentence(e) if out_of_memory(e) else ...
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import os
import re
import resource
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from moetool.errors import Terminated, quote, size_text

# How a signal that stops a command is named in its one line; its exit code is 128 + the signal's
# number, what a shell reports for a process the signal killed (130, 143, 129).
STOPPED = {signal.SIGINT: "interrupted (Ctrl-C)", signal.SIGTERM: "terminated (SIGTERM)",
           signal.SIGHUP: "hung up (SIGHUP)"}
# What a stopped command says unless the stage noted what it keeps (`moetool.errors.keeping`): every
# file moetool writes is written whole or not at all, and its temp files are removed on the way out.
NOTHING_HALF_WRITTEN = "no file was left half-written; run the same command again"


def return_freed_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere). A
    layer's transient tensors are freed between layers, but glibc keeps the pages of its arenas, so
    quantize's resident memory rose by about 1 MiB a layer (67 to 93 MiB over 16) with none of it in
    use: a long model looked like a leak."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator is its own business
        pass


def hold_closed_descriptors() -> None:
    """Open /dev/null on each standard descriptor (0, 1, 2) the command was started without (`>&-`), so
    that no file opened later takes its number: what a library writes to stdout or stderr from C
    (torch's warnings) would land in that file, an artifact or a bundle's shard being written."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one, as the lower ones are held
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Within a command, SIGTERM and SIGHUP raise `Terminated` in the main thread as Ctrl-C raises
    KeyboardInterrupt, so the cleanup a Ctrl-C runs (temp files removed, a half-built report directory
    dropped, a lock released, a quantize's journal kept) runs for them too; their default action ends
    the process where it stands. A second SIGTERM or SIGHUP ends it at once, as the default does. A signal the caller
    ignores (`nohup`) or handles stays so."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return

    def stop(signum: int, frame: Any) -> None:
        signal.signal(signum, signal.SIG_DFL)
        raise Terminated(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)
                if signal.getsignal(s) == signal.SIG_DFL}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def interruption(e: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or `Terminated` behind `e`, where a library turned it into another exception: a C
    extension whose module initialization it interrupted raises "ImportError: initialization failed"
    from it (matplotlib's Agg backend, imported as a report draws its first figure); None if none."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


CUDA_CALL_OOM = "CUDA error: out of memory"


def out_of_memory(e: BaseException) -> BaseException | None:
    """The failed allocation behind `e`, or None: Python's MemoryError (numpy's too), torch's CPU allocator
    ("can't allocate memory"), CUDA's out of memory, or the OS's ENOMEM (an mmap). The chain of causes is
    read as `interruption` reads it, because a library may wrap the allocation in its own error: torch.compile
    an out of memory met while it compiles or captures, a Ray sweep cell's in a task error."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if _failed_allocation(e):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _failed_allocation(e: BaseException) -> bool:
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError (CUDA)
        return True
    if isinstance(e, OSError):
        return e.errno == errno.ENOMEM
    # torch's CPU allocator; a CUDA call other than the caching allocator's (cudaHostAlloc pinning host
    # memory, a library's workspace) says "CUDA error: out of memory" in a plain RuntimeError.
    return isinstance(e, RuntimeError) and ("DefaultCPUAllocator: can't allocate memory" in str(e)
                                            or CUDA_CALL_OOM in str(e))


def memory_sentence(e: BaseException) -> str:
    """One sentence for an allocation that failed (`out_of_memory`): which memory, how much was asked
    where the library says, and what to do, naming this process's address-space limit when it has one."""
    text = str(e)
    if type(e).__name__ == "OutOfMemoryError":  # "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ..."
        said = ". ".join(text.split(". ")[:3]).rstrip(".")
        return (f"out of device memory ({said}); give a smaller --budget or --batch-size, or free the device "
                "(another process may hold its memory).")
    if CUDA_CALL_OOM in text:  # pinned host memory or the device's, as the call that failed does not say
        return (f"out of memory in a CUDA call ({CUDA_CALL_OOM}); give a smaller --budget or --host-budget (pinned "
                "host memory), or free the device (another process may hold its memory).")
    asked = re.search(r"allocate (\d+) bytes", text) or re.search(r"allocate ([\d.]+ [KMGT]i?B)", text)
    amount = "" if asked is None else f" allocating {size_text(int(asked[1])) if asked[1].isdigit() else asked[1]}"
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    raise_it = "" if limit == resource.RLIM_INFINITY else \
        f", or raise this process's address-space limit ({size_text(limit)}, ulimit -v)"
    return (f"out of host memory{amount} ({type(e).__name__}); free memory or ask for less (a smaller --budget, "
            f"--host-budget, --batch-size or token count){raise_it}, and run the same command again.")


__all__ = ["NOTHING_HALF_WRITTEN", "STOPPED", "hold_closed_descriptors", "interruption", "memory_sentence",
           "out_of_memory", "signals_raise"]


# -- the process's environment ----------------------------------------------------------------------

_ESCAPED: list[str] = []  # what standard output could not spell since the last `escaped_note`


def _escape(e: UnicodeError) -> tuple[str, int]:
    _ESCAPED.append(e.object[e.start:e.end])
    return codecs.backslashreplace_errors(e)


codecs.register_error("moetool-escape", _escape)


def escape_unencodable() -> None:
    """Let standard output write what its encoding cannot spell (PYTHONIOENCODING=ascii, a latin-1
    locale given a CJK prompt) as backslash escapes, noted once (`escaped_note`), as Python's own stderr
    does: a run's text or a report's path was a traceback after the work was done and saved."""
    stream = sys.stdout
    try:
        if getattr(stream, "errors", None) == "strict" and codecs.lookup(stream.encoding).name != "utf-8":
            stream.reconfigure(errors="moetool-escape")
    except (AttributeError, LookupError, TypeError, ValueError):  # a stream without reconfigure (a test's capture)
        pass


def escaped_note() -> str | None:
    """One sentence for what `escape_unencodable` escaped since it was last asked, or None."""
    if not _ESCAPED:
        return None
    chars = "".join(dict.fromkeys("".join(_ESCAPED)))
    _ESCAPED.clear()
    return (f"standard output's encoding ({getattr(sys.stdout, 'encoding', '?')}) cannot spell {quote(chars, 20)}, "
            "written as backslash escapes; set PYTHONIOENCODING=utf-8 (or a UTF-8 locale) to see them.")


def warning_sentence(e: BaseException) -> str | None:
    """One sentence for a warning the process's filters turned into an error (PYTHONWARNINGS=error,
    `python -W error`): a library's DeprecationWarning at import was "a bug in moetool"."""
    if not isinstance(e, Warning):
        return None
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return (f"a {type(e).__name__} was made an error by this process's warning filters (PYTHONWARNINGS or python "
            f"-W): {quote(str(e), 120)}{where}; run without that filter, or add "
            f"-W ignore::{type(e).__name__} after it.")


def raised_in_transformers(e: BaseException) -> bool:
    """Whether the innermost frame of `e`'s traceback is transformers' code."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and f"{os.sep}transformers{os.sep}" in frames[-1].filename


# The libraries' own settings, named where an import's error quotes their value (not HOME's path in it).
_LIBRARY_ENV = ("TORCH", "PYTORCH", "CUDA", "TRITON", "HF_", "TRANSFORMERS", "TOKENIZERS", "OMP_", "MKL_", "RAY_",
                "NCCL_", "PYTHON", "DATASETS", "LM_EVAL", "HQQ")


def import_failure(e: BaseException) -> str | None:
    """One sentence for a library that failed as it was imported, in a library's own code (an invalid
    TORCH_LOGS is a ValueError from torch's import): the installation's or the environment's fault,
    not moetool's, named with the variables whose values the error quotes. None otherwise: moetool's
    own code at the failing line, or no import under way."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)  # Python drops importlib's own frames from it
    if not frames or f"{os.sep}moetool{os.sep}" in frames[-1].filename:
        return None
    # a library module's top-level code under way: the outermost is the library imported
    library = next((f.filename for f in frames if f.name == "<module>" and "-packages" in f.filename
                    and f"{os.sep}moetool{os.sep}" not in f.filename), None)
    if library is None:
        return None
    name = re.split(r"[\\/]", library.split("-packages", 1)[1].lstrip("/\\"))[0].removesuffix(".py")
    text = " ".join(str(e).split()) or type(e).__name__
    named = [f"{k}={v}" for k, v in os.environ.items() if k.startswith(_LIBRARY_ENV) and len(v) > 2 and v in text]
    cause = f"check or unset {', '.join(named)}" if named else "check its installation (make install) and environment"
    return f"importing {name} failed: {quote(text, 160)}; {cause}."


def quiet_libraries() -> None:
    """transformers' loading bars and warnings, torchao's kernel-library misses (the gptq extra) and
    torch's pytree deprecations would bury moetool's own output; a user's own TRANSFORMERS_VERBOSITY
    (debugging a checkpoint's load) is kept. A transformers not yet imported is told through the
    environment it reads as it imports, so a command that never loads a model (`report`) does not
    import it for this; one imported already is told directly. Called per command, not at import: a
    script that imports moetool keeps its loggers."""
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    mine = "TRANSFORMERS_VERBOSITY" not in os.environ
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # transformers' bars follow the hub's
    if "transformers" in sys.modules or "huggingface_hub" in sys.modules:
        from transformers.utils import logging as hf_logging

        if mine:
            hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


def space_cause(e: OSError, where: str = "") -> str | None:
    """What ran out, for a write that failed with no space (ENOSPC), a quota (EDQUOT) or past the file-size
    limit (EFBIG, `ulimit -f`), and how to go on; `where` (" writing PATH") placed after the cause. None
    for another error."""
    cause = e.strerror or str(e) or type(e).__name__
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        said = "" if e.errno == errno.ENOSPC else f" ({cause})"  # a quota says so; a full disk is the sentence
        return f"no space left on the device{where}{said}; free some space"
    if e.errno == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        why = (f"this process may write files of at most {size_text(limit)} (its file-size limit, ulimit -f)"
               if limit != resource.RLIM_INFINITY else "the filesystem holds no file that large")
        return f"file too large{where} ({cause}): {why}; raise the limit or write to another filesystem"
    return None

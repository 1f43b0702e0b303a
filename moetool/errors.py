"""The one exception type for user mistakes; the CLI turns it into one red line and exit code 1.
`Terminated` is how SIGTERM and SIGHUP stop a command (as Ctrl-C does, with KeyboardInterrupt)."""

import math
import signal


class MoetoolError(Exception):
    """A problem the user can fix (bad path, wrong model, corrupt file, impossible budget).

    The message is one sentence that says what is wrong and, where possible, what to do.
    """


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP) during a command, raised in the main thread as Ctrl-C raises KeyboardInterrupt,
    so that one cleanup runs for all three: temp files removed, half-built directories dropped, locks
    released (`moetool.app.command` installs the handler). `signum` sets the exit code, 128 + signum."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)
        self.signum = int(signum)


def keeping(e: KeyboardInterrupt, what: str) -> KeyboardInterrupt:
    """`e`, an interruption (Ctrl-C, `Terminated`), noting what the stopped command keeps and what
    running it again does ("OUT keeps the 2 of 6 MoE layers finished; ..."): the CLI's one line says
    this instead of its default, that no file was left half-written."""
    e.kept = what  # type: ignore[attr-defined]
    return e


def article(word: str) -> str:
    """'an' before 'eval' or 'int', 'a' before 'run': for one-sentence messages that name a kind."""
    return "an" if word[:1].lower() in "aeiou" else "a"


def size_text(n: float, up: bool = False) -> str:
    """A byte count as a sentence shows it, in the largest unit that keeps it >= 1 (so two small
    sizes never both read "0.0 MiB"); `up` rounds up, for a minimum (a budget of 16.1 MiB was "below the
    minimum of 16.1 MiB", 16.14 of them)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{(math.ceil(n / scale * 10) / 10 if up else n / scale):.1f} {unit}"
    return f"{int(n)} B"


def not_a_file(path, what: str = "") -> MoetoolError:
    """One sentence for a `path` that should be a readable file and is not: missing, a directory,
    or something else (a device, a FIFO). `what` names the option or role ("--data")."""
    import os
    import stat
    from pathlib import Path

    p, name = Path(path), f"{what} {path}".strip()
    if not p.exists():
        return MoetoolError(f"{name} does not exist.")
    if p.is_dir():
        return MoetoolError(f"{name} is a directory; give a file.")
    mode = os.stat(p).st_mode
    kind = next((k for test, k in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                                   (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")) if test(mode)),
                "a special file")
    target = f" (a link to {os.path.realpath(p)})" if p.is_symlink() else ""
    return MoetoolError(f"{name} is {kind}{target}, not a regular file; give a file.")


def yaml_error(what: str, e: Exception) -> MoetoolError:
    """One sentence for a YAML file that does not parse: `what` ("task file X"), the line, the problem."""
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1})" if mark is not None else ""
    return MoetoolError(f"{what} is not valid YAML{where}: {getattr(e, 'problem', None) or e}.")


def not_text(text: str) -> str | None:
    """Why `text` is not text, or None: the first lone UTF-16 surrogate in it, a code point that
    encodes no character (JSON's `"\\ud800"` escape without its pair, or a byte of the command line
    that was not UTF-8, which Python keeps as one). A tokenizer cannot encode it, so a prompt holding
    one would fail deep inside tokenization. A NUL character too (a JSON `"\\u0000"` escape), which no
    text holds and a file holding one raw is refused for (`datasets.decode_text`)."""
    if (nul := text.find("\0")) >= 0:
        return f"holds a NUL character at character {nul + 1}, which no text holds; give text"
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return (f"holds U+{ord(text[e.start]):04X} at character {e.start + 1}, a lone surrogate that is no "
                "character (a JSON \\u escape without its pair, or a byte that is not UTF-8); give UTF-8 text")


def quote(value: object, limit: int = 60) -> str:
    """A value from a user's file in a sentence: its repr, at most `limit` characters. Built by
    `reprlib`, which stops early, so a value that is huge (or a YAML alias bomb, small on disk and
    billions of items when expanded) costs nothing to quote."""
    import reprlib

    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother, short.maxlong = 3, limit, limit, limit
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = 4
    text = short.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, for one sentence; a KeyError (whose message is only
    the key, `'metadata'`) says that a key was missing."""
    if isinstance(e, KeyError) and len(e.args) == 1:
        return f"no {e.args[0]!r} key where one was expected"
    text = str(e).strip()
    return (text.splitlines()[0] if text else e.__class__.__name__).rstrip(".")

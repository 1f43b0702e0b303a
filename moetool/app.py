"""The Typer app, its two consoles and the `command` wrapper every command registers through.

    from moetool.app import app, command, err, out

    @command
    def verify(bundle: Path) -> None: ...

Results go to stdout (`out`: a Rich table, or JSON with --json); progress and errors go to stderr
(`err`). Rich lives in the CLI and nowhere else. Each command is a module of moetool/commands/;
moetool/cli.py imports them all and runs `app`.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import select
import signal
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click
import typer
import typer.core
from rich._null_file import NULL_FILE
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from moetool.errors import MoetoolError
from moetool.shown import visible
from moetool.machine import NOTHING_HALF_WRITTEN, STOPPED, escape_unencodable, escaped_note, hold_closed_descriptors, \
    import_failure, interruption, memory_sentence, out_of_memory, quiet_libraries, space_cause, raised_in_transformers, \
    signals_raise, warning_sentence

# Typer runs on a vendored click (typer._click) since 0.2x, whose exceptions are not click's own;
# its Abort is typer.exceptions'.
_clicks = tuple({click.exceptions, getattr(getattr(typer.core, "_click", None), "exceptions", click.exceptions)})
_USAGE = tuple(m.UsageError for m in _clicks)
_NO_ARGS = tuple(getattr(m, "NoArgsIsHelpError", m.UsageError) for m in _clicks)
_CLICK = tuple(m.ClickException for m in _clicks)
_ABORT = (click.exceptions.Abort, typer.Abort)


class _Help:
    """A help page (`--help`, `moetool` alone) under moetool's rule for a closed pipe. Typer prints the page
    through a Rich console of its own, whose closed pipe is exit code 1 without a word (Rich's
    `on_broken_pipe`), and click's newline after it, a BrokenPipeError, is exit code 1 too (Typer's main):
    both are `pipe_closed`, as for the rest of moetool's output."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        try:
            super().format_help(ctx, formatter)  # type: ignore[misc]
        except SystemExit:  # Rich's on_broken_pipe: the page's only exit, and stdout already points to /dev/null
            pipe_closed()

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        try:  # parsing runs the eager options: --help prints its page, then click echoes a newline
            return super().make_context(info_name, args, parent, **extra)  # type: ignore[misc]
        except BrokenPipeError:
            if reader_gone():
                pipe_closed()
            raise


class _Command(_Help, typer.core.TyperCommand):
    """Every moetool command (`command` registers it with this class): Typer's, with `_Help`'s pages."""


class _Group(_Help, typer.core.TyperGroup):
    """moetool's command group: a usage error (an option value outside its choices, an unknown option,
    a missing argument, an unreadable path argument) is bad input like any other, so it is one
    sentence and exit code 1 (click's default is a boxed usage text and code 2). Everything else
    is click's and Typer's own handling."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        if sys.flags.optimize >= 2:
            raise SystemExit(_fail(OPTIMIZED).exit_code)
        if os.environ.get("COLUMNS", "1").strip() in ("0", ""):  # Typer's help console takes it as 0 wide too
            del os.environ["COLUMNS"]
        from moetool.files import directory_spelled

        if (said := directory_spelled(list(sys.argv[1:] if args is None else args))) is not None:
            raise SystemExit(_fail(said).exit_code)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _NO_ARGS as e:  # `moetool` alone: the error's making printed the help (Typer's rich help)
            raise SystemExit(e.exit_code) from None
        except _USAGE as e:
            command = f"{e.ctx.command_path} --help" if e.ctx is not None else "moetool --help"
            text = e.format_message().replace("Value error, ", "").rstrip(".")
            raise SystemExit(_fail(f"{text} (`{command}` lists the options).").exit_code) from None
        except _CLICK as e:
            e.show()
            raise SystemExit(e.exit_code) from None
        except _ABORT:
            err.print("Aborted!", highlight=False)
            raise SystemExit(1) from None
        raise SystemExit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=_Group,
    name="moetool",
    help="Run Mixture-of-Experts models on one memory-limited GPU.\n\nExample: moetool check ./my-moe-checkpoint",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="markdown",
)
# The exit code when the reader of stdout or stderr went away (`moetool report out | head -1`): 128 +
# SIGPIPE, what a shell reports for `yes | head -1`. Neither 0 (the output was not all delivered) nor
# 1 (moetool's code for a mistake or a fault, which always comes with its sentence).
PIPE_CLOSED = 141
OPTIMIZED = ("python -OO (PYTHONOPTIMIZE=2) strips docstrings, which transformers builds its model classes from and "
             "moetool's --help pages are written in; run moetool without it (-O is fine).")


class _Console(Console):
    """moetool's consoles: Rich's, with two rules of their own.

    - A table is never drawn narrower than its widest word per column (`COLUMNS=20`, a narrow
      terminal; the terminal wraps its lines), and a cell folds rather than ends in "…": no number
      is cut to "1.…" or dropped.
    - A write to a pipe whose reader has gone ends the command quietly with `PIPE_CLOSED` (Rich's own
      handling exits with 1 and no word, as if it were a failure).
    - Text to a pipe or a file is not wrapped: there a line is a record (a path for `xargs`, generated
      text, a sentence in a log), and Rich would break it at 80 columns, inside a path or a word run.
      A terminal wraps long lines itself; tables are drawn to the width as before.
    - A write that fails otherwise (stdout redirected to a full disk or /dev/full, a terminal gone)
      names the stream, so its sentence is not taken for a failure to write the command's files; a
      result for a stdout the command was started without (`>&-`, where Rich writes nowhere) is refused
      in one sentence, not lost with exit code 0.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._width is not None and self._width < 1:  # COLUMNS=0 (a 0x0 pty): every line drawn 0 wide, nothing
            self._width = None

    def print(self, *objects: Any, **kwargs: Any) -> None:
        if not self.stderr and not self.quiet and self.file is NULL_FILE:
            raise MoetoolError("standard output is closed (the command was started with `>&-`), so its result "
                               "cannot be shown; send it to a file or to /dev/null instead.")
        try:
            self._print(*objects, **kwargs)
        except OSError as e:
            if e.filename is None:
                e.filename = self._stream_name()
            raise

    def _stream_name(self) -> str:
        name = "standard error" if self.stderr else "standard output"
        try:
            target = os.readlink(f"/proc/self/fd/{self.file.fileno()}")
        except (OSError, ValueError, AttributeError):  # no /proc, or a stream that is no file (a test's capture)
            return name
        return f"{name} ({target})" if target.startswith(os.sep) else name  # "pipe:[123]" says nothing

    def _print(self, *objects: Any, **kwargs: Any) -> None:
        objects = tuple(visible(o) for o in objects)
        tables = [o for o in objects if isinstance(o, Table)]
        if not tables and not self.is_terminal:
            kwargs.setdefault("soft_wrap", True)
        for table in tables:  # a cell too narrow folds onto the next line rather than end in "…"
            for column in table.columns:
                column.overflow = "fold" if column.overflow == "ellipsis" else column.overflow
        unbounded = self.options.update_width(1 << 16)  # measured at the console's width, a table fits it
        need = max((Measurement.get(self, unbounded, t).minimum for t in tables), default=0)
        if need <= self.width or kwargs.get("width") is not None:
            return super().print(*objects, **kwargs)
        saved = self._width  # COLUMNS or the detected size; the setter below replaces it for this print
        self.width = need
        try:
            super().print(*objects, **kwargs)
        finally:
            self._width = saved

    def on_broken_pipe(self) -> None:
        pipe_closed()


def pipe_closed() -> NoReturn:
    """The reader of stdout or stderr went away: stop quietly, with `PIPE_CLOSED`. What was written
    before stays (every artifact is written before its summary is printed); both streams go to
    /dev/null first, so nothing more (nor Python's flush at exit) writes to a closed pipe."""
    out.quiet = err.quiet = True
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                os.dup2(devnull, stream.fileno())
    except (OSError, ValueError):  # a stream that is no file (a test's capture): nothing to redirect
        pass
    raise SystemExit(PIPE_CLOSED)


def reader_gone() -> bool:
    """Whether stdout's or stderr's reader has gone (the write end of a pipe whose read end is closed
    polls as an error), so that a BrokenPipeError is about moetool's own output, not a socket or a
    subprocess's pipe (which is a fault like any other)."""
    try:
        poll = select.poll()
        for fd in (1, 2):
            poll.register(fd, 0)  # errors and hang-ups are reported whatever the mask
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no poll (Windows) or no such descriptor
        return False


# Neither console reads markup: what they print holds the user's text (prompts, generated text, paths,
# task and cell names), and "[/x]" in it would be a MarkupError after the work, "[red]" would vanish.
# Styles are given as `Text` spans (`styled`).
# Nor emoji codes: ":smile:" in a prompt or a generated text is printed as written.
out = _Console(markup=False, emoji=False)
err = _Console(stderr=True, markup=False, emoji=False)
# Progress bars use `disable=not err.is_terminal`: on a pipe or a log file a bar cannot redraw, and
# its teardown would put a blank line before a one-line error.

BUG = ("this is a bug in moetool, not a problem with your input: please report it with the traceback above "
       "and the command you ran.")
# When the failing line is transformers' own, the checkpoint may be one transformers cannot run.
BUG_IN_TRANSFORMERS = ("the error above was raised inside transformers: if `moetool check` on this model fails "
                       "too, its checkpoint or config.json is at fault; if not, this is a bug in moetool: please "
                       "report it with the traceback and the command you ran.")

@app.callback()
def _root() -> None:
    """Run Mixture-of-Experts models on one memory-limited GPU.

    Pipeline: quantize -> profile -> fit -> run / eval -> report; each stage writes a JSON
    artifact the next one reads. Example: `moetool check ./my-moe-checkpoint`
    """


def os_sentence(e: OSError) -> str:
    """One sentence for a failure of the filesystem (or the network): the path and the cause, as the OS
    says them, and the environment variable the path came from when it lies in a directory one names.
    A path inside one of moetool's temp files or directories is named as the file it stands for."""
    from moetool.files import target_of_temp

    cause = e.strerror or str(e) or type(e).__name__
    filename = target_of_temp(e.filename) if e.filename is not None else None
    where = f" writing {filename}" if filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return f"{space_cause(e, where)} and run the same command again."
    if e.errno == errno.ENOMEM:
        return memory_sentence(e)
    if e.filename is None:
        return f"{cause} ({type(e).__name__})."
    path = f"{filename} -> {target_of_temp(e.filename2)}" if e.filename2 else str(filename)
    var = environment_origin(e.filename)
    if var is not None:
        value = os.environ[var]
        root = os.path.abspath(os.path.expanduser(value.strip()))
        where = "is" if os.path.abspath(os.fsdecode(e.filename)) == root else "lies in"
        return (f"{path}: {cause}; it {where} ${var} ({value}), which is not a directory this user can write: "
                f"point {var} at one, or unset it.")
    return f"{path}: {cause}."


# Directories the libraries moetool runs (and moetool's own cache) take from the environment: caches,
# temp and config directories. The libraries create them as they import or start (torch's inductor cache
# as transformers imports, Ray's session directory under TMPDIR, matplotlib's config), so a failure
# there names a path the user never typed.
ENV_DIRS = ("MOETOOL_CACHE", "MOETOOL_KERNEL_CONFIGS", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCH_HOME",
            "HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "HF_MODULES_CACHE",
            "TRANSFORMERS_CACHE", "MPLCONFIGDIR", "RAY_TMPDIR", "PIP_CACHE_DIR", "XDG_CACHE_HOME",
            "XDG_CONFIG_HOME", "TMPDIR", "TEMP", "TMP", "HOME")


def environment_origin(path: object) -> str | None:
    """The variable of `ENV_DIRS` whose directory holds `path` (the innermost such), when that directory
    is itself unusable (missing under a file, a file, not writable): then it is the variable, not the
    command's input, that is at fault. A usable HOME is never blamed for a path under it."""
    try:
        target = os.path.abspath(os.fsdecode(path))
    except (TypeError, ValueError):
        return None
    best: tuple[int, str] | None = None
    for var in ENV_DIRS:
        value = os.environ.get(var, "").strip()
        if not value:
            continue
        root = os.path.abspath(os.path.expanduser(value))
        if (target == root or target.startswith(root.rstrip(os.sep) + os.sep)) and (best is None or len(root) > best[0]):
            best = (len(root), var)
    if best is None:
        return None
    root = os.path.abspath(os.path.expanduser(os.environ[best[1]].strip()))
    usable = os.path.isdir(root) and os.access(root, os.W_OK | os.X_OK)
    return None if usable else best[1]


def _fail(sentence: str) -> typer.Exit:
    try:
        err.print(styled(("error:", "red"), f" {sentence}"), highlight=False, soft_wrap=True)
    except (SystemExit, OSError):  # stderr's reader has gone, or stderr is full: the exit code still says it failed
        pass
    return typer.Exit(1)


def _stopped(e: KeyboardInterrupt) -> typer.Exit:
    """One line for a command stopped by Ctrl-C or a signal (yellow: the user's act, not an error), and
    its exit code. Typer's own handling of a KeyboardInterrupt is exit code 130 without a word."""
    signum = getattr(e, "signum", signal.SIGINT)
    how = STOPPED.get(signum, f"stopped by signal {signum}")
    try:
        err.print(styled((how, "yellow"), f": {getattr(e, 'kept', None) or NOTHING_HALF_WRITTEN}."), highlight=False,
                  soft_wrap=True)
    except (SystemExit, OSError):  # stderr gone with the terminal (SIGHUP) or its reader: the code still says it
        pass
    return typer.Exit(128 + signum)


def styled(*parts: str | tuple[str, str]) -> Text:
    """Text with styled spans, for the consoles (which read no markup): `styled(("OK", "green"), " done")`.
    Its controls are shown (`visible`) before Rich's `Text` would drop five of them."""
    return Text.assemble(*(visible(p) if isinstance(p, str) else (visible(p[0]), p[1]) for p in parts))


def command(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """Register `fn` as a command of `app`, with one policy for what goes wrong:

    - a `MoetoolError` (a problem the user can fix) is one red line on stderr and exit code 1;
    - an `OSError` (a path that is a directory, under a file, not writable; a full disk) is one red
      line naming the path and the cause, and exit code 1;
    - an allocation that fails (out of host or device memory, `machine.out_of_memory`) is one red line
      saying which memory and what to ask for instead, and exit code 1;
    - any other exception is a bug: its traceback, then one line asking to report it, and exit
      code 1 (as Python's own uncaught exception), so a script sees the code it saw before.

    A write to stdout or stderr whose reader has gone (`| head -1`) ends the command quietly with
    `PIPE_CLOSED` (141). Ctrl-C, SIGTERM and SIGHUP stop the command through the same cleanup
    (`machine.signals_raise`), then one yellow line and exit code 128 + the signal (130, 143, 129). Typer's
    own exits (`typer.Exit`, usage errors) pass through untouched. The libraries' Python warnings wait
    for the end of the command, and a refusal drops them.
    """

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            hold_closed_descriptors()
            escape_unencodable()
            quiet_libraries()
            # Python warnings of the libraries (torch's "Initializing zero-element tensors" for a config
            # size of 0, ...) are held until the command ends: a refusal is its one sentence alone, and
            # anything else shows them then, under the filters in force, as they would have been shown.
            held: list[warnings.WarningMessage] = []
            try:
                with signals_raise(), warnings.catch_warnings(record=True) as held:
                    result = fn(*args, **kwargs)
            except (typer.Exit, click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
                _show(held)
                raise  # an exit code chosen by the command (typer.Exit is not a click Exit since typer 0.2x)
            except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP (`Terminated`)
                raise _stopped(e) from None
            except MoetoolError as e:
                if (stopped := interruption(e)) is not None:  # a Ctrl-C a stage turned into a refusal
                    raise _stopped(stopped) from None
                raise _fail(str(e)) from None
            except BrokenPipeError as e:
                if reader_gone():  # a write to stdout or stderr (a library's print): as the consoles do
                    pipe_closed()
                raise _fail(os_sentence(e)) from None
            except OSError as e:
                raise _fail(os_sentence(e)) from None
            except Exception as e:  # noqa: BLE001 - shown in full, not hidden: a bug to report
                if (stopped := interruption(e)) is not None:  # a Ctrl-C or SIGTERM a library wrapped
                    raise _stopped(stopped) from None
                if (failed := out_of_memory(e)) is not None or (said := warning_sentence(e) or import_failure(e)):
                    raise _fail(memory_sentence(failed) if failed is not None else said) from None  # not a bug
                if type(e) is RuntimeError and (loop := re.fullmatch(r"Symlink loop from '(.*)'", str(e))):
                    # pathlib's resolve() of a link loop on Python < 3.13 (3.13 raises ELOOP): a path given
                    raise _fail(f"{loop.group(1)} is a symlink that leads back to itself (a loop); give another "
                                "path.") from None
                _show(held)
                err.print(traceback.format_exc().rstrip(), highlight=False, markup=False, soft_wrap=True)
                from moetool.policies.knobs import raised_in_a_policy

                raise _fail(raised_in_a_policy(e) or (BUG_IN_TRANSFORMERS if raised_in_transformers(e) else BUG)) from None
            _show(held)
            if (note := escaped_note()) is not None:
                err.print(f"note: {note}", highlight=False)
            return result

        return app.command(name=name, cls=_Command)(wrapper)

    return register(fn) if fn is not None else register


def _show(held: list[warnings.WarningMessage]) -> None:
    """Show the warnings a command's `catch_warnings(record=True)` held, as Python would have."""
    try:
        for w in held:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)
    except BrokenPipeError:
        if reader_gone():
            pipe_closed()
        raise


def writable(path: Path | None, kind: str = "file", option: str = "--out") -> None:
    """Refuse, before any work, an output path that cannot be written: a `kind` ("file" or "dir") whose
    path is the other kind, lies under a file, or in a directory this user cannot write."""
    if path is None:
        return
    p = Path(path)
    from moetool.files import symlink_loop

    loop = symlink_loop(p)
    if loop is not None:
        where = "is" if loop == p else f"lies under {loop}, which is"
        raise MoetoolError(f"{option} {p} {where} a symlink that leads back to itself (a loop); give another path.")
    if kind == "file" and p.is_dir():
        raise MoetoolError(f"{option} {p} is a directory; give a file path, e.g. {p / 'result.json'}.")
    if kind == "dir" and p.exists() and not p.is_dir():
        raise MoetoolError(f"{option} {p} is a file; give a directory.")
    shown = str(p)
    if p.is_symlink():  # written through (the link stays): where it leads must be writable, dangling or not
        p = Path(os.path.realpath(p))
        shown = f"{shown} (a link to {p})"
    start = p if kind == "dir" else p.parent
    parent = next((a for a in (start, *start.parents) if a.exists()), Path("."))
    if not parent.is_dir():
        raise MoetoolError(f"{option} {shown} lies under {parent}, which is a file, not a directory.")
    if not os.access(parent, os.W_OK | os.X_OK):
        why = "on a read-only filesystem" if os.statvfs(parent).f_flag & os.ST_RDONLY else "permission denied"
        raise MoetoolError(f"{option} {shown} cannot be written: {parent} is not writable ({why}).")


def not_an_input(save: Path | None, *inputs: Path | str | None, inside: Path | str | None = None,
                 option: str = "--out") -> None:
    """Refuse an output that is one of the command's own inputs (its text, profile, fit, prompts), or
    that lies inside `inside` (a bundle or model directory), before any work: writing it would
    destroy what the command read."""
    if save is None:
        return
    target = Path(save).resolve()
    for p in inputs:
        if p is not None and Path(p).exists() and Path(p).resolve() == target:
            raise MoetoolError(f"{option} {save} is also an input of this command; write the result elsewhere.")
    if inside is not None and Path(inside).is_dir() and target.is_relative_to(Path(inside).resolve()):
        raise MoetoolError(f"{option} {save} lies inside {inside}, which this command reads; write the result "
                           "outside it.")



def given(ctx: typer.Context, *names: str) -> list[str]:
    """The options among `names` (parameter names) that the command line gives, as spelled there
    (`--sweep-budget`): what an option read only in another mode is checked by, since a default cannot
    tell "left out" from "given its default value". `ctx`: the command's (a `typer.Context` parameter)."""
    flags = {p.name: p.secondary_opts[0] if getattr(p, "secondary_opts", None) and ctx.params.get(p.name) is False
             else p.opts[0] for p in ctx.command.params}  # as typed: --no-hqq-optimize
    return [flags.get(n, n) for n in names
            if getattr(ctx.get_parameter_source(n), "name", None) in ("COMMANDLINE", "ENVIRONMENT")]


def only_with(mode: str, names: list[str], fix: str | None = None) -> None:
    """Refuse options given where `mode` (the option or setting that reads them) is off: they change
    nothing there, and the command would have run as if they were not given. `fix`: how to turn it on
    (default: "add MODE")."""
    if not names:
        return
    one = len(names) == 1
    listed = names[0] if one else ", ".join(names[:-1]) + " and " + names[-1]
    raise MoetoolError(f"{listed} {'is' if one else 'are'} read only with {mode}, so {'it changes' if one else 'they change'} "
                       f"nothing here; leave {'it' if one else 'them'} out, or {fix or 'add ' + mode}.")


__all__ = ["BUG", "PIPE_CLOSED", "app", "command", "environment_origin", "err", "given", "not_an_input", "only_with",
           "os_sentence", "out", "pipe_closed", "styled", "writable"]

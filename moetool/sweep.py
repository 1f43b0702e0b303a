"""`moetool sweep`: every cell of a grid (`moetool.grid`) as a Ray task, one artifact per cell.

    index = sweep(SweepConfig(grid="grid.yaml", out=Path("out/sweep")))
    index.cells["lru_budget=25pct"]["status"]      # done, refused, failed or pending

Each cell writes `OUT/<name>.<stage>.json`; `OUT/sweep.json` (the index) maps every cell to its
artifact or its one-sentence reason and is rewritten atomically after each cell. A cell whose
artifact is valid (this model, this cell's settings, unchanged input files) is not re-run, nor is
a recorded refusal of the same settings, so a sweep resumes after a crash or a Ctrl-C (SIGTERM stops
it as Ctrl-C does; a lock keeps a second sweep out of its directory; the temp files of a killed one
are removed; a local Ray it started dies with it, even by SIGKILL: `moetool.reaper`). Cells run
on a local Ray (this machine's cores), on an existing Ray cluster (`address`), or one after
another in this process (`workers=0`); the results come back to this process, which alone writes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlparse

from moetool.artifacts import Artifact, ModelFingerprint, atomic_write_bytes, code_version, sha256_file
from moetool.errors import MoetoolError, Terminated
from moetool.files import DirectoryLock, not_inside_a_model, temp_file_of
from moetool.schema import SchemaError
from moetool.grid import STAGES, Cell, expand, grid_cells, grid_path, load_grid, select
from moetool.machine import memory_sentence, out_of_memory
from moetool.reaper import Reaper, descendants

INDEX = "sweep.json"
LOCK = ".sweep.lock"  # flock'ed while a sweep writes its directory
CELL_INPUT = "sweep cell"  # key in an artifact's `inputs`: sha256 of the settings of the cell that made it
# Results are JSON of a few MB at most; Ray's default store (30% of RAM) would take memory the models need.
LOCAL_OBJECT_STORE_BYTES = 256 * 2**20
PROBE_TIMEOUT_S = 5.0  # Ray itself retries an unreachable address for minutes

Outcome = tuple[str, Any, str | None]  # (done | refused | failed, artifact JSON or reason, detail)
Progress = Callable[[str, str, int, int], None]  # (cell, reused | done | refused | failed, finished, total)


def add_worker_arguments(ap: Any) -> None:
    """The `argparse` options of a script that runs a grid as a sweep (scripts/compare_policies.py,
    scripts/accuracy_table.py): where its cells run, and torch's threads when they run here."""
    ap.add_argument("--workers", type=int, default=None, help="local Ray CPUs (default all; 0: in this process)")
    ap.add_argument("--address", default=None, help="an existing Ray cluster")
    ap.add_argument("--threads", type=int, default=0, help="torch threads with --workers 0")


STATUSES = ("done", "refused", "failed", "pending")


@dataclass(frozen=True)
class Sweep(Artifact):
    """The sweep index: every cell of the grid, its status, and its artifact or why it has none.

    `cells[name]` holds `status` (done, refused, failed, pending), `artifact` (file name in the
    sweep directory, when done), `reason` (one sentence, when refused or failed), `detail` (a
    traceback tail for a failure that is not a refusal), `settings` and their sha256 `digest`.
    """

    SCHEMA: ClassVar[str] = "sweep"
    SCHEMA_VERSION: ClassVar[int] = 1

    stage: str
    grid: dict[str, Any]  # the grid as expanded (after overrides)
    cells: dict[str, dict[str, Any]]

    def validate(self) -> None:
        """On read (report draws the index as a table): a stage sweep runs, and per cell a status it writes,
        its artifact a file name in the sweep directory, its reason one line of text."""
        if self.stage not in STAGES:
            raise SchemaError("stage", f"is {self.stage!r}, not one of {', '.join(STAGES)}")
        for name, cell in self.cells.items():
            where = f"cells[{name[:40]!r}]"
            if cell.get("status") not in STATUSES:
                raise SchemaError(f"{where}.status", f"is {cell.get('status')!r}, not one of {', '.join(STATUSES)}")
            artifact = cell.get("artifact")
            if artifact is not None and (not isinstance(artifact, str) or Path(artifact).name != artifact
                                         or artifact in (".", "..")):
                raise SchemaError(f"{where}.artifact", f"is {artifact!r}, not a file name in the sweep directory")
            reason = cell.get("reason")
            if reason is not None and (not isinstance(reason, str) or "\n" in reason):
                raise SchemaError(f"{where}.reason", "is not one line of text")


@dataclass(frozen=True)
class SweepConfig:
    grid: str | Path | dict[str, Any]  # a grid file, a packaged grid's name, or an already loaded grid
    out: Path
    overrides: dict[str, Any] = field(default_factory=dict)  # top-level settings that replace the grid's
    only: tuple[str, ...] = ()  # glob patterns over cell names (default: every cell)
    address: str | None = None  # an existing Ray cluster; None: start Ray on this machine
    workers: int | None = None  # CPUs of the local Ray (default: all cores); 0: one by one in this process
    cpus_per_cell: int = 1  # also the cell's torch threads
    retry_refused: bool = False


def _resolve(cfg: SweepConfig) -> tuple[dict[str, Any], Path, dict[str, str]]:
    """(the grid after overrides, the directory its paths are relative to, the grid file's sha256)."""
    path = None if isinstance(cfg.grid, dict) else grid_path(cfg.grid)
    grid = cfg.grid if path is None else load_grid(path)
    axes = grid.get("grid") if isinstance(grid.get("grid"), dict) else {}
    crossed = next((k for k in cfg.overrides if k in axes), None)
    if crossed is not None:  # the axis decides it in every cell: the override would change nothing, silently
        raise MoetoolError(f"{crossed} given on the command line replaces a top-level setting of the grid, but the "
                           f"grid crosses {crossed} as an axis, which decides it in every cell; change the axis in "
                           "the grid file instead.")
    # A path given on the command line (`--with fit=F`, --bundle) is the working directory's, as every other
    # command reads it; the grid's own paths are its directory's. A file of that name beside the grid was used.
    overrides = {k: str(Path(v).resolve()) if isinstance(v, str) and v and Path(v).exists() else v
                 for k, v in cfg.overrides.items()}
    if path is None:
        return {**grid, **overrides}, Path("."), {}
    return {**grid, **overrides}, path.parent, {str(path): sha256_file(path)}


def cells_of(cfg: SweepConfig) -> list[Cell]:
    """The cells `cfg` names, without opening its model, bundle or fit (which need not exist yet)."""
    grid, base, _ = _resolve(cfg)
    return select(grid_cells(grid, base), cfg.only)


# -- one cell, in a worker ----------------------------------------------------------------------------

def run_cell(cell: Cell, threads: int | None = None) -> Outcome:
    """Run one cell where it is called (a Ray worker or this process): its artifact as JSON, or why not."""
    import torch

    if threads:
        torch.set_num_threads(threads)  # as many threads as CPUs the cell was given, not all the node's
    try:
        if cell.stage == "run":
            from moetool.run import run

            result = run(cell.config())
        else:
            from moetool.evaluate import evaluate

            result = evaluate(cell.config())
    except MoetoolError as e:
        return "refused", str(e), None
    except Exception as e:  # noqa: BLE001 - a bug in one cell is recorded; the other cells go on
        if (failed := out_of_memory(e)) is not None:  # the machine's limit, said as `moetool run` says it
            return "failed", memory_sentence(failed), None
        first = (str(e).strip().splitlines() or [""])[0]
        return "failed", f"it raised {type(e).__name__}: {first}".rstrip(": ") + ".", traceback.format_exc()[-4000:]
    # The cell's settings go into the artifact's inputs, so the artifact alone says which cell it answers.
    return "done", dataclasses.replace(result, inputs={**result.inputs, CELL_INPUT: cell.digest}).to_json(), None


def _serial(cells: list[Cell], work: Callable[..., Outcome]) -> Iterator[tuple[Cell, Outcome]]:
    for cell in cells:
        yield cell, work(cell)


def _probe(address: str) -> None:
    """Fail in seconds, in one sentence, where Ray would retry an unreachable address for minutes."""
    if address in ("auto", "local"):
        return  # Ray resolves these itself, at once
    url = urlparse(address if "://" in address else f"tcp://{address}")
    try:
        host, port = url.hostname, url.port
    except ValueError:
        host = port = None
    if not host or not port:
        raise MoetoolError(f"--address {address} is not host:port (e.g. 10.0.0.1:6379 or ray://10.0.0.1:10001).")
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
    except OSError as e:
        raise MoetoolError(f"cannot reach a Ray cluster at {address} ({e.strerror or type(e).__name__}); start one "
                           f"with `ray start --head` there, or check the address.") from None


@contextmanager
def _fd2_captured() -> Iterator[Any]:
    """Ray's C++ client logs each failed connection attempt straight to fd 2; keep them for the one sentence."""
    saved, sink = os.dup(2), tempfile.TemporaryFile()
    os.dup2(sink.fileno(), 2)
    try:
        yield sink
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _workers_know(policies: Any) -> None:
    """One sentence for a policy registered in this process alone (a launcher that imports its module):
    Ray's workers import moetool, and what MOETOOL_POLICIES names; every cell of it was "unknown policy"."""
    from moetool.policies import POLICIES
    from moetool.policies.knobs import USER_POLICIES, user_modules

    for name in dict.fromkeys(policies):
        module = POLICIES[name].__module__
        if module.split(".")[0] != "moetool" and module not in user_modules():
            raise MoetoolError(f"policy '{name}' is registered in this process only (by its module {module!r}), "
                               f"which the sweep's Ray workers do not import: name the module in {USER_POLICIES} "
                               f"(`{USER_POLICIES}={module} moetool sweep ...`), or run the cells here with --workers 0.")


def _start_ray(address: str | None, workers: int | None) -> tuple[bool, Reaper | None]:
    """Connect to or start Ray: (whether this call started it, and so shuts it down; the watcher that
    kills the processes of a Ray it started on this machine if this process dies without shutting it down)."""
    import ray

    if ray.is_initialized():
        return False, None  # the caller's Ray (a test fixture, a notebook): use it, leave it running
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        before = set(descendants(os.getpid()))
        try:
            # "local": a new Ray of our own, not whatever `ray start` left in /tmp/ray; None CPUs: Ray counts the cores
            ray.init(address="local", num_cpus=workers, include_dashboard=False, logging_level=logging.ERROR,
                     object_store_memory=LOCAL_OBJECT_STORE_BYTES, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
            raise MoetoolError(f"Ray did not start on this machine: {first}.") from None
        return True, Reaper.start(set(descendants(os.getpid())) - before)
    _probe(address)
    with _fd2_captured() as log:
        try:
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
            return True, None
        except (ConnectionError, RuntimeError, ValueError) as e:
            log.seek(0)
            said = log.read().decode(errors="replace")
            first = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
    if "InvalidAuthToken" in said:  # Ray >= 2.60 starts clusters with token authentication on
        raise MoetoolError(f"the Ray cluster at {address} refused this machine's token: run with RAY_AUTH_MODE=token "
                           f"and the cluster's token in RAY_AUTH_TOKEN or ~/.ray/auth_token (`ray get-auth-token` "
                           f"on the head prints it).")
    raise MoetoolError(f"cannot connect to the Ray cluster at {address}: {first}.")


def _on_gpu(cell: Cell) -> bool:
    return str(cell.settings.get("device") or "cpu").startswith("cuda")


def _check_feasible(ray: Any, cells: list[Cell], cpus: int) -> None:
    """Ray waits forever for a task no node can hold: say so instead."""
    need = {"CPU": cpus, "GPU": 1 if any(_on_gpu(c) for c in cells) else 0}
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    if not any(all(r.get(k, 0) >= v for k, v in need.items()) for r in nodes):
        what = f"{cpus} CPU{'s' if cpus > 1 else ''}" + (" and a GPU" if need["GPU"] else "")
        raise MoetoolError(f"no node of the Ray cluster has {what} for a cell (its nodes: "
                           f"{'; '.join(_resources(r) for r in nodes) or 'none'}).")


def _resources(r: dict[str, float]) -> str:
    return f"{r.get('CPU', 0):g} CPUs, {r.get('GPU', 0):g} GPUs"


@contextmanager
def _sigterm_raises() -> Iterator[list[int]]:
    """Within the block, SIGTERM raises `Terminated` in the main thread (and is noted in the list the
    block gets: Ray turns any KeyboardInterrupt raised while it waits into a plain one); a second
    SIGTERM kills at once, as SIGTERM does. (Ray's driver installs a native handler that prints a stack
    dump and dies: this one replaces it while cells run.)"""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received  # signal handlers belong to the main thread; elsewhere SIGTERM keeps its meaning
        return

    def terminated(signum: int, frame: Any) -> None:
        received.append(signum)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)  # None: a native handler


def _on_ray(cells: list[Cell], work: Callable[..., Outcome], cfg: SweepConfig) -> Iterator[tuple[Cell, Outcome]]:
    import ray

    started, reaper = _start_ray(cfg.address, cfg.workers)
    local = started and not (cfg.address or os.environ.get("RAY_ADDRESS"))
    pending: dict[Any, Cell] = {}
    try:
        with _sigterm_raises() as sigterm:  # again, now that ray.init has installed a handler of its own
            # max_retries re-runs a cell whose worker process died (OOM kill, segfault) once; an exception
            # raised inside the cell is not retried (run_cell returns it as an outcome).
            task = ray.remote(work)
            _check_feasible(ray, cells, cfg.cpus_per_cell)
            for cell in cells:
                gpus = 1 if _on_gpu(cell) else 0
                ref = task.options(num_cpus=cfg.cpus_per_cell, num_gpus=gpus, max_retries=1,
                                   retry_exceptions=False).remote(cell, cfg.cpus_per_cell)
                pending[ref] = cell
            while pending:
                try:
                    (ref,), _ = ray.wait(list(pending), num_returns=1)
                except KeyboardInterrupt:
                    if sigterm:
                        raise Terminated() from None  # Ray re-raised it as a plain KeyboardInterrupt
                    raise
                cell = pending.pop(ref)
                try:
                    outcome = ray.get(ref)
                except ray.exceptions.RayError as e:
                    outcome = ("failed", f"its worker died twice ({type(e).__name__}); the worker's log on its node "
                                         f"says why (often memory).", str(e)[-4000:])
                yield cell, outcome
    finally:
        if not local:  # interrupted, on a cluster that outlives us: nothing keeps computing unrecorded cells
            for ref in pending:
                ray.cancel(ref, force=True)
        if started:
            # A Ray of our own takes its workers with it. Cancelling them first raced Ray's bookkeeping
            # of a task finishing at that moment (Ray 2.60: "Tried to complete task that was not
            # pending", a failed CHECK that aborts the process).
            ray.shutdown()
        if reaper is not None:
            reaper.stop()  # what ray.shutdown left running (its agents wind down for minutes) is killed now


# -- the stage --------------------------------------------------------------------------------------

@lru_cache(maxsize=64)
def _sha(path: str, mtime_ns: int) -> str:
    return sha256_file(Path(path))


def reusable(path: Path, cell: Cell, model: ModelFingerprint) -> bool:
    """True when `path` is a valid artifact of this cell: this model, these settings, unchanged input files."""
    from moetool.evaluate import Eval
    from moetool.run import Run

    if not path.is_file():
        return False
    try:
        art = {"run": Run, "eval": Eval}[cell.stage].load(path, model=model)
    except MoetoolError:
        return False
    if art.inputs.get(CELL_INPUT) != cell.digest:
        return False
    if art.moetool_version != code_version():  # another moetool's numbers (a knob's meaning, a clock's charges)
        return False
    for name, digest in art.inputs.items():  # the bundle manifest and fit it was made from, unchanged
        p = Path(name)
        if name != CELL_INPUT and p.is_file() and _sha(str(p.resolve()), p.stat().st_mtime_ns) != digest:
            return False
    return True


def _previous(out: Path, model: ModelFingerprint) -> dict[str, dict[str, Any]]:
    if not (out / INDEX).is_file():
        return {}
    try:
        prev = Sweep.load(out / INDEX)
    except MoetoolError:
        return {}  # an unreadable index is rebuilt from the artifacts
    if not prev.model.same_model(model):
        raise MoetoolError(f"{out} holds a sweep of model {prev.model.source} ({prev.model.model_type}); give this "
                           f"grid another --out.")
    return prev.cells


def sweep(cfg: SweepConfig, progress: Progress | None = None, work: Callable[..., Outcome] = run_cell) -> Sweep:
    """Run every cell of the grid that has no valid artifact yet; return the index (also in OUT/sweep.json).

    `work` is what a worker runs per cell (`run_cell`; tests give one that kills its worker).
    """
    from moetool.evaluate import Eval
    from moetool.run import Run

    if cfg.cpus_per_cell < 1 or (cfg.workers is not None and cfg.workers < 0):
        raise MoetoolError("--cpus-per-cell must be at least 1 and --workers at least 0.")
    if cfg.workers == 0 and cfg.address:
        raise MoetoolError("--workers 0 runs the cells in this process; it takes no --address.")
    if cfg.address:
        _probe(cfg.address)  # before the grid is expanded: models can take a while to open
    grid, base, inputs = _resolve(cfg)
    plan = expand(grid, base, cfg.only)
    for cell in plan.cells:  # what no model could run with (a device, a budget's text, a dtype): before any work
        try:
            cell.config().check()
        except MoetoolError as e:
            raise MoetoolError(f"cell {cell.name}: {str(e)[0].lower()}{str(e)[1:]}") from None
    if cfg.workers != 0:
        _workers_know(cell.config().policy for cell in plan.cells)
        if os.environ.get("MOETOOL_POLICIES"):  # paths as the workers read them: their working directory is Ray's
            os.environ["MOETOOL_POLICIES"] = ",".join(str(Path(e.strip()).resolve()) if e.strip().endswith(".py") else e
                                                      for e in os.environ["MOETOOL_POLICIES"].split(","))
    out = Path(cfg.out)
    previous = _previous(out, plan.model)
    if previous:
        names = {c.name for c in (plan.cells if not cfg.only else grid_cells(grid, base))}
        stale = [n for n in previous if n not in names]
        if stale:  # their artifacts would stay beside this grid's, and `report OUT` would draw them as its own
            more = f" and {len(stale) - 1} more" if len(stale) > 1 else ""
            raise MoetoolError(f"{out} holds a sweep of another grid, whose cell {stale[0]}{more} this grid does not "
                               "have; give another --out, or remove that sweep first.")
    cells: dict[str, dict[str, Any]] = {}
    todo: list[Cell] = []
    done = 0

    def write() -> Sweep:
        index = Sweep(model=plan.model, inputs=inputs, stage=plan.stage, grid=grid, cells=dict(cells))
        text = (json.dumps(index.to_json(), indent=1) + "\n").encode()
        if not (out / INDEX).is_file() or (out / INDEX).read_bytes() != text:  # a re-run that changes nothing touches nothing
            atomic_write_bytes(out / INDEX, text)
        return index

    def tell(name: str, status: str) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(name, status, done, len(plan.cells))

    for cell in plan.cells:
        entry = {"status": "pending", "artifact": None, "reason": None, "detail": None, "settings": cell.settings,
                 "digest": cell.digest}
        old = previous.get(cell.name, {})
        if reusable(out / cell.artifact, cell, plan.model):
            cells[cell.name] = {**entry, "status": "done", "artifact": cell.artifact}
        elif old.get("status") == "refused" and old.get("digest") == cell.digest and not cfg.retry_refused:
            cells[cell.name] = {**entry, "status": "refused", "reason": old.get("reason")}  # the same answer again
        else:
            cells[cell.name] = entry
            todo.append(cell)
    not_inside_a_model(out, "the sweep")
    out.mkdir(parents=True, exist_ok=True)
    busy = f"another moetool sweep is writing in {out}; wait for it to finish or give another --out."
    with DirectoryLock(out, LOCK, busy):
        # What a sweep killed in the middle of a write left (its temp files), now that none can be live.
        ours = {INDEX, *(c.artifact for c in plan.cells), *(f"{n}.{plan.stage}.json" for n in previous)}
        for stray in out.glob(".*.tmp"):
            if temp_file_of(stray.name, ours) and stray.is_file():
                stray.unlink(missing_ok=True)
        index = write()
        for name, entry in cells.items():
            if entry["status"] != "pending":
                tell(name, "reused")
        if not todo:
            return index
        kind = Run if plan.stage == "run" else Eval
        runs = _serial(todo, work) if cfg.workers == 0 else _on_ray(todo, work, cfg)
        # On Ctrl-C or SIGTERM the generator's cleanup cancels what is in flight and stops Ray.
        with _sigterm_raises(), closing(runs):
            for cell, (status, payload, detail) in runs:
                entry = cells[cell.name]
                if status == "done":
                    kind.from_json(payload, where=cell.name).save(out / cell.artifact)
                    entry.update(status="done", artifact=cell.artifact)
                else:
                    entry.update(status=status, reason=payload, detail=detail)
                index = write()
                tell(cell.name, status)
    return index

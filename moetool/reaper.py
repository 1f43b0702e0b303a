"""Kill what a process started once that process is gone, even by SIGKILL (Linux): `sweep`'s local Ray.

Ray ties its head processes (GCS, raylet) to the driver, but not what the raylet starts: after a
SIGKILLed `moetool sweep` its dashboard and runtime-env agents lived on for minutes, and a worker
can outlive its raylet. So the driver notes the processes `ray.init` started and starts this
watcher, tied to it by a pipe:

    before = set(descendants(os.getpid())); ray.init(...)
    reaper = Reaper.start(set(descendants(os.getpid())) - before)
    ...                          # the watcher notes those processes and theirs, twice a second
    reaper.stop()                # or the driver dies: the pipe closes either way

When the pipe closes (the driver exited, or `stop`), the watcher kills every process it noted that
is still the same process (same pid, same start time: a reused pid is never killed), then exits.
Only Ray's processes are noted, never another child of the driver (a notebook's own). The watcher
runs in a session of its own, so a signal to the driver's process group does not take it first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

POLL_S = 0.5


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every process /proc shows."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone since the listing
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": comm may hold spaces and parentheses
        out[int(entry.name)] = (int(fields[1]), fields[19])  # ppid, starttime (fields 4 and 22 of proc(5))
    return out


def descendants(*roots: int, table: dict[int, tuple[int, str]] | None = None) -> dict[int, str]:
    """pid -> start time of every process below `roots` (in `table`, default: the processes now)."""
    table = _processes() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[int, str] = {}
    todo = [c for r in roots for c in children.get(r, [])]
    while todo:
        pid = todo.pop()
        if pid not in found and pid in table:
            found[pid] = table[pid][1]
            todo += children.get(pid, [])
    return found


def watch(roots: list[int]) -> None:
    """Note `roots` and their descendants until stdin closes, then kill those still alive (the watcher's body)."""
    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.buffer.read(), closed.set()), daemon=True).start()
    table = _processes()
    noted = {pid: table[pid][1] for pid in roots if pid in table}
    while not closed.wait(POLL_S):
        table = _processes()
        # Only below a noted process that is still itself: a pid the kernel gave to another process
        # since would make that one's children Ray's.
        noted.update(descendants(*(pid for pid, started in noted.items() if table.get(pid, (0, ""))[1] == started),
                                 table=table))
    noted.pop(os.getpid(), None)
    alive = _processes()
    for pid, started in noted.items():
        if pid in alive and alive[pid][1] == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


class Reaper:
    """The driver's end of the watcher: its pipe and its process."""

    def __init__(self, process: subprocess.Popen):
        self.process = process

    @classmethod
    def start(cls, roots: set[int]) -> "Reaper | None":
        """Start a watcher of `roots` (pids); None where /proc is not there to watch with (not Linux)."""
        if not roots or not Path("/proc/self/stat").exists():
            return None
        # Run as a script (it imports only the standard library), so it starts fast and needs no moetool on its path.
        process = subprocess.Popen([sys.executable, os.path.abspath(__file__), *map(str, sorted(roots))],
                                   stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
        return cls(process)

    def stop(self) -> None:
        """Close the pipe: the watcher kills what outlived a clean shutdown (Ray's agents) and exits."""
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


if __name__ == "__main__":
    watch([int(a) for a in sys.argv[1:]])

"""The processes the host-level backends act on, named so that a reused pid is never mistaken for them.

A pid alone can name another process once the first one exited; a pid with its start time (clock
ticks since boot, ``/proc/<pid>/stat`` field 22) names one process. Every host action that signals
or resumes a process checks both. Linux only (``/proc``), like the backends themselves.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from gpumigrate.errors import PolicyDeniedError, SnapshotError


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot): with the pid, names one process, never a recycled pid."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R, S, T, Z, ...), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def ensure_running(pid: int, *, dump_dir: str | Path | None = None) -> str:
    """The undo on the source: a tree left stopped (a CRIU dump interrupted mid-way) continues; returns what it did.

    A source that is gone is not brought back from an old dump (a training job would rewind): the
    error says where the dump is, for a person to decide.
    """
    state = process_state(pid)
    if state is None or state == "Z":
        where = f"; its last dump is in {dump_dir} (`criu restore -D {dump_dir}`)" if dump_dir else ""
        raise SnapshotError(f"the source process {pid} is gone{where}")
    if state in ("T", "t"):
        _signal_tree(pid, signal.SIGCONT)
        return "continued"
    return "running"


def stop_tree(pid: int, started: int | None, *, grace_s: float = 10.0) -> str:
    """Stop the tree at ``pid`` (SIGTERM, then SIGKILL after ``grace_s``) if it is still the process that
    started at ``started``; a pid the kernel gave to another process since is left alone."""
    if process_state(pid) in (None, "Z"):
        return "already gone"
    if started is not None and start_ticks(pid) != started:
        return "already gone (the pid now names another process)"
    try:
        _signal_tree(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while process_state(pid) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.05)
        if process_state(pid) not in (None, "Z"):
            _signal_tree(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return "stopped"


def _signal_tree(pid: int, sig: int) -> None:
    """Signal the process group of ``pid`` (a dumped or restored tree keeps its own), never the caller's own group."""
    group = os.getpgid(pid)
    if group == os.getpgrp():
        os.kill(pid, sig)
    else:
        os.killpg(group, sig)


def require_same(pid: int, started: int | None) -> None:
    """Refuse to act on ``pid`` when it no longer names the process that started at ``started``."""
    if started is not None and start_ticks(pid) != started:
        raise PolicyDeniedError(
            "host-action", f"pid {pid} no longer names the process it named (it exited; the pid was reused)"
        )

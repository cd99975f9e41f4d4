"""An exclusive file lock (``flock``) that a stop signal cannot leave held.

Python runs a signal's handler in the main thread between two bytecodes, and the stop handler raises there
(``flows/stopping.py`` raises Prefect's ``TerminationSignal`` where the flow is, so that its Cancel path rolls back).
One that lands between the ``flock`` and the ``try`` that would undo it (inside ``contextlib``'s ``__enter__``, or in
the ``finally`` before the unlock) leaves the lock held by a file descriptor nobody closes while the exception lives,
and Prefect keeps it, in the run's state. ``flock`` locks belong to an open file, so the process's own next lock of
the same file waits forever: a SIGTERM in the snapshot phase hung the rollback that way, every audit write after it
waiting on the migration's state lock (``tests/core/test_filelock.py`` sends the signal at every step of a lock).

So a handler asks :func:`defer` first: while the main thread holds one of these locks, the raise is kept and
happens as the outermost lock is let go, nothing held. Other threads need nothing: no handler runs there. A lock
that waits on another process still waits (a signal cannot cut that wait short); the stopper's deadline and a
second signal (``os._exit``) end the process whatever it waits on.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path
from types import TracebackType

_depth = 0  # locks the main thread holds now (only the main thread touches it)
_deferred: BaseException | None = None  # what a handler would have raised while they were held


def defer(exc: BaseException) -> bool:
    """Called by a signal handler: when the main thread holds a lock, keep ``exc`` to raise as the outermost lock
    is let go, and say so (True); otherwise the handler raises it itself (False)."""
    global _deferred
    if _depth == 0 or threading.current_thread() is not threading.main_thread():
        return False
    if _deferred is None:
        _deferred = exc
    return True


def _leave() -> None:
    global _depth, _deferred
    _depth -= 1
    if _depth == 0 and _deferred is not None:
        exc, _deferred = _deferred, None
        raise exc


class FileLock:
    """``with FileLock(path) as fd:`` holds an exclusive ``flock`` on ``path`` (created with ``mode``); ``fd`` is
    open read-write (and append, with ``append=True``) for the caller's own writes under the lock."""

    def __init__(self, path: str | Path, *, mode: int = 0o644, append: bool = False, nofollow: bool = False) -> None:
        self.path = Path(path)
        self.flags = os.O_RDWR | os.O_CREAT | (os.O_APPEND if append else 0) | (os.O_NOFOLLOW if nofollow else 0)
        self.mode = mode
        self._fd: int | None = None
        self._main = False

    def __enter__(self) -> int:
        global _depth
        self._main = threading.current_thread() is threading.main_thread()
        if self._main:
            _depth += 1  # first: from here on a stop handler defers its raise
        try:
            fd = os.open(self.path, self.flags, self.mode)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            if self._main:
                _leave()
            raise
        self._fd = fd
        return fd

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        fd, self._fd = self._fd, None
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                finally:
                    os.close(fd)
        finally:
            if self._main:
                _leave()  # last: a deferred raise comes here, the lock let go

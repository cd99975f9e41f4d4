"""Hold Python's cyclic garbage collector off while a command on the freeze → ready path runs.

A full collection walks every object the process tracks, holding the GIL, for tens of milliseconds in a
workload process with torch loaded, and longer where more is imported (CUDA, Triton, a web framework;
bench/README.md has the figures). It starts whenever allocations cross the collector's thresholds, so it
lands at random; a final round or a restore allocates thousands of small objects (the manifest, per-chunk
records), and a migration's pre-load was caught by one. Inside the downtime window such a pause is downtime. Reference counting still frees every object
that is not part of a cycle; cycles wait for the first collection after the command.

Holds nest and may overlap across threads (a command on one connection, another on the next): the
collector is switched back on when the last hold ends, and only if it was on when the first began
(a workload that turned it off itself keeps it off).

:func:`release_later` moves the other pause out of that window: freeing a large object graph (a restore's parsed
manifest) when the command returns, before its reply.
"""

from __future__ import annotations

import gc
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_holds = 0
_was_enabled = False


@contextmanager
def gc_held() -> Iterator[None]:
    """No automatic cyclic collection inside the block (see the module docstring)."""
    global _holds, _was_enabled
    with _lock:
        if _holds == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holds += 1
    try:
        yield
    finally:
        with _lock:
            _holds -= 1
            if _holds == 0 and _was_enabled:
                gc.enable()


RELEASE_AFTER_S = 1.0
_released: queue.SimpleQueue[tuple[float, object]] = queue.SimpleQueue()
_reaper: threading.Thread | None = None


def release_later(obj: object, after_s: float | None = None) -> None:
    """Keep ``obj`` alive ``after_s`` (default ``RELEASE_AFTER_S``) seconds more, then drop this reference on a
    background thread.

    Freeing a large object graph takes the GIL for its whole length: the final restore's manifest (a reader's
    parsed body, several objects per chunk) was freed when the restore returned, inside the downtime window,
    before the reply that says ready. Later it costs nothing that waits."""
    global _reaper
    _released.put((time.monotonic() + (RELEASE_AFTER_S if after_s is None else after_s), obj))
    with _lock:
        if _reaper is None:
            _reaper = threading.Thread(target=_reap, name="gm-release-later", daemon=True)
            _reaper.start()


def _reap() -> None:
    while True:
        deadline, obj = _released.get()
        time.sleep(max(0.0, deadline - time.monotonic()))
        del obj  # the last reference, usually: the object is freed here, off the command's thread

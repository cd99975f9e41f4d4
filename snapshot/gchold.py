"""Hold Python's cyclic garbage collector off while a command on the freeze → ready path runs.

A full collection walks every object the process tracks, holding the GIL: in a workload process with
torch loaded it took 40-100 ms on the 2-core dev machine, and more where more is imported (CUDA, Triton,
a web framework). It starts whenever allocations cross the collector's thresholds, so it lands at
random; a final round or a restore allocates thousands of small objects (the manifest, per-chunk
records) and was caught by one inside the pre-load of a migration measured here (91 ms of a restore).
Inside the downtime window such a pause is downtime. Reference counting still frees every object
that is not part of a cycle; cycles wait for the first collection after the command.

Holds nest and may overlap across threads (a command on one connection, another on the next): the
collector is switched back on when the last hold ends, and only if it was on when the first began
(a workload that turned it off itself keeps it off).
"""

from __future__ import annotations

import gc
import threading
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

"""Seconds spent per stage, summed over threads: where a capture or restore waits and works.

The transfer engine's direct path (``transfer/direct_writer.py``, ``transfer/direct_reader.py``) and the snapshot pipeline that feeds it
(``snapshot/pipeline.py``) add to one process-wide clock; ``bench/direct.py`` reads it, and
``bench/e2e.py`` reads the lines each agent appends to ``GPUMIGRATE_STAGES_LOG``. Cheap enough to stay
on: a lock and an add per stage per chunk (per batch on the submitting thread).
"""

from __future__ import annotations

import json
import os
import threading
import time


class StageClock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.totals: dict[str, float] = {}

    def add(self, stage: str, since: float) -> float:
        """Add the wall time since ``since`` (a ``perf_counter`` reading) to ``stage``; return now."""
        now = time.perf_counter()
        with self._lock:
            self.totals[stage] = self.totals.get(stage, 0.0) + now - since
        return now

    def add_both(self, stage: str, since: tuple[float, float]) -> tuple[float, float]:
        """Wall time and this thread's CPU time since ``since`` (from :func:`both_now`), as ``stage`` and
        ``stage.cpu``: where one thread sets the pace, wall time well above its CPU time means it waited
        (for the device, a lock, or the GIL)."""
        now = both_now()
        with self._lock:
            self.totals[stage] = self.totals.get(stage, 0.0) + now[0] - since[0]
            key = stage + ".cpu"
            self.totals[key] = self.totals.get(key, 0.0) + now[1] - since[1]
        return now

    def set(self, stage: str, seconds: float) -> None:
        """Record ``stage`` as ``seconds`` (a figure measured elsewhere: a device timer, a driver call's total)."""
        with self._lock:
            self.totals[stage] = seconds

    def take(self) -> dict[str, float]:
        with self._lock:
            out, self.totals = self.totals, {}
        return {k: round(v, 4) for k, v in sorted(out.items())}


def both_now() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


STAGES = StageClock()


def log_stages(what: str) -> None:
    """Append this process's stage totals to ``GPUMIGRATE_STAGES_LOG`` (one JSON line), if set, and reset them."""
    path = os.environ.get("GPUMIGRATE_STAGES_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"pid": os.getpid(), "what": what, "stages": STAGES.take()}) + "\n")

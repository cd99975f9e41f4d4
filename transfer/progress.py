"""Progress reporting shared by the CLI (rich bars) and the Prefect flow (progress artifacts).

A callback receives (bytes_done, bytes_total) and may be called from several threads; the
:class:`ProgressCounter` serialises calls and rate-limits them so a slow callback never stalls chunks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

ProgressCallback = Callable[[int, int], None]


class ProgressCounter:
    def __init__(self, callback: ProgressCallback | None, total: int, *, min_interval_s: float = 0.1) -> None:
        self.callback = callback
        self.total = total
        self.done = 0
        self._lock = threading.Lock()
        self._last = 0.0
        self._interval = min_interval_s

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            if self.callback is None:
                return
            now = time.monotonic()
            if now - self._last < self._interval and self.done < self.total:
                return
            self._last = now
            self.callback(self.done, max(self.total, self.done))

    def grow(self, nbytes: int) -> None:
        with self._lock:
            self.total += nbytes

    def finish(self) -> None:
        if self.callback is not None:
            with self._lock:
                self.callback(self.done, max(self.total, self.done))


@dataclass
class TransferStats:
    """What one push/pack/verify did. ``bytes_sent`` counts stored-object bytes that crossed."""

    image_id: str
    chunks_total: int = 0
    chunks_sent: int = 0
    chunks_skipped: int = 0
    chunks_resent_invalid: int = 0
    bytes_logical: int = 0
    bytes_sent: int = 0
    bytes_landed: int = 0  # check_landed: the stored size of the image's objects found where it was checked
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def throughput_bps(self) -> float:
        return self.bytes_logical / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        out = dict(self.__dict__)
        out["throughput_bytes_per_s"] = round(self.throughput_bps)
        return out


class RateLimiter:
    """Bytes per second through a point that several threads pass (push's ``--rate-limit``, a capture round's
    ``transfer.rate_limit`` and its pacing, ``pacing.py``).

    A bucket that may go into debt: a ``take`` passes at once while the bucket holds no debt, and its bytes are
    then repaid at the rate before the next one passes. So a whole chunk moves in one piece, the average holds,
    and a rate raised meanwhile (:meth:`set_rate`) frees the waiting threads at once rather than after the wait
    the old rate set. ``admitted`` counts every byte passed, capped or not (what the pacing measures)."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.rate = bytes_per_s or None
        self.admitted = 0
        self.held = 0  # takes that had to wait for the rate (the cap held the round back), and those waiting now:
        self.waiting = 0  # the pacing lifts a cap that holds nothing back
        self._cond = threading.Condition()
        self._balance = 0.0  # bytes: negative while a passed take is still being repaid
        self._at = time.monotonic()

    def _refill(self, now: float) -> None:
        if self.rate is not None:
            self._balance = min(0.0, self._balance + (now - self._at) * self.rate)
        self._at = now

    def take(self, nbytes: int) -> None:
        with self._cond:
            waited = False
            while True:
                now = time.monotonic()
                self._refill(now)
                if self.rate is None or self._balance >= 0:
                    break
                if not waited:
                    waited = True
                    self.held += 1
                    self.waiting += 1
                self._cond.wait(-self._balance / self.rate)
            if waited:
                self.waiting -= 1
            if self.rate is not None:
                self._balance -= nbytes
            self.admitted += nbytes

    def set_rate(self, bytes_per_s: float | None) -> None:
        """A new rate from now on (None: no cap); waiting threads re-check at once."""
        with self._cond:
            self._refill(time.monotonic())
            self.rate = bytes_per_s or None
            if self.rate is None:
                self._balance = 0.0
            self._cond.notify_all()

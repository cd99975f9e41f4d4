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
    """Token bucket shared by threads: caps bytes/s on a shared link (``--rate-limit``)."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.rate = bytes_per_s
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, nbytes: int) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + nbytes / self.rate
            wait = start - now
        if wait > 0:
            time.sleep(wait)

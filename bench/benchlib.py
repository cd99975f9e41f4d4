"""Helpers the benchmarks share (each benchmark is a script: ``bench/`` is on its import path)."""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any


def threaded(n: int, fn: Any) -> float:
    """Seconds for ``fn(0)`` … ``fn(n - 1)`` on n threads at once, from the first start to the last join."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else float("inf")


def pinned_d2h_GBps(src: Any) -> float:
    """The line rate: 1 GiB of device→pinned-host copies from ``src`` (256 MiB of device bytes), median of 4."""
    import torch

    pinned = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k in range(4):
            pinned[k << 28 : (k + 1) << 28].copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return gbps(1 << 30, statistics.median(times[1:]))

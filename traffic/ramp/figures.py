"""What clients saw during a ramp, read from every Envoy's client listener on a thread of its own, several
times a second (:class:`~gpumigrate.traffic.stats.ClientFigures`: requests, failures, p99, downtime)."""

from __future__ import annotations

import threading
import time
from functools import partial
from typing import Any

from gpumigrate.errors import TrafficError
from gpumigrate.traffic.envoy import EnvoyAdmin
from gpumigrate.traffic.stats import (
    ClientFigures,
    IngressCounters,
    baseline_reading,
    client_figures,
    parse_ingress,
    settled_reading,
)


def _read_ingress(admin: EnvoyAdmin) -> IngressCounters:
    return parse_ingress(admin.ingress_stats(), ts=time.monotonic())


class ClientFiguresSampler:
    """Reads every Envoy's client-listener counters every ``every_s`` on its own thread (the first sample a
    :func:`~gpumigrate.traffic.stats.baseline_reading`, each later one a
    :func:`~gpumigrate.traffic.stats.settled_reading`)."""

    def __init__(self, admin_urls: list[str], every_s: float) -> None:
        self.admins = [EnvoyAdmin(u, timeout_s=max(1.0, every_s * 4)) for u in admin_urls]
        self.figures = [ClientFigures() for _ in admin_urls]
        self.every_s = every_s
        self.reads = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the last sample (stop) may meet a read still running on the thread
        self._thread = threading.Thread(target=self._loop, daemon=True, name="ramp-figures")

    def sample(self) -> None:
        with self._lock:
            for admin, fig in zip(self.admins, self.figures, strict=True):
                take = baseline_reading if fig.prev is None else settled_reading  # the span's base: most reads agree
                try:
                    fig.add(take(partial(_read_ingress, admin)))
                    self.reads += 1
                except (TrafficError, ValueError):  # a missed read widens one window; the resolution says so
                    continue

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def start(self) -> ClientFiguresSampler:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any] | None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sample()
        self.sample()  # confirms the last window's reading of requests that ended unanswered
        for fig in self.figures:
            fig.close()
        for admin in self.admins:
            admin.close()
        return client_figures(self.figures) if self.reads else None

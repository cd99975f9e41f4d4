"""Seconds per step of one engine command, so that a slow reply shows which step was slow."""

from __future__ import annotations

import time


class Phases:
    """Seconds per step of one agent command, in the order the steps ran: a reply's ``phases`` sum to
    nearly its ``seconds``, so a slow call shows which step was slow (PROTOCOL.md)."""

    def __init__(self) -> None:
        self.t0 = self._last = time.perf_counter()
        self._phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        """The time since the previous mark (or the start) was spent in step ``name``."""
        now = time.perf_counter()
        self._phases[name] = self._phases.get(name, 0.0) + now - self._last
        self._last = now

    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def phases(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in self._phases.items()}

"""Pacing: a live capture round yields to the source's own requests (``transfer.pacing: adaptive``).

The controller is delay-based, in the manner of LEDBAT (RFC 6817, the "less than best effort" transport that
yields to other traffic by watching the delay it adds). Its signal is the source's request latency as the
workload's SDK times it (:class:`~gpumigrate.interfaces.LatencySignal`: the safe point around each request), so a
service needs no setup beyond the SDK. Its lever is the round's :class:`~.progress.RateLimiter`, which every chunk
passes before its device copy is queued (``writer.py``, ``direct_writer.py``).

* Before the round moves a byte, the requests of the last ``baseline_s`` set the base latency (their median) and
  the source's own noise (or those of the last ``baseline_max_s``, when fewer than ``2 × min_samples`` ended in the
  short window: a source with few requests). The short window first, because a load that changed shortly before
  the round, a burst and then a steady load, would otherwise set a base the source no longer has: on an H100 a 30 s
  window took in such a burst, read a base of 65 ms for a source at 39 ms, and judged every verdict of a round that
  doubled the p99 "within" (bench/HISTORY.md, seventeenth session). The noise is the ``noise_quantile`` of the
  medians of ``min_samples`` consecutive baseline requests, what a verdict's window reads with no round beside it.
  A verdict is "felt" only above both that and ``base × (1 + tolerance)``: a source under an open-loop load
  queues, so the median of a few of its requests swings well past 10% by itself, and a bound inside that swing
  cut a round that nothing felt down to the floor (bench/HISTORY.md, sixteenth session: 328 cuts in 339 verdicts,
  0.5 GiB in 486 s). With too few requests before the round (an idle source), the first verdict's requests set the
  base; a lower median seen later lowers it. A base from a baseline is not lowered: the lowest of many noisy
  medians is below the source's typical latency, and every verdict after it would read as felt.
* **Slow start** (as TCP's): a source that serves (a request ended in the last ``idle_s``, or one is under way)
  gets a round that starts at ``start_rate`` (or the plan's ``rate_limit``, if lower), not uncapped: a round that
  began at full speed stalled an engine loop's steps for the half second before its first verdict
  (bench/HISTORY.md, fifteenth session). Each verdict within tolerance multiplies the rate by ``start_growth``
  until the first cut, ``growth`` after it. An idle source's round starts uncapped: nothing to yield to.
* Every ``interval_s`` the controller reads the requests that ended since its last verdict. With ``min_samples``
  of them it compares their median with the base:
  above ``base × (1 + tolerance)`` the round is felt: its rate is cut by ``backoff`` (from the rate it moves at,
  measured, when it is uncapped), never below the floor, and the next verdict waits ``settle_s`` for the cut to
  show; at or below it, the rate grows by ``growth``.
* A request that began during the round and is still under way for longer than ``overdue`` times the base (and
  than the baseline's 99th percentile, with the tolerance) is a verdict by itself: it is cut at once, whatever has
  ended, once per request: the next overdue cut needs a request admitted after this one (one slow request is one
  piece of evidence, not one per ``settle_s`` while it runs). The bound reads the percentile, not the slowest: an
  engine loop's baseline holds a few prefill steps many times a decode step's length, and the bound must stay
  below a stalled decode step. An engine loop's safe point is one
  decode step; a round that stalls the steps (they wait for the GIL or the device beside it) would otherwise be
  judged only once ``min_samples`` stalled steps had ended, seconds later, after the round it should have slowed.
* No request ended for ``idle_s`` and none under way: an idle source, the rate grows too.
* Grown past the highest rate the round moved at uncapped (or to the plan's ``rate_limit``), or within tolerance
  while no chunk waited for the cap since the last verdict, the cap is lifted (back to ``rate_limit``).

Token buckets exist as libraries; a controller that steers one from a latency signal does not (asyncio-only
limiters aside), hence this module, with its rules as data (:class:`PacingRules`).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from gpumigrate.bounds import MIN_RATE
from gpumigrate.interfaces import LatencySignal
from gpumigrate.transfer.progress import RateLimiter

LOG_KEPT = 64  # rate changes a round's report keeps (the first ones, then a count)


@dataclass(frozen=True)
class PacingRules:
    """How the controller decides (see the module docstring)."""

    interval_s: float = 0.05
    tolerance: float = 0.10
    backoff: float = 0.5
    growth: float = 1.25
    min_samples: int = 4
    idle_s: float = 0.5
    settle_s: float = 0.2
    floor_fraction: float = 0.02  # of the highest rate: the round always moves (a freeze waits for it)
    overdue: float = 3.0  # times the base latency: a request under way for longer cuts the rate before it ends
    baseline_s: float = 5.0  # the source's latency now: the requests that ended this recently set the base
    baseline_max_s: float = 30.0  # the window for a source with fewer than 2 × min_samples requests in baseline_s
    start_rate: float = 64 * (1 << 20)  # bytes/s: a serving source's round starts here (slow start)
    start_growth: float = 2.0  # the rate's growth per verdict within tolerance until the first cut
    noise_quantile: float = 0.9  # of the baseline's window medians: a verdict above it is felt (a false cut 1 in 10)


@dataclass
class PacingReport:
    """What the controller did in one round (a round's stats carry it: ``RoundStats.pacing``)."""

    base_latency_ms: float | None = None
    verdicts: int = 0
    cuts: int = 0
    raises: int = 0
    idle_raises: int = 0
    overdue_cuts: int = 0  # cuts for a request still under way (already longer than the overdue bound)
    lowest_rate: float | None = None
    capped_s: float = 0.0  # seconds the round spent under a cap below its top
    start_rate: float | None = None  # the slow start's first rate (None: the source was idle, the round uncapped)
    changes: list[tuple[float, float | None, str]] = field(default_factory=list)  # (s since start, rate, why)

    def as_dict(self, top: float | None) -> dict[str, Any]:
        return {
            "mode": "adaptive",
            "base_latency_ms": self.base_latency_ms,
            "verdicts": self.verdicts,
            "cuts": self.cuts,
            "raises": self.raises,
            "idle_raises": self.idle_raises,
            "overdue_cuts": self.overdue_cuts,
            "lowest_rate": None if self.lowest_rate is None else round(self.lowest_rate),
            "top_rate": None if top is None else round(top),
            "capped_s": round(self.capped_s, 3),
            "start_rate": None if self.start_rate is None else round(self.start_rate),
            "changes": [[round(t, 3), None if r is None else round(r), why] for t, r, why in self.changes],
        }


class PacingController:
    """Steers ``limiter`` from ``signal`` on a thread of its own between :meth:`start` and :meth:`stop`."""

    def __init__(
        self,
        signal: LatencySignal,
        limiter: RateLimiter,
        *,
        ceiling: float | None = None,
        rules: PacingRules | None = None,
    ) -> None:
        self.signal = signal
        self.limiter = limiter
        self.ceiling = ceiling  # the plan's rate_limit: never above it
        self.rules = rules or PacingRules()
        self.report = PacingReport()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._base: float | None = None
        self._slowest = 0.0  # the baseline's 99th percentile (seconds): a request under way for longer is overdue
        self._noise = 0.0  # the baseline's noise_quantile of window medians (seconds): a verdict above it is felt
        self._base_fixed = False  # the base came from a baseline: later medians do not lower it
        self._slow_start = False  # growing by start_growth until the first cut
        self._held = limiter.held  # the limiter's held takes at the last verdict
        self._peak = 0.0  # the highest rate measured while uncapped (bytes/s)
        now = time.monotonic()
        self._t0 = self._seen = self._quiet_since = self._settled = self._tick_at = self._verdict_at = now
        self._overdue_at = now  # the round's start, then the last overdue cut: the next needs a request admitted after
        self._tick_bytes = self._verdict_bytes = limiter.admitted
        self._window: list[float] = []  # latencies since the last verdict
        self._capped_from: float | None = None

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        now = time.monotonic()
        before = self.signal.latencies(now - self.rules.baseline_s)
        if len(before) < 2 * self.rules.min_samples:
            before = self.signal.latencies(now - self.rules.baseline_max_s)
        if before:
            self._base, self._slowest = statistics.median(before), _percentile(before, 0.99)
            self._noise = _window_noise(before, self.rules.min_samples, self.rules.noise_quantile)
            self._base_fixed = len(before) >= 2 * self.rules.min_samples
            self.report.base_latency_ms = round(self._base * 1000, 3)
        self._t0 = self._seen = self._quiet_since = self._settled = self._tick_at = self._verdict_at = now
        self._overdue_at = now
        self._tick_bytes = self._verdict_bytes = self.limiter.admitted
        self._held = self.limiter.held
        serving = self.signal.in_flight > 0 or bool(self.signal.latencies(now - self.rules.idle_s))
        if serving:  # slow start: nothing moves at full speed before a verdict says the source does not feel it
            first = self.rules.start_rate if self.ceiling is None else min(self.rules.start_rate, self.ceiling)
            self._slow_start = True
            self.report.start_rate = first
            base = "no base yet" if self._base is None else f"base {self._base * 1000:.1f} ms"
            self._set(first, f"slow start, {base}", now)
        self._thread = threading.Thread(target=self._run, name="gm-pacing", daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, Any]:
        """Stop steering; the limiter goes back to the ceiling. Returns the round's report."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._set(self.ceiling, "round over", time.monotonic())
        return self.report.as_dict(self._top())

    def _run(self) -> None:
        while not self._stop.wait(self.rules.interval_s):
            self.step(time.monotonic())

    # ------------------------------------------------------------------ one look
    def step(self, now: float) -> None:
        """Read what ended since the last look and decide (the thread calls it every ``interval_s``)."""
        rules = self.rules
        moved = self.limiter.admitted
        if self.limiter.rate is None and now > self._tick_at:  # the round's own speed, uncapped
            self._peak = max(self._peak, (moved - self._tick_bytes) / (now - self._tick_at))
        self._tick_at, self._tick_bytes = now, moved
        ended = self.signal.latencies(self._seen)
        self._seen = now
        if ended:
            self._window.extend(ended)
            self._quiet_since = now
        if now < self._settled:  # a cut has yet to show: what ended meanwhile started before it
            self._window.clear()
            return
        # A long request from before the round says nothing of it; one that already cut says nothing more.
        running = self.signal.running_for(self._overdue_at)
        if self._base is not None and running > max(self._base * rules.overdue, self._slowest * (1 + rules.tolerance)):
            self._window.clear()
            self.report.verdicts += 1
            self.report.overdue_cuts += 1
            self._overdue_at = now
            self._cut(now, f"a request under way for {running * 1000:.1f} ms, base {self._base * 1000:.1f} ms")
            self._mark_verdict(now)
            return
        if len(self._window) >= rules.min_samples:
            self._verdict(statistics.median(self._window), now)
            self._window.clear()
        elif now - self._quiet_since >= rules.idle_s and self.signal.in_flight == 0:
            self._window.clear()
            self._quiet_since = now
            self.report.idle_raises += 1
            self._raise(now, "source idle")
            self._held = self.limiter.held

    def _verdict(self, latency: float, now: float) -> None:
        self.report.verdicts += 1
        if self._base is None or (latency < self._base and not self._base_fixed):
            self._base = latency
            self.report.base_latency_ms = round(latency * 1000, 3)
        bound = max(self._base * (1 + self.rules.tolerance), self._noise)
        # The reason names the bound that judged it: the base's tolerance, or the source's own noise above it.
        judged = f"bound {bound * 1000:.1f} ms ({'noise' if self._noise > self._base * (1 + self.rules.tolerance) else 'tolerance'})"
        if latency > bound:
            self._cut(now, f"latency {latency * 1000:.1f} ms, base {self._base * 1000:.1f} ms, {judged}")
        else:
            self._raise(now, f"latency {latency * 1000:.1f} ms within {judged}")
        self._mark_verdict(now)

    def _mark_verdict(self, now: float) -> None:
        self._verdict_at, self._verdict_bytes, self._held = now, self.limiter.admitted, self.limiter.held

    def _cut(self, now: float, why: str) -> None:
        current = self.limiter.rate if self.limiter.rate is not None else self._moving(now)
        if current <= 0:
            return  # nothing moves: nothing to slow
        self.report.cuts += 1
        self._slow_start = False
        self._set(max(self._floor(), current * self.rules.backoff), why, now)
        self._settled = now + self.rules.settle_s

    def _raise(self, now: float, why: str) -> None:
        current = self.limiter.rate
        if current is None or current == self.ceiling:
            return  # already as fast as allowed
        grown = current * (self.rules.start_growth if self._slow_start else self.rules.growth)
        top = self._top()
        unheld = self.limiter.held == self._held and not self.limiter.waiting  # no chunk waited for the cap
        self.report.raises += 1
        # Lifted at the top (the plan's rate_limit, or the fastest the round moved uncapped), or where the cap holds
        # nothing back (the round moves slower by itself: growing it further only delays the lift).
        self._set(self.ceiling if unheld or (top is not None and grown >= top) else grown, why, now)

    # ------------------------------------------------------------------ helpers
    def _moving(self, now: float) -> float:
        """The rate the round moved at since the last verdict (uncapped), else the highest one measured."""
        span = now - self._verdict_at
        moved = (self.limiter.admitted - self._verdict_bytes) / span if span > 0 else 0.0
        return moved if moved > 0 else self._peak

    def _top(self) -> float | None:
        """The fastest the round may go: the ceiling, else the highest rate it moved at uncapped (None: unknown)."""
        return self.ceiling if self.ceiling is not None else (self._peak or None)

    def _floor(self) -> float:
        return max(float(MIN_RATE), self.rules.floor_fraction * (self._top() or 0.0))

    def _set(self, rate: float | None, why: str, now: float) -> None:
        if rate == self.limiter.rate:
            return
        self.limiter.set_rate(rate)
        top = self._top()
        if self._capped_from is not None:
            self.report.capped_s += now - self._capped_from
        below = rate is not None and (top is None or rate < top)
        self._capped_from = now if below else None
        if rate is not None:
            self.report.lowest_rate = rate if self.report.lowest_rate is None else min(self.report.lowest_rate, rate)
        if len(self.report.changes) < LOG_KEPT:
            self.report.changes.append((now - self._t0, rate, why))


def _window_noise(values: list[float], size: int, q: float) -> float:
    """The ``q`` quantile of the medians of ``size`` consecutive ``values``: how high a verdict's window reads with
    nothing but the source's own noise (0.0: too few values to tell)."""
    if size < 1 or len(values) < size:
        return 0.0
    medians = [statistics.median(values[i : i + size]) for i in range(len(values) - size + 1)]
    return _percentile(medians, q)


def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank: one of them)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, -(-round(q * 1000) * len(ordered) // 1000) - 1))]


def fixed_rate_report(limiter: RateLimiter) -> dict[str, Any]:
    """A round under a fixed ``rate_limit`` and no pacing: what it was capped at."""
    return {"mode": "off", "rate_limit": None if limiter.rate is None else round(limiter.rate)}


__all__ = ["PacingController", "PacingReport", "PacingRules", "fixed_rate_report"]

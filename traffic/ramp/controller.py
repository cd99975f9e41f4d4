"""The ramp's stage loop: measure the source alone, wait until Envoy sees the target healthy, then for each stage
write its weights, read Envoy's stats every interval, have them judged (judgement.py) and record each interval
(records.py); on a failed gate, a rollback request or a rollback from outside, everything goes back to the
source in one state version (= one RDS update), and the loop waits for Envoy's ACK. Every write and read of the
split, and the traffic lease, go through :class:`~gpumigrate.traffic.ramp.steering.Steering`.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpumigrate.errors import TrafficError
from gpumigrate.traffic.analysis import Analysis, analyze
from gpumigrate.traffic.envoy import EnvoyAdmin
from gpumigrate.traffic.probes import Prober
from gpumigrate.traffic.ramp.figures import ClientFiguresSampler
from gpumigrate.traffic.ramp.judgement import (
    RolledBack,
    StageJudge,
    analysis_window,
    baseline_analysis,
    rolled_back_outside,
)
from gpumigrate.traffic.ramp.records import RampResult, Sample, StageRecord, write_progress
from gpumigrate.traffic.ramp.settings import RampSettings
from gpumigrate.traffic.ramp.steering import Steering
from gpumigrate.traffic.state import StateStore
from gpumigrate.traffic.stats import StatsSnapshot, window
from gpumigrate.traffic.streamprobe import StreamProber, StreamWindow


class RampController:
    """Drive one ramp. ``admin_urls``: every Envoy in front of the service (stats are summed)."""

    def __init__(
        self,
        state_dir: str | Path,
        admin_urls: list[str],
        settings: RampSettings,
        *,
        nodes: list[str] | None = None,
        source: str = "source",
        target: str = "target",
        prober: Prober | None = None,
        stream_prober: StreamProber | None = None,
        rollback_signal: Callable[[], Any] | None = None,
        on_interval: Callable[[Sample], None] | None = None,
        lease_holder: str | None = None,
    ) -> None:
        self.steer = Steering(
            StateStore(state_dir),
            [EnvoyAdmin(u) for u in admin_urls],
            settings,
            nodes=nodes or [],
            source=source,
            target=target,
            rollback_signal=rollback_signal,
            lease_holder=lease_holder or f"ramp pid {os.getpid()} on {socket.gethostname()}",
        )
        self.settings = settings
        self.source, self.target = source, target
        self.prober = prober
        self.stream_prober = stream_prober  # streamed requests: time to first token, inter-token gaps (per side)
        self.on_interval = on_interval
        self.samples: list[Sample] = []
        self.stages: list[StageRecord] = []
        self.baseline_p99: float | None = None
        self.last_source_p99: float | None = None  # the source's p99 in the last window of the ramp that had one
        self._skipped = 0  # stages a resumed ramp finds already behind it

    # -- what it records ---------------------------------------------------------------
    def _record(
        self,
        stage: int,
        prev: StatsSnapshot,
        cur: StatsSnapshot,
        window_s: float,
        analysis: Analysis,
        streams: tuple[StreamWindow, StreamWindow] | None = None,
    ) -> Sample:
        per = {u: w.to_json() for u, w in window(prev, cur).items()}
        for side, figures in zip((self.source, self.target), streams or (), strict=False):
            per.setdefault(side, {})["streams"] = figures.to_json()
        sample = Sample(self.steer.now(), time.time(), stage, self.steer.weight, per, window_s, analysis.to_json())
        self.samples.append(sample)
        self._progress("running", sample)
        self.steer.renew()  # between the blocking steps of an interval too, not only while it sleeps
        if self.on_interval is not None:
            try:
                self.on_interval(sample)
            except Exception:  # a broken progress view must not stop (or roll back) a ramp
                pass
        return sample

    def _progress(self, status: str, sample: Sample | None, **extra: Any) -> None:
        write_progress(self.steer.store.dir, status, self.steer.weight, sample, **extra)

    # -- phases -----------------------------------------------------------------------
    def _baseline(self) -> None:
        """Measure the source alone before any traffic moves: its p99 is the latency baseline."""
        g = self.settings.gates
        start = self.steer.snapshot()
        prev = start
        measured = 0
        until = self.steer.now() + self.settings.baseline_max_s
        while measured < self.settings.baseline_intervals or (
            self.baseline_p99 is None and self.steer.now() + self.settings.interval_s <= until
        ):
            measured += 1
            self.steer.sleep_to(self.steer.now() + self.settings.interval_s)
            self.steer.check_signals()
            cur = self.steer.snapshot()
            src = window(start, cur)[self.source]
            if src.requests >= g.min_requests and src.p99_ms is not None:
                self.baseline_p99 = src.p99_ms
            self._record(-1, prev, cur, cur.ts - start.ts, baseline_analysis(self.baseline_p99, src.requests))
            prev = cur

    def _stage(self, index: int, weight: float, hold_s: float) -> None:
        s = self.settings
        rec = StageRecord(index, weight, hold_s, self.steer.now())
        self.stages.append(rec)
        self.steer.apply(weight)
        started = time.monotonic()
        judge = StageJudge(rec, s, started)
        snaps = [self.steer.snapshot()]
        next_tick = self.steer.now() + s.interval_s
        while True:
            self.steer.sleep_to(next_tick)
            next_tick += s.interval_s
            self.steer.check_signals()
            try:
                snaps.append(self.steer.snapshot())
                if len(snaps) > 600:  # bound memory on long holds; keep the stage's first snapshot
                    del snaps[1]
            except TrafficError as exc:  # an unreadable admin makes this interval inconclusive, not a pass
                self.samples.append(
                    Sample(
                        self.steer.now(),
                        time.time(),
                        index,
                        weight,
                        {},
                        0.0,
                        {"verdict": "inconclusive", "reason": str(exc), "measurements": []},
                    )
                )
                # The policy counts these too: a dead Envoy must not hold the split (and the lease) forever.
                judge.unreadable(f"Envoy's admin unreadable: {exc}")
                continue
            w, window_s = analysis_window(snaps, self.target, s.gates.min_requests)
            src = w[self.source]
            if src.requests >= s.gates.min_requests and src.p99_ms is not None:
                base: float | None = src.p99_ms
                self.last_source_p99 = src.p99_ms
            else:  # at 100% the source takes no new requests: the baseline, or the source's last p99 in the ramp
                base = self.baseline_p99 if self.baseline_p99 is not None else self.last_source_p99
            probe = self.prober.latest(newer_than=started) if self.prober else None
            streams = self._streams(started)
            a = analyze(
                w[self.target],
                base,
                s.gates,
                probe=probe,
                probes_expected=self.prober is not None,
                target_name=self.target,
                streams=streams,
            )
            self._record(index, snaps[-2], snaps[-1], window_s, a, streams)
            if judge.passed(a, window_s):
                rec.outcome, rec.ended_t = "passed", self.steer.now()
                return

    def _streams(self, since: float) -> tuple[StreamWindow, StreamWindow] | None:
        """The streamed probes of the stage so far: (source, target)."""
        if self.stream_prober is None:
            return None
        got = self.stream_prober.window(newer_than=since)
        return got[self.source], got[self.target]

    def _await_target_healthy(self) -> None:
        """Move no weight before every Envoy has seen the target pass a health check.

        The endpoint clusters route with no panic threshold (a dead host reads as dead), so a request
        weighted to a target that Envoy has not yet checked gets "no healthy upstream" (503): under
        load the first check can trail the restore by a second or more, and those 503s landed on
        clients at the first stage. ``healthy`` is None where Envoy reports no membership (nothing to
        wait for); a target that never passes is a failed ramp, rolled back before any client sees it.
        """
        give_up = self.steer.now() + max(self.settings.target_healthy_wait_s, 3 * self.settings.interval_s)
        while True:
            self.steer.check_signals()
            healthy = self.steer.snapshot().clusters.get(self.target)
            if healthy is None or healthy.healthy is None or healthy.healthy >= 1:
                return
            if self.steer.now() >= give_up:
                raise RolledBack(
                    "the target never passed Envoy's health check; no traffic was moved to it",
                    "target_unhealthy",
                    None,
                )
            self.steer.sleep_to(self.steer.now() + 0.1)

    def run(self) -> RampResult:
        state = self.steer.begin()
        self._skipped = sum(1 for weight, _ in self.settings.stages if weight < self.steer.weight)  # resumed
        self.steer.renew()  # a resumed ramp takes the lease over at once: the split it finds is its own now
        sampler = ClientFiguresSampler([a.url for a in self.steer.admins], self.settings.figures_every_s).start()
        if self.prober is not None:
            if self.steer.weight <= 0:
                # Warm the target's model and Envoy's connections to it through the probe route,
                # so the first users at 1% do not pay for a cold start.
                self.prober.run_round()
            self.prober.start()
        if self.stream_prober is not None:
            if self.steer.weight <= 0:
                self.stream_prober.run_round()  # warm, as the parity probes do
            self.stream_prober.start()
        result: RampResult
        try:
            if state.rolled_back:
                raise RolledBack(f"already rolled back: {state.rolled_back.get('reason')}", *rolled_back_outside(state))
            if self.steer.weight <= 0:
                self._baseline()
                self._await_target_healthy()
            for i, (weight, hold) in enumerate(self.settings.stages):
                if weight < self.steer.weight:
                    continue  # resumed: stages already behind us
                self._stage(i, weight, hold)
            self._progress("completed", self.samples[-1] if self.samples else None)
            result = RampResult(
                "completed",
                self.stages,
                self.samples,
                self.baseline_p99,
                seconds=self.steer.now(),
                final_weight=self.steer.weight,
                progress_pct=100.0,
            )
        except RolledBack as rb:
            result = self._roll_back(rb)
        except TrafficError as exc:
            # The controller can no longer see or steer (admin gone, control plane not applying):
            # a ramp it cannot judge goes back to the source.
            result = self._roll_back(RolledBack(f"ramp error: {exc}", "error", None))
        finally:
            if self.prober is not None:
                self.prober.stop()
            if self.stream_prober is not None:
                self.stream_prober.stop()
            for admin in self.steer.admins:
                admin.close()
            figures = sampler.stop()
            self.steer.store.release_lease(self.steer.lease_holder)
        result.figures = figures
        if self.stream_prober is not None:
            result.streams = {side: w.to_json() for side, w in self.stream_prober.window().items()}
        return result

    def _roll_back(self, rb: RolledBack) -> RampResult:
        decided = time.monotonic()
        rolled_at, applied = self.steer.return_to_source(rb.reason, decided)
        for rec in self.stages:
            if rec.outcome == "running":
                rec.outcome = "rolled_back"
            rec.ended_t = rec.ended_t or self.steer.now()
        passed = self._skipped + sum(1 for rec in self.stages if rec.outcome == "passed")
        detect = None if rb.detect_from is None else decided - rb.detect_from
        self._progress("rolled_back", self.samples[-1] if self.samples else None, reason=rb.reason, trigger=rb.trigger)
        return RampResult(
            "rolled_back",
            self.stages,
            self.samples,
            self.baseline_p99,
            reason=rb.reason,
            trigger=rb.trigger,
            seconds_to_detect=detect,
            rolled_back_at=rolled_at,
            rollback_applied_s=applied,
            seconds=self.steer.now(),
            final_weight=0.0,
            progress_pct=100.0 * passed / max(1, len(self.settings.stages)),
        )

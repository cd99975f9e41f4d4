"""The ramp controller: stages from the plan, analysis every interval, rollback on the first failed gate.

    baseline (0%) → stage 1 (1%) → … → stage n (100%): completed
                         └─ fail gate / rollback signal / external rollback → 100% source, rolled_back

A stage passes when its hold has elapsed and the latest analysis passes. Inconclusive analyses
hold the stage; after ``max_inconclusive`` of them past the hold, ``inconclusive_policy`` decides
(default ``rollback``: a canary nobody could judge is not promoted). A fail counts toward
``failures_to_rollback`` consecutive fails, then the controller writes 100% source in one state
version (= one RDS update) and waits for Envoy's ACK. Re-running against a state that already
sends traffic to the target resumes at the first stage at or above the current weight.

While it runs, the controller renews the traffic lease (``lease.json``) from its own loop; if it
dies or hangs for ``lease_intervals`` intervals (``lease_min_s`` at least), the control plane sends everything back to the
source by itself (:class:`~gpumigrate.traffic.xds.LeaseWatch`). A sampler thread reads the client
listener's counters several times a second, so every ramp's result carries what clients saw
(requests, failures, p99, downtime: :class:`~gpumigrate.traffic.stats.ClientFigures`).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from gpumigrate.atomic import atomic_write_json
from gpumigrate.errors import TrafficError
from gpumigrate.traffic.analysis import Analysis, GateSettings, Measurement, Verdict, analyze
from gpumigrate.traffic.envoy import EnvoyAdmin
from gpumigrate.traffic.probes import Prober
from gpumigrate.traffic.state import DesiredState, StateStore, rollback_to_source, split
from gpumigrate.traffic.stats import (
    ClientFigures,
    ClusterWindow,
    IngressCounters,
    StatsSnapshot,
    client_figures,
    merge,
    parse_ingress,
    parse_stats,
    settled_reading,
    window,
)
from gpumigrate.traffic.streamprobe import StreamProber, StreamWindow

if TYPE_CHECKING:  # the control plane process never loads the plan's models
    from gpumigrate.plan import Traffic

PROGRESS_FILE = "ramp.json"


@dataclass(frozen=True)
class RampSettings:
    stages: tuple[tuple[float, float], ...]  # (target weight percent, hold seconds)
    interval_s: float = 2.0
    gates: GateSettings = field(default_factory=GateSettings)
    baseline_intervals: int = 2
    max_inconclusive: int = 20
    inconclusive_policy: Literal["rollback", "hold"] = "rollback"
    apply_timeout_s: float = 20.0
    lease_intervals: int = 3  # intervals without a renewal before the control plane returns traffic by itself
    # ... but never less than this: a live controller can block this long (an admin read times out at
    # 5 s; the flow's per-interval callback calls Prefect's API) and must not lose a healthy split.
    lease_min_s: float = 10.0
    figures_every_s: float = 0.25  # how often the client figures are sampled: the downtime's resolution
    # How long the first stage waits for every Envoy to see the target pass a health check (at least
    # three intervals): a restored target is ready already, so this is Envoy's check cadence plus load.
    target_healthy_wait_s: float = 15.0

    @property
    def lease_s(self) -> float:
        """How long the control plane waits for a renewal before it takes the split back."""
        return max(self.lease_intervals * self.interval_s, self.lease_min_s, self.interval_s)

    @classmethod
    def from_plan(cls, traffic: Traffic, **extra: Any) -> RampSettings:
        """From ``gpumigrate.plan.Traffic``; ``extra`` may set any other field (gate extras via ``gates``)."""
        gates = extra.pop("gates", None) or GateSettings.from_plan(traffic.gates)
        return cls(
            stages=tuple((s.weight, s.hold_s) for s in traffic.stages),
            interval_s=traffic.analysis_interval_s,
            gates=gates,
            **extra,
        )


@dataclass
class Sample:
    t: float  # seconds since the ramp started
    ts: float  # epoch seconds
    stage: int  # -1 for the baseline
    weight: float
    clusters: dict[str, dict[str, Any]]  # per upstream, over this interval alone
    window_s: float  # the analysis window (may span several intervals at low traffic)
    analysis: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "t": round(self.t, 3),
            "ts": self.ts,
            "stage": self.stage,
            "weight": self.weight,
            "clusters": self.clusters,
            "window_s": round(self.window_s, 3),
            "analysis": self.analysis,
        }


@dataclass
class StageRecord:
    index: int
    weight: float
    hold_s: float
    started_t: float
    ended_t: float | None = None
    intervals: int = 0
    inconclusive: int = 0
    outcome: str = "running"  # passed | rolled_back | running

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "weight": self.weight,
            "hold_s": self.hold_s,
            "started_t": round(self.started_t, 3),
            "ended_t": None if self.ended_t is None else round(self.ended_t, 3),
            "intervals": self.intervals,
            "inconclusive": self.inconclusive,
            "outcome": self.outcome,
        }


@dataclass
class RampResult:
    status: Literal["completed", "rolled_back"]
    stages: list[StageRecord]
    samples: list[Sample]
    baseline_p99_ms: float | None
    reason: str | None = None
    trigger: str | None = None  # gate | manual | external | inconclusive | error
    seconds_to_detect: float | None = None  # start of the first failing window → rollback decided
    rolled_back_at: float | None = None  # epoch seconds when 100% source was written
    rollback_applied_s: float | None = None  # write → every Envoy ACKed
    seconds: float = 0.0
    figures: dict[str, Any] | None = None  # what clients saw, from Envoy (ClientFigures); None if unread
    streams: dict[str, Any] | None = None  # the streamed probes over the whole ramp, per side (StreamWindow)
    final_weight: float = 0.0  # percent on the target when the ramp ended (0 after a rollback)
    progress_pct: float = 0.0  # share of the plan's stages passed (100 only when completed)

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "final_weight": self.final_weight,
            "progress_pct": round(self.progress_pct, 1),
            "figures": self.figures,
            "streams": self.streams,
            "reason": self.reason,
            "trigger": self.trigger,
            "seconds_to_detect": None if self.seconds_to_detect is None else round(self.seconds_to_detect, 3),
            "rolled_back_at": self.rolled_back_at,
            "rollback_applied_s": self.rollback_applied_s,
            "baseline_p99_ms": self.baseline_p99_ms,
            "seconds": round(self.seconds, 3),
            "stages": [s.to_json() for s in self.stages],
            "samples": [s.to_json() for s in self.samples],
        }


def _read_ingress(admin: EnvoyAdmin) -> IngressCounters:
    return parse_ingress(admin.ingress_stats(), ts=time.monotonic())


class _FiguresSampler:
    """Reads every Envoy's client-listener counters every ``every_s`` on its own thread (each sample a
    :func:`~gpumigrate.traffic.stats.settled_reading`, which does not read the unanswered count low)."""

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
                try:
                    fig.add(settled_reading(partial(_read_ingress, admin)))
                    self.reads += 1
                except (TrafficError, ValueError):  # a missed read widens one window; the resolution says so
                    continue

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def start(self) -> _FiguresSampler:
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


class _RolledBack(Exception):
    def __init__(self, reason: str, trigger: str, detect_from: float | None) -> None:
        super().__init__(reason)
        self.reason, self.trigger, self.detect_from = reason, trigger, detect_from


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
        self.store = StateStore(state_dir)
        self.admins = [EnvoyAdmin(u) for u in admin_urls]
        self.settings = settings
        self.nodes = nodes or []
        self.source, self.target = source, target
        self.prober = prober
        self.stream_prober = stream_prober  # streamed requests: time to first token, inter-token gaps (per side)
        self.rollback_signal = rollback_signal
        self.on_interval = on_interval
        self.samples: list[Sample] = []
        self.stages: list[StageRecord] = []
        self.baseline_p99: float | None = None
        self._t0 = 0.0
        self._weight = 0.0
        self._failover = True
        self.lease_holder = lease_holder or f"ramp pid {os.getpid()} on {socket.gethostname()}"
        self._lease_seq = 0
        self._renewed_at = -1e9
        self._skipped = 0  # stages a resumed ramp finds already behind it

    # -- plumbing ---------------------------------------------------------------------
    def _now(self) -> float:
        return time.monotonic() - self._t0

    def _snapshot(self) -> StatsSnapshot:
        ups = [self.source, self.target]
        return merge(
            [parse_stats(a.stats(ups), ups, ts=time.monotonic(), failover=self._failover) for a in self.admins]
        )

    def _renew(self) -> None:
        """Renew the traffic lease when half an interval has passed since the last renewal. Called from
        the controller's own loop (never a helper thread), so a hung controller stops renewing too."""
        now = time.monotonic()
        if now - self._renewed_at < self.settings.interval_s / 2:
            return
        self._lease_seq += 1
        try:
            self.store.renew_lease(
                self.lease_holder,
                interval_s=self.settings.interval_s,
                length_s=self.settings.lease_s,
                seq=self._lease_seq,
            )
            self._renewed_at = now
        except OSError:  # unrenewed, the lease lapses and the control plane returns traffic: the safe side
            pass

    def _apply(self, weight: float) -> None:
        self._renew()
        try:
            state = self.store.set_weights(split(self.source, self.target, weight))
        except TrafficError as exc:  # someone rolled back from outside between two intervals
            self._check_signals()  # the migration's own rollback request (it moves traffic first) reads as manual
            raise _RolledBack(str(exc), "external", None) from None
        self._weight = weight
        if self.nodes:
            self.store.wait_applied(
                state.version, self.nodes, timeout_s=self.settings.apply_timeout_s, tick=self._renew
            )

    def _check_signals(self) -> None:
        if self.rollback_signal is not None:
            sig = self.rollback_signal()
            if sig:
                why = sig.get("reason") if isinstance(sig, dict) else None
                asked = sig.get("ts") if isinstance(sig, dict) else None
                # The request's own timestamp (Migration.request_rollback writes one) gives request → action.
                since = (
                    time.monotonic() - max(0.0, time.time() - float(asked)) if isinstance(asked, int | float) else None
                )
                raise _RolledBack(f"manual rollback: {why or 'requested'}", "manual", since)
        state = self.store.read()
        if state.rolled_back:
            raise _RolledBack(f"rolled back from outside: {state.rolled_back.get('reason')}", *_outside(state))

    def _sleep_to(self, deadline: float) -> None:
        while True:
            self._renew()
            left = deadline - self._now()
            if left <= 0:
                return
            time.sleep(min(left, 0.05))

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
        sample = Sample(self._now(), time.time(), stage, self._weight, per, window_s, analysis.to_json())
        self.samples.append(sample)
        self._progress("running", sample)
        self._renew()  # between the blocking steps of an interval too, not only while it sleeps
        if self.on_interval is not None:
            try:
                self.on_interval(sample)
            except Exception:  # a broken progress view must not stop (or roll back) a ramp
                pass
        return sample

    def _progress(self, status: str, sample: Sample | None, **extra: Any) -> None:
        """``ramp.json`` in the state directory: what ``gpumigrate traffic watch`` shows from any process."""
        doc = {
            "status": status,
            "weight": self._weight,
            "updated": time.time(),
            "sample": sample.to_json() if sample else None,
            **extra,
        }
        try:
            atomic_write_json(self.store.dir / PROGRESS_FILE, doc, mode=0o600)
        except OSError:  # progress is a view; never a reason to stop a ramp
            pass

    # -- phases -----------------------------------------------------------------------
    def _baseline(self) -> None:
        """Measure the source alone before any traffic moves: its p99 is the latency baseline."""
        g = self.settings.gates
        start = self._snapshot()
        prev = start
        for _ in range(self.settings.baseline_intervals):
            self._sleep_to(self._now() + self.settings.interval_s)
            self._check_signals()
            cur = self._snapshot()
            src = window(start, cur)[self.source]
            if src.requests >= g.min_requests and src.p99_ms is not None:
                self.baseline_p99 = src.p99_ms
            a = Analysis(
                Verdict.INCONCLUSIVE,
                [
                    Measurement(
                        "baseline_p99_ms",
                        Verdict.PASS if self.baseline_p99 else Verdict.INCONCLUSIVE,
                        self.baseline_p99,
                        None,
                        f"source p99 over {src.requests} requests",
                    )
                ],
            )
            self._record(-1, prev, cur, cur.ts - start.ts, a)
            prev = cur

    def _analysis_window(self, snaps: list[StatsSnapshot]) -> tuple[dict[str, ClusterWindow], float]:
        """Shortest trailing window (in intervals, within the stage) with min_requests target requests."""
        cur = snaps[-1]
        for old in reversed(snaps[:-1]):
            w = window(old, cur)
            if w[self.target].requests >= self.settings.gates.min_requests:
                return w, cur.ts - old.ts
        return window(snaps[0], cur), cur.ts - snaps[0].ts

    def _stage(self, index: int, weight: float, hold_s: float) -> None:
        s = self.settings
        rec = StageRecord(index, weight, hold_s, self._now())
        self.stages.append(rec)
        self._apply(weight)
        started = time.monotonic()
        snaps = [self._snapshot()]
        fails = 0
        fail_from: float | None = None
        next_tick = self._now() + s.interval_s
        while True:
            self._sleep_to(next_tick)
            next_tick += s.interval_s
            self._check_signals()
            try:
                snaps.append(self._snapshot())
                if len(snaps) > 600:  # bound memory on long holds; keep the stage's first snapshot
                    del snaps[1]
            except TrafficError as exc:  # an unreadable admin makes this interval inconclusive, not a pass
                rec.intervals += 1
                rec.inconclusive += 1
                self.samples.append(
                    Sample(
                        self._now(),
                        time.time(),
                        index,
                        weight,
                        {},
                        0.0,
                        {"verdict": "inconclusive", "reason": str(exc), "measurements": []},
                    )
                )
                # The policy counts these too: a dead Envoy must not hold the split (and the lease) forever.
                self._inconclusive_policy(rec, weight, f"Envoy's admin unreadable: {exc}")
                continue
            w, window_s = self._analysis_window(snaps)
            src = w[self.source]
            base = src.p99_ms if src.requests >= s.gates.min_requests and src.p99_ms is not None else self.baseline_p99
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
            rec.intervals += 1
            if a.verdict == Verdict.FAIL:
                fails += 1
                fail_from = fail_from if fail_from is not None else time.monotonic() - window_s
                if fails >= s.gates.failures_to_rollback:
                    rec.outcome = "rolled_back"
                    raise _RolledBack(f"gate failed at {weight:g}%: {a.reason}", "gate", fail_from)
                continue
            fails, fail_from = 0, None
            if time.monotonic() - started + 1e-3 < hold_s:
                continue
            if a.verdict == Verdict.PASS:
                rec.outcome, rec.ended_t = "passed", self._now()
                return
            rec.inconclusive += 1
            self._inconclusive_policy(rec, weight, a.reason)

    def _streams(self, since: float) -> tuple[StreamWindow, StreamWindow] | None:
        """The streamed probes of the stage so far: (source, target)."""
        if self.stream_prober is None:
            return None
        got = self.stream_prober.window(newer_than=since)
        return got[self.source], got[self.target]

    def _inconclusive_policy(self, rec: StageRecord, weight: float, reason: str) -> None:
        """Past ``max_inconclusive`` inconclusive intervals, the ``rollback`` policy ends the ramp."""
        s = self.settings
        if rec.inconclusive > s.max_inconclusive and s.inconclusive_policy == "rollback":
            rec.outcome = "rolled_back"
            raise _RolledBack(
                f"stage {weight:g}% stayed inconclusive for {rec.inconclusive} intervals: {reason}",
                "inconclusive",
                None,
            )

    def _await_target_healthy(self) -> None:
        """Move no weight before every Envoy has seen the target pass a health check.

        The endpoint clusters route with no panic threshold (a dead host reads as dead), so a request
        weighted to a target that Envoy has not yet checked gets "no healthy upstream" (503): under
        load the first check can trail the restore by a second or more, and those 503s landed on
        clients at the first stage. ``healthy`` is None where Envoy reports no membership (nothing to
        wait for); a target that never passes is a failed ramp, rolled back before any client sees it.
        """
        give_up = self._now() + max(self.settings.target_healthy_wait_s, 3 * self.settings.interval_s)
        while True:
            self._check_signals()
            healthy = self._snapshot().clusters.get(self.target)
            if healthy is None or healthy.healthy is None or healthy.healthy >= 1:
                return
            if self._now() >= give_up:
                raise _RolledBack(
                    "the target never passed Envoy's health check; no traffic was moved to it",
                    "target_unhealthy",
                    None,
                )
            self._sleep_to(self._now() + 0.1)

    def run(self) -> RampResult:
        self._t0 = time.monotonic()
        state = self.store.read()
        self._weight = state.weights.get(self.target, 0.0)
        self._failover = state.failover
        self._skipped = sum(1 for weight, _ in self.settings.stages if weight < self._weight)  # resumed
        self._renew()  # a resumed ramp takes the lease over at once: the split it finds is its own now
        sampler = _FiguresSampler([a.url for a in self.admins], self.settings.figures_every_s).start()
        if self.prober is not None:
            if self._weight <= 0:
                # Warm the target's model and Envoy's connections to it through the probe route,
                # so the first users at 1% do not pay for a cold start.
                self.prober.run_round()
            self.prober.start()
        if self.stream_prober is not None:
            if self._weight <= 0:
                self.stream_prober.run_round()  # warm, as the parity probes do
            self.stream_prober.start()
        result: RampResult
        try:
            if state.rolled_back:
                raise _RolledBack(f"already rolled back: {state.rolled_back.get('reason')}", *_outside(state))
            if self._weight <= 0:
                self._baseline()
                self._await_target_healthy()
            for i, (weight, hold) in enumerate(self.settings.stages):
                if weight < self._weight:
                    continue  # resumed: stages already behind us
                self._stage(i, weight, hold)
            self._progress("completed", self.samples[-1] if self.samples else None)
            result = RampResult(
                "completed",
                self.stages,
                self.samples,
                self.baseline_p99,
                seconds=self._now(),
                final_weight=self._weight,
                progress_pct=100.0,
            )
        except _RolledBack as rb:
            result = self._roll_back(rb)
        except TrafficError as exc:
            # The controller can no longer see or steer (admin gone, control plane not applying):
            # a ramp it cannot judge goes back to the source.
            result = self._roll_back(_RolledBack(f"ramp error: {exc}", "error", None))
        finally:
            if self.prober is not None:
                self.prober.stop()
            if self.stream_prober is not None:
                self.stream_prober.stop()
            for admin in self.admins:
                admin.close()
            figures = sampler.stop()
            self.store.release_lease(self.lease_holder)
        result.figures = figures
        if self.stream_prober is not None:
            result.streams = {side: w.to_json() for side, w in self.stream_prober.window().items()}
        return result

    def _roll_back(self, rb: _RolledBack) -> RampResult:
        decided = time.monotonic()
        rollback_to_source(self.store.dir, rb.reason, actor="gpumigrate-ramp")
        rolled_at = time.time()
        applied: float | None = None
        try:
            state = self.store.read()
            if self.nodes:
                self.store.wait_applied(state.version, self.nodes, timeout_s=self.settings.apply_timeout_s)
            applied = round(time.monotonic() - decided, 3)
        except TrafficError:
            applied = None  # written; Envoy picks it up when the control plane is back
        self._weight = 0.0
        for rec in self.stages:
            if rec.outcome == "running":
                rec.outcome = "rolled_back"
            rec.ended_t = rec.ended_t or self._now()
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
            seconds=self._now(),
            final_weight=0.0,
            progress_pct=100.0 * passed / max(1, len(self.settings.stages)),
        )


def _outside(state: DesiredState) -> tuple[str, None]:
    """Trigger and detection start of a rollback someone else wrote: the control plane's lease watch,
    or a person (``gpumigrate traffic rollback``, ``gpumigrate rollback ID``)."""
    trigger = "lease" if (state.rolled_back or {}).get("trigger") == "lease" else "external"
    return trigger, None

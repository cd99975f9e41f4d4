"""Per-cluster figures from Envoy's own stats, windowed by diffing two snapshots.

For upstream ``X`` client traffic is counted on the aggregate cluster ``X_failover`` (see
:mod:`resources`). A request that failed on ``X`` and succeeded on the other side by retry still
counts against ``X``: every retry is one failed attempt (``upstream_rq_retry``), so

    attempts = upstream_rq_completed + upstream_rq_retry
    failures = upstream_rq_5xx + upstream_rq_retry        (final 5xx + attempts that were retried)

and the plain ``upstream_rq_5xx`` (which a retry hides) is never used alone. ``p99`` comes from
the diff of the cumulative ``upstream_rq_time`` buckets, interpolated inside the bucket.
Health comes from the endpoint cluster ``X``: ``membership_healthy`` and outlier ejections.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpumigrate.traffic.resources import FAILOVER_SUFFIX


@dataclass
class ClusterCounters:
    completed: int = 0
    xx5: int = 0
    retries: int = 0
    buckets: list[tuple[float, int]] = field(default_factory=list)  # (upper bound ms, cumulative count)
    healthy: int | None = None  # hosts passing health checks in the endpoint cluster
    ejected: int = 0  # hosts ejected by outlier detection now
    active: int = 0  # requests in flight now (a gauge: a long stream counts until it ends)


@dataclass
class StatsSnapshot:
    ts: float
    clusters: dict[str, ClusterCounters]


@dataclass
class ClusterWindow:
    """One upstream over one window."""

    requests: int
    failures: int
    seconds: float
    p99_ms: float | None
    healthy: int | None
    ejected: int
    active: int = 0  # requests in flight at the window's end (streams being answered)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def error_rate(self) -> float | None:
        return self.failures / self.requests if self.requests else None

    @property
    def success_rate(self) -> float | None:
        return None if self.requests == 0 else 1.0 - self.failures / self.requests

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "failures": self.failures,
            "rps": round(self.rps, 2),
            "error_rate": None if self.error_rate is None else round(self.error_rate, 5),
            "p99_ms": None if self.p99_ms is None else round(self.p99_ms, 2),
            "healthy": self.healthy,
            "ejected": self.ejected,
            "in_flight": self.active,
        }


def parse_stats(
    stats_json: dict[str, Any], upstreams: list[str], ts: float | None = None, *, failover: bool = True
) -> StatsSnapshot:
    """Pick our upstreams' counters out of ``/stats?format=json&histogram_buckets=cumulative``.

    ``failover=False`` (a plain split, the benchmark's baseline) counts client traffic on the
    endpoint clusters themselves, where the split sends it.
    """
    out = {u: ClusterCounters() for u in upstreams}
    agg = {f"cluster.{u}{FAILOVER_SUFFIX if failover else ''}.": u for u in upstreams}
    raw = {f"cluster.{u}.": u for u in upstreams}
    for entry in stats_json.get("stats", []):
        if "histograms" in entry:
            hists = entry["histograms"]
            for h in hists if isinstance(hists, list) else []:
                name = h.get("name", "")
                for prefix, u in agg.items():
                    if name == prefix + "upstream_rq_time":
                        out[u].buckets = [(float(b["upper_bound"]), int(b["cumulative"])) for b in h.get("buckets", [])]
            continue
        name, value = entry.get("name", ""), entry.get("value", 0)
        for prefix, u in agg.items():
            if name.startswith(prefix):
                key = name[len(prefix) :]
                if key == "upstream_rq_completed":
                    out[u].completed = int(value)
                elif key == "upstream_rq_5xx":
                    out[u].xx5 = int(value)
                elif key == "upstream_rq_retry":
                    out[u].retries = int(value)
                elif key == "upstream_rq_active":
                    out[u].active = max(out[u].active, int(value))
        for prefix, u in raw.items():
            if name == prefix + "membership_healthy":
                out[u].healthy = int(value)
            elif name == prefix + "outlier_detection.ejections_active":
                out[u].ejected = int(value)
            elif name == prefix + "upstream_rq_active":  # where the aggregate cluster keeps no gauge of its own
                out[u].active = max(out[u].active, int(value))
    return StatsSnapshot(ts if ts is not None else time.time(), out)


def merge(snapshots: list[StatsSnapshot]) -> StatsSnapshot:
    """Sum several Envoys' snapshots (they front the same upstreams)."""
    if len(snapshots) == 1:
        return snapshots[0]
    out: dict[str, ClusterCounters] = {}
    for snap in snapshots:
        for u, c in snap.clusters.items():
            m = out.setdefault(u, ClusterCounters())
            m.completed += c.completed
            m.xx5 += c.xx5
            m.retries += c.retries
            m.ejected += c.ejected
            m.active += c.active
            if c.healthy is not None:
                m.healthy = c.healthy if m.healthy is None else min(m.healthy, c.healthy)
            if not m.buckets:
                m.buckets = list(c.buckets)
            elif c.buckets:
                m.buckets = [(ub, n + cn) for (ub, n), (_, cn) in zip(m.buckets, c.buckets, strict=False)]
    return StatsSnapshot(max(s.ts for s in snapshots), out)


def percentile_from_buckets(buckets: list[tuple[float, int]], q: float) -> float | None:
    """``q``-quantile (0..1) from cumulative (upper bound, count) buckets, linear inside the bucket."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0
    for upper, cum in buckets:
        if cum >= rank and cum > below:
            return lower + (upper - lower) * (rank - below) / (cum - below)
        lower, below = upper, cum
    return buckets[-1][0]


def window(old: StatsSnapshot, new: StatsSnapshot) -> dict[str, ClusterWindow]:
    """Figures per upstream between two snapshots (counters are monotonic; a restart resets them)."""
    seconds = max(1e-6, new.ts - old.ts)
    out: dict[str, ClusterWindow] = {}
    for u, n in new.clusters.items():
        o = old.clusters.get(u, ClusterCounters())
        if n.completed < o.completed:  # Envoy restarted: its counters began again
            o = ClusterCounters()
        retries = max(0, n.retries - o.retries)
        requests = max(0, n.completed - o.completed) + retries
        failures = max(0, n.xx5 - o.xx5) + retries
        diff = _bucket_diff(o.buckets, n.buckets)
        p99 = percentile_from_buckets(diff, 0.99)
        out[u] = ClusterWindow(requests, failures, seconds, p99, n.healthy, n.ejected, n.active)
    return out


def _bucket_diff(old: list[tuple[float, int]], new: list[tuple[float, int]]) -> list[tuple[float, int]]:
    if not old or len(old) != len(new):
        return list(new)
    return [(ub, max(0, n - o)) for (ub, n), (_, o) in zip(new, old, strict=True)]


# -- what clients saw: the client listener's own counters (``http.ingress.*``) --------------------
#
# Probes go through their own listener (``http.probes.*``), so none of this counts them.
INGRESS_PREFIX = "http.ingress."
INGRESS_STATS: tuple[str, ...] = (
    "downstream_rq_total",
    "downstream_rq_completed",
    "downstream_rq_5xx",
    "downstream_rq_active",
    "downstream_rq_time",
)

DOWNTIME_DEFINITION = (
    "longest stretch of consecutive stats samples in which requests were waiting (arrived, or in flight "
    "at the sample's start) and none was answered without a 5xx, counted only when the stretch held a "
    "failure (a 5xx, or a request that ended unanswered); the samples on either side add the failed share of their answers "
    "(where the outage began or ended inside them); within one sample of the truth at each end"
)


@dataclass
class IngressCounters:
    """One Envoy's client-listener counters at one moment."""

    ts: float
    total: int = 0  # requests that arrived
    completed: int = 0  # requests answered (any status)
    xx5: int = 0  # answered with a 5xx
    active: int = 0  # in flight now (a gauge); arrived - answered - in flight = ended unanswered (reset)
    buckets: list[tuple[float, int]] = field(default_factory=list)  # downstream_rq_time, cumulative

    @property
    def unanswered(self) -> int:
        """Requests that ended unanswered so far (cumulative), as this reading has it."""
        return self.total - self.completed - self.active


def settled_reading(read: Callable[[], IngressCounters], tries: int = 4, gap_s: float = 0.002) -> IngressCounters:
    """One reading whose count of requests that ended unanswered does not read low.

    Envoy counts a request answered a moment before it stops counting it in flight, and reads a
    listener's counters one by one: a read in that moment says one request fewer ended unanswered than
    did (about one read in a hundred at 200 requests/s, now and then across two reads a millisecond
    apart), always with that request in flight. A read with nothing in flight cannot read low, and is
    returned at once; otherwise up to ``tries`` reads ``gap_s`` apart, and the one with the highest
    count (the latest of equals). Reading high would take a request counted arrived and not in flight
    within one read, which Envoy counts together; no read did in thousands. A read that raises propagates.
    """
    best = read()
    for _ in range(tries - 1):
        if best.active == 0:
            return best
        time.sleep(gap_s)
        cur = read()
        if cur.active == 0 or cur.unanswered >= best.unanswered:
            best = cur
    return best


def baseline_reading(read: Callable[[], IngressCounters], reads: int = 12, gap_s: float = 0.003) -> IngressCounters:
    """The reading a span starts from: what ended unanswered before it, which every later failure is counted above.

    A :func:`settled_reading` can still read one low when every one of its reads lands while an answer is counted
    in flight (long streams keep requests in flight all the time, and on a loaded host Envoy's worker may take
    tens of milliseconds to let go of a finished stream): as the span's base, that one request would be counted
    lost in every later window, a failure no client saw.
    A read can also read one high (a request arriving between Envoy's read of its gauge and of its counter).
    Both are brief, so the base is the count most of ``reads`` reads ``gap_s`` apart agree on (the latest of
    those), once per span: a request that really ended unanswered during them stays in every read after it.
    """
    seen = [read()]
    for _ in range(reads - 1):
        time.sleep(gap_s)
        seen.append(read())
    votes = Counter(r.unanswered for r in seen)
    most = max(votes.values())
    return [r for r in seen if votes[r.unanswered] == most][-1]


def parse_ingress(stats_json: dict[str, Any], ts: float | None = None) -> IngressCounters:
    """Pick ``http.ingress.*`` out of ``/stats?format=json&histogram_buckets=cumulative``."""
    out = IngressCounters(ts if ts is not None else time.time())
    for entry in stats_json.get("stats", []):
        if "histograms" in entry:
            hists = entry["histograms"]
            for h in hists if isinstance(hists, list) else []:
                if h.get("name") == INGRESS_PREFIX + "downstream_rq_time":
                    out.buckets = [(float(b["upper_bound"]), int(b["cumulative"])) for b in h.get("buckets", [])]
            continue
        name, value = entry.get("name", ""), entry.get("value", 0)
        if not name.startswith(INGRESS_PREFIX):
            continue
        key = name[len(INGRESS_PREFIX) :]
        if key == "downstream_rq_total":
            out.total = int(value)
        elif key == "downstream_rq_completed":
            out.completed = int(value)
        elif key == "downstream_rq_5xx":
            out.xx5 = int(value)
        elif key == "downstream_rq_active":
            out.active = int(value)
    return out


@dataclass
class _Window:
    dt: float
    xx5: int
    good: int  # answers that were not a 5xx
    waiting: bool  # requests arrived, or were in flight at the window's start
    lost: int  # arrived - answered - in flight at the window's end (cumulative; a noisy reading)


class ClientFigures:
    """What one Envoy's clients saw over a span, from successive :class:`IngressCounters` samples.

    Requests, failures (5xx answers, and requests that ended unanswered), p99 of every answer, and downtime as
    :data:`DOWNTIME_DEFINITION` says. Why that definition: a window with requests waiting and no
    good answer is what a client feels as an outage, but a workload whose normal answers take longer
    than a sample (a long generation) has such windows on every quiet start; requiring a failure in
    the stretch keeps slow-but-healthy service out of downtime (its cost shows in p99 instead),
    while a hang still counts once its requests time out or are given up (504s, resets).

    Envoy's reset counters also count streams closed after their answer, so a request that ended
    unanswered is read as arrived − answered − in flight. Envoy reads those counters one by one while
    requests come and go, so one read can be off by the few requests that moved during it. Feed
    :func:`settled_reading` samples, the first a :func:`baseline_reading`: that first reading sets what ended
    unanswered before the span, and a reading one low there would count a request no client missed. An
    increase counts only once the next sample confirms it, and each window is judged one sample late.
    Call :meth:`close` after the last sample.
    """

    def __init__(self) -> None:
        self.prev: IngressCounters | None = None
        self.requests = self.answered = self.failures = 0
        self.buckets: list[tuple[float, int]] = []
        self.seconds = 0.0
        self.longest_window_s = 0.0
        self.downtime_s = 0.0
        self._pending: _Window | None = None  # the last window, judged when the next sample confirms it
        self._lost_high: int | None = None  # the highest confirmed reading of requests that ended unanswered
        self._stretch_s = 0.0
        self._stretch_failed = False
        self._last_edge_s = 0.0  # the previous window's failed share, in seconds: a stretch may begin there

    def add(self, cur: IngressCounters) -> None:
        prev, self.prev = self.prev, cur
        if prev is None:
            return
        if cur.total < prev.total:  # Envoy restarted: its counters began again from zero
            prev = IngressCounters(prev.ts)
            self.close()
            self._lost_high = None
        dt = max(0.0, cur.ts - prev.ts)
        answered = max(0, cur.completed - prev.completed)
        xx5 = max(0, cur.xx5 - prev.xx5)
        self.requests += max(0, cur.total - prev.total)
        self.answered += answered
        self.seconds += dt
        self.longest_window_s = max(self.longest_window_s, dt)
        diff = _bucket_diff(prev.buckets, cur.buckets)
        self.buckets = (
            diff if not self.buckets else [(ub, n + d) for (ub, n), (_, d) in zip(self.buckets, diff, strict=False)]
        )
        window = _Window(dt, xx5, answered - xx5, cur.total > prev.total or prev.active > 0, cur.unanswered)
        if self._lost_high is None:  # the span's first window: what ended unanswered before it is not its own
            self._lost_high = prev.unanswered
        if self._pending is not None:
            confirmed = min(self._pending.lost, window.lost)
            self._judge(self._pending, max(0, confirmed - self._lost_high))
            self._lost_high = max(self._lost_high, confirmed)
        self._pending = window

    def close(self) -> None:
        """Judge the last window (an unconfirmed rise of its unanswered reading is not counted)."""
        if self._pending is not None:
            self._judge(self._pending, 0)
            self._pending = None

    def _judge(self, w: _Window, unanswered: int) -> None:
        failed = w.xx5 + unanswered
        self.failures += failed
        edge = w.dt * failed / (failed + w.good) if failed and w.good > 0 else 0.0
        if w.waiting and w.good <= 0:
            if self._stretch_s == 0.0:
                self._stretch_s = self._last_edge_s
            self._stretch_s += w.dt
            self._stretch_failed = self._stretch_failed or failed > 0
        elif self._stretch_s > 0.0:
            self._stretch_s += edge
            self._close_stretch()
        self._last_edge_s = edge

    def _close_stretch(self) -> None:
        if self._stretch_failed:
            self.downtime_s = max(self.downtime_s, self._stretch_s)
        self._stretch_s, self._stretch_failed = 0.0, False

    def downtime(self) -> float:
        """Seconds, the stretch still open at the last judged window included."""
        open_s = self._stretch_s if self._stretch_failed else 0.0
        return max(self.downtime_s, open_s)


def client_figures(per_envoy: list[ClientFigures]) -> dict[str, Any]:
    """The figures of a migration's traffic: sums over every Envoy; downtime is the worst Envoy's."""
    buckets: list[tuple[float, int]] = []
    for f in per_envoy:
        buckets = (
            list(f.buckets)
            if not buckets
            else [(ub, n + m) for (ub, n), (_, m) in zip(buckets, f.buckets, strict=False)]
        )
    p50, p99 = percentile_from_buckets(buckets, 0.5), percentile_from_buckets(buckets, 0.99)
    return {
        "source": "envoy",
        "envoys": len(per_envoy),
        "requests": sum(f.requests for f in per_envoy),
        "answered": sum(f.answered for f in per_envoy),
        "failures": sum(f.failures for f in per_envoy),
        "p50_ms": None if p50 is None else round(p50, 2),
        "p99_ms": None if p99 is None else round(p99, 2),
        "downtime_ms": round(1000 * max((f.downtime() for f in per_envoy), default=0.0), 1),
        "downtime_resolution_ms": round(1000 * max((f.longest_window_s for f in per_envoy), default=0.0), 1),
        "downtime_definition": DOWNTIME_DEFINITION,
        "seconds": round(max((f.seconds for f in per_envoy), default=0.0), 3),
    }

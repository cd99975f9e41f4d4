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
        for prefix, u in raw.items():
            if name == prefix + "membership_healthy":
                out[u].healthy = int(value)
            elif name == prefix + "outlier_detection.ejections_active":
                out[u].ejected = int(value)
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
        out[u] = ClusterWindow(requests, failures, seconds, percentile_from_buckets(diff, 0.99), n.healthy, n.ejected)
    return out


def _bucket_diff(old: list[tuple[float, int]], new: list[tuple[float, int]]) -> list[tuple[float, int]]:
    if not old or len(old) != len(new):
        return list(new)
    return [(ub, max(0, n - o)) for (ub, n), (_, o) in zip(new, old, strict=True)]

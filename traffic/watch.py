"""The side-by-side live view: per upstream weight, request rate, error rate, p99, health, plus the
ramp's parity probes and gate verdict (from ``ramp.json`` in the state directory, when given) and
the traffic lease: who holds the split and how long since their last renewal.

Reads only Envoy's admin interface and the state directory, so it runs in any process next to a
ramp: ``gpumigrate traffic watch --admin URL [--state-dir D] [--prometheus-port P]``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from gpumigrate.errors import TrafficError
from gpumigrate.traffic.envoy import EnvoyAdmin
from gpumigrate.traffic.ramp import PROGRESS_FILE
from gpumigrate.traffic.resources import FAILOVER_SUFFIX, WEIGHT_SCALE
from gpumigrate.traffic.state import StateStore
from gpumigrate.traffic.stats import StatsSnapshot, parse_stats, window

_FAILOVER_RE = re.compile(r"^cluster\.([A-Za-z0-9_-]+)" + re.escape(FAILOVER_SUFFIX) + r"\.")


class Watcher:
    def __init__(self, admin_url: str, *, state_dir: str | Path | None = None) -> None:
        self.admin = EnvoyAdmin(admin_url)
        self.state_dir = Path(state_dir) if state_dir else None
        self.upstreams: list[str] = []
        self._prev: StatsSnapshot | None = None

    def _discover(self, stats: dict[str, Any]) -> list[str]:
        names = set()
        for entry in stats.get("stats", []):
            m = _FAILOVER_RE.match(entry.get("name", ""))
            if m:
                names.add(m.group(1))
        return sorted(names)

    def poll(self) -> dict[str, Any]:
        """One row set: figures since the previous poll (the first poll only primes the counters)."""
        stats = self.admin.stats()
        self.upstreams = self._discover(stats) or self.upstreams
        snap = parse_stats(stats, self.upstreams, ts=time.monotonic())
        prev, self._prev = self._prev, snap
        clusters = {u: w.to_json() for u, w in window(prev, snap).items()} if prev else {}
        weights = {u: w / WEIGHT_SCALE for u, w in self.admin.live_weights().items()}
        ramp = lease = None
        if self.state_dir is not None:
            try:
                ramp = json.loads((self.state_dir / PROGRESS_FILE).read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                ramp = None
            try:
                held = StateStore(self.state_dir).lease()
            except TrafficError:
                held = None
            if held is not None:  # the age by the wall clock: a view, not the control plane's judgement
                lease = {
                    "holder": held.holder,
                    "age_s": round(time.time() - held.renewed, 1),
                    "length_s": held.length_s,
                }
        return {
            "ts": time.time(),
            "weights": {u: weights.get(u, 0.0) for u in self.upstreams},
            "clusters": clusters,
            "ramp": ramp,
            "lease": lease,
        }


def _fmt(v: Any, spec: str, none: str = "–") -> str:
    return none if v is None else format(v, spec)


def render(row: dict[str, Any]) -> Table:
    ramp = row.get("ramp") or {}
    analysis = ((ramp.get("sample") or {}).get("analysis")) or {}
    verdict = analysis.get("verdict", "–")
    parity = next((m for m in analysis.get("measurements", []) if m.get("metric") == "parity"), None)
    title = f"traffic · ramp {ramp.get('status', 'not running')} · gate {verdict}"
    lease = row.get("lease")
    if lease:
        title += f" · lease {lease['holder']}, renewed {lease['age_s']:g}s ago (lapses at {lease['length_s']:g}s)"
    t = Table(title=title, caption=(analysis.get("reason") or "")[:160])
    for col in ("cluster", "weight %", "req/s", "error rate", "p99 ms", "healthy"):
        t.add_column(col, justify="right" if col != "cluster" else "left")
    for u in sorted(row["weights"], key=lambda n: (n != "source", n)):
        c = row["clusters"].get(u, {})
        err = c.get("error_rate")
        style = "red" if err else None
        t.add_row(
            u,
            _fmt(row["weights"].get(u), ".2f"),
            _fmt(c.get("rps"), ".1f"),
            _fmt(err, ".4f"),
            _fmt(c.get("p99_ms"), ".1f"),
            _fmt(c.get("healthy"), "d"),
            style=style,
        )
    if parity:
        t.add_row("parity probes", "", "", "", "", parity.get("verdict", "–"))
    return t

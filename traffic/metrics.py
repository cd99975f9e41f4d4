"""Prometheus export of the figures the live view shows, per upstream, so dashboards can show a ramp.

Metric names (all gauges unless noted), label ``cluster`` = upstream name (``source``, ``target``):

    gpumigrate_traffic_weight_percent        share of client traffic routed to the upstream
    gpumigrate_traffic_requests_per_second   over the last analysis interval (retried attempts included)
    gpumigrate_traffic_error_rate            failed or retried attempts / attempts, same interval
    gpumigrate_traffic_p99_ms                p99 of upstream_rq_time, same interval
    gpumigrate_traffic_healthy_hosts         hosts passing active health checks
    gpumigrate_traffic_parity_ok             1 agree, 0 disagree, -1 no probe round yet
    gpumigrate_traffic_gate_verdict          1 for the current verdict (label ``verdict``), 0 for the others
    gpumigrate_traffic_rollbacks_total       counter of rollbacks this process saw
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

VERDICTS = ("pass", "fail", "inconclusive")


class TrafficMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.weight = Gauge("gpumigrate_traffic_weight_percent", "Share of client traffic", ["cluster"], registry=r)
        self.rps = Gauge("gpumigrate_traffic_requests_per_second", "Attempts per second", ["cluster"], registry=r)
        self.error_rate = Gauge(
            "gpumigrate_traffic_error_rate", "Failed or retried attempts share", ["cluster"], registry=r
        )
        self.p99 = Gauge("gpumigrate_traffic_p99_ms", "p99 upstream request time (ms)", ["cluster"], registry=r)
        self.healthy = Gauge("gpumigrate_traffic_healthy_hosts", "Hosts passing health checks", ["cluster"], registry=r)
        self.parity = Gauge("gpumigrate_traffic_parity_ok", "1 agree, 0 disagree, -1 unknown", registry=r)
        self.verdict = Gauge("gpumigrate_traffic_gate_verdict", "Current analysis verdict", ["verdict"], registry=r)
        self.rollbacks = Counter("gpumigrate_traffic_rollbacks", "Rollbacks seen", registry=r)
        self.parity.set(-1)
        self._server: Any = None

    def observe(
        self, weights: dict[str, float], clusters: dict[str, dict[str, Any]], analysis: dict[str, Any] | None = None
    ) -> None:
        """One interval: ``clusters`` as in ``Sample.clusters`` (ClusterWindow.to_json per upstream)."""
        for name, w in weights.items():
            self.weight.labels(name).set(w)
        for name, c in clusters.items():
            self.rps.labels(name).set(c.get("rps") or 0.0)
            self.error_rate.labels(name).set(c.get("error_rate") or 0.0)
            if c.get("p99_ms") is not None:
                self.p99.labels(name).set(c["p99_ms"])
            if c.get("healthy") is not None:
                self.healthy.labels(name).set(c["healthy"])
        if analysis:
            verdict = analysis.get("verdict")
            for v in VERDICTS:
                self.verdict.labels(v).set(1 if v == verdict else 0)
            for m in analysis.get("measurements", []):
                if m.get("metric") == "parity":
                    self.parity.set({"pass": 1, "fail": 0}.get(m.get("verdict"), -1))

    def rolled_back(self) -> None:
        self.rollbacks.inc()

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` (0 = any free port); returns the port."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return int(server.server_address[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

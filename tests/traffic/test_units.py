"""Pure parts: stats windows, percentiles, gate verdicts, state validation, resources, load reports."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpumigrate.errors import InvalidInputError, TrafficError
from gpumigrate.interfaces import ParityReport
from gpumigrate.plan import Traffic
from gpumigrate.traffic import resources as res
from gpumigrate.traffic.analysis import GateSettings, Verdict, analyze
from gpumigrate.traffic.loadgen import LoadGenerator
from gpumigrate.traffic.ramp import RampSettings
from gpumigrate.traffic.state import DesiredState, StateStore, Upstream, rollback_to_source, split
from gpumigrate.traffic.stats import ClusterWindow, parse_stats, percentile_from_buckets, window
from gpumigrate.traffic.xds import build_snapshot


def _stats(
    completed: int, xx5: int, retries: int, buckets: list[tuple[float, int]], healthy: int = 1
) -> dict[str, Any]:
    return {
        "stats": [
            {"name": "cluster.target_failover.upstream_rq_completed", "value": completed},
            {"name": "cluster.target_failover.upstream_rq_5xx", "value": xx5},
            {"name": "cluster.target_failover.upstream_rq_retry", "value": retries},
            {"name": "cluster.target_failover.retry.upstream_rq_5xx", "value": retries},
            {"name": "cluster.target.membership_healthy", "value": healthy},
            {"name": "cluster.target.upstream_rq_completed", "value": 10_000},  # probes: not client traffic
            {
                "histograms": [
                    {
                        "name": "cluster.target_failover.upstream_rq_time",
                        "buckets": [{"upper_bound": ub, "cumulative": n} for ub, n in buckets],
                    }
                ]
            },
        ]
    }


def test_window_counts_retried_failures_and_diffs_histograms() -> None:
    old = parse_stats(_stats(100, 0, 0, [(5, 90), (10, 100), (500, 100)]), ["target"], ts=0.0)
    new = parse_stats(_stats(200, 1, 9, [(5, 180), (10, 190), (500, 200)]), ["target"], ts=2.0)
    w = window(old, new)["target"]
    assert (w.requests, w.failures) == (109, 10)  # 100 completed + 9 retried attempts; 1 final 5xx + 9 retries
    assert w.rps == pytest.approx(54.5)
    assert w.p99_ms is not None and 10 < w.p99_ms <= 500  # the new 10 slow ones are in the window's top 1%
    assert w.healthy == 1


def test_percentile_interpolates_inside_bucket_and_handles_empty() -> None:
    assert percentile_from_buckets([], 0.99) is None
    assert percentile_from_buckets([(10, 0), (20, 0)], 0.99) is None
    assert percentile_from_buckets([(10, 50), (20, 100)], 0.5) == pytest.approx(10)
    assert percentile_from_buckets([(10, 50), (20, 100)], 0.75) == pytest.approx(15)


def _w(
    requests: int, failures: int = 0, p99: float | None = 10.0, healthy: int | None = 1, ejected: int = 0
) -> ClusterWindow:
    return ClusterWindow(requests, failures, 1.0, p99, healthy, ejected)


def test_verdicts_pass_fail_inconclusive() -> None:
    g = GateSettings(min_requests=20, p99_slack_ms=5)
    assert analyze(_w(50), 10.0, g, probe=None, probes_expected=False).verdict == Verdict.PASS
    few = analyze(_w(5), 10.0, g, probe=None, probes_expected=False)
    assert few.verdict == Verdict.INCONCLUSIVE and "min_requests" in few.reason
    # Failures that break the gate whatever comes next fail at once, before min_requests.
    assert analyze(_w(5, failures=3), 10.0, g, probe=None, probes_expected=False).verdict == Verdict.FAIL
    slow = analyze(_w(50, p99=600.0), 10.0, g, probe=None, probes_expected=False)
    assert slow.verdict == Verdict.FAIL and "p99" in slow.reason
    # Within slack: 2 ms → 4 ms is not a regression even at ratio 2.
    assert analyze(_w(50, p99=4.0), 2.0, g, probe=None, probes_expected=False).verdict == Verdict.PASS
    assert analyze(_w(50, healthy=0), 10.0, g, probe=None, probes_expected=False).verdict == Verdict.FAIL
    assert analyze(_w(50, ejected=1), 10.0, g, probe=None, probes_expected=False).verdict == Verdict.FAIL
    bad = ParityReport(passed=False, cases=3, max_abs_err=0.5, failures=("case 0: tokens differ",))
    drift = analyze(_w(50), 10.0, g, probe=bad, probes_expected=True)
    assert drift.verdict == Verdict.FAIL and "tokens differ" in drift.reason
    assert analyze(_w(50), 10.0, g, probe=None, probes_expected=True).verdict == Verdict.INCONCLUSIVE
    assert analyze(_w(50), None, g, probe=None, probes_expected=False).verdict == Verdict.INCONCLUSIVE


def test_settings_from_plan() -> None:
    plan = Traffic.model_validate(
        {
            "stages": [{"weight": 10, "hold_s": 3}, {"weight": 100, "hold_s": 1}],
            "gates": {"min_requests": 7, "failures_to_rollback": 2},
            "analysis_interval_s": 0.5,
        }
    )
    s = RampSettings.from_plan(plan)
    assert s.stages == ((10, 3), (100, 1)) and s.interval_s == 0.5
    assert s.gates.min_requests == 7 and s.gates.failures_to_rollback == 2


def _state(tmp_path: Path) -> StateStore:
    store = StateStore(tmp_path / "xds")
    store.init(
        DesiredState(
            upstreams={"source": Upstream("source", "127.0.0.1", 1), "target": Upstream("target", "127.0.0.1", 2)},
            weights=split("source", "target", 0),
        )
    )
    return store


def test_state_validation_versions_and_rollback(tmp_path: Path) -> None:
    store = _state(tmp_path)
    assert store.version() == 1
    with pytest.raises(InvalidInputError, match="sum to 100"):
        store.set_weights({"source": 50, "target": 10})
    with pytest.raises(InvalidInputError, match="unknown upstreams"):
        store.set_weights({"source": 50, "canary": 50})
    with pytest.raises(InvalidInputError, match="0..100"):
        split("source", "target", 101)
    assert store.set_weights(split("source", "target", 25)).version == 2
    rolled = rollback_to_source(store.dir, "because", actor="tester")
    assert rolled.weights == {"source": 100.0, "target": 0.0}
    assert rolled.rolled_back and rolled.rolled_back["reason"] == "because"
    with pytest.raises(TrafficError, match="rolled back"):
        store.set_weights(split("source", "target", 50))
    doc = json.loads(store.path.read_text())
    assert doc["format"] == 1 and doc["version"] == 3


def test_concurrent_writers_never_lose_an_update(tmp_path: Path) -> None:
    store = _state(tmp_path)

    def bump() -> None:
        for _ in range(20):
            StateStore(store.dir).update(lambda s: None)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.version() == 1 + 80


def test_resources_split_and_failover_order(tmp_path: Path) -> None:
    state = _state(tmp_path).set_weights(split("source", "target", 12.5))
    snap = build_snapshot(state)
    assert set(snap.clusters) == {"source", "target", "source_failover", "target_failover"}
    order = snap.clusters["target_failover"]["cluster_type"]["typed_config"]["clusters"]
    assert order == ["target", "source"]  # a failed attempt on the target is retried on the source
    assert set(snap.routes) == {res.ROUTE_NAME, res.PROBE_ROUTE_NAME}
    client = snap.routes[res.ROUTE_NAME]
    split_route = client["virtual_hosts"][0]["routes"][-1]["route"]
    assert split_route["weighted_clusters"]["clusters"] == [
        {"name": "source_failover", "weight": 8750},
        {"name": "target_failover", "weight": 1250},
    ]
    assert "5xx" in split_route["retry_policy"]["retry_on"]
    for c in snap.clusters.values():  # every resource is valid protobuf
        res.to_any(c, res.CLUSTER_TYPE)
    for route in snap.routes.values():
        res.to_any(route, res.ROUTE_TYPE)
    # No client route picks a side by header: only the probe listener's routes match on it.
    assert not any("headers" in r["match"] for r in client["virtual_hosts"][0]["routes"])
    assert all(r["match"].get("headers") for r in snap.routes[res.PROBE_ROUTE_NAME]["virtual_hosts"][0]["routes"][:-1])
    safe = res.route_config(["source"], {"source": 100}, idempotent=False)
    assert safe["virtual_hosts"][0]["routes"][-1]["route"]["retry_policy"]["retry_on"] == res.SAFE_RETRY_ON


def test_a_stalled_generator_skips_only_the_slots_of_its_own_run() -> None:
    """A generator not scheduled for longer than the whole run counts its slots skipped, never more than it has."""
    gen = LoadGenerator("http://127.0.0.1:9/v1/generate", rps=10, seconds=1, timeout_s=1)
    gen.on_start = lambda t: time.sleep(2.5)  # the stall: its loop runs 2.5 s late, past all ten slots
    report = gen.run()
    assert report.total + report.skipped == 10 and report.skipped >= 9, (report.total, report.skipped)


def test_load_report_downtime_when_nothing_answers() -> None:
    # Nothing listens on port 9 of loopback: every request fails and the whole run is downtime.
    report = LoadGenerator("http://127.0.0.1:9/v1/generate", rps=20, seconds=0.5, timeout_s=1).run()
    assert report.total + report.skipped == 10 and report.total > 0  # a slot is skipped only on a stalled machine
    assert report.failed == report.total and report.ok == 0
    assert report.downtime_ms >= 400
    assert report.errors and all(k for k in report.errors)


def test_prometheus_endpoint_exports_per_cluster_figures() -> None:
    import httpx

    from gpumigrate.traffic.metrics import TrafficMetrics

    m = TrafficMetrics()
    port = m.serve(0)
    try:
        m.observe(
            {"source": 75.0, "target": 25.0},
            {
                "source": {"rps": 150.0, "error_rate": 0.0, "p99_ms": 9.5, "healthy": 1},
                "target": {"rps": 50.0, "error_rate": 0.02, "p99_ms": 12.0, "healthy": 1},
            },
            {"verdict": "fail", "measurements": [{"metric": "parity", "verdict": "fail"}]},
        )
        m.rolled_back()
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        m.close()
    assert 'gpumigrate_traffic_weight_percent{cluster="target"} 25.0' in text
    assert 'gpumigrate_traffic_error_rate{cluster="target"} 0.02' in text
    assert 'gpumigrate_traffic_p99_ms{cluster="source"} 9.5' in text
    assert 'gpumigrate_traffic_gate_verdict{verdict="fail"} 1.0' in text
    assert "gpumigrate_traffic_parity_ok 0.0" in text
    assert "gpumigrate_traffic_rollbacks_total 1.0" in text


def test_live_view_renders_both_sides_and_the_gate() -> None:
    from rich.console import Console

    from gpumigrate.traffic.watch import render

    row = {
        "weights": {"source": 75.0, "target": 25.0},
        "clusters": {
            "source": {"rps": 150.0, "error_rate": 0.0, "p99_ms": 9.5, "healthy": 1},
            "target": {"rps": 50.0, "error_rate": 0.02, "p99_ms": 12.0, "healthy": 1},
        },
        "ramp": {
            "status": "running",
            "sample": {
                "analysis": {
                    "verdict": "fail",
                    "reason": "target success rate 0.98",
                    "measurements": [{"metric": "parity", "verdict": "pass"}],
                }
            },
        },
        "lease": {"holder": "migration m7", "age_s": 0.4, "length_s": 6.0},
    }
    console = Console(width=120, record=True)
    console.print(render(row))
    text = console.export_text()
    assert "source" in text and "target" in text and "75.00" in text and "0.0200" in text
    assert "gate fail" in text and "parity probes" in text and "target success rate 0.98" in text
    assert "lease migration m7, renewed 0.4s ago (lapses at 6s)" in " ".join(text.split())  # the title wraps


def test_stats_of_several_envoys_are_summed() -> None:
    from gpumigrate.traffic.stats import merge

    a = parse_stats(_stats(100, 1, 2, [(5, 90), (10, 100)]), ["target"], ts=1.0)
    b = parse_stats(_stats(50, 0, 1, [(5, 50), (10, 50)], healthy=0), ["target"], ts=2.0)
    m = merge([a, b]).clusters["target"]
    assert (m.completed, m.xx5, m.retries) == (150, 1, 3)
    assert m.buckets == [(5.0, 140), (10.0, 150)]
    assert m.healthy == 0  # one Envoy seeing no healthy host is enough to say so

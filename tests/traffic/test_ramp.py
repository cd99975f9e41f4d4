"""Ramps through a real Envoy under open-loop load: completion, rollbacks on faults, manual rollback."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from gpumigrate.traffic.analysis import GateSettings
from gpumigrate.traffic.loadgen import LoadProcess
from gpumigrate.traffic.probes import Prober
from gpumigrate.traffic.ramp import RampController, RampResult, RampSettings

INTERVAL = 0.5
BODY = {"prompt": "hello", "max_new_tokens": 1}


def _controller(
    env: Any,
    stages: tuple[tuple[float, float], ...],
    *,
    comparator: Any = None,
    golden: Any = None,
    min_requests: int = 10,
    interval: float = INTERVAL,
    **kw: Any,
) -> RampController:
    prober = Prober(env.envoy.probe_url, golden, comparator, every_s=interval) if comparator else None
    settings = RampSettings(
        stages=stages,
        interval_s=interval,
        baseline_intervals=2,
        gates=GateSettings(min_requests=min_requests, min_success_rate=0.999, p99_slack_ms=150),
        max_inconclusive=40,
    )
    return RampController(
        env.state_dir, [env.envoy.admin_url], settings, nodes=[env.envoy.node_id], prober=prober, **kw
    )


def test_full_ramp_at_200_rps_has_no_failed_requests(traffic_env: Any, comparator: Any, golden: Any) -> None:
    stages = ((1, 1.0), (5, 1.0), (25, 1.0), (50, 1.0), (100, 1.0))
    ctl = _controller(traffic_env, stages, comparator=comparator, golden=golden, min_requests=3)
    load = LoadProcess(traffic_env.url, rps=200, seconds=60, body=BODY)
    try:
        result: RampResult = ctl.run()
    finally:
        load.stop()
    report = load.wait()
    print(
        json.dumps(
            {
                "stages": [s.to_json() for s in result.stages],
                "figures": result.figures,
                "load": {k: v for k, v in report.to_json().items() if k != "per_second"},
            }
        )
    )
    assert result.status == "completed", result.reason
    assert [s.outcome for s in result.stages] == ["passed"] * 5
    assert traffic_env.envoy.admin.live_weights() == {"target": 10000}
    assert report.total > 500
    assert report.failed == 0, report.errors
    # Envoy's own figures for the ramp: what the clients saw over its span (never the probes).
    fig = result.figures
    assert fig is not None and fig["source"] == "envoy"
    # Envoy saw only the load's requests (a saturated client sends late, so not all of them in the span).
    assert 0 < fig["requests"] <= report.total
    assert fig["failures"] == 0 and fig["downtime_ms"] == 0
    assert fig["p99_ms"] is not None and fig["p99_ms"] > 0
    assert result.final_weight == 100 and result.progress_pct == 100


@pytest.mark.parametrize("fault", ["errors", "slow", "drift", "killed"])
def test_fault_on_target_at_25_percent_rolls_back_within_two_intervals(
    traffic_env: Any, comparator: Any, golden: Any, fault: str
) -> None:
    marks: dict[str, int] = {}

    def inject(sample: Any) -> None:
        if sample.stage == 0 and "fault" not in marks and sum(1 for s in ctl.samples if s.stage == 0) >= 2:
            marks["fault"] = len(ctl.samples)
            marks["load_t"] = int(load.elapsed())
            target = traffic_env.upstreams["target"]
            if fault == "killed":
                target.kill()
            elif fault == "slow":
                target.fault("slow", 1.0, 500)
            else:
                target.fault(fault, 1.0)

    # Envoy times a request when it completes: a +500 ms fault can only show in an interval longer than
    # the added latency, so that case runs at 1 s (the demo's interval) instead of 0.5 s.
    ctl = _controller(
        traffic_env,
        ((25, 30.0), (100, 1.0)),
        comparator=comparator,
        golden=golden,
        min_requests=5,
        on_interval=inject,
        interval=1.0 if fault == "slow" else INTERVAL,
    )
    load = LoadProcess(traffic_env.url, rps=100, seconds=60, body=BODY)
    try:
        result = ctl.run()
    finally:
        load.stop()
    report = load.wait()
    assert "fault" in marks, "the fault was never injected"
    assert result.status == "rolled_back"
    assert result.trigger == "gate"
    failing = [i for i, s in enumerate(result.samples) if s.analysis["verdict"] == "fail"]
    assert failing and failing[0] >= marks["fault"], "a gate failed before the fault"
    assert failing[0] - marks["fault"] + 1 <= 2, f"detected after {failing[0] - marks['fault'] + 1} intervals"
    assert traffic_env.envoy.admin.live_weights() == {"source": 10000}
    _, window_total = report.failures_between(marks["load_t"], report.seconds + 1)
    if fault == "killed":
        assert report.failed == 0, report.errors
    else:
        assert report.failed <= 0.001 * window_total, report.errors


def test_a_source_whose_requests_outlast_the_baseline_intervals_still_gets_a_baseline(traffic_env: Any) -> None:
    """An LLM's streams on a loaded host last seconds: none ends within the baseline's two intervals. The baseline
    measures on until min_requests ended (CI once rolled a healthy LLM migration back: at 100% the source takes no
    new requests, so 'no baseline p99 yet' stayed inconclusive until the policy rolled back)."""
    # Both answer alike, slowly, one request at a time (the server's safe point): a request every 2 s, each 1.2 s.
    for name in ("source", "target"):
        traffic_env.upstreams[name].fault("slow", 1.0, 1200)
    ctl = _controller(traffic_env, ((100, 2.0),), min_requests=3)
    load = LoadProcess(traffic_env.url, rps=0.5, seconds=60, body=BODY)
    try:
        result = ctl.run()
    finally:
        load.stop()
    load.wait()
    assert result.status == "completed", result.reason
    baseline = [s for s in result.samples if s.stage == -1]
    assert len(baseline) > 2, "the baseline ended after its two intervals without a p99"
    assert ctl.baseline_p99 is not None and ctl.baseline_p99 >= 1200


def test_manual_rollback_acts_within_one_interval(traffic_env: Any, gm_home: Any) -> None:
    from gpumigrate.state import Migration

    migration = Migration.create("m-traffic-1", "workload: x\n")
    asked: dict[str, int] = {}

    def ask(sample: Any) -> None:
        if sample.stage == 1 and "at" not in asked:
            asked["at"] = len(ctl.samples)
            migration.request_rollback("operator pressed the button")

    ctl = _controller(
        traffic_env,
        ((5, 1.0), (25, 30.0), (100, 1.0)),
        min_requests=5,
        rollback_signal=lambda: migration.rollback_requested(),
        on_interval=ask,
    )
    load = LoadProcess(traffic_env.url, rps=50, seconds=60, body=BODY)
    try:
        result = ctl.run()
    finally:
        load.stop()
    report = load.wait()
    assert result.status == "rolled_back"
    assert result.trigger == "manual"
    assert "operator pressed the button" in (result.reason or "")
    assert result.seconds_to_detect is not None  # request → rollback, from the request's own timestamp
    assert len(result.samples) - asked["at"] <= 1  # no more than one further interval ran
    assert traffic_env.envoy.admin.live_weights() == {"source": 10000}
    assert traffic_env.store.read().rolled_back is not None
    assert report.failed == 0, report.errors


def test_quiet_service_stays_inconclusive_then_policy_rolls_back(light_env: Any) -> None:
    # No load at all: no stage may pass on "no data"; the documented policy rolls back.
    settings = RampSettings(
        stages=((5, 0.2), (100, 0.2)),
        interval_s=0.2,
        baseline_intervals=1,
        gates=GateSettings(min_requests=5),
        max_inconclusive=3,
    )
    ctl = RampController(light_env.state_dir, [light_env.envoy.admin_url], settings, nodes=[light_env.envoy.node_id])
    result = ctl.run()
    assert result.status == "rolled_back"
    assert result.trigger == "inconclusive"
    assert [s.outcome for s in result.stages] == ["rolled_back"]
    assert all(s.analysis["verdict"] == "inconclusive" for s in result.samples)
    assert light_env.envoy.admin.live_weights() == {"source": 10000}


def test_rerun_resumes_at_the_current_weight(light_env: Any) -> None:
    from gpumigrate.traffic.state import split

    env = light_env
    state = env.store.set_weights(split("source", "target", 25))
    env.store.wait_applied(state.version, [env.envoy.node_id])
    settings = RampSettings(
        stages=((5, 0.5), (25, 0.5), (100, 0.5)),
        interval_s=0.25,
        gates=GateSettings(min_requests=3, p99_slack_ms=150),
        max_inconclusive=40,
    )
    ctl = RampController(env.state_dir, [env.envoy.admin_url], settings, nodes=[env.envoy.node_id])
    load = LoadProcess(env.url, rps=40, seconds=30, body=BODY)
    try:
        result = ctl.run()
    finally:
        load.stop()
    report = load.wait()
    assert result.status == "completed", result.reason
    assert [s.weight for s in result.stages] == [25, 100]  # 5% was behind us already
    assert not any(s.stage == -1 for s in result.samples)  # no fresh baseline on a resumed ramp
    assert report.failed == 0


def test_no_weight_moves_to_a_target_envoy_never_saw_healthy(light_env: Any) -> None:
    # The target is gone before the ramp: Envoy's checks never pass, and with no panic routing any
    # weight on it would be a 503 for clients. The ramp waits, then rolls back with nothing moved.
    from gpumigrate.traffic.stats import parse_stats

    env = light_env
    env.upstreams["target"].kill()
    deadline = time.monotonic() + 20  # Envoy's checks (two failures, 0.5 s apart) mark it down
    while parse_stats(env.envoy.admin.stats(["source", "target"]), ["source", "target"]).clusters["target"].healthy:
        assert time.monotonic() < deadline, "Envoy never marked the dead target unhealthy"
        time.sleep(0.1)
    settings = RampSettings(
        stages=((5, 0.5), (100, 0.5)),
        interval_s=0.25,
        baseline_intervals=1,
        gates=GateSettings(min_requests=3, p99_slack_ms=150),
        target_healthy_wait_s=1.0,
    )
    ctl = RampController(env.state_dir, [env.envoy.admin_url], settings, nodes=[env.envoy.node_id])
    load = LoadProcess(env.url, rps=40, seconds=30, body=BODY)
    try:
        result = ctl.run()
    finally:
        load.stop()
    report = load.wait()
    assert result.status == "rolled_back" and result.trigger == "target_unhealthy", result.reason
    assert result.stages == []  # no stage began
    assert env.envoy.admin.live_weights() == {"source": 10000}
    assert report.failed == 0  # every request went to the source


def test_a_ramp_whose_envoy_died_rolls_back_by_policy_instead_of_holding_forever(light_env: Any) -> None:
    # Envoy SIGKILLed mid-stage: every later interval is unreadable. Those intervals count toward the
    # inconclusive policy like any other, so the ramp ends (and releases the split) instead of renewing
    # the traffic lease forever.
    import os
    import signal
    import threading

    from gpumigrate.traffic.ramp import Sample

    settings = RampSettings(
        stages=((50, 0.2), (100, 0.2)),
        interval_s=0.2,
        baseline_intervals=1,
        gates=GateSettings(min_requests=5),
        max_inconclusive=3,
        apply_timeout_s=2.0,
    )

    def kill_envoy_once_split(sample: Sample) -> None:
        proc = light_env.envoy.proc
        if sample.weight > 0 and proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)

    ctl = RampController(
        light_env.state_dir,
        [light_env.envoy.admin_url],
        settings,
        nodes=[light_env.envoy.node_id],
        on_interval=kill_envoy_once_split,
    )
    done: list[RampResult] = []
    runner = threading.Thread(target=lambda: done.append(ctl.run()), daemon=True)  # a hang must not hang CI
    runner.start()
    runner.join(timeout=120)
    assert done, "the ramp still runs 120 s after its Envoy died"
    result = done[0]
    assert result.status == "rolled_back"
    assert result.trigger == "inconclusive"
    assert "admin unreadable" in (result.reason or "")
    assert light_env.store.read().weights["source"] == 100


def test_the_migrations_own_rollback_that_moved_traffic_first_reads_manual(light_env: Any, gm_home: Any) -> None:
    """`gpumigrate rollback` moves traffic before the flow's ramp sees the request (issue 35, finding 5): when that
    lands between an interval's check and the next stage's weights, the ramp still says manual, not "external"."""
    from gpumigrate.state import Migration
    from gpumigrate.traffic.ramp.judgement import RolledBack
    from gpumigrate.traffic.state import rollback_to_source

    migration = Migration.create("m-traffic-first", "workload: x\n")
    settings = RampSettings(stages=((5, 0.2), (100, 0.2)), interval_s=0.2, gates=GateSettings(min_requests=5))
    ctl = RampController(light_env.state_dir, [light_env.envoy.admin_url], settings, nodes=[light_env.envoy.node_id],
                         rollback_signal=lambda: migration.rollback_requested())  # fmt: skip
    migration.request_rollback("operator typed gpumigrate rollback")
    rollback_to_source(light_env.state_dir, "rollback requested: operator typed gpumigrate rollback")
    with pytest.raises(RolledBack) as raised:
        ctl.steer.apply(5.0)
    assert raised.value.trigger == "manual" and "operator typed gpumigrate rollback" in raised.value.reason

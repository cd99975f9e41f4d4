"""Ramps through a real Envoy under open-loop load: completion, rollbacks on faults, manual rollback."""

from __future__ import annotations

import json
from typing import Any

from gpumigrate.traffic.analysis import GateSettings
from gpumigrate.traffic.loadgen import LoadProcess
from gpumigrate.traffic.probes import Prober
from gpumigrate.traffic.ramp import RampController, RampResult, RampSettings

INTERVAL = 0.5
BODY = {"prompt": "hello", "max_new_tokens": 1}


def _controller(env: Any, stages: tuple[tuple[float, float], ...], *, comparator: Any = None, golden: Any = None,
                min_requests: int = 10, **kw: Any) -> RampController:
    prober = Prober(env.envoy.url, golden, comparator, every_s=INTERVAL) if comparator else None
    settings = RampSettings(stages=stages, interval_s=INTERVAL, baseline_intervals=2,
                            gates=GateSettings(min_requests=min_requests, min_success_rate=0.999, p99_slack_ms=150), max_inconclusive=40)
    return RampController(env.state_dir, [env.envoy.admin_url], settings, nodes=[env.envoy.node_id],
                          prober=prober, **kw)


def test_full_ramp_at_200_rps_has_no_failed_requests(traffic_env: Any, comparator: Any, golden: Any) -> None:
    stages = ((1, 1.0), (5, 1.0), (25, 1.0), (50, 1.0), (100, 1.0))
    ctl = _controller(traffic_env, stages, comparator=comparator, golden=golden, min_requests=3)
    load = LoadProcess(traffic_env.url, rps=200, seconds=60, body=BODY)
    try:
        result: RampResult = ctl.run()
    finally:
        load.stop()
    report = load.wait(60)
    print(json.dumps({"stages": [s.to_json() for s in result.stages], "load": {k: v for k, v in report.to_json().items() if k != "per_second"}}))
    assert result.status == "completed", result.reason
    assert [s.outcome for s in result.stages] == ["passed"] * 5
    assert traffic_env.envoy.admin.live_weights() == {"target": 10000}
    assert report.total > 500
    assert report.failed == 0, report.errors

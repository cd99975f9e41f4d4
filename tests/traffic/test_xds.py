"""The control plane against real Envoys: ACK, NACK keeps the last good config, restart, several Envoys."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpumigrate.errors import TrafficError
from gpumigrate.traffic.analysis import GateSettings
from gpumigrate.traffic.envoy import Envoy
from gpumigrate.traffic.loadgen import LoadProcess
from gpumigrate.traffic.ramp import RampController, RampSettings
from gpumigrate.traffic.state import DesiredState, Upstream, rollback_to_source, split

BODY = {"prompt": "hello", "max_new_tokens": 1}


def _hosts(url: str, n: int) -> dict[str, int]:
    seen: dict[str, int] = {}
    with httpx.Client(timeout=10) as c:
        for _ in range(n):
            r = c.post(url, json=BODY)
            assert r.status_code == 200
            host = r.json()["host"]
            seen[host] = seen.get(host, 0) + 1
    return seen


def test_weights_reach_envoy_through_rds(light_env: Any) -> None:
    env = light_env
    assert env.envoy.admin.live_weights() == {"source": 10000}
    assert _hosts(env.url, 20) == {"source": 20}
    state = env.store.set_weights(split("source", "target", 100))
    env.store.wait_applied(state.version, [env.envoy.node_id])
    assert env.envoy.admin.live_weights() == {"target": 10000}
    assert _hosts(env.url, 20) == {"target": 20}
    # The probe listener reaches one side whatever the split says; the client listener ignores the header.
    r = httpx.post(env.envoy.probe_url + "/v1/generate", json=BODY, headers={"x-gpumigrate-cluster": "source"})
    assert r.json()["host"] == "source"
    r = httpx.post(env.url, json=BODY, headers={"x-gpumigrate-cluster": "source"}, timeout=10)
    assert r.json()["host"] == "target"


def test_nack_keeps_last_good_config_and_is_raised(light_env: Any) -> None:
    env = light_env
    good = env.store.set_weights(split("source", "target", 50))
    env.store.wait_applied(good.version, [env.envoy.node_id])

    def break_health_path(s: DesiredState) -> None:  # Envoy requires a non-empty health check path
        s.upstreams["target"] = Upstream("target", "127.0.0.1", s.upstreams["target"].port, health_path="")
        s.weights = split("source", "target", 100)

    bad = env.store.update(break_health_path)
    with pytest.raises(TrafficError, match="rejected config version"):
        env.store.wait_applied(bad.version, [env.envoy.node_id], timeout_s=10)
    assert env.envoy.admin.live_weights() == {"source": 5000, "target": 5000}
    assert sum(_hosts(env.url, 10).values()) == 10  # still serving on the last good config

    def repair(s: DesiredState) -> None:
        s.upstreams["target"] = Upstream("target", "127.0.0.1", s.upstreams["target"].port)

    fixed = env.store.update(repair)
    env.store.wait_applied(fixed.version, [env.envoy.node_id])
    assert env.envoy.admin.live_weights() == {"target": 10000}


def test_one_control_plane_serves_several_envoys_and_rollback_from_outside(light_env: Any, tmp_path: Path) -> None:
    env = light_env
    with Envoy(tmp_path / "e2", state_dir=env.state_dir, node_id="second-envoy") as second:
        state = env.store.set_weights(split("source", "target", 100))
        env.store.wait_applied(state.version, [env.envoy.node_id, second.node_id])
        assert second.admin.live_weights() == env.envoy.admin.live_weights() == {"target": 10000}
        rolled = rollback_to_source(env.state_dir, "test")
        env.store.wait_applied(rolled.version, [env.envoy.node_id, second.node_id])
        assert second.admin.live_weights() == {"source": 10000}
        assert _hosts(second.url + "/v1/generate", 10) == {"source": 10}
        with pytest.raises(TrafficError, match="rolled back"):
            env.store.set_weights(split("source", "target", 5))


def test_control_plane_killed_mid_ramp_envoy_keeps_weights_and_ramp_resumes(traffic_env_external: Any) -> None:
    env = traffic_env_external
    seen: dict[str, Any] = {}

    def restart_later() -> None:
        time.sleep(1.5)
        seen["weights_while_down"] = env.envoy.admin.live_weights()
        seen["served_while_down"] = sum(_hosts(env.url, 5).values())
        env.start_plane()

    def chaos(sample: Any) -> None:
        if sample.stage == 1 and "killed" not in seen:
            seen["killed"] = True
            env.kill_plane()
            threading.Thread(target=restart_later, daemon=True).start()

    settings = RampSettings(
        stages=((5, 1.0), (25, 1.0), (50, 1.0), (100, 1.0)),
        interval_s=0.5,
        gates=GateSettings(min_requests=3, p99_slack_ms=150),
        max_inconclusive=40,
    )
    ctl = RampController(env.state_dir, [env.envoy.admin_url], settings, nodes=[env.envoy.node_id], on_interval=chaos)
    load = LoadProcess(env.url, rps=50, seconds=60, body=BODY)
    try:
        result = ctl.run()
    finally:
        load.stop()
    report = load.wait(60)
    assert seen.get("killed"), (result.status, result.trigger, result.reason)
    assert seen["weights_while_down"] == {"source": 7500, "target": 2500}
    assert seen["served_while_down"] == 5
    assert result.status == "completed", result.reason
    assert [s.outcome for s in result.stages] == ["passed"] * 4
    assert env.envoy.admin.live_weights() == {"target": 10000}
    assert report.failed == 0, report.errors


def test_envoy_restart_gets_current_state_again(light_env: Any) -> None:
    env = light_env
    state = env.store.set_weights(split("source", "target", 25))
    env.store.wait_applied(state.version, [env.envoy.node_id])
    env.envoy.restart()
    assert env.envoy.admin.live_weights() == {"source": 7500, "target": 2500}
    assert sum(_hosts(env.url, 8).values()) == 8
    assert env.envoy.ensure_running() is False
    os.killpg(env.envoy.proc.pid, signal.SIGKILL)  # Envoy crashes
    env.envoy.proc.wait(timeout=10)
    assert env.envoy.ensure_running() is True
    assert env.envoy.admin.live_weights() == {"source": 7500, "target": 2500}
    assert sum(_hosts(env.url, 8).values()) == 8


def test_cluster_removed_only_after_the_route_stopped_using_it(light_env: Any) -> None:
    env = light_env
    moved = env.store.set_weights(split("source", "target", 100))
    env.store.wait_applied(moved.version, [env.envoy.node_id])

    def drop_source(s: DesiredState) -> None:  # cutover is final: the source leaves the front door
        s.upstreams.pop("source")
        s.primary = "target"
        s.weights = {"target": 100.0}

    dropped = env.store.update(drop_source)
    env.store.wait_applied(dropped.version, [env.envoy.node_id])
    names = {c["name"] for c in env.envoy.admin.clusters().get("cluster_statuses", [])}
    assert "source" not in names and "source_failover" not in names
    assert {"target", "target_failover"} <= names
    assert _hosts(env.url, 5) == {"target": 5}


def test_max_connection_duration_closes_long_lived_client_connections(light_env: Any, tmp_path: Path) -> None:
    import socket

    env = light_env
    with Envoy(tmp_path / "short", state_dir=env.state_dir, node_id="short-envoy", max_connection_s=1.0) as short:
        body = json.dumps(BODY).encode()
        request = (
            f"POST /v1/generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode() + body
        with socket.create_connection(("127.0.0.1", short.listen_port), timeout=10) as s:
            s.sendall(request)
            data = b""
            while b"\r\n\r\n" not in data:
                data += s.recv(65536)
            head, rest = data.split(b"\r\n\r\n", 1)
            assert b" 200 " in head.split(b"\r\n", 1)[0]
            length = int(
                next(h.split(b":", 1)[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
            )
            while len(rest) < length:  # the whole response, so that what follows can only be the close
                rest += s.recv(65536)
            time.sleep(1.5)  # past max_connection_duration, idle: Envoy closes the connection itself
            s.settimeout(5)
            closed = False
            try:
                closed = s.recv(65536) == b""
            except ConnectionResetError:
                closed = True
            assert closed, "a connection older than max_connection_duration must be closed so the client reconnects"

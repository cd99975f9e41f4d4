"""`gpumigrate frontdoor up|status|down` as a user runs them: a detached Envoy and control plane that outlive
the command, found again by `status` and `down`; the traffic lease still enforced with no orchestrator."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpumigrate.traffic.state import StateStore, Upstream, split


def _gm(cli_cmd: list[str], home: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    env = {**os.environ, "GPUMIGRATE_HOME": str(home)}
    out = subprocess.run([*cli_cmd, "frontdoor", *args, "--json"], env=env, capture_output=True, text=True, timeout=120)
    lines = out.stdout.strip().splitlines()
    return out.returncode, json.loads(lines[-1]) if lines else {}, out.stderr


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def service(json_http: Callable[..., str]) -> str:
    def route(method: str, path: str, headers: Mapping[str, str], body: bytes) -> tuple[int, Any]:
        return 200, {"path": path, "served_by": "source"}

    return str(json_http(route))


@pytest.fixture
def door(cli_cmd: list[str], gm_home: Path) -> Iterator[Callable[..., tuple[int, dict[str, Any], str]]]:
    """``door(*args)``: runs `gpumigrate frontdoor ARGS --json`; every door started is taken down after the test."""
    yield lambda *args: _gm(cli_cmd, gm_home, *args)
    for workload in ("svc", "default"):
        _gm(cli_cmd, gm_home, "down", *(("--workload", workload) if workload != "default" else ()))


def test_up_outlives_the_command_then_status_and_down_find_it(door: Any, service: str, gm_home: Path) -> None:
    code, up, err = door("up", "--source", service, "--workload", "svc", "--listen", "127.0.0.1:0")
    assert code == 0, err
    assert up["started"] is True and up["state_dir"] == str(gm_home / "traffic" / "svc")
    assert up["source_healthy"] is True  # `up` returns once Envoy routes to the source
    assert f"clients call {up['listener']}" in err and "gpumigrate frontdoor down --workload svc" in err
    # The command has exited; the door serves: Envoy's listener reaches the source.
    deadline = time.monotonic() + 30
    while True:
        try:
            answer = httpx.post(up["listener"] + "/v1/embed", json={}, timeout=5)
            if answer.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the front door never reached the source"
        time.sleep(0.2)
    assert answer.json() == {"path": "/v1/embed", "served_by": "source"}
    code, status, err = door("status", "--workload", "svc")
    assert code == 0 and status["up"] is True and status["weights"] == {"source": 100.0}, err
    assert all(p["running"] for p in status["processes"].values()) and set(status["processes"]) == {
        "frontdoor",
        "envoy",
        "control-plane",
    }
    # Up again for the same source: the same door, nothing started twice. Another source: refused.
    code, again, _ = door("up", "--source", service, "--workload", "svc", "--listen", "127.0.0.1:0")
    assert code == 0 and again["started"] is False and again["processes"] == up["processes"]
    code, _, err = door("up", "--source", "http://127.0.0.1:9", "--workload", "svc")
    assert code == 2 and "gpumigrate frontdoor down --workload svc" in err and "Traceback" not in err

    code, down, err = door("down", "--workload", "svc")
    assert code == 0 and "frontdoor" in down["stopped"], err
    assert not any(_running(pid) for pid in up["processes"].values())
    code, _, err = door("status", "--workload", "svc")
    assert code == 2 and "gpumigrate frontdoor up --source URL --workload svc" in err
    assert door("down", "--workload", "svc")[0] == 0  # idempotent


def test_the_traffic_lease_is_enforced_by_the_detached_control_plane(door: Any, service: str) -> None:
    """A ramp holds a split under a lease, then its orchestrator dies: the door's own control plane puts
    every request back on the source by itself."""
    code, up, err = door("up", "--source", service, "--listen", "127.0.0.1:0")
    assert code == 0, err
    store = StateStore(up["state_dir"])

    def with_target(s: Any) -> None:
        s.upstreams["target"] = Upstream("target", "127.0.0.1", 9)

    store.update(with_target)
    store.set_weights(split("source", "target", 50))
    store.renew_lease("an orchestrator that dies now", interval_s=0.2, length_s=1.0, seq=1)
    deadline = time.monotonic() + 20
    while not store.read().rolled_back:
        assert time.monotonic() < deadline, "the control plane never acted on the lapsed lease"
        time.sleep(0.1)
    state = store.read()
    assert state.weights == {"source": 100.0, "target": 0.0} and state.rolled_back["trigger"] == "lease"


def test_bad_input_exits_2_naming_what_is_allowed(door: Any) -> None:
    for args, says in (
        (("up", "--source", "ftp://x"), "http://HOST:PORT"),
        (("up", "--source", "http://127.0.0.1:1", "--workload", "../etc"), "lowercase letters"),
        (("up", "--source", "http://127.0.0.1:1", "--listen", "nowhere"), "HOST:PORT"),
        (("up", "--source", "http://127.0.0.1:1", "--health-path", "readyz"), "HTTP path"),
    ):
        code, _, err = door(*args)
        assert code == 2 and says in err and "Traceback" not in err, (args, err)


def test_up_with_another_health_path_on_a_running_door_makes_envoy_check_it(
    door: Any, json_http: Callable[..., str]
) -> None:
    """`up --health-path /ready` on a door already up used to say "already up (GET /ready answering 200)" while Envoy
    still checked /readyz (issue 35, finding 7): now Envoy checks the new path, and what `up` says is what it runs."""

    def route(method: str, path: str, headers: Mapping[str, str], body: bytes) -> tuple[int, Any]:
        return (404, {"status": "not this path"}) if path == "/readyz" else (200, {"path": path})

    service = str(json_http(route))
    code, first, err = door("up", "--source", service, "--listen", "127.0.0.1:0")
    assert code == 0 and first["health_path"] == "/readyz" and first["source_healthy"] is False, err
    assert "GET /readyz answering 200) (it answers HTTP 404" in err  # said at once: no wait mends a missing path
    code, again, err = door("up", "--source", service, "--listen", "127.0.0.1:0", "--health-path", "/ready")
    assert code == 0 and again["started"] is False and again["processes"] == first["processes"], err
    assert again["health_path"] == "/ready" and again["health_path_before"] == "/readyz"
    assert again["source_healthy"] is True, err  # Envoy passed a check of /ready: it routes to the source
    assert "Envoy now checks GET /ready (it checked /readyz)" in err
    assert httpx.post(again["listener"] + "/v1/x", json={}, timeout=10).status_code == 200
    code, status, _ = door("status")
    assert code == 0 and status["health_path"] == "/ready"

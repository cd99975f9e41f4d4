"""The front door lets clients reach the service and nothing else (real Envoy, real control plane).

Internal paths (``/admin`` and below) answer 404 from Envoy however they are spelled; internal
headers neither pick a side nor reach the workload; parity probes have their own loopback listener.
"""

from __future__ import annotations

import json
import socket
from typing import Any
from urllib.parse import urlsplit

import httpx

from gpumigrate.traffic.probes import Prober
from gpumigrate.traffic.state import split

BODY = {"prompt": "hello", "max_new_tokens": 1}
# Sent byte for byte (an HTTP client library would tidy some of these up before they left).
ADMIN_SPELLINGS = [
    "/admin/fault",
    "/ADMIN/fault",
    "/Admin/Fault",
    "//admin/fault",
    "/./admin/fault",
    "/x/../admin/fault",
    "/x/%2e%2e/admin/fault",
    "/%61dmin/fault",
    "/admin%2Ffault",
    "/admin%2ffault",
    "/admin/fault?x=1",
    "/admin",
    "/admin/",
]


def _raw(url: str, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> int:
    """One HTTP/1.1 request with ``path`` exactly as given; returns the status code."""
    u = urlsplit(url)
    head = [f"{method} {path} HTTP/1.1", f"Host: {u.hostname}", "Connection: close", f"Content-Length: {len(body)}"]
    head += ["Content-Type: application/json"] + [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        status = s.makefile("rb").readline().decode()
    return int(status.split()[1])


def test_admin_paths_answer_404_at_the_front_door(traffic_env: Any) -> None:
    env = traffic_env  # the reference inference server, which serves POST /admin/fault on its own port
    state = env.store.set_weights(split("source", "target", 50))
    env.store.wait_applied(state.version, [env.envoy.node_id])
    fault = json.dumps({"kind": "errors", "rate": 1.0}).encode()
    for path in ADMIN_SPELLINGS:
        assert _raw(env.envoy.url, "POST", path, fault) == 404, path
        assert _raw(env.envoy.url, "GET", path) == 404, path
    # No fault took on either side: both answer, directly and through the front door.
    for up in env.upstreams.values():
        assert httpx.post(up.url + "/v1/generate", json=BODY, timeout=30).status_code == 200
    with httpx.Client(timeout=30) as c:
        assert all(c.post(env.url, json=BODY).status_code == 200 for _ in range(10))
    # A path that only starts with the same letters is the service's business, not a closed door.
    assert httpx.get(env.envoy.url + "/administrator", timeout=10).text != "not found\n"


def test_internal_headers_neither_pick_a_side_nor_reach_the_workload(light_env: Any) -> None:
    env = light_env  # weights: 100% source
    internal = {"x-gpumigrate-cluster": "target", "x-gpumigrate-upstream": "target"}
    with httpx.Client(timeout=10) as c:
        for _ in range(5):
            r = c.post(env.url, json=BODY, headers=internal)
            assert r.status_code == 200 and r.json()["host"] == "source"
            assert "x-gpumigrate-upstream" not in r.headers
        seen = c.get(env.envoy.url + "/v1/headers", headers=internal).json()
    assert seen["host"] == "source"
    assert not set(internal) & set(seen["headers"]), seen["headers"]


def test_probes_have_their_own_listener_and_know_which_side_answered(light_env: Any, comparator: Any) -> None:
    env = light_env
    with httpx.Client(timeout=10) as c:
        for side in ("source", "target"):
            r = c.post(env.envoy.probe_url + "/v1/generate", json=BODY, headers={"x-gpumigrate-cluster": side})
            assert r.json()["host"] == side and r.headers["x-gpumigrate-upstream"] == side
        # Naming no side, or a side that does not exist, never falls through to the split.
        assert c.post(env.envoy.probe_url + "/v1/generate", json=BODY).status_code == 404
        r = c.post(env.envoy.probe_url + "/v1/generate", json=BODY, headers={"x-gpumigrate-cluster": "other"})
        assert r.status_code == 404
    assert urlsplit(env.envoy.probe_url).hostname == "127.0.0.1"
    good = Prober(env.envoy.probe_url, [BODY], comparator)
    assert good.run_round().passed
    good.stop()
    # Given the client listener by mistake, a prober would compare the source with itself: it refuses.
    wrong = Prober(env.envoy.url, [BODY], comparator)
    report = wrong.run_round()
    wrong.stop()
    assert not report.passed
    assert any("probe listener" in f for f in report.failures), report.failures

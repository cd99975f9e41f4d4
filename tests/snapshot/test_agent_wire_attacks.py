"""Attacks on a running workload's agent (a user's own service, tests/agent/kv_service.py, in its own process),
by someone who holds no key but can reach its port and watch the orchestrator's traffic:

* a request captured before the workload restarted (same port, same agent id, same key) is void after it;
* malformed lines (deep nesting, a 5,000-digit integer, NUL bytes, invalid UTF-8, an overlong line) each get a
  typed refusal, never a traceback in the workload's log, and 50,000 junk lines grow that log by a few lines.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gpumigrate import control
from gpumigrate.snapshot.client import AgentClient
from tests.support.relay import Relay, send_lines

REPO = Path(__file__).resolve().parents[2]
KV = REPO / "tests" / "agent" / "kv_service.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Workload:
    env: dict[str, str]
    agent: str
    endpoint: str
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        fh = open(self.log, "ab")  # noqa: SIM115 - the child's; closed with this process
        self.proc = subprocess.Popen(
            [sys.executable, str(KV)], env=self.env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.log.read_text(errors="replace")[-2000:]
            assert time.monotonic() < deadline, "the service did not answer /readyz within 120 s"
            try:
                if httpx.get(self.endpoint + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(timeout=30)

    def client(self) -> AgentClient:
        return AgentClient(self.agent, key_ref={"file": str(Path(self.env["GPUMIGRATE_HOME"]) / "control.key")})

    def refused(self) -> int:
        with self.client() as c:
            info = c.request_info()
        assert info.frozen is False
        return int(info.auth["refused"])


def _workload(home: Path) -> Workload:
    port, agent = _free_port(), f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "PORT": str(port), "GPUMIGRATE_AGENT_ADDR": agent, "GPUMIGRATE_AGENT_ID": "kv-service"}
    env["GPUMIGRATE_HOME"] = str(home)
    env.pop("GPUMIGRATE_AWAIT_RESTORE", None)
    w = Workload(env, agent, f"http://127.0.0.1:{port}", home / "service.log")
    w.start()
    return w


@pytest.fixture
def workload(tmp_path: Path) -> Iterator[Workload]:
    w = _workload(tmp_path)
    yield w
    w.stop()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workload]:
    """One service for the attacks that leave it running as it was."""
    w = _workload(tmp_path_factory.mktemp("shared"))
    yield w
    w.stop()


def test_a_request_captured_before_a_restart_is_void_after_it(workload: Workload) -> None:
    relay = Relay(workload.agent)
    key_ref = {"file": str(Path(workload.env["GPUMIGRATE_HOME"]) / "control.key")}
    try:
        with AgentClient(relay.address, key_ref=key_ref) as orchestrator:
            orchestrator.request_freeze(lease_s=30)
            orchestrator.request_resume()
    finally:
        relay.close()
    (freeze,) = relay.requests("freeze")
    workload.stop()
    workload.start()  # the same port, agent id and key: only its epoch is new
    (reply,) = send_lines(workload.agent, freeze)
    assert reply["ok"] is False and reply["error"]["type"] == "AuthError", reply
    assert "earlier start of this server" in reply["error"]["message"]
    with workload.client() as c:
        info = c.request_info()
    assert info.frozen is False and info.auth["agent"] == "kv-service" and info.auth["refused"] == 1


MALFORMED = {
    "deep nesting": b"[" * 100_000 + b"\n",
    "a 5,000-digit integer": b'{"id": ' + b"9" * 5000 + b', "cmd": "ping"}\n',
    "NUL bytes": b'{"id": 1, "cmd": "pi\x00ng"}\n',
    "invalid UTF-8": b'{"id": 1, "cmd": "\xff\xfe"}\n',
    "a NaN timestamp": b'{"id": 1, "cmd": "freeze", "auth": {"v": 1, "ts": NaN, "nonce": "'
    + b"a" * 32
    + b'", "mac": "x"}}\n',
    "deep arguments": b'{"id": 1, "cmd": "freeze", "args": ' + b'{"a": ' * 60 + b"1" + b"}" * 60 + b"}\n",
}


def test_every_malformed_line_gets_a_typed_refusal_and_no_traceback(shared: Workload) -> None:
    workload, refused = shared, shared.refused()
    for what, line in MALFORMED.items():
        (reply,) = send_lines(workload.agent, line)
        assert reply["ok"] is False and reply["error"]["type"] in ("MalformedRequest", "AuthError"), (what, reply)
        assert "auth" not in reply, what
    # A line past 1 MiB: refused, then the connection is closed (the rest would read as more lines).
    with socket.create_connection(workload.agent.rsplit(":", 1), timeout=30) as s:  # type: ignore[arg-type]
        s.sendall(b'{"x": "' + b"a" * (2 << 20) + b'"}\n')
        data = s.makefile("rb").read()
    assert b"MalformedRequest" in data and b"longer than 1 MiB" in data and data.count(b"\n") == 1
    assert workload.refused() == refused + len(MALFORMED) + 1
    assert httpx.post(workload.endpoint + "/v1/predict", json={"x": [0.0] * 16}, timeout=10).status_code == 200
    assert "Traceback" not in workload.log.read_text(errors="replace")


def test_junk_at_full_speed_is_counted_and_the_log_stays_small(shared: Workload) -> None:
    workload, refused = shared, shared.refused()
    before, started = workload.log.stat().st_size, time.monotonic()
    lines = 50_000
    host, port = workload.agent.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as s:
        writer = threading.Thread(target=lambda: s.sendall(b"junk\n" * lines), daemon=True)
        writer.start()
        answers = 0
        with s.makefile("rb") as f:
            while answers < lines and f.readline():
                answers += 1
        writer.join(30)
    assert answers == lines  # every junk line answered (typed), none dropped
    assert workload.refused() == refused + lines
    grown = workload.log.read_text(errors="replace")[before:]
    limit = control.RefusalLog(logging.getLogger())
    windows = (time.monotonic() - started) / limit.window_s + 2  # the one open before, each begun since
    assert grown.count("\n") <= windows * (limit.burst + 1), grown[-3000:]  # a few lines per window, the rest counted
    assert "more refusals were not logged" in grown or grown.count("\n") <= limit.burst
    assert "Traceback" not in grown

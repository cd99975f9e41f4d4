"""The scenario of ``gpumigrate migrate`` told to stop (flows/stopping.py), shared by ``tests/flows/test_stop_signals.py``
(which asserts what must hold) and ``bench/stop.py`` (which measures how long the exit took): a user's own service
behind a real front door, Prefect's own ephemeral API (no PREFECT_API_URL), the real CLI in its own session,
SIGTERM to its whole process group (as `timeout`, a systemd stop or a CI cancel send it) once a phase runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from gpumigrate.traffic.envoy import free_port

REPO = Path(__file__).resolve().parents[2]
_EXE = Path(sys.executable).parent / "gpumigrate"
CLI = [str(_EXE)] if _EXE.exists() else [sys.executable, "-m", "gpumigrate"]  # the real CLI, as a user runs it
KV = REPO / "tests" / "agent" / "kv_service.py"
X = [0.1 * i for i in range(16)]
EXITS_WITHIN_S = 60.0  # "it exits" on a loaded machine; the promise (10 s) is measured in bench/stop.py
# A target that answers its health path but never starts an agent: the snapshot phase waits for it.
NO_AGENT = (
    "import http.server, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
    "    def log_message(self, *a): pass\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
)


@dataclass
class Source:
    home: Path
    env: dict[str, str]
    endpoint: str
    agent: str
    key_file: Path
    proc: subprocess.Popen[bytes]


def gm(cli: list[str], env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cli, *args], env=env, capture_output=True, text=True, timeout=600)


@contextlib.contextmanager
def running_source(home: Path) -> Iterator[Source]:
    """A user's own service (tests/agent/kv_service.py) with its agent, behind a real front door, in ``home``."""
    cli = CLI
    home.mkdir(parents=True, exist_ok=True)
    # Prefect's ephemeral API, started by each `migrate` in its own process group (PREFECT_API_URL empty).
    env = {**os.environ, "GPUMIGRATE_HOME": str(home), "PREFECT_API_URL": ""}
    env.pop("GPUMIGRATE_AWAIT_RESTORE", None)
    key_file = home / "image.key"
    assert gm(cli, env, "image", "keygen", "--out", str(key_file)).returncode == 0
    port, agent = free_port(), f"127.0.0.1:{free_port()}"
    with open(home / "source.log", "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, str(KV)], env={**env, "PORT": str(port), "GPUMIGRATE_AGENT_ADDR": agent},
            stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the source did not answer /readyz in 120 s"
            try:
                if httpx.get(endpoint + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        up = gm(cli, env, "frontdoor", "up", "--source", endpoint, "--workload", "kv", "--listen", "127.0.0.1:0")
        assert up.returncode == 0, up.stderr
        yield Source(home, env, endpoint, agent, key_file, proc)
    finally:
        gm(cli, env, "frontdoor", "down", "--workload", "kv")
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def plan(src: Source, path: Path, *, launch: list[str], hold_s: float = 1.0) -> Path:
    golden = path.parent / "golden.jsonl"
    golden.write_text("".join(json.dumps({"id": f"c{i}", "x": [v + i for v in X]}) + "\n" for i in range(2)))
    doc: dict[str, Any] = {
        "version": 1,
        "workload": {
            "name": "kv",
            "kind": "inference",
            "source_host": "local-a",
            "endpoint": src.endpoint,
            "agent": src.agent,
            "launch": {"argv": launch, "env": {"PORT": "{service_port}"}, "ready_timeout_s": 600},
        },
        "target": {"provider": "local", "region": "local-b", "host": f"stop-{path.stem}"},
        "data": {"classification": "internal", "allowed_jurisdictions": ["LOCAL"]},
        "snapshot": {"precopy_rounds": 1},
        "transfer": {"store": "file://store", "encryption_key": {"file": str(src.key_file)}},
        "parity": {
            "golden_inputs": "golden.jsonl",
            "request": {"path": "/v1/predict", "body": {"x": "{x}"}, "compare": [{"field": "y", "kind": "numeric"}]},
        },
        "traffic": {
            "stages": [{"weight": 10, "hold_s": hold_s}, {"weight": 100, "hold_s": 1}],
            "analysis_interval_s": 0.5,
        },
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


SERVICE = ["{python}", str(KV)]
PHASES = {
    # phase: (the target's launch, what the phase waits on when the signal comes)
    "provision": (["{python}", "-c", "import time; time.sleep(3600)"], "a target that never answers"),
    "snapshot": (["{python}", "-c", NO_AGENT, "{service_port}"], "a target agent that never listens"),
    "ramp": (SERVICE, "the ramp's first stage (held 300 s)"),
}


@dataclass
class Stopped:
    code: int
    seconds: float
    result: dict[str, Any]
    stderr: str


def _state(src: Source, mid: str) -> dict[str, Any]:
    try:
        return dict(json.loads((src.home / "migrations" / mid / "state.json").read_text()))
    except (OSError, ValueError):
        return {}


def run_and_signal(src: Source, plan: Path, mid: str, phase: str, *, signals: int = 1) -> Stopped:
    """Start `gpumigrate migrate` in its own session; once ``phase`` runs, SIGTERM its process group ``signals``
    times; wait for the exit."""
    proc = subprocess.Popen(
        [*CLI, "migrate", str(plan), "--id", mid, "--json"],
        env=src.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while _state(src, mid).get("phases", {}).get(phase, {}).get("status") != "running":
        assert proc.poll() is None, f"migrate ended before {phase} ran: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"phase {phase} did not start within 300 s"
        time.sleep(0.05)
    if phase == "ramp":  # into the first stage: traffic is split when the signal comes
        while not (src.home / "traffic" / "kv" / "lease.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    sent = time.monotonic()
    for _ in range(signals):
        os.killpg(proc.pid, signal.SIGTERM)
        time.sleep(0.2)
    try:
        out, err = proc.communicate(timeout=EXITS_WITHIN_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"migrate did not exit within {EXITS_WITHIN_S:.0f} s of SIGTERM in {phase}: {err[-3000:]}"
        ) from None
    seconds = time.monotonic() - sent
    lines = out.strip().splitlines()
    result = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    return Stopped(proc.returncode, seconds, result, err)


def unharmed(src: Source) -> None:
    """The source serves, is not frozen, no lease of its ran out, no target is left, all traffic goes to it."""
    from gpumigrate.infra import get_provider
    from gpumigrate.snapshot.client import AgentClient
    from gpumigrate.traffic.state import StateStore

    assert httpx.post(src.endpoint + "/v1/predict", json={"x": X}, timeout=10).status_code == 200
    with AgentClient(src.agent, key_ref={"file": str(src.home / "control.key")}, timeout_s=30) as agent:
        info = agent.request_info()
    assert info.frozen is False and info.lease_expiries == 0
    os.environ["GPUMIGRATE_HOME"], home = str(src.home), os.environ.get("GPUMIGRATE_HOME")
    try:
        assert get_provider("local").list_hosts() == []
    finally:
        if home is None:
            os.environ.pop("GPUMIGRATE_HOME")
        else:
            os.environ["GPUMIGRATE_HOME"] = home
    assert StateStore(src.home / "traffic" / "kv").read().weights.get("target", 0.0) == 0.0

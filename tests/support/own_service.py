"""A user's own service (tests/agent/kv_service.py: a small torch model behind Starlette embedding gpumigrate.agent)
as a source the flow tests migrate with `gpumigrate migrate` as a subprocess: the ``source`` fixture, its plan, and
the checks that nothing was harmed (tests/flows/test_own_service.py, test_preflight_source.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gpumigrate.traffic.envoy import free_port

REPO = Path(__file__).resolve().parents[2]
KV = REPO / "tests" / "agent" / "kv_service.py"
X = [0.1 * i for i in range(16)]


@dataclass
class Source:
    home: Path
    env: dict[str, str]
    endpoint: str
    agent: str
    key_file: Path


def gm(cli_cmd: list[str], env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cli_cmd, *args], env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(name="source")
def own_service_source(tmp_path: Path, gm_home: Path, prefect_api: str, cli_cmd: list[str]) -> Iterator[Source]:
    env = {**os.environ, "GPUMIGRATE_HOME": str(gm_home), "PREFECT_API_URL": prefect_api}
    env.pop("GPUMIGRATE_AWAIT_RESTORE", None)
    key_file = tmp_path / "image.key"
    assert gm(cli_cmd, env, "image", "keygen", "--out", str(key_file)).returncode == 0
    port, agent = free_port(), f"127.0.0.1:{free_port()}"
    log = tmp_path / "source.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, str(KV)], env={**env, "PORT": str(port), "GPUMIGRATE_AGENT_ADDR": agent},
            stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
            try:
                if httpx.get(endpoint + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield Source(gm_home, env, endpoint, agent, key_file)
    finally:
        gm(cli_cmd, env, "frontdoor", "down", "--workload", "kv")
        from gpumigrate.infra import get_provider

        provider = get_provider("local")
        for host in provider.list_hosts():
            provider.terminate(host)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def service_plan(src: Source, path: Path, edit: Callable[[dict[str, Any]], None] = lambda doc: None) -> Path:
    golden = path.parent / "golden.jsonl"
    golden.write_text("".join(json.dumps({"id": f"c{i}", "x": [v + i for v in X]}) + "\n" for i in range(3)))
    doc: dict[str, Any] = {
        "version": 1,
        "workload": {
            "name": "kv",
            "kind": "inference",
            "source_host": "local-a",
            "endpoint": src.endpoint,
            "agent": src.agent,
            "launch": {"argv": ["{python}", str(KV)], "env": {"PORT": "{service_port}"}, "ready_timeout_s": 60},
        },
        "target": {"provider": "local", "region": "local-b", "host": "own-bad-b"},
        "data": {"classification": "internal", "allowed_jurisdictions": ["LOCAL"]},
        "snapshot": {"precopy_rounds": 1},
        "transfer": {"store": "file://store", "encryption_key": {"file": str(src.key_file)}, "parallelism": 2},
        "parity": {
            "golden_inputs": "golden.jsonl",
            "request": {"path": "/v1/predict", "body": {"x": "{x}"}, "compare": [{"field": "y", "kind": "numeric"}]},
        },
        "traffic": {"stages": [{"weight": 100, "hold_s": 1}], "analysis_interval_s": 0.5},
    }
    edit(doc)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def migrate(src: Source, cli_cmd: list[str], plan: Path, mid: str) -> tuple[int, dict[str, Any], str]:
    """(exit code, the result JSON, stderr). A refusal (exit 2) shows no traceback at all; a failure after
    the start (1, 3) may show Prefect's log of the failed task, never in the result's error."""
    out = gm(cli_cmd, src.env, "migrate", str(plan), "--id", mid, "--json")
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if lines else {}
    assert "Traceback" not in str(result.get("error")), result
    if out.returncode == 2:
        assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return out.returncode, result, out.stderr


def phase(src: Source, mid: str, name: str) -> str:
    state = json.loads((src.home / "migrations" / mid / "state.json").read_text())
    return str(state["phases"].get(name, {}).get("status", "pending"))


def untouched(src: Source) -> None:
    """The source serves, was never frozen (no freeze, no lease ran out), and no target is left."""
    from gpumigrate.infra import get_provider
    from gpumigrate.snapshot.client import AgentClient

    assert httpx.post(src.endpoint + "/v1/predict", json={"x": X}, timeout=10).status_code == 200
    with AgentClient(src.agent, timeout_s=30) as agent:
        info = agent.request_info()
    assert info.frozen is False and info.lease_expiries == 0
    assert get_provider("local").list_hosts() == []


def door_up(src: Source, cli_cmd: list[str], *, health_path: str = "/readyz") -> None:
    """`gpumigrate frontdoor up` for the source, the door Envoy health-checks on ``health_path``."""
    up = gm(cli_cmd, src.env, "frontdoor", "up", "--source", src.endpoint, "--workload", "kv",
            "--listen", "127.0.0.1:0", "--health-path", health_path)  # fmt: skip
    assert up.returncode == 0, up.stderr

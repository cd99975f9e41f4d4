"""Retiring the source: refused inside the rollback window, then zeroize + verify + audit; no rollback after."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml


@pytest.fixture
def cut_over(gm_home: Path, workload_launch: Callable[..., Any]) -> Iterator[dict[str, Any]]:
    """A migration that cut over, whose source (a real inference server with its agent) is still warm."""
    from gpumigrate.flows.context import RunContext
    from gpumigrate.infra import get_provider
    from gpumigrate.infra.launch import service_url, wait_http
    from gpumigrate.interfaces import HostSpec
    from gpumigrate.state import Migration

    provider = get_provider("local")
    host = provider.wait_ready(provider.provision(HostSpec("retire-src", "local", "local-a"), migration_id="retire"))
    try:
        host = provider.bootstrap(host, workload_launch("inference", "--seed", "0", "--size", "tiny"), timeout_s=120)
        url = service_url(host)
        wait_http(url, path="/readyz", timeout_s=60)
        plan = {
            "version": 1,
            "workload": {
                "name": "tiny-lm",
                "kind": "inference",
                "source_host": "retire-src",
                "endpoint": url,
                "agent": f"{host.address}:{host.ports['agent']}",
                "launch": {"argv": ["{python}", "-m", "gpumigrate.workloads.inference", "--port", "{service_port}"]},
            },
            "target": {"provider": "local", "region": "local-b", "host": "retire-tgt"},
            "data": {"classification": "internal", "allowed_jurisdictions": ["LOCAL"]},
            "transfer": {"store": "file://store"},
        }
        m = Migration.create("m-retire", yaml.safe_dump(plan))
        m.update(status="completed")
        RunContext.load(m.id).update(rollback_deadline=time.time() + 3600)
        yield {"migration": m, "url": url}
    finally:
        provider.terminate(host)


def _events(m: Any) -> list[str]:
    return [r["event"] for r in m.audit.records()]


def test_retire_waits_for_the_window_then_zeroizes(cut_over: dict[str, Any], cli_cmd: list[str], gm_home: Path) -> None:
    from gpumigrate.flows.context import RunContext
    from gpumigrate.flows.rollback import rollback_migration

    m, url = cut_over["migration"], cut_over["url"]
    env = {**os.environ, "GPUMIGRATE_HOME": str(gm_home)}
    before = httpx.get(url + "/v1/info", timeout=10).json()["weights_digest"]

    early = subprocess.run([*cli_cmd, "retire", m.id], capture_output=True, text=True, env=env, timeout=120)
    assert early.returncode == 2, early.stderr
    assert "rollback window" in early.stderr and "Traceback" not in early.stderr
    assert httpx.get(url + "/v1/info", timeout=10).json()["weights_digest"] == before  # untouched

    RunContext.load(m.id).update(rollback_deadline=time.time() - 1)  # the window is over
    done = subprocess.run([*cli_cmd, "retire", m.id, "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["source"] == "retired"
    assert httpx.get(url + "/v1/info", timeout=10).json()["weights_digest"] != before  # zeros now
    ready = httpx.get(url + "/readyz", timeout=10)  # a zeroized source answers nothing, and says why
    assert ready.status_code == 503 and ready.json()["status"] == "retired", ready.text
    t0 = time.monotonic()
    answer = httpx.post(url + "/v1/generate", json={"prompt": "x", "max_new_tokens": 1}, timeout=60)
    assert answer.status_code == 503 and "retired" in answer.text and time.monotonic() - t0 < 5  # at once
    names = _events(m)
    assert "source.zeroized" in names and "source.retired" in names
    zero = next(r for r in m.audit.records() if r["event"] == "source.zeroized")["data"]
    assert zero["verified"] is True and zero["zeroized_bytes"] > 0
    m.verify_audit()

    from gpumigrate.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="zeroized"):
        rollback_migration(m.id, reason="too late")
    again = subprocess.run([*cli_cmd, "retire", m.id], capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 0 and _events(m).count("source.zeroized") == 1  # idempotent


def test_retire_refuses_a_rolled_back_migration(cut_over: dict[str, Any]) -> None:
    from gpumigrate.errors import InvalidInputError
    from gpumigrate.flows.retire import retire_source

    m = cut_over["migration"]
    m.update(status="rolled_back")
    with pytest.raises(InvalidInputError, match="only a migration that cut over"):
        retire_source(m.id, force=True)
    assert "source.zeroized" not in _events(m)

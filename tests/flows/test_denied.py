"""A residency denial stops the migrate flow before anything is provisioned: exit 2, audited."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import yaml


def _migrate(
    cli_cmd: list[str], gm_home: Path, prefect_api: str, tmp_path: Path, plan: dict[str, Any], migration_id: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """`gpumigrate migrate` of ``plan`` (written beside the test) in this state root; its run and environment."""
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    env = {**os.environ, "GPUMIGRATE_HOME": str(gm_home), "PREFECT_API_URL": prefect_api}
    cmd = [*cli_cmd, "migrate", str(path), "--id", migration_id, "--json"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180), env


def _audit(gm_home: Path, migration_id: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (gm_home / "migrations" / migration_id / "audit.jsonl").read_text().splitlines()]


def test_migrate_denied_by_residency_moves_nothing(
    cli_cmd: list[str], gm_home: Path, prefect_api: str, tmp_path: Path
) -> None:
    plan = {
        "workload": {
            "name": "svc",
            "kind": "inference",
            "source_host": "local-a",
            "endpoint": "http://127.0.0.1:9",
            "agent": "127.0.0.1:9",
            "launch": {"argv": ["{python}", "serve.py", "--port", "{service_port}"]},
        },
        "target": {"provider": "local", "region": "local-b", "host": "never-started"},
        "data": {"classification": "restricted", "allowed_jurisdictions": ["EU"]},
        "transfer": {"store": "file://store"},
    }
    out, env = _migrate(cli_cmd, gm_home, prefect_api, tmp_path, plan, "denied-1")
    assert out.returncode == 2, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["status"] == "denied" and "data-residency" in result["error"] and "local-b" in result["error"]
    assert result["phases"]["preflight"]["status"] == "failed" and "provision" not in result["phases"]
    records = _audit(gm_home, "denied-1")
    deny = [r["data"] for r in records if r["event"] == "residency.deny"]
    assert deny and deny[0]["region"] == "local-b" and deny[0]["rule"] == "data-residency"
    assert not list((gm_home / "hosts").glob("*/host.json")) if (gm_home / "hosts").exists() else True
    assert not (tmp_path / "store").exists()  # no byte moved
    # The audit command shows the decision for the residency-denial runbook.
    audit = subprocess.run(
        [*cli_cmd, "audit", "denied-1", "--json"], env=env, capture_output=True, text=True, timeout=60
    )
    assert (
        audit.returncode == 0 and json.loads(audit.stdout.strip().splitlines()[-1])["residency"][0]["verdict"] == "deny"
    )


def test_migrate_with_the_source_not_answering_exits_2_not_rolled_back(
    cli_cmd: list[str], gm_home: Path, prefect_api: str, tmp_path: Path
) -> None:
    """Preflight cannot reach the source (not running, or another control key): nothing moved, so exit 2 and
    status denied, audited like any preflight refusal, naming the source's URL and what to check."""
    dead = "http://127.0.0.1:9"
    plan = {
        "workload": {
            "name": "svc",
            "kind": "training",
            "source_host": "local-a",
            "endpoint": dead,
            "agent": "127.0.0.1:9",
            "launch": {"argv": ["{python}", "train.py"]},
        },
        "target": {"provider": "local", "region": "local-b", "host": "never-started"},
        "data": {"classification": "internal", "allowed_jurisdictions": ["LOCAL"]},
        "transfer": {"store": "file://store"},
    }
    out, _ = _migrate(cli_cmd, gm_home, prefect_api, tmp_path, plan, "nosource-1")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "rolled_back" not in out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["status"] == "denied" and result["rollback"]["triggered"] is not True
    assert result["error"].startswith(f"the source workload svc at {dead} did not answer")
    assert "check that the source is running" in result["error"]
    assert result["phases"]["preflight"]["status"] == "failed" and "provision" not in result["phases"]
    records = _audit(gm_home, "nosource-1")
    events = [r["event"] for r in records]
    assert "migration.denied" in events and "migration.rolled_back" not in events
    assert not (tmp_path / "store").exists()  # no byte moved

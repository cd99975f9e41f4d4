"""`gpumigrate demo` as users run it: a subprocess, the JSON contract on stdout, nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest


def _leftovers(migration_id: str) -> list[str]:
    """Processes still running for this demo (its hosts are named demo-a-/demo-b-<suffix>)."""
    suffix = migration_id.rsplit("-", 1)[-1]
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if f"-{suffix}" in line and "ps -eo" not in line]


def _run_demo(
    cli_cmd: list[str], env: dict[str, str], *args: str, timeout_s: float = 300
) -> tuple[int, dict[str, Any], str]:
    proc = subprocess.run(
        [*cli_cmd, "demo", "--json", "--no-live", *args], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    return proc.returncode, json.loads(lines[-1]), proc.stderr


def test_demo_migrates_to_cutover(cli_cmd: list[str], gm_home: Path, prefect_api: str) -> None:
    env = {**os.environ, "GPUMIGRATE_HOME": str(gm_home), "PREFECT_API_URL": prefect_api}
    code, result, stderr = _run_demo(cli_cmd, env)
    assert code == 0, stderr[-3000:]
    assert result["status"] == "completed" and result["error"] is None
    assert set(result["phases"]) == {
        "preflight",
        "provision",
        "snapshot",
        "transfer",
        "restore",
        "parity",
        "ramp",
        "finalize",
    }
    assert all(p["status"] == "completed" for p in result["phases"].values())
    rq = result["requests"]
    assert rq["total"] > 100 and rq["failed"] == 0 and rq["p50_ms"] > 0 and rq["p99_ms"] >= rq["p50_ms"]
    assert result["downtime_ms"] is not None
    assert result["bytes"]["image"] > 0 and result["bytes"]["sent"] > 0
    assert result["parity"]["passed"] is True and result["parity"]["cases"] > 0
    assert result["rollback"]["triggered"] is False
    assert Path(result["report"]).is_file() and Path(result["chart"]).read_bytes()[:4] == b"\x89PNG"
    assert result["report"] in stderr and result["chart"] in stderr  # says where they are
    mdir = gm_home / "migrations" / result["migration_id"]
    key = mdir / "demo.key"
    assert key.stat().st_mode & 0o777 == 0o600
    secret = key.read_text().strip()
    for path in mdir.rglob("*"):  # the key never lands in state, audit, plan or artifacts
        if path.is_file() and path != key and path.stat().st_size < 5_000_000:
            assert secret not in path.read_text(errors="ignore"), path
    assert secret not in stderr
    assert _leftovers(result["migration_id"]) == []


@pytest.mark.parametrize("fault", ["target-errors"])
def test_demo_fault_rolls_back_on_the_embedded_api(
    cli_cmd: list[str], gm_home: Path, tmp_path: Path, fault: str
) -> None:
    """No PREFECT_API_URL: Prefect's ephemeral API with a fresh project-local home."""
    env = {**os.environ, "GPUMIGRATE_HOME": str(gm_home), "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    code, result, stderr = _run_demo(cli_cmd, env, "--fault", fault)
    assert code == 3, stderr[-3000:]
    assert result["status"] == "rolled_back" and result["rollback"]["triggered"] is True
    assert "gate failed" in result["rollback"]["reason"]
    records = [
        json.loads(x)
        for x in (gm_home / "migrations" / result["migration_id"] / "audit.jsonl").read_text().splitlines()
    ]
    load = next(r["data"] for r in records if r["event"] == "demo.load")
    # The source kept serving: clients see (almost) nothing of the broken target. The traffic layer's
    # own tests hold the tight bound (<= 0.1%); here a busy CI box may add a few timeouts.
    assert result["requests"]["failed"] <= 0.05 * result["requests"]["total"], load
    assert result["phases"]["ramp"]["status"] == "rolled_back"
    audit = [r["event"] for r in records]
    assert "fault.injected" in audit and "rollback.automatic" in audit and "traffic.rolled_back" in audit
    assert (tmp_path / "prefect").is_dir()  # the embedded API kept its files where we said
    assert _leftovers(result["migration_id"]) == []


def test_a_load_generator_that_does_not_finish_leaves_the_outcome_standing(gm_home: Path) -> None:
    """On a machine loaded past its cores, the demo's load generator did not finish within 60 s of its stop; the
    demo then exited 1 ("unexpected RuntimeError: load generator did not finish") for a migration that had rolled
    back (3). Now the lost clients' view is said in the audit, and the result stands (issue 35: the exit code
    matches what happened)."""
    from gpumigrate.flows.demo import _record_load
    from gpumigrate.state import Migration

    class Stuck:
        stopped = False

        def stop(self) -> None:
            self.stopped = True

        def wait(self, timeout_s: float) -> Any:
            raise RuntimeError("load generator did not finish")

    m = Migration.create("demo-stuck-load", "workload: x\n")
    load = Stuck()
    _record_load(m, load)
    audit = [
        json.loads(x) for x in (gm_home / "migrations" / "demo-stuck-load" / "audit.jsonl").read_text().splitlines()
    ]
    event = next(e["data"] for e in audit if e["event"] == "demo.load")
    assert load.stopped and "did not finish within 60 s of its stop" in event["error"]


@pytest.mark.slow
def test_the_llm_demo_moves_the_server_with_its_streams_in_flight(
    cli_cmd: list[str], gm_home: Path, prefect_api: str
) -> None:
    env = {**os.environ, "GPUMIGRATE_HOME": str(gm_home), "PREFECT_API_URL": prefect_api}
    # Two LLM servers started and eight clients streaming all along: minutes on two busy cores.
    code, result, stderr = _run_demo(cli_cmd, env, "--workload", "llm", timeout_s=900)
    assert code == 0, stderr[-3000:]
    assert result["status"] == "completed" and result["error"] is None
    assert result["requests"]["failed"] == 0 and result["requests"]["total"] > 8  # no stream broke or differed
    assert result["streams"]["handed_over"] >= 1  # the clients' streams were in flight at the freeze
    assert result["parity"]["passed"] is True
    mdir = gm_home / "migrations" / result["migration_id"]
    records = [json.loads(line) for line in (mdir / "audit.jsonl").read_text().splitlines()]
    streams = [r["data"] for r in records if r["event"] == "demo.streams"]
    assert streams and streams[-1]["broken"] == 0 and streams[-1]["differ"] == 0
    assert _leftovers(result["migration_id"]) == []

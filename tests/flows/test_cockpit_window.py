"""The rollback control on the migration's own run page, through Prefect's API (the browser test in tests/ui
clicks the same form): after the cut-over the run stays paused through the rollback window, and its Resume
form rolls back; Prefect's Cancel at a pause means roll back too. Each run ends in a state named RolledBack.

The source, its front door and the plan come from test_migrate.py's harness (this module gets its own).
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gpumigrate.traffic.loadgen import LoadProcess

_spec = importlib.util.spec_from_file_location("flows_migrate_harness", Path(__file__).with_name("test_migrate.py"))
assert _spec is not None and _spec.loader is not None
harness = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)
home, source = harness.home, harness.source  # module-scoped fixtures: this module's own source and front door
Source = harness.Source


def _run_in_thread(**kw: Any) -> tuple[threading.Thread, dict[str, Any]]:
    from gpumigrate.flows.migrate import migrate_flow

    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.update(harness.final(migrate_flow(return_state=True, **kw))))
    t.start()
    return t, out


def _wait_for(what: str, check: Any, runner: threading.Thread, out: dict[str, Any], timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert runner.is_alive(), f"the flow ended before {what}: {out}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f}s"
        time.sleep(0.1)


def _latest_artifact(key: str) -> Any:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_latest_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    return found[0] if found else None


def test_roll_back_from_the_run_page_during_the_rollback_window(
    source: Source, prefect_api: str, tmp_path: Path
) -> None:
    from prefect.flow_runs import resume_flow_run

    from gpumigrate.flows.context import RunContext
    from gpumigrate.traffic.state import StateStore

    plan = harness.write_plan(source, tmp_path / "plan.yaml", target="cockpit-tgt-window", window_s=600)
    mid = RunContext.create(plan, migration_id="cockpit-window", resume=False).migration.id
    lp = LoadProcess(source.door.url + "/v1/generate", rps=30, seconds=120, keep_records=True)
    runner, out = _run_in_thread(migration_id=mid, hold_rollback_window=True)
    try:
        _wait_for("the rollback window", lambda: harness.state(source.home, mid).get("window_hold"), runner, out)
        st = harness.state(source.home, mid)
        harness.wait_paused(st["flow_run_id"])
        assert st["status"] == "completed" and StateStore(source.door.state_dir).read().weights["target"] == 100.0
        # The summary on the run's page: the chart inside it as a data URI, the window and how to roll back.
        summary = _latest_artifact(f"summary-{mid}")
        assert "data:image/png;base64," in summary.data and "file://" not in summary.data
        assert "Resume → roll back" in summary.data
        # The clients' figures and where they come from: the front door, for every request after the freeze.
        assert "downtime (client-visible stall)" in summary.data and "through the front door" in summary.data
        target = st["runtime"]["target_endpoint"]
        clicked = time.time()
        resume_flow_run(st["flow_run_id"], run_input={"action": "roll back", "acting_as": "sre-ana", "reason": "p99"})
        runner.join(timeout=120)
    finally:
        lp.stop()
        report = lp.wait(timeout_s=60)
    assert not runner.is_alive()
    assert out["state"] == ("FAILED", "RolledBack"), out
    assert out["status"] == "rolled_back" and out["rollback"]["actor"] == "sre-ana", out["rollback"]
    assert out["rollback"]["trigger"] == "manual" and out["rollback"]["reason"] == "p99"
    # The clients' figures come from the front door, for a migration whose traffic no demo made.
    assert out["requests"]["measured_by"].startswith("the front door's access log"), out["requests"]
    assert out["requests"]["total"] > 0 and out["requests"]["failed"] == 0 and out["downtime_ms"] is not None
    assert StateStore(source.door.state_dir).read().weights["source"] == 100.0
    assert not harness.serves(target) and harness.serves(source.door.url)
    # The clients never noticed the rollback: no request from the answer on failed (this test's subject; what
    # clients saw during the ramp is the front door's figures above).
    failed, total = report.count_between(clicked - (report.started_at or 0), float("inf"))
    assert total > 0 and failed == 0, (failed, total, report.errors)
    records = harness.events(source.home, mid)
    decided = [r for r in records if r["event"] == "rollback.window.decided"]
    assert decided and decided[-1]["actor"] == "sre-ana" and "identity" in decided[-1]  # who said, who Prefect saw
    assert any(r["event"] == "rollback.completed" for r in records)
    assert harness.state(source.home, mid)["status"] == "rolled_back"
    assert "rolled_back" in _latest_artifact(f"summary-{mid}").description  # the page's summary says so too


def test_cancel_at_the_manual_gate_means_roll_back(source: Source, prefect_api: str, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    from gpumigrate.flows.context import RunContext

    plan = harness.write_plan(source, tmp_path / "plan.yaml", target="cockpit-tgt-cancel", manual_gate=True)
    mid = RunContext.create(plan, migration_id="cockpit-cancel", resume=False).migration.id
    runner, out = _run_in_thread(migration_id=mid, gate_timeout_s=120)
    _wait_for("the manual gate", lambda: harness.state(source.home, mid).get("status") == "paused", runner, out)
    st = harness.state(source.home, mid)
    harness.wait_paused(st["flow_run_id"])
    target = st["runtime"]["target_endpoint"]
    with get_client(sync_client=True) as client:  # what Prefect's Cancel button does to the run
        client.set_flow_run_state(st["flow_run_id"], Cancelling(), force=True)
    runner.join(timeout=120)
    assert not runner.is_alive()
    assert out["state"] == ("CANCELLED", "RolledBack"), out
    assert out["status"] == "rolled_back" and out["rollback"]["trigger"] == "cancel", out["rollback"]
    assert harness.state(source.home, mid)["status"] == "rolled_back"
    assert not harness.serves(target) and harness.serves(source.door.url)
    names = [r["event"] for r in harness.events(source.home, mid)]
    assert "rollback.cancel" in names and "rollback.target_torn_down" in names and "traffic.stage" not in names


def test_sigterm_mid_ramp_rolls_back_and_the_source_keeps_serving(
    source: Source, prefect_api: str, cli_cmd: list[str], tmp_path: Path
) -> None:
    """What Prefect's Cancel does to a worker's flow process (SIGTERM), here to the CLI's: roll back, exit 3."""
    import yaml

    from gpumigrate.traffic.state import StateStore

    plan = harness.write_plan(source, tmp_path / "plan.yaml", target="cockpit-tgt-sigterm")
    data = yaml.safe_load(plan.read_text())
    data["traffic"]["stages"] = [{"weight": 25, "hold_s": 60}, {"weight": 100, "hold_s": 1}]
    plan.write_text(yaml.safe_dump(data))
    mid = "cockpit-sigterm"
    lp = LoadProcess(source.door.url + "/v1/generate", rps=30, seconds=120, keep_records=True)
    proc = subprocess.Popen(
        [*cli_cmd, "migrate", str(plan), "--id", mid, "--json"],
        env=harness.cli_env(prefect_api, source.home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not any(r["event"] == "traffic.stage" for r in _records(source.home, mid)):
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stderr.read()[-2000:] if proc.stderr else ""
            )
            time.sleep(0.1)
        target = harness.state(source.home, mid)["runtime"]["target_endpoint"]
        stopped = time.time()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        lp.stop()
        report = lp.wait(timeout_s=60)
    assert proc.returncode == 3, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["status"] == "rolled_back" and result["rollback"]["trigger"] == "cancel", result["rollback"]
    assert harness.state(source.home, mid)["status"] == "rolled_back"
    assert StateStore(source.door.state_dir).read().weights["source"] == 100.0
    assert not harness.serves(target) and harness.serves(source.door.url)
    names = [r["event"] for r in _records(source.home, mid)]
    assert "rollback.cancel" in names and "rollback.target_torn_down" in names
    failed, total = report.count_between(stopped - (report.started_at or 0), float("inf"))
    assert total > 0 and failed == 0, (failed, total, report.errors)


def _records(home: Path, mid: str) -> list[dict[str, Any]]:
    try:
        return harness.events(home, mid)
    except FileNotFoundError:
        return []


def test_the_window_ends_unanswered_then_the_run_retires_the_source(
    source: Source, prefect_api: str, tmp_path: Path
) -> None:
    """Last in this module: retiring zeroizes the module's source."""
    from gpumigrate.flows.context import RunContext

    plan = harness.write_plan(source, tmp_path / "plan.yaml", target="cockpit-tgt-retire", window_s=4)
    mid = RunContext.create(plan, migration_id="cockpit-retire", resume=False).migration.id
    lp = harness.load(source)
    runner, out = _run_in_thread(migration_id=mid, hold_rollback_window=True)
    try:
        runner.join(timeout=300)
    finally:
        lp.stop()
        lp.wait(timeout_s=60)
    assert not runner.is_alive()
    assert out["state"] == ("COMPLETED", "Completed") and out["status"] == "completed", out
    st = harness.state(source.home, mid)
    assert st["runtime"]["source_retired"] and not st.get("window_hold")
    names = [r["event"] for r in harness.events(source.home, mid)]
    assert "rollback.window.decided" in names and "rollback.completed" not in names
    assert harness.serves(source.door.url)  # the clients are on the target now, through the same front door

"""An SRE starts a migration from Prefect's UI and watches it on the run's own page (headless chromium)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpumigrate.traffic.loadgen import LoadProcess

BODY = {"prompt": "hello", "max_new_tokens": 2}


def test_a_migration_started_from_the_ui_shows_its_state_and_report(
    ui: Any, prefect_server: Any, local_source: Any, tmp_path: Path
) -> None:
    plan = local_source.plan(tmp_path / "plan.yaml", target="ui-tgt-1")
    # Clients keep calling through the front door the whole time (a ramp with no traffic is inconclusive).
    load = LoadProcess(local_source.door.url + "/v1/generate", rps=30, seconds=240, body=BODY)
    try:
        run_id = ui.custom_run(
            "migrate/migrate", {"migration_id": "ui-m1", "plan_path": str(plan)}, run_name="ui-migration-1"
        )
        final = ui.wait_for_final_state(run_id, timeout_s=300)
    finally:
        load.stop()
    report = load.wait(60)
    run = prefect_server.flow_run(run_id)
    assert run["parameters"] == {"migration_id": "ui-m1", "plan_path": str(plan), "gate_timeout_s": 3600}
    assert final == run["state"]["name"] == "Completed", run["state"]
    page = ui.page
    assert page.get_by_text("migrate-ui-m1").first.is_visible()  # the flow names its run after the migration
    # The migration's own report is on the run's page: its summary, phases and ramp artifacts.
    ui.open_tab("Artifacts")
    page.get_by_text("summary-ui-m1").first.wait_for(timeout=30_000)
    ui.shot("artifacts")
    for key in ("summary-ui-m1", "phases-ui-m1"):
        assert page.get_by_text(key).first.is_visible(), key
    # What the page says happened, happened: every client request is on the target now, none failed.
    assert local_source.door.envoy.admin.live_weights() == {"target": 10000}
    assert report.failed == 0, report.errors

"""An SRE starts a migration from Prefect's UI, watches it on the run's own page, sees the ramp chart, and rolls
it back from that page (headless chromium; screenshots under build/ui/). How long the click took to put every
request back on the source is written beside the screenshots (rollback.json), never asserted: a test on a shared
machine measures the machine; the rollback's speed is a benchmark's figure."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from gpumigrate.traffic.loadgen import LoadProcess

BODY = {"prompt": "hello", "max_new_tokens": 2}
ROLLBACK_WAIT_S = 60.0  # for every request to be back on the source after the click (a condition, not a figure)


def test_start_from_the_ui_then_roll_back_from_the_run_page(
    ui: Any, prefect_server: Any, local_source: Any, tmp_path: Path
) -> None:
    plan = local_source.plan(tmp_path / "plan.yaml", target="ui-tgt-1", window_s=900)
    admin = local_source.door.envoy.admin
    page = ui.page
    # Clients keep calling through the front door the whole time (a ramp with no traffic is inconclusive).
    load = LoadProcess(local_source.door.url + "/v1/generate", rps=20, seconds=420, body=BODY)
    try:
        run_id = ui.custom_run(
            "migrate/migrate", {"migration_id": "ui-m1", "plan_path": str(plan)}, run_name="ui-migration-1"
        )
        # After the cut-over the run stays on its page, paused through the rollback window.
        ui.wait_for_state(run_id, "Paused", timeout_s=300)
        assert page.get_by_text("migrate-ui-m1").first.is_visible()  # the flow names its run after the migration
        assert admin.live_weights() == {"target": 10000}
        # The chart displays, drawn in the summary and as its own artifact: the browser decoded every image.
        for key in ("summary-ui-m1", "ramp-chart-ui-m1"):
            widths = ui.image_sizes(key)
            assert widths and all(w > 0 for w in widths), (key, widths)
        page.goto(f"{prefect_server.url}/runs/flow-run/{run_id}")
        clicked = ui.resume({"Acting as": "sre-ana", "Reason": "p99 doubled on the target"})  # action: roll back
        deadline = clicked + ROLLBACK_WAIT_S
        while admin.live_weights().get("target"):
            assert time.monotonic() < deadline, f"Envoy still sends traffic to the target {ROLLBACK_WAIT_S:.0f}s after"
            time.sleep(0.02)
        took = time.monotonic() - clicked
        ui.shot("traffic-on-source")
        final = ui.wait_for_final_state(run_id, timeout_s=180)
    finally:
        load.stop()
    report = load.wait()
    (ui.shots / "rollback.json").write_text(
        json.dumps(
            {
                "click_to_source_s": round(took, 3),
                "server_refused_first": ui.resume_refusals,
                "run_submissions_refused": ui.submit_refusals,
            }
        )
    )
    run = prefect_server.flow_run(run_id)
    assert final == run["state"]["name"] == "RolledBack" and run["state"]["type"] == "FAILED", run["state"]
    # The audit names who acted (the form's "acting as") beside the identity the flow's process had.
    audit = prefect_server.gm_home / "migrations" / "ui-m1" / "audit.jsonl"
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    decided = [r for r in records if r["event"] == "rollback.window.decided"]
    assert decided and decided[-1]["actor"] == "sre-ana" and decided[-1]["data"]["via"] == "form"
    assert decided[-1]["identity"]["name"]
    assert report.failed == 0, report.errors  # the clients never noticed: not the ramp, not the rollback

"""What the Prefect UI is told about a migration, without a migration: the run's final state for each
outcome, the chart drawn from a data URI, the figures' provenance in the report."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from gpumigrate.result import MigrationResult, ParitySummary, Requests, RollbackSummary

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (MigrationResult(status="rolled_back", rollback=RollbackSummary(reason="p99")), ("FAILED", "RolledBack")),
        (
            MigrationResult(status="rolled_back", rollback=RollbackSummary(reason="x", trigger="cancel")),
            ("CANCELLED", "RolledBack"),
        ),
        (MigrationResult(status="denied", error="region forbidden"), ("FAILED", "Denied")),
        (MigrationResult(status="failed", error="disk full"), ("FAILED", "Failed")),
    ],
)
def test_every_outcome_but_a_cut_over_ends_in_a_state_that_is_not_completed(
    result: MigrationResult, expected: tuple[str, str]
) -> None:
    from gpumigrate.flows.flowrun import final_state

    state = final_state(result)
    assert (state.type.value, state.name) == expected
    assert MigrationResult.model_validate(state.data) == result  # the result contract rides in the state
    assert result.status != "completed"


def test_a_cut_over_returns_the_plain_result_contract() -> None:
    from gpumigrate.flows.flowrun import final_state

    assert final_state(MigrationResult(status="completed")) == MigrationResult(status="completed").model_dump(
        mode="json"
    )


def test_the_chart_travels_as_a_data_uri_and_the_report_never_links_a_local_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpumigrate.flows.report import chart_data_uri, summary_markdown
    from gpumigrate.state import Migration

    chart = tmp_path / "ramp.png"
    chart.write_bytes(PNG)
    uri = chart_data_uri(chart)
    assert uri is not None and base64.b64decode(uri.removeprefix("data:image/png;base64,")) == PNG
    assert chart_data_uri(tmp_path / "missing.png") is None and chart_data_uri(None) is None

    monkeypatch.setenv("GPUMIGRATE_HOME", str(tmp_path / "home"))  # the audit key lives outside the state dir
    m = Migration.create("cockpit-report", "version: 1\n", root=tmp_path / "state")
    result = MigrationResult(
        migration_id=m.id,
        status="rolled_back",
        requests=Requests(total=120, failed=0, p99_ms=12.5, measured_by="the front door's access log"),
        downtime_ms=0.0,
        rollback=RollbackSummary(triggered=True, reason="p99", trigger="manual", actor="sre-ana"),
        chart=str(chart),
    )
    in_ui = summary_markdown(m, result, chart_src=uri)
    on_disk = summary_markdown(m, result)
    assert f"![traffic ramp]({uri})" in in_ui and "file://" not in in_ui
    assert "![traffic ramp](ramp.png)" in on_disk and "file://" not in on_disk  # beside report.md
    assert "every request through the front door from the first freeze to the end" in in_ui  # what they include
    assert "rolled back by: manual (sre-ana)" in in_ui


def test_the_summary_and_report_leave_out_figures_nobody_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No "p50 None ms" and no "(detected in None s)": a parity or preflight rollback has no detection time."""
    from gpumigrate.cli.live import summary
    from gpumigrate.cli.output import console
    from gpumigrate.flows.report import summary_markdown
    from gpumigrate.state import Migration

    def shown(result: MigrationResult) -> str:
        with console.capture() as cap:
            summary(result)
        return cap.get()

    rolled = MigrationResult(
        migration_id="m-1",
        status="rolled_back",
        requests=Requests(total=10, failed=0, p99_ms=12.5),
        downtime_ms=0.0,
        rollback=RollbackSummary(triggered=True, reason="parity failed", trigger="parity"),
    )
    text = shown(rolled)
    assert "None" not in text and "detected in" not in text
    assert "requests: 10, 0 failed, p99 12.5 ms: every request" in text and "rollback: parity failed" in text
    assert "downtime (client-visible stall): 0 ms, the longest extra wait" in text
    timed = rolled.model_copy(
        update={
            "requests": Requests(total=10, failed=0, p50_ms=3.0, p99_ms=12.5),
            "rollback": RollbackSummary(triggered=True, reason="gate", seconds_to_detect=1.5),
        }
    )
    assert "p50 3 ms, p99 12.5 ms" in shown(timed) and "rollback: gate (detected in 1.5 s)" in shown(timed)
    # Issue 35, finding 9: "detected in 0.9888288960598857 s"; "max abs err None" for a parity with no number.
    odd = rolled.model_copy(
        update={
            "rollback": RollbackSummary(triggered=True, reason="gate", seconds_to_detect=0.9888288960598857),
            "parity": ParitySummary(passed=False, cases=3, max_abs_err=None),
        }
    )
    assert "(detected in 0.989 s)" in shown(odd) and "max abs err" not in shown(odd)

    monkeypatch.setenv("GPUMIGRATE_HOME", str(tmp_path / "home"))
    m = Migration.create("report-none", "version: 1\n", root=tmp_path / "state")
    report = summary_markdown(m, rolled.model_copy(update={"migration_id": m.id}))
    assert "- rollback: triggered True, reason parity failed\n" in report and "detected in" not in report
    assert "detected in 1.5 s" in summary_markdown(m, timed.model_copy(update={"migration_id": m.id}))


def test_streams_in_flight_show_in_the_live_view_the_summary_and_the_artifacts_table() -> None:
    """A streaming workload's intervals (requests in flight per side, inter-token p99) reach the live view, the
    Prefect table and the summary; a workload that does not stream gets none of those lines."""
    from gpumigrate.cli.live import LiveView, summary
    from gpumigrate.cli.output import console
    from gpumigrate.flows.report import stream_rows
    from gpumigrate.result import Streams

    plain = [{"t": 1.0, "weight": 25, "p99_ms": 10.0}]
    assert stream_rows(plain) == []
    sample = {"t": 2.0, "weight": 50, "in_flight": 3, "source_in_flight": 5, "itl_p99_ms": 41.5,
              "source_itl_p99_ms": 40.0, "ttft_p99_ms": 120.0, "p99_ms": 10.0}  # fmt: skip
    (row,) = stream_rows([sample])
    assert row["in_flight"] == 3 and row["source_in_flight"] == 5 and row["itl_p99_ms"] == 41.5
    view = LiveView("m-streams")
    view.on_event("traffic.interval", sample)
    view.on_event("demo.streams", {"in_flight": 8, "completed": 4, "broken": 0, "differ": 0, "max_gap_ms": 220.0})
    with console.capture() as cap:
        console.print(view._render())
    shown = " ".join(cap.get().split())  # as read, whatever width the console wraps at
    assert "in flight target 3 / source 5" in shown and "inter-token p99 target 41.5 ms" in shown
    assert "8 in flight, 4 done, 0 broken, 0 differ; longest gap 220 ms" in shown
    result = MigrationResult(migration_id="m-streams", status="completed", streams=Streams(handed_over=8,
                             handover_ms=310.0, probes={"target": {"ttft_p99_ms": 120.0, "itl_p99_ms": 41.5,
                             "itl_max_ms": 60.0}}))  # fmt: skip
    with console.capture() as cap:
        summary(result)
    said = " ".join(cap.get().split())
    assert "streams: 8 handed over, paused at most 310.0 ms" in said
    assert "target streams: first token p99 120.0 ms, inter-token p99 41.5 ms" in said

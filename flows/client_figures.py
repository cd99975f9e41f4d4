"""What the clients of an inference migration met at the front door: one downtime figure, the same everywhere.

The figure is the client-visible stall (:data:`gpumigrate.traffic.access_log.STALL_DEFINITION`), with the count of
requests from the first freeze to the end (:data:`~gpumigrate.traffic.access_log.REQUESTS_DEFINITION`), both read from
the front door's access log: the result's ``downtime_ms`` and ``requests``, the report, the Prefect artifacts and
``gpumigrate status`` all show these numbers. :func:`mark` notes where each log stands before the snapshot (the
requests before the freeze are the baseline), :func:`record` reads them at the end of the migration (a cut-over, a
rollback). A front door that is not ours (``GPUMIGRATE_ENVOY_ADMIN``) has no log here: then both stay null.
"""

from __future__ import annotations

import time
from typing import Any

from gpumigrate.errors import TrafficError
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit
from gpumigrate.flows.report import merge_result
from gpumigrate.traffic import access_log, frontdoor


def _logs(ctx: RunContext) -> list[str]:
    try:
        return frontdoor.read(ctx.traffic_dir()).access_logs
    except TrafficError:
        return []


def mark(ctx: RunContext) -> None:
    """Where each access log stands now (before the snapshot); kept from a first attempt on a resume."""
    if ctx.plan.workload.kind != "inference" or ctx.runtime.access_marks:
        return
    marks = {path: [m.inode, m.offset] for path in _logs(ctx) for m in [access_log.mark(path)]}
    if marks:
        ctx.update(access_marks=marks)


def record(ctx: RunContext) -> dict[str, Any] | None:
    """The figures from the first freeze to now, into the result and the audit; None where nothing was measured
    (no freeze, a training job, no access log)."""
    rt = ctx.runtime
    if ctx.plan.workload.kind != "inference" or rt.froze_at is None or not rt.access_marks:
        return None
    end = time.time()
    time.sleep(max(0.0, end + 2 * access_log.FLUSH_MS / 1000 - time.time()))  # Envoy writes them this late
    requests = [
        r
        for path, (inode, offset) in rt.access_marks.items()
        for r in access_log.read_since(access_log.Mark(path, inode, offset))
    ]
    found = access_log.figures(requests, froze_at=rt.froze_at, resumed_at=rt.resumed_at, end=end)
    emit(ctx.migration, "traffic.client_figures", {**found, "definition": access_log.STALL_DEFINITION})
    merge_result(
        ctx.migration,
        requests={
            "total": found["requests"],
            "failed": found["failed"],
            "p50_ms": found["p50_ms"],
            "p99_ms": found["p99_ms"],
            "measured_by": f"the front door's access log: {access_log.REQUESTS_DEFINITION}",
        },
        downtime_ms=found["stall_ms"],
    )
    return found

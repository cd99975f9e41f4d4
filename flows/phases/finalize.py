"""Finalize: keep the source warm through the rollback window, or retire it at once when the window is 0.

Neither happens while the target does not answer: then the migration rolls back (the source is whole).
A training job trains on the target now: its source, still frozen, is parked for as long as a lease goes
(first, so that no failure after it lets the source train beside the target), then its memory is zeroized, and
its process ends once one freeze lease (``snapshot.freeze_lease_s``) ran out, unless ``snapshot.keep_parked_source``.
"""

from __future__ import annotations

import time
from typing import Any

from gpumigrate.errors import RolledBackError
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit
from gpumigrate.flows.freeze_lease import release
from gpumigrate.flows.undo import undo_all
from gpumigrate.infra.launch import answers
from gpumigrate.parity.urls import redact_url
from gpumigrate.snapshot.lease import MAX_LEASE_S

TARGET_CHECKS = 3
TARGET_CHECK_TIMEOUT_S = 2.0


def run(ctx: RunContext) -> dict[str, Any]:
    m, plan = ctx.migration, ctx.plan
    if plan.workload.kind == "training":
        return _park_and_retire(ctx)
    _target_still_serves(ctx)
    window = plan.traffic.rollback_window_s
    deadline = time.time() + window
    ctx.update(rollback_deadline=deadline)
    if window <= 0:
        drained = drain_source(ctx)  # the streams still on the source (its own, and those it relays) end first
        if drained is not None:
            emit(m, "source.drained", drained)
        emit(m, "source.zeroized", ctx.backend().retire())
        ctx.update(source_zeroized=True, source_retired=True)
        return {"source": "zeroized"}
    emit(
        m,
        "source.kept_warm",
        {
            "until": deadline,
            "rollback_window_s": window,
            "note": f"`gpumigrate rollback {m.id}` works until then; "
            f"`gpumigrate retire {m.id}` zeroizes the source after it",
        },
    )
    return {"source": "warm", "rollback_window_s": window}


def drain_source(ctx: RunContext) -> dict[str, Any] | None:
    """Wait (at most ``traffic.drain_s``) until the source serves no work in flight and relays none, where its
    workload reports such work (``SnapshotBackend.work``); ``None`` where it reports none."""
    backend = ctx.backend()
    start = time.monotonic()
    figures = backend.work("source")
    if not figures:
        return None
    while _busy(figures) > 0 and time.monotonic() - start < ctx.plan.traffic.drain_s:
        time.sleep(0.2)
        figures = backend.work("source")
    return {"seconds": round(time.monotonic() - start, 2), "left": _busy(figures)}


def _busy(figures: dict[str, Any]) -> int:
    """Work in flight on a side: served there, or relayed from elsewhere to its clients."""
    return int(figures.get("in_flight") or 0) + int(figures.get("relayed") or 0)


def _park_and_retire(ctx: RunContext) -> dict[str, Any]:
    """The job trains on the target: the source is parked (never resumed), then its memory zeroized; then, unless
    the plan keeps it (``snapshot.keep_parked_source``), its process ends once one more freeze lease ran out."""
    m, plan = ctx.migration, ctx.plan
    backend = ctx.backend()
    backend.renew(MAX_LEASE_S)  # first: parked for as long as a lease goes, whatever fails below
    kept = release(ctx)
    emit(m, "source.parked", {"lease_renewals": kept.get("renewals"), "parked_s": MAX_LEASE_S})
    emit(m, "source.zeroized", backend.retire())  # retired: a parked step ends the process when the lease runs out
    ctx.update(source_zeroized=True, source_retired=True, rollback_deadline=time.time())
    if plan.snapshot.keep_parked_source:
        emit(m, "source.kept_parked", {"note": "snapshot.keep_parked_source: stop the source process yourself"})
        return {"source": "zeroized", "parked_s": MAX_LEASE_S}
    lease = plan.snapshot.freeze_lease_s
    backend.renew(lease)
    emit(m, "source.ends", {"in_s": lease, "note": "the source process ends when its freeze lease runs out"})
    return {"source": "zeroized", "source_process_ends_in_s": lease}


def target_answers(ctx: RunContext) -> bool:
    """Whether the target answers its health path (True where there is no endpoint to ask: training).
    Asked a few times: one slow answer on a loaded host is not a dead target."""
    plan, rt = ctx.plan, ctx.runtime
    if plan.workload.kind != "inference" or not rt.target_endpoint:
        return True
    url = ctx.target_endpoint()
    return answers(url, path=plan.workload.health_path, timeout_s=TARGET_CHECK_TIMEOUT_S, tries=TARGET_CHECKS)


def _target_still_serves(ctx: RunContext) -> None:
    """The target carries all traffic now; if it has died since the ramp, retiring the source would
    leave nothing serving (the fault matrix found this: the flow said "completed" while clients failed).
    The source is still whole here, so a dead target means the whole rollback, not a retirement."""
    if target_answers(ctx):
        return
    url = redact_url(ctx.target_endpoint())
    reason = f"the target ({url}) stopped answering after the cut-over, before the source was retired"
    emit(ctx.migration, "finalize.target_lost", {"target": url})
    undo_all(ctx, reason=reason)
    raise RolledBackError(reason)

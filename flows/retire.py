"""Retire the source after a cut-over has held through its rollback window: wipe (or stop) it, verify, record.

Nothing on the source is destroyed while a rollback may still need it: before the deadline that
``finalize`` recorded, retiring is refused unless forced. The snapshot backend does the retiring:
the agent overwrites every tracked tensor with zeros and reads it back; a host-level backend stops
the source process. The record goes to the audit log. Idempotent.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from gpumigrate.errors import InvalidInputError
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit
from gpumigrate.flows.phases.finalize import target_answers


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat(timespec="seconds")


def retire_source(migration_id: str, *, force: bool = False, actor: str | None = None) -> dict[str, Any]:
    """Retire the source once the rollback window is over (or ``force``)."""
    ctx = RunContext.load(migration_id)
    m, rt = ctx.migration, ctx.runtime
    status = m.read().get("status")
    if rt.source_retired:
        return {"migration_id": m.id, "source": "retired", "how": "already retired", "exit_code": 0}
    if status != "completed":
        raise InvalidInputError(
            f"migration {m.id} is {status!r}: only a migration that cut over can retire its source "
            "(a rolled-back or failed migration keeps serving from the source)"
        )
    deadline = rt.rollback_deadline
    now = time.time()
    if deadline is not None and now < deadline and not force:
        raise InvalidInputError(
            f"the rollback window of migration {m.id} is open until {_iso(deadline)} "
            f"({deadline - now:.0f}s left): the source must stay warm until then; use --force to retire now"
        )
    if not rt.source_zeroized and not target_answers(ctx):
        raise InvalidInputError(
            f"the target of migration {m.id} does not answer: retiring the source would leave nothing serving; "
            f"roll back instead (`gpumigrate rollback {m.id}`)"
        )
    if not rt.source_zeroized:
        emit(m, "source.zeroized", ctx.backend().retire(), actor=actor)
        ctx.update(source_zeroized=True)
    ctx.update(source_retired=True)
    emit(m, "source.retired", {"forced": bool(force and deadline is not None and now < deadline)}, actor=actor)
    return {"migration_id": m.id, "source": "retired", "how": "zeroized and verified", "exit_code": 0}

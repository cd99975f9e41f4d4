"""Retire the source after a cut-over has held through its rollback window: zeroize, verify, record.

Nothing on the source is destroyed while a rollback may still need it: before the deadline that
``finalize`` recorded, retiring is refused unless forced. Zeroizing goes through the source's
agent, which overwrites every tracked tensor with zeros and reads it back; the record (what was
cleared, how many bytes, verified or not) goes to the audit log. Idempotent.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from gpumigrate.errors import InvalidInputError, SnapshotError
from gpumigrate.flows import wiring
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat(timespec="seconds")


def retire_source(migration_id: str, *, force: bool = False, actor: str | None = None) -> dict[str, Any]:
    """Zeroize the source's tracked GPU/CPU state once the rollback window is over (or ``force``)."""
    ctx = RunContext.load(migration_id)
    m, plan = ctx.migration, ctx.plan
    status = m.read().get("status")
    if ctx.get("source_retired"):
        return {"migration_id": m.id, "source": "retired", "how": "already retired", "exit_code": 0}
    if status != "completed":
        raise InvalidInputError(
            f"migration {m.id} is {status!r}: only a migration that cut over can retire its source "
            "(a rolled-back or failed migration keeps serving from the source)"
        )
    deadline = ctx.get("rollback_deadline")
    now = time.time()
    if deadline is not None and now < deadline and not force:
        raise InvalidInputError(
            f"the rollback window of migration {m.id} is open until {_iso(deadline)} "
            f"({deadline - now:.0f}s left): the source must stay warm until then; use --force to retire now"
        )
    if ctx.get("source_zeroized"):
        record: dict[str, Any] = {"already": True}
    else:
        record = wiring.agent(plan.workload.agent, "source").zeroize()
        if record.get("verified") is False:
            raise SnapshotError(f"zeroize of the source of {m.id} could not be verified: {record}")
        emit(
            m,
            "source.zeroized",
            {k: v for k, v in record.items() if isinstance(v, (str, int, float, bool))},
            actor=actor,
        )
        ctx.put(source_zeroized=True)
    ctx.put(source_retired=True)
    emit(m, "source.retired", {"forced": bool(force and deadline is not None and now < deadline)}, actor=actor)
    return {"migration_id": m.id, "source": "retired", "how": "zeroized and verified", "exit_code": 0}

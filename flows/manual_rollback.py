"""A rollback, acted on at once from whichever process asks for it: the ``gpumigrate rollback`` command, the
``rollback`` deployment's flow (flows/rollback.py), the run page's form. No Prefect here: the command acts before
anything slow loads (the CLI's rollback reaches 100% of traffic on the source within about two seconds).

Traffic first, in this process: 100% to the source in one update of the front door's state, which the running
migrate flow's ramp controller also obeys (it cannot set a weight while the state says rolled back); every Envoy
runs it before this returns. Then the rest of the undo in order (target torn down, source resumed): by the migrate
flow where one still acts on the migration (it sees the request within a fraction of a second when paused, within
one analysis interval while ramping), else here.
"""

from __future__ import annotations

import os
import time
from typing import Any
from uuid import UUID

from gpumigrate.errors import EXIT_FAILURE, EXIT_OK, InvalidInputError
from gpumigrate.flows import client_figures
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit
from gpumigrate.flows.report import merge_result, write_outputs
from gpumigrate.flows.undo import (
    applied_everywhere,
    quietly,
    rolled_back_or_not,
    source_lost_target_serves,
    undo_all,
)
from gpumigrate.result import MigrationResult
from gpumigrate.traffic.frontdoor import traffic_to_source


def _flow_alive(ctx: RunContext) -> bool | None:
    """Is the process running this migration's flow alive? None when it ran on another host (unknown)."""
    rt = ctx.runtime
    if not rt.flow_pid:
        return False
    if rt.flow_host != os.uname().nodename:
        return None
    try:
        os.kill(rt.flow_pid, 0)
    except (ProcessLookupError, PermissionError, ValueError):
        return False
    return True


def _answer_pause(flow_run_id: str | None, reason: str, actor: str | None) -> None:
    """Answer the form of a flow paused on its run page (the gate, the rollback window) with "roll back":
    a flow on another host may not see this host's request file."""
    if not flow_run_id:
        return
    try:
        from prefect.flow_runs import resume_flow_run

        from gpumigrate.settings import identity

        answer = {"action": "roll back", "acting_as": (actor or identity().name)[:200], "reason": reason[:300]}
        resume_flow_run(UUID(flow_run_id), run_input=answer)
    except Exception:  # not paused any more, or another API: the request file still stands
        pass


def roll_back_here(ctx: RunContext, *, reason: str, actor: str | None, trigger: str, after: str) -> MigrationResult:
    """Undo in this process, in order (traffic first), and record the outcome: status, result, audit, report."""
    m = ctx.migration
    undo_all(ctx, reason=reason)
    quietly("client figures", lambda: client_figures.record(ctx))  # the migration ends here: figures to now
    status, error = rolled_back_or_not(ctx, "rolled_back", f"rolled back: {reason}")
    m.update(status=status)
    merge_result(m, rollback={"triggered": True, "reason": reason[:300], "trigger": trigger, "actor": actor})
    if status == "rolled_back":
        emit(m, "rollback.completed", {"reason": reason[:300], "after": after, "trigger": trigger}, actor=actor)
    else:  # refused, or a step did not take effect: the audit says so, not "completed"
        emit(m, "rollback.incomplete", {"reason": reason[:300], "after": after, "error": error[:500]}, actor=actor)
    return write_outputs(m, status=status, error=error)


def rollback_migration(
    migration_id: str, *, reason: str, actor: str | None = None, wait_s: float | None = None
) -> dict[str, Any]:
    """Roll a migration back. Idempotent. Returns ``{"status", "how", "exit_code", ...}``."""
    ctx = RunContext.load(migration_id)
    m, plan = ctx.migration, ctx.plan
    status = m.read().get("status")
    if status == "rolled_back":
        return {"migration_id": m.id, "status": "rolled_back", "how": "already rolled back", "exit_code": EXIT_OK}
    if status == "denied":
        return {
            "migration_id": m.id,
            "status": "denied",
            "how": "denied before anything moved: nothing to undo",
            "exit_code": EXIT_OK,
        }
    if status == "completed" and ctx.runtime.source_zeroized:
        raise InvalidInputError(
            f"migration {m.id} cut over and its source was zeroized (retired): there is nothing to roll back to; "
            "migrate back with a new plan instead"
        )
    if status == "completed":
        deadline = ctx.runtime.rollback_deadline
        if deadline is not None and time.time() > deadline:
            raise InvalidInputError(
                f"migration {m.id} cut over and its rollback window ({plan.traffic.rollback_window_s:.0f}s) is over: "
                "the source may be zeroized; migrate back with a new plan instead"
            )
    # The request first (a ramp that sees the traffic back reads it as this request), then the traffic; the audit
    # records both once the traffic moved (proving the actor's identity may take seconds: flows/README.md).
    m.request_rollback(reason, actor=actor, record=False)
    moved = traffic_first(ctx, reason)
    m.record("rollback.requested", {"reason": reason}, actor=actor)
    if moved:
        emit(m, "traffic.rolled_back", {"reason": reason[:300], "weights": moved, "by": "the rollback request"})
    alive = _flow_alive(ctx)
    holding = status == "completed" and bool(m.read().get("window_hold"))  # paused on its page, in the window
    if (status in ("running", "paused") or holding) and alive is not False:
        if status == "paused" or holding:
            _answer_pause(m.read().get("flow_run_id"), reason, actor)
        # The running flow acts on the request within one analysis interval and undoes in order.
        limit = wait_s if wait_s is not None else max(15.0, 5 * plan.traffic.analysis_interval_s)
        deadline_t = time.monotonic() + limit
        while time.monotonic() < deadline_t and _still_acting(m.read()):
            time.sleep(0.1)
        final = m.read().get("status")
        if not _still_acting(m.read()) or alive:
            how = "requested; the running flow rolled back" if final == "rolled_back" else f"requested; flow is {final}"
            return {
                "migration_id": m.id,
                "status": final,
                "how": how,
                "exit_code": EXIT_OK if final == "rolled_back" else EXIT_FAILURE,
            }
        # Its flow ran on another host and did not act within the wait: treat it as gone.
    # No flow is acting on it (it ended, or its process died): undo here, in the same order.
    result = roll_back_here(ctx, reason=reason, actor=actor, trigger="manual", after=str(status))
    done = result.status == "rolled_back"
    return {
        "migration_id": m.id,
        "status": result.status,
        "how": "traffic to source, target torn down" if done else f"not rolled back: {result.error}",
        "exit_code": EXIT_OK if done else EXIT_FAILURE,
    }


def traffic_first(ctx: RunContext, reason: str) -> dict[str, float] | None:
    """All traffic back on the source now, applied by every Envoy, before anything else of the undo: the new
    weights, or None when there was nothing to move. Not where the source is gone while the target serves (the
    undo then keeps both, and says so: flows/undo.py)."""
    if ctx.plan.workload.kind != "inference" or source_lost_target_serves(ctx):
        return None
    weights = traffic_to_source(ctx.traffic_dir(), f"rollback requested: {reason}")
    if weights:
        applied_everywhere(ctx)
        ctx.migration.set_phase("ramp", "rolled_back")
    return weights


def _still_acting(state: dict[str, Any]) -> bool:
    """The flow has not finished acting on the request yet: still running, paused, or holding the window."""
    return state.get("status") in ("running", "paused") or (
        state.get("status") == "completed" and bool(state.get("window_hold"))
    )

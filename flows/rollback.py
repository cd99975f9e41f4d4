"""The rollback button: one path for ``gpumigrate rollback``, the ``rollback`` deployment and the gate.

While the migrate flow runs, a rollback is a request (``Migration.request_rollback``) that the ramp
controller polls every analysis interval; the flow's transaction hooks then undo in order. After the
flow ended, inside the rollback window, this module does the undo itself: traffic back to the
source in one update, then the target torn down, then the source's agent resumed.
"""

from __future__ import annotations

import os
import time
from typing import Any
from uuid import UUID

from prefect import flow

from gpumigrate.errors import EXIT_FAILURE, EXIT_OK, InvalidInputError
from gpumigrate.flows import prefect_env
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit
from gpumigrate.flows.report import merge_result, write_outputs
from gpumigrate.flows.undo import undo_all


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


def _answer_gate(flow_run_id: str | None, reason: str) -> None:
    """A flow paused at the manual gate only listens to its Resume form: answer it with "roll back"."""
    if not flow_run_id:
        return
    try:
        from prefect.flow_runs import resume_flow_run

        resume_flow_run(UUID(flow_run_id), run_input={"action": "roll back", "reason": reason[:300]})
    except Exception:  # not paused any more, or another API: the request file still stands
        pass


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
    m.request_rollback(reason, actor=actor)
    alive = _flow_alive(ctx)
    if status in ("running", "paused") and alive is not False:
        if status == "paused":
            _answer_gate(m.read().get("flow_run_id"), reason)
        # The running flow acts on the request within one analysis interval and undoes in order.
        limit = wait_s if wait_s is not None else max(15.0, 5 * plan.traffic.analysis_interval_s)
        deadline_t = time.monotonic() + limit
        while time.monotonic() < deadline_t and m.read().get("status") in ("running", "paused"):
            time.sleep(0.1)
        final = m.read().get("status")
        if final not in ("running", "paused") or alive:
            how = "requested; the running flow rolled back" if final == "rolled_back" else f"requested; flow is {final}"
            return {
                "migration_id": m.id,
                "status": final,
                "how": how,
                "exit_code": EXIT_OK if final == "rolled_back" else EXIT_FAILURE,
            }
        # Its flow ran on another host and did not act within the wait: treat it as gone.
    # No flow is acting on it (it ended, or its process died): undo here, in the same order.
    undo_all(ctx, reason=reason)
    m.update(status="rolled_back")
    merge_result(m, rollback={"triggered": True, "reason": reason[:300]})
    emit(m, "rollback.completed", {"reason": reason[:300], "after": status}, actor=actor)
    write_outputs(m, status="rolled_back", error=f"rolled back: {reason}")
    return {
        "migration_id": m.id,
        "status": "rolled_back",
        "how": "traffic to source, target torn down",
        "exit_code": EXIT_OK,
    }


@flow(name="rollback", flow_run_name="rollback-{migration_id}", persist_result=False)
def rollback_flow(migration_id: str, reason: str = "rollback requested from the Prefect UI") -> dict[str, Any]:
    """The rollback button: traffic to the source, the target torn down. Same path as the CLI."""
    prefect_env.configure()  # a worker imported this module: no analytics, whatever its environment says
    return rollback_migration(migration_id, reason=reason)

"""The migrate flow: one Prefect flow, one task per phase, undo registered in transactions.

Each task runs one phase module of :mod:`gpumigrate.flows.phases` (plain ``run(ctx)`` functions the
CLI and tests call without Prefect) on the one :class:`RunContext` the flow loaded. A task skips a
phase its state record marks completed (and still valid), so re-running a migration with the same id
resumes. Two transactions carry the undo (:mod:`gpumigrate.flows.undo`):

* the *target* transaction (provision → parity): on failure, the target is torn down and the source
  resumed (it never stays frozen);
* the *traffic* transaction (hold target, ramp): on failure or a rollback request, traffic goes back
  to the source first, then the target is torn down (``on_rollback`` hooks run in reverse order).

The manual gate (``plan.traffic.manual_gate``) pauses between them, never inside a transaction.
Hooks are idempotent and never raise: a hook that raised would stop the hooks after it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from prefect import Task, flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State, TaskRun
from prefect.flow_runs import pause_flow_run
from prefect.transactions import Transaction, transaction
from pydantic import BaseModel

from gpumigrate.errors import (
    DecryptionError,
    GpumigrateError,
    InvalidInputError,
    ParityError,
    PolicyDeniedError,
    RolledBackError,
)
from gpumigrate.flows import prefect_artifacts, prefect_env, training
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit, notify
from gpumigrate.flows.phases import finalize, parity, preflight, provision, ramp, restore, snapshot, transfer
from gpumigrate.flows.report import merge_result, write_outputs
from gpumigrate.flows.undo import undo_all, undo_source, undo_traffic
from gpumigrate.infra.launch import answers
from gpumigrate.result import MigrationResult
from gpumigrate.state import PHASES

Phase = Callable[[RunContext], dict[str, Any]]


def still_valid(ctx: RunContext, name: str) -> bool:
    """A completed phase is skipped on resume unless the world it left is gone (a dead target)."""
    if name in ("provision", "restore"):
        endpoint = ctx.runtime.target_endpoint
        if not endpoint or not answers(endpoint, path=ctx.plan.workload.health_path):
            for later in PHASES[PHASES.index("provision") :]:
                if ctx.migration.phase(later).get("status") == "completed":
                    ctx.migration.set_phase(later, "pending")
            notify(ctx.migration.id, "phase.provision.invalid", {"reason": "target not answering"})
            return False
    return True


def run_phase(ctx: RunContext, name: str, phase: Phase) -> dict[str, Any]:
    """Run one phase unless the state record says it is done and still valid; record the outcome."""
    m = ctx.migration
    done = m.phase(name)
    if done.get("status") in ("completed", "skipped") and still_valid(ctx, name):
        notify(m.id, f"phase.{name}.skipped", done.get("result") or {})
        return dict(done.get("result") or {})
    phase = training.phase_for(ctx, name, phase)  # kind: training has phases of its own (flows/training.py)
    requested = m.rollback_requested()
    if requested and name != "finalize":
        raise RolledBackError(f"rollback requested by {requested.get('actor')}: {requested.get('reason')}")
    notify(m.id, f"phase.{name}.started", {})
    try:
        with m.running_phase(name) as result:
            result.update(phase(ctx))
    except BaseException as exc:
        notify(m.id, f"phase.{name}.failed", {"error": str(exc)[:300]})
        raise
    notify(m.id, f"phase.{name}.completed", result)
    return result


def _transient(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Retry only what a retry can fix: a decision (policy, bad input, wrong key, rollback) stays made."""
    exc = state.data if isinstance(state.data, BaseException) else None
    return not isinstance(exc, (PolicyDeniedError, InvalidInputError, RolledBackError, DecryptionError))


def _task_opts(**kw: Any) -> dict[str, Any]:
    if kw.get("retries"):
        kw["retry_condition_fn"] = _transient
    return {"cache_policy": NO_CACHE, "persist_result": False, **kw}


def _ctx(txn: Transaction) -> RunContext:
    ctx: RunContext = txn.get("ctx")
    return ctx


# Read-only checks: safe to retry.
@task(name="preflight", **_task_opts(retries=1, retry_delay_seconds=1))
def preflight_task(ctx: RunContext) -> dict[str, Any]:
    return run_phase(ctx, "preflight", preflight.run)


# Providers are idempotent per migration id: a retry finds the host already launched.
@task(name="provision", **_task_opts(retries=1, retry_delay_seconds=2))
def provision_task(ctx: RunContext) -> dict[str, Any]:
    return run_phase(ctx, "provision", provision.run)


@provision_task.on_rollback
def _undo_provision(txn: Transaction) -> None:
    undo_all(_ctx(txn), reason=txn.get("reason", "migration failed"))


# Not retried: a retry after freeze would pre-copy a frozen workload. The undo resumes the source.
@task(name="snapshot", **_task_opts())
def snapshot_task(ctx: RunContext) -> dict[str, Any]:
    return run_phase(ctx, "snapshot", snapshot.run)


@snapshot_task.on_rollback
def _undo_snapshot(txn: Transaction) -> None:
    undo_source(_ctx(txn))


# Resumable by design: only chunks missing at the destination move again.
@task(name="transfer", **_task_opts(retries=2, retry_delay_seconds=1))
def transfer_task(ctx: RunContext) -> dict[str, Any]:
    return run_phase(ctx, "transfer", transfer.run)


@task(name="restore", **_task_opts(retries=1, retry_delay_seconds=1))
def restore_task(ctx: RunContext) -> dict[str, Any]:
    return run_phase(ctx, "restore", restore.run)


@task(name="parity", **_task_opts())
def parity_task(ctx: RunContext) -> dict[str, Any]:
    return run_phase(ctx, "parity", parity.run)


@task(name="hold-target", **_task_opts())
def hold_target_task(ctx: RunContext) -> dict[str, Any]:
    """Inside the traffic transaction, so that its undo (tear the target down) runs after traffic's."""
    return {"target": ctx.runtime.target_endpoint}


@hold_target_task.on_rollback
def _undo_hold_target(txn: Transaction) -> None:
    undo_all(_ctx(txn), reason=txn.get("reason", "ramp failed"))


@task(name="ramp", **_task_opts())
def ramp_task(ctx: RunContext) -> dict[str, Any]:
    return run_phase(ctx, "ramp", ramp.run)


@ramp_task.on_rollback
def _undo_ramp(txn: Transaction) -> None:
    undo_traffic(_ctx(txn), reason=txn.get("reason", "ramp failed"))


@task(name="finalize", **_task_opts(retries=1, retry_delay_seconds=1))
def finalize_task(ctx: RunContext) -> dict[str, Any]:
    return run_phase(ctx, "finalize", finalize.run)


class GateDecision(BaseModel):
    """What the operator chooses at the manual gate (the form behind Resume in the Prefect UI)."""

    action: Literal["proceed", "roll back"] = "proceed"
    reason: str = ""


def manual_gate(ctx: RunContext, *, timeout_s: int = 3600) -> GateDecision:
    """Pause before any traffic moves; the operator resumes with proceed or roll back."""
    m = ctx.migration
    emit(m, "traffic.gate.waiting", {"timeout_s": timeout_s})
    m.update(status="paused")
    decision = pause_flow_run(wait_for_input=GateDecision, timeout=timeout_s, poll_interval=1, key=f"gate-{m.id}")
    m.update(status="running")
    emit(m, "traffic.gate.decided", {"action": decision.action, "reason": decision.reason[:300]})
    return decision


def _run_name() -> str:
    from prefect.runtime import flow_run

    params = flow_run.parameters or {}
    return f"migrate-{params.get('migration_id') or Path(params.get('plan_path') or 'plan').stem}"


@flow(name="migrate", flow_run_name=_run_name, log_prints=False, persist_result=False)
def migrate_flow(
    migration_id: str | None = None, plan_path: str | None = None, gate_timeout_s: int = 3600
) -> dict[str, Any]:
    """Move one workload as its plan says. Returns the result contract (gpumigrate.result).

    From the CLI: ``migration_id`` of a created migration. From the deployment (UI, cost-move):
    ``plan_path`` (and optionally an id: an existing id resumes).
    """
    prefect_env.configure()  # a worker imported this module: no analytics, whatever its environment says
    if plan_path:
        ctx = RunContext.create(plan_path, migration_id=migration_id, resume=None)
    elif migration_id:
        ctx = RunContext.load(migration_id)
    else:
        raise InvalidInputError("give migration_id (an existing migration) or plan_path (a new one)")
    return run_flow(ctx, gate_timeout_s=gate_timeout_s).model_dump(mode="json")


def run_flow(ctx: RunContext, *, gate_timeout_s: int) -> MigrationResult:
    """The phases in order inside their two transactions; whatever happens, a result and a safe source."""
    m = ctx.migration
    m.update(status="running", flow_run_id=_flow_run_id())
    # Who runs this migration: the rollback path asks whether this process still acts on requests.
    ctx.update(flow_pid=os.getpid(), flow_host=os.uname().nodename)
    started = time.monotonic()
    status, error = "completed", None
    try:
        preflight_task(ctx)
        with transaction() as txn:
            txn.set("ctx", ctx)
            provision_task(ctx)
            snapshot_task(ctx)
            transfer_task(ctx)
            restore_task(ctx)
            parity_task(ctx)
        if ctx.plan.traffic.manual_gate and m.phase("ramp").get("status") != "completed":
            decision = manual_gate(ctx, timeout_s=gate_timeout_s)
            if decision.action == "roll back":
                m.request_rollback(decision.reason or "rolled back at the manual gate")
                undo_all(ctx, reason="rolled back at the manual gate")
                raise RolledBackError(decision.reason or "rolled back at the manual gate")
        with transaction() as txn:
            txn.set("ctx", ctx)
            hold_target_task(ctx)
            ramp_task(ctx)
        finalize_task(ctx)
    except PolicyDeniedError as exc:
        status, error = ("denied" if m.phase("provision").get("status") == "pending" else "rolled_back"), str(exc)
    except (RolledBackError, ParityError) as exc:
        status, error = "rolled_back", str(exc)
        reason = exc.reason if isinstance(exc, RolledBackError) else str(exc)
        detect = exc.seconds_to_detect if isinstance(exc, RolledBackError) else None
        merge_result(m, rollback={"triggered": True, "reason": reason[:300], "seconds_to_detect": detect})
    except GpumigrateError as exc:
        status, error = "failed", str(exc)
    except Exception as exc:  # a library bug must still leave a result and a safe source
        status, error = "failed", f"unexpected {type(exc).__name__}: {exc}"
        undo_all(ctx, reason=error)
    if status == "completed":
        merge_result(m, rollback={"triggered": False})
    m.update(status=status, seconds=round(time.monotonic() - started, 3))
    emit(m, f"migration.{status}", {"error": (error or "")[:500]} if status != "completed" else {})
    result = write_outputs(m, status=status, error=error)
    prefect_artifacts.publish(m, result)
    try:
        get_run_logger().info("migration %s %s", m.id, status)
    except Exception:
        pass
    return result


def _flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    return str(flow_run.id) if flow_run.id else None

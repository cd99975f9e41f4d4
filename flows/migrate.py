"""The migrate flow: one Prefect flow, one task per phase, undo registered in transactions.

Each task is a thin shell around :mod:`gpumigrate.flows.phases` (plain functions the CLI and tests
call without Prefect). A task skips a phase its state record marks completed (and still valid), so
re-running a migration with the same id resumes. Two transactions carry the undo:

* the *target* transaction (provision → parity): on failure, the target is torn down and the source
  resumed (it never stays frozen);
* the *traffic* transaction (hold target, ramp): on failure or a rollback request, traffic goes back
  to the source first, then the target is torn down (``on_rollback`` hooks run in reverse order).

The manual gate (``plan.traffic.manual_gate``) pauses between them, never inside a transaction.
Hooks are idempotent and never raise: a hook that raised would stop the hooks after it.
"""

from __future__ import annotations

from gpumigrate.flows import prefect_env

prefect_env.configure()

import os  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Literal  # noqa: E402

from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402
from prefect.flow_runs import pause_flow_run  # noqa: E402
from prefect.transactions import Transaction, transaction  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from gpumigrate.errors import (  # noqa: E402
    DecryptionError,
    GpumigrateError,
    InvalidInputError,
    ParityError,
    PolicyDeniedError,
    RolledBackError,
)
from gpumigrate.flows import phases, prefect_artifacts  # noqa: E402
from gpumigrate.flows.context import RunContext  # noqa: E402
from gpumigrate.flows.events import emit, notify  # noqa: E402
from gpumigrate.flows.report import merge_result  # noqa: E402

PhaseFn = Callable[[RunContext], dict[str, Any]]


def run_phase(migration_id: str, name: str, fn: PhaseFn) -> dict[str, Any]:
    """Run one phase unless the state record says it is done and still valid; record the outcome."""
    ctx = RunContext.load(migration_id)
    m = ctx.migration
    done = m.phase(name)
    if done.get("status") in ("completed", "skipped") and phases.still_valid(ctx, name):
        notify(m.id, f"phase.{name}.skipped", done.get("result") or {})
        return done.get("result") or {}
    requested = m.rollback_requested()
    if requested and name != "finalize":
        raise RolledBackError(f"rollback requested by {requested.get('actor')}: {requested.get('reason')}")
    notify(m.id, f"phase.{name}.started", {})
    try:
        with m.running_phase(name) as result:
            result.update(fn(ctx))
    except BaseException as exc:
        notify(m.id, f"phase.{name}.failed", {"error": str(exc)[:300]})
        raise
    notify(m.id, f"phase.{name}.completed", result)
    return result


def _transient(task: Any, task_run: Any, state: Any) -> bool:
    """Retry only what a retry can fix: a decision (policy, bad input, wrong key, rollback) stays made."""
    exc = state.data if isinstance(state.data, BaseException) else None
    return not isinstance(exc, (PolicyDeniedError, InvalidInputError, RolledBackError, DecryptionError))


def _task_opts(**kw: Any) -> dict[str, Any]:
    if kw.get("retries"):
        kw["retry_condition_fn"] = _transient
    return {"cache_policy": NO_CACHE, "persist_result": False, **kw}


# Read-only checks: safe to retry.
@task(name="preflight", **_task_opts(retries=1, retry_delay_seconds=1))
def preflight_task(migration_id: str) -> dict[str, Any]:
    return run_phase(migration_id, "preflight", phases.preflight)


# Providers are idempotent per migration id: a retry finds the host already launched.
@task(name="provision", **_task_opts(retries=1, retry_delay_seconds=2))
def provision_task(migration_id: str) -> dict[str, Any]:
    return run_phase(migration_id, "provision", phases.provision)


@provision_task.on_rollback
def _undo_provision(txn: Transaction) -> None:
    phases.undo_target(txn.get("migration_id"), reason=txn.get("reason", "migration failed"))


# Not retried: a retry after freeze would pre-copy a frozen workload. The undo resumes the source.
@task(name="snapshot", **_task_opts())
def snapshot_task(migration_id: str) -> dict[str, Any]:
    return run_phase(migration_id, "snapshot", phases.snapshot)


@snapshot_task.on_rollback
def _undo_snapshot(txn: Transaction) -> None:
    phases.undo_source(txn.get("migration_id"))


# Resumable by design: only chunks missing at the destination move again.
@task(name="transfer", **_task_opts(retries=2, retry_delay_seconds=1))
def transfer_task(migration_id: str) -> dict[str, Any]:
    return run_phase(migration_id, "transfer", phases.transfer)


@task(name="restore", **_task_opts(retries=1, retry_delay_seconds=1))
def restore_task(migration_id: str) -> dict[str, Any]:
    return run_phase(migration_id, "restore", phases.restore)


@task(name="parity", **_task_opts())
def parity_task(migration_id: str) -> dict[str, Any]:
    return run_phase(migration_id, "parity", phases.parity)


@task(name="hold-target", **_task_opts())
def hold_target_task(migration_id: str) -> dict[str, Any]:
    """Inside the traffic transaction, so that its undo (tear the target down) runs after traffic's."""
    return {"target": RunContext.load(migration_id).get("target_endpoint")}


@hold_target_task.on_rollback
def _undo_hold_target(txn: Transaction) -> None:
    phases.undo_target(txn.get("migration_id"), reason=txn.get("reason", "ramp failed"))


@task(name="ramp", **_task_opts())
def ramp_task(migration_id: str) -> dict[str, Any]:
    return run_phase(migration_id, "ramp", phases.ramp)


@ramp_task.on_rollback
def _undo_ramp(txn: Transaction) -> None:
    phases.undo_traffic(txn.get("migration_id"), reason=txn.get("reason", "ramp failed"))


@task(name="finalize", **_task_opts(retries=1, retry_delay_seconds=1))
def finalize_task(migration_id: str) -> dict[str, Any]:
    return run_phase(migration_id, "finalize", phases.finalize)


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
    if plan_path:
        from gpumigrate.flows.run import create_migration
        from gpumigrate.state import Migration

        exists = bool(migration_id) and Migration(migration_id).exists
        migration_id = create_migration(plan_path, migration_id=migration_id, resume=exists)
    if not migration_id:
        raise InvalidInputError("give migration_id (an existing migration) or plan_path (a new one)")
    ctx = RunContext.load(migration_id)
    m = ctx.migration
    m.update(status="running", flow_run_id=_flow_run_id())
    # Who runs this migration: the rollback path asks whether this process still acts on requests.
    ctx.put(flow_pid=os.getpid(), flow_host=os.uname().nodename)
    started = time.monotonic()
    status, error = "completed", None
    try:
        preflight_task(migration_id)
        with transaction() as txn:
            txn.set("migration_id", migration_id)
            provision_task(migration_id)
            snapshot_task(migration_id)
            transfer_task(migration_id)
            restore_task(migration_id)
            parity_task(migration_id)
        if ctx.plan.traffic.manual_gate and m.phase("ramp").get("status") != "completed":
            decision = manual_gate(ctx, timeout_s=gate_timeout_s)
            if decision.action == "roll back":
                m.request_rollback(decision.reason or "rolled back at the manual gate")
                phases.undo_all(migration_id, reason="rolled back at the manual gate")
                raise RolledBackError(decision.reason or "rolled back at the manual gate")
        with transaction() as txn:
            txn.set("migration_id", migration_id)
            hold_target_task(migration_id)
            ramp_task(migration_id)
        finalize_task(migration_id)
    except PolicyDeniedError as exc:
        status, error = ("denied" if m.phase("provision").get("status") == "pending" else "rolled_back"), str(exc)
    except (RolledBackError, ParityError) as exc:
        status, error = "rolled_back", str(exc)
        reason = exc.reason if isinstance(exc, RolledBackError) else str(exc)
        merge_result(
            m,
            rollback={
                "triggered": True,
                "reason": reason[:300],
                "seconds_to_detect": getattr(exc, "seconds_to_detect", None),
            },
        )
    except GpumigrateError as exc:
        status, error = "failed", str(exc)
    except Exception as exc:  # a library bug must still leave a result and a safe source
        status, error = "failed", f"unexpected {type(exc).__name__}: {exc}"
        phases.undo_all(migration_id, reason=error)
    if status == "completed":
        merge_result(m, rollback={"triggered": False})
    m.update(status=status, seconds=round(time.monotonic() - started, 3))
    if status != "completed":
        emit(m, f"migration.{status}", {"error": (error or "")[:500]})
    else:
        emit(m, "migration.completed", {})
    result = phases.write_outputs(ctx, status=status, error=error)
    prefect_artifacts.publish(ctx, result)
    try:
        get_run_logger().info("migration %s %s", migration_id, status)
    except Exception:
        pass
    return result.model_dump(mode="json")


def _flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    return str(flow_run.id) if flow_run.id else None

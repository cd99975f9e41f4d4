"""The migrate flow: one Prefect flow, one task per phase, undo registered in transactions.

Each task runs one phase module of :mod:`gpumigrate.flows.phases` (plain ``run(ctx)`` functions the
CLI and tests call without Prefect) on the one :class:`RunContext` the flow loaded, whatever the workload's
kind: a training job runs the same phases, which differ where its plan's kind says (no ramp, parity by its
next steps) and through the snapshot backend's methods for safe points. A task skips a
phase its state record marks completed (and still valid), so re-running a migration with the same id
resumes. Two transactions carry the undo (:mod:`gpumigrate.flows.undo`):

* the *target* transaction (provision → parity): on failure, the target is torn down and the source
  resumed (it never stays frozen);
* the *traffic* transaction (hold target, ramp): on failure or a rollback request, traffic goes back
  to the source first, then the target is torn down (``on_rollback`` hooks run in reverse order).

The manual gate (``plan.traffic.manual_gate``) pauses between them, never inside a transaction.
Hooks are idempotent and never raise: a hook that raised would stop the hooks after it.

The run's final state says how it ended (Completed only for a cut-over; RolledBack, Denied otherwise)
and Prefect's Cancel means roll back (:mod:`gpumigrate.flows.flowrun`). A run started from a deployment
stays paused on its page through the rollback window, with the rollback control there
(:mod:`gpumigrate.flows.run_page`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import Task, flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State, TaskRun
from prefect.exceptions import TerminationSignal
from prefect.transactions import Transaction, transaction

from gpumigrate.errors import (
    DecryptionError,
    GpumigrateError,
    InvalidInputError,
    ParityError,
    PolicyDeniedError,
    RolledBackError,
)
from gpumigrate.flows import client_figures, flowrun, prefect_artifacts, run_page
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit, notify
from gpumigrate.flows.phases import finalize, parity, preflight, provision, ramp, restore, snapshot, transfer
from gpumigrate.flows.report import merge_result, write_outputs
from gpumigrate.flows.undo import quietly, rolled_back_or_not, undo_all, undo_source, undo_traffic
from gpumigrate.infra.launch import accepts, answers
from gpumigrate.result import MigrationResult
from gpumigrate.snapshot.errors import TrainingLoopError
from gpumigrate.state import PHASES

Phase = Callable[[RunContext], dict[str, Any]]


def still_valid(ctx: RunContext, name: str) -> bool:
    """A completed phase is skipped on resume unless the world it left is gone (a dead target), or unless it is the
    preflight of a migration that never provisioned its target: time has passed, and the source, its facts, the
    capacity and the store are checked again before anything is launched. Once a target holds the capacity the
    preflight would count it against itself, so from then on it stands."""
    if name == "preflight" and ctx.migration.phase("provision").get("status") != "completed":
        emit(ctx.migration, "phase.preflight.recheck", {"reason": "resumed before a target was provisioned"})
        return False
    if name in ("provision", "restore") and not _target_lives(ctx):
        for later in PHASES[PHASES.index("provision") :]:
            if ctx.migration.phase(later).get("status") == "completed":
                ctx.migration.set_phase(later, "pending")
        notify(ctx.migration.id, "phase.provision.invalid", {"reason": "target not answering"})
        return False
    return True


def not_applicable(ctx: RunContext, name: str) -> str | None:
    """Why a phase does not apply to this migration's workload (it is skipped), or None."""
    if name == "ramp" and ctx.plan.workload.kind == "training":
        return "a training job has no clients to shift"
    return None


def _target_lives(ctx: RunContext) -> bool:
    """The target's workload answers: its health path, or (a workload with no HTTP, a training job) its agent, every
    rank's (a resumed training migration must not provision, snapshot and restore again into a target that already
    trains on)."""
    rt = ctx.runtime
    if rt.target_endpoint:
        return answers(rt.target_endpoint, path=ctx.plan.workload.health_path)
    if not rt.target_agent:
        return False
    host, _, port = rt.target_agent.rpartition(":")
    return all(accepts(host, int(port) + r) for r in range(ctx.plan.workload.ranks))


def run_phase(ctx: RunContext, name: str, phase: Phase) -> dict[str, Any]:
    """Run one phase unless the state record says it is done and still valid; record the outcome."""
    m = ctx.migration
    done = m.phase(name)
    if done.get("status") in ("completed", "skipped") and still_valid(ctx, name):
        notify(m.id, f"phase.{name}.skipped", done.get("result") or {})
        return dict(done.get("result") or {})
    requested = m.rollback_requested()
    if requested and name != "finalize":
        raise RolledBackError(f"rollback requested by {requested.get('actor')}: {requested.get('reason')}")
    why = not_applicable(ctx, name)
    if why is not None:  # shown as skipped, never as a phase that completed in no time
        m.set_phase(name, "skipped", result={"skipped": why})
        m.record(f"phase.{name}.skipped", {"reason": why})
        notify(m.id, f"phase.{name}.skipped", {"reason": why})
        return {"skipped": why}
    notify(m.id, f"phase.{name}.started", {})
    try:
        with m.running_phase(name) as result:
            result.update(flowrun.cancel_means_rollback(lambda: phase(ctx)))
    except flowrun.RunCancelled as exc:
        # Not a failure of the phase but a decision: the undo then gives the Cancel as its reason.
        m.set_phase(name, "rolled_back", result={"error": str(exc)[:500]})
        flowrun.record_cancel(m, exc.reason, where=name)
        notify(m.id, f"phase.{name}.failed", {"error": str(exc)[:300]})
        raise
    except BaseException as exc:
        notify(m.id, f"phase.{name}.failed", {"error": str(exc)[:300]})
        raise
    finally:
        prefect_artifacts.anchor_audit(m)  # the chain's head beside the run, at the end of every phase
    notify(m.id, f"phase.{name}.completed", result)
    return result


def _transient(task: Task[..., Any], task_run: TaskRun, state: State[Any]) -> bool:
    """Retry only what a retry can fix: a decision (policy, bad input, wrong key, rollback) stays made."""
    exc = state.data if isinstance(state.data, BaseException) else None
    return not isinstance(
        exc, (PolicyDeniedError, InvalidInputError, RolledBackError, DecryptionError, TrainingLoopError)
    )


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
    flowrun.surviving_cancel(lambda: undo_all(_ctx(txn), reason=txn.get("reason", "migration failed")))


# Not retried: a retry after freeze would pre-copy a frozen workload. The undo resumes the source.
@task(name="snapshot", **_task_opts())
def snapshot_task(ctx: RunContext) -> dict[str, Any]:
    return run_phase(ctx, "snapshot", snapshot.run)


@snapshot_task.on_rollback
def _undo_snapshot(txn: Transaction) -> None:
    flowrun.surviving_cancel(lambda: undo_source(_ctx(txn)))


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
    flowrun.surviving_cancel(lambda: undo_all(_ctx(txn), reason=txn.get("reason", "ramp failed")))


@task(name="ramp", **_task_opts())
def ramp_task(ctx: RunContext) -> dict[str, Any]:
    return run_phase(ctx, "ramp", ramp.run)


@ramp_task.on_rollback
def _undo_ramp(txn: Transaction) -> None:
    flowrun.surviving_cancel(lambda: undo_traffic(_ctx(txn), reason=txn.get("reason", "ramp failed")))


@task(name="finalize", **_task_opts(retries=1, retry_delay_seconds=1))
def finalize_task(ctx: RunContext) -> dict[str, Any]:
    return run_phase(ctx, "finalize", finalize.run)


def _run_name() -> str:
    from prefect.runtime import flow_run

    params = flow_run.parameters or {}
    return f"migrate-{params.get('migration_id') or Path(params.get('plan_path') or 'plan').stem}"


@flow(name="migrate", flow_run_name=_run_name, log_prints=False, persist_result=False)
def migrate_flow(
    migration_id: str | None = None,
    plan_path: str | None = None,
    gate_timeout_s: int = 3600,
    hold_rollback_window: bool | None = None,
) -> Any:
    """Move one workload as its plan says. The run's final state says how it ended; its data is the result
    contract (gpumigrate.result).

    From the CLI: ``migration_id`` of a created migration. From the deployment (UI, cost-move):
    ``plan_path`` (and optionally an id: an existing id resumes). ``hold_rollback_window``: stay paused on
    the run's page through the plan's rollback window (default: when started from a deployment).
    """
    flowrun.begin()  # a worker imported this module: Prefect's settings, and who the audit's actor is
    if plan_path:
        ctx = RunContext.create(plan_path, migration_id=migration_id, resume=None)
    elif migration_id:
        ctx = RunContext.load(migration_id)
    else:
        raise InvalidInputError("give migration_id (an existing migration) or plan_path (a new one)")
    hold = flowrun.from_deployment() if hold_rollback_window is None else hold_rollback_window
    return flowrun.final_state(run_flow(ctx, gate_timeout_s=gate_timeout_s, hold_window=hold))


def run_flow(ctx: RunContext, *, gate_timeout_s: int, hold_window: bool = False) -> MigrationResult:
    """The phases in order inside their two transactions; whatever happens, a result and a safe source.
    With ``hold_window``, a cut-over then waits on the run's page through the rollback window."""
    m = ctx.migration
    m.update(status="running", flow_run_id=flowrun.run_id(), window_hold=None)
    # Who runs this migration: the rollback path asks whether this process still acts on requests.
    ctx.update(flow_pid=os.getpid(), flow_host=os.uname().nodename)
    started = time.monotonic()
    status, error = _run_phases(ctx, gate_timeout_s=gate_timeout_s)
    if status == "completed":
        merge_result(m, rollback={"triggered": False})
    quietly("client figures", lambda: client_figures.record(ctx))  # the one downtime figure, from the first freeze
    hold = status == "completed" and hold_window and not ctx.runtime.source_retired
    m.update(
        status=status,
        seconds=round(time.monotonic() - started, 3),
        window_hold=run_page.hold_record(ctx) if hold else None,
    )
    emit(m, f"migration.{status}", {"error": (error or "")[:500]} if status != "completed" else {})
    result = write_outputs(m, status=status, error=error)
    prefect_artifacts.publish(m, result)
    if hold:
        result = run_page.hold_rollback_window(ctx)
    prefect_artifacts.anchor_audit(m)
    try:
        get_run_logger().info("migration %s %s", m.id, result.status)
    except Exception:
        pass
    return result


def _run_phases(ctx: RunContext, *, gate_timeout_s: int) -> tuple[str, str | None]:
    """(status, error) once the phases ran as far as they could; every failure leaves the source serving."""
    m = ctx.migration
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
            run_page.manual_gate(ctx, timeout_s=gate_timeout_s)
        with transaction() as txn:
            txn.set("ctx", ctx)
            hold_target_task(ctx)
            ramp_task(ctx)
        finalize_task(ctx)
    except PolicyDeniedError as exc:
        # Denied while nothing was frozen or moved (a placement that found no zone undid its launches): exit 2.
        if m.phase("snapshot").get("status") == "pending":
            return "denied", str(exc)
        return rolled_back_or_not(ctx, "rolled_back", str(exc))
    except (RolledBackError, ParityError) as exc:
        reason = exc.reason if isinstance(exc, RolledBackError) else str(exc)
        detect = exc.seconds_to_detect if isinstance(exc, RolledBackError) else None
        trigger = (
            "cancel" if isinstance(exc, flowrun.RunCancelled) else "parity" if isinstance(exc, ParityError) else None
        )
        requested = m.rollback_requested() or {}
        merge_result(
            m,
            rollback={
                "triggered": True,
                "reason": reason[:300],
                "seconds_to_detect": detect,
                "trigger": trigger,
                "actor": requested.get("actor") if trigger != "cancel" else None,
            },
        )
        return rolled_back_or_not(ctx, "rolled_back", str(exc))
    except TerminationSignal:  # Prefect's Cancel landed outside a phase (between tasks): it still means roll back
        reason = flowrun.stop_reason()
        flowrun.record_cancel(m, reason, where="between phases")
        flowrun.surviving_cancel(lambda: undo_all(ctx, reason=reason))
        merge_result(m, rollback={"triggered": True, "reason": reason[:300], "trigger": "cancel"})
        return rolled_back_or_not(ctx, "rolled_back", f"rolled back: {reason}")
    except InvalidInputError as exc:
        # Bad input found by preflight (a transport that cannot load, a receiver's certificate, a key
        # that cannot be read) is the plan's fault and nothing was launched: exit 2, like a denial. So is a
        # launch contract a started target broke (its health path, infra/launch.py) once that target is gone.
        rt = ctx.runtime
        if m.phase("provision").get("status") == "pending" or (rt.froze_at is None and rt.target_torn_down):
            return "denied", str(exc)
        return _failed(ctx, exc)
    except GpumigrateError as exc:
        return _failed(ctx, exc)
    except Exception as exc:  # a library bug must still leave a result and a safe source
        error = f"unexpected {type(exc).__name__}: {exc}"
        undo_all(ctx, reason=error)
        return "failed", error
    return "completed", None


def _failed(ctx: RunContext, exc: GpumigrateError) -> tuple[str, str]:
    """A phase failed. Once the source had frozen, the transactions' undo put it back (traffic, target torn
    down, source resumed): the migration rolled back, and says why (exit 3, as the source serves again);
    before the freeze, or where the undo could not finish, it failed (exit 1)."""
    rt = ctx.runtime
    if rt.froze_at is None or rt.source_frozen or not rt.target_torn_down:
        return "failed", str(exc)
    merge_result(ctx.migration, rollback={"triggered": True, "reason": str(exc)[:300], "trigger": "error"})
    return rolled_back_or_not(ctx, "rolled_back", f"rolled back: {exc}")

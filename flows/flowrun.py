"""What every gpumigrate flow does first in the process that runs it, what it asks of its own run, and
how the migrate run ends in Prefect's eyes.

A flow run by a Prefect worker never goes through the CLI's entry point: it sets the same things here,
at its start — Prefect's project-local settings, and the hook that names who writes the audit records
(the authenticated identity: AWS STS, a Google account, the Prefect Cloud user; ``$USER`` only where
none is found; gpumigrate/AUDIT.md).

Prefect's **Cancel** means "roll back". It reaches the flow's process as a SIGTERM, which Prefect's
engine raises as ``TerminationSignal`` wherever the flow is: in a phase (``cancel_means_rollback``
turns it into :class:`RunCancelled`, a rollback), at a pause on the run page, or inside an undo, which
``surviving_cancel`` runs to its end. The audit says so (``record_cancel``).

The run's final state (``final_state``) says what happened: Completed after a cut-over, and otherwise a
state that is not COMPLETED, so that the UI and automations keyed on state types see it — Failed named
``RolledBack`` (the source serves, exit 3), Cancelled named ``RolledBack`` after Prefect's Cancel,
Failed named ``Denied`` (nothing moved, exit 2), or Failed. The result contract rides in its data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelled, Failed

from gpumigrate.errors import RolledBackError
from gpumigrate.flows import prefect_env, stopping
from gpumigrate.flows.events import emit
from gpumigrate.result import MigrationResult
from gpumigrate.settings import Identity, set_identity_resolver
from gpumigrate.state import Migration

T = TypeVar("T")


def _authenticated_identity() -> Identity | None:
    from gpumigrate.infra.identity import resolve_identity

    return resolve_identity()


def begin() -> None:
    """At the start of every flow: no analytics, whatever the worker's environment says; the audit's actor; and, in
    the CLI's own run, its handling of SIGTERM and SIGINT back in place of Prefect's (stopping.py)."""
    prefect_env.configure()
    set_identity_resolver(_authenticated_identity)
    stopping.reinstall()


def run_id() -> str | None:
    """This flow run's id (None outside a run)."""
    from prefect.runtime import flow_run

    return str(flow_run.id) if flow_run.id else None


def from_deployment() -> bool:
    """Whether this run was started from a deployment (the UI, a schedule, ``prefect deployment run``):
    then a person watches its page, and it stays there through the rollback window."""
    ctx = FlowRunContext.get()
    return ctx is not None and ctx.flow_run is not None and ctx.flow_run.deployment_id is not None


class RunCancelled(RolledBackError):
    """Prefect's Cancel reached the flow's process (a SIGTERM, raised as ``TerminationSignal``): roll back."""

    trigger = "cancel"


def stop_reason() -> str:
    """Why this flow run's process was told to stop: Prefect's Cancel (which means roll back), or a SIGTERM."""
    stopper = stopping.active()
    if stopper is not None and stopper.signum is not None:  # the CLI's run: a signal, not Prefect (its API may be gone)
        return stopper.reason
    ctx = FlowRunContext.get()
    try:
        if ctx is not None and ctx.flow_run is not None:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(ctx.flow_run.id).state
            if state is not None and (state.is_cancelling() or state.is_cancelled()):
                return "cancelled in Prefect (Cancel means roll back)"
    except Exception:  # the API is gone too: the signal is all we know
        pass
    return "the orchestrator was told to stop (SIGTERM): rolled back to keep the source serving"


def cancel_means_rollback(step: Callable[[], T]) -> T:
    """Run ``step`` (a phase); a Cancel that lands in it becomes a rollback (:class:`RunCancelled`)."""
    try:
        return step()
    except TerminationSignal as exc:
        raise RunCancelled(stop_reason()) from exc


def record_cancel(m: Migration, reason: str, *, where: str) -> None:
    """The audit says what Cancel meant: a rollback request (the undo's reason), and where it landed."""
    m.request_rollback(reason)
    emit(m, "rollback.cancel", {"reason": reason[:300], "during": where})


def surviving_cancel(step: Callable[[], None]) -> None:
    """Run an undo to its end even if Prefect's Cancel lands in it as a SIGTERM: its steps are idempotent,
    so it runs again from the start (Prefect sends one SIGTERM, then waits before it kills)."""
    for _ in range(3):
        try:
            step()
            return
        except TerminationSignal:
            continue


def final_state(result: MigrationResult) -> Any:
    """The migrate run's final state: Completed only for a cut-over (then the plain result contract, which
    Prefect stores as Completed); otherwise a state, with the result contract as its data."""
    data = result.model_dump(mode="json")
    if result.status == "completed":
        return data
    if result.status == "rolled_back":
        message = f"rolled back: {result.rollback.reason or result.error or 'requested'}"[:500]
        if result.rollback.trigger == "cancel":
            return Cancelled(name="RolledBack", message=message, data=data)
        return Failed(name="RolledBack", message=message, data=data)
    if result.status == "denied":
        return Failed(name="Denied", message=(result.error or "denied by policy")[:500], data=data)
    return Failed(message=(result.error or "failed")[:500], data=data)

"""What every gpumigrate flow does first in the process that runs it, and what it asks of its own run.

A flow run by a Prefect worker never goes through the CLI's entry point: it sets the same things here,
at its start — Prefect's project-local settings, and the hook that names who writes the audit records
(the authenticated identity: AWS STS, a Google account, the Prefect Cloud user; ``$USER`` only where
none is found; gpumigrate/AUDIT.md).
"""

from __future__ import annotations

from gpumigrate.flows import prefect_env
from gpumigrate.settings import Identity, set_identity_resolver


def _authenticated_identity() -> Identity | None:
    from gpumigrate.infra.identity import resolve_identity

    return resolve_identity()


def begin() -> None:
    """At the start of every flow: no analytics, whatever the worker's environment says; the audit's actor."""
    prefect_env.configure()
    set_identity_resolver(_authenticated_identity)


def run_id() -> str | None:
    """This flow run's id (None outside a run)."""
    from prefect.runtime import flow_run

    return str(flow_run.id) if flow_run.id else None


def from_deployment() -> bool:
    """Whether this run was started from a deployment (the UI, a schedule, ``prefect deployment run``):
    then a person watches its page, and it stays there through the rollback window."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return ctx is not None and ctx.flow_run is not None and ctx.flow_run.deployment_id is not None

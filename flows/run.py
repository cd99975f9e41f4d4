"""Run the migrate flow in this process (the CLI's and the demo's way), on the embedded default or a server.

Without ``PREFECT_API_URL`` Prefect starts its ephemeral API for this process (project-local
PREFECT_HOME, :mod:`gpumigrate.flows.prefect_env`, configured by the entry point before Prefect loads).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, cast

from gpumigrate.errors import GpumigrateError
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.report import write_outputs
from gpumigrate.flows.undo import undo_all
from gpumigrate.result import MigrationResult

if TYPE_CHECKING:
    from prefect.client.schemas.objects import State


def run_migration(migration_id: str) -> MigrationResult:
    """Run (or resume) the migrate flow and return the result contract.

    If Prefect itself fails (its API down, its database locked), the migration is undone and recorded
    as failed, with the reason: the source is never left frozen or without its traffic.
    """
    from gpumigrate.flows.migrate import migrate_flow

    try:
        # The run's state says how it ended (a rollback is not Completed); the result contract is its data.
        state = cast("State[Any]", migrate_flow(migration_id=migration_id, return_state=True))
        out = state.result(raise_on_failure=False)
        if isinstance(out, BaseException):
            raise out
    except GpumigrateError:
        raise
    except Exception as exc:
        ctx = RunContext.load(migration_id)
        undo_all(ctx, reason=f"orchestrator failed: {exc}")
        ctx.migration.update(status="failed")
        error = f"orchestrator failed: {type(exc).__name__}: {exc}"
        if "ephemeral Prefect API server" in str(exc):  # Prefect's own words say nothing of how long or what to do
            error += (
                f" (waited PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="
                f"{os.environ.get('PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS', '?')}s for its /health; the "
                "first start of a fresh PREFECT_HOME applies its database migrations: run again, raise that setting, "
                "or run `prefect server start` and set PREFECT_API_URL)"
            )
        return write_outputs(ctx.migration, status="failed", error=error)
    return MigrationResult.model_validate(out)

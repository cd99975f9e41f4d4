"""What the CLI calls: run a migration (new or resumed) and roll one back, on the embedded default.

Works with or without a Prefect server: without ``PREFECT_API_URL`` Prefect starts its ephemeral
API for this process (project-local PREFECT_HOME, see :mod:`gpumigrate.flows.prefect_env`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpumigrate.flows import prefect_env
from gpumigrate.result import MigrationResult


def create_migration(
    plan_path: str | Path, *, migration_id: str | None, resume: bool, runtime: dict[str, Any] | None = None
) -> str:
    """Validate the plan and create (or, with ``resume``, reopen) the migration's state record."""
    from gpumigrate.errors import InvalidInputError
    from gpumigrate.flows.context import RunContext
    from gpumigrate.plan import load_plan
    from gpumigrate.state import Migration, new_migration_id

    plan = load_plan(plan_path)  # PlanError (exit 2) before anything is recorded
    if resume:
        if not migration_id:
            raise InvalidInputError("--resume needs --id: the id of the migration to continue")
        m = Migration.open(migration_id)
        status = m.read().get("status")
        if status == "completed":
            return m.id
        if status == "rolled_back" and m.rollback_requested():
            # Resuming a rolled-back migration is a new attempt: the old request must not stop it again.
            m.clear_rollback_request()
            m.record("migration.retry", {"after": "rolled_back"})
    else:
        m = Migration.create(migration_id or new_migration_id(plan.workload.name), Path(plan_path).read_text())
    ctx = RunContext(m, plan)
    ctx.put(plan_dir=str(Path(plan_path).resolve().parent), **(runtime or {}))
    return m.id


def run_migration(migration_id: str) -> MigrationResult:
    """Run (or resume) the migrate flow in this process and return the result contract."""
    prefect_env.configure(quiet_console=True)
    from gpumigrate.errors import GpumigrateError
    from gpumigrate.flows.migrate import migrate_flow

    try:
        out = migrate_flow(migration_id=migration_id)
    except GpumigrateError:
        raise
    except Exception as exc:  # Prefect itself failed (API down, DB locked): say so, keep the source safe
        from gpumigrate.flows import phases
        from gpumigrate.flows.context import RunContext

        phases.undo_all(migration_id, reason=f"orchestrator failed: {exc}")
        ctx = RunContext.load(migration_id)
        ctx.migration.update(status="failed")
        return phases.write_outputs(ctx, status="failed", error=f"orchestrator failed: {type(exc).__name__}: {exc}")
    return MigrationResult.model_validate(out)


def run_migration_cli(plan_path: str | Path, *, migration_id: str | None, resume: bool) -> MigrationResult:
    """``gpumigrate migrate``: a live phase view on stderr while the flow runs."""
    from gpumigrate.flows.events import listening
    from gpumigrate.flows.live import PhaseLines

    mid = create_migration(plan_path, migration_id=migration_id, resume=resume)
    view = PhaseLines(mid)
    with listening(mid, view.on_event):
        result = run_migration(mid)
    view.summary(result)
    return result


def rollback_cli(migration_id: str, *, reason: str) -> dict[str, Any]:
    """``gpumigrate rollback``: through the rollback flow, the same path as the Prefect UI's button."""
    from gpumigrate.state import Migration

    Migration.open(migration_id)  # a wrong id fails fast (exit 2), before Prefect starts
    prefect_env.configure(quiet_console=True)
    from gpumigrate.flows.rollback import rollback_flow

    return rollback_flow(migration_id=migration_id, reason=reason)

"""``gpumigrate migrate|rollback|status|audit``: one migration's life."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.table import Table

from gpumigrate.cli.output import console, emit_json, esc
from gpumigrate.errors import IntegrityError
from gpumigrate.state import Migration


def register(app: typer.Typer) -> None:
    app.command("migrate")(migrate)
    app.command("rollback")(rollback)
    app.command("status")(status)
    app.command("audit")(audit)
    app.command("retire")(retire)


def migrate(
    plan_file: Path = typer.Argument(..., help="Plan file (YAML)."),
    migration_id: str | None = typer.Option(None, "--id", help="Migration id (default: generated)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the migration with this --id where it stopped."),
    json_out: bool = typer.Option(False, "--json", help="Print the result JSON as the last line of stdout."),
) -> None:
    """Run a migration as a Prefect flow (ephemeral API unless PREFECT_API_URL is set)."""
    from prefect.exceptions import TerminationSignal

    from gpumigrate.cli.live import summary, watching
    from gpumigrate.flows import stopping
    from gpumigrate.flows.context import RunContext
    from gpumigrate.flows.run import run_migration
    from gpumigrate.result import MigrationResult

    def show(result: MigrationResult) -> None:
        summary(result)
        if json_out:
            emit_json(result)

    mid = RunContext.create(plan_file, migration_id=migration_id, resume=resume).migration.id
    # SIGTERM / SIGINT: roll back, record, exit within 10 s even if Prefect's API is gone; a second one at once.
    with stopping.on_signals(mid, show) as stop:
        try:
            with watching(mid):
                result = run_migration(mid)
        except TerminationSignal:  # it landed outside the flow's body: the undo and the record, here
            result = stop.settle_here()
        stop.finished(result)
        show(result)
        stop.leave()  # after a signal: now, with the result's code (Prefect's teardown may wait on a dead API)
    raise typer.Exit(result.exit_code)


def rollback(
    migration_id: str = typer.Argument(..., help="Migration id."),
    reason: str = typer.Option("manual rollback requested", "--reason"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Roll a migration back: traffic to the source at once, then the target torn down and the source resumed."""
    Migration.open(migration_id)  # a wrong id fails fast (exit 2)
    from gpumigrate.flows.manual_rollback import rollback_migration

    # The same path as the Prefect UI's button, acted on here and now: no Prefect before the traffic moved.
    outcome = rollback_migration(migration_id, reason=reason)
    console.print(f"migration {migration_id}: [bold]{outcome.get('status')}[/] ({outcome.get('how')})", soft_wrap=True)
    if os.environ.get("PREFECT_API_URL") and not str(outcome.get("how", "")).startswith(("already", "denied")):
        try:  # a server's UI shows it beside the button's runs; what was done is done either way
            from gpumigrate.flows.rollback import rollback_recorded_flow

            rollback_recorded_flow(migration_id=migration_id, outcome=outcome, reason=reason)
        except Exception as exc:
            console.print(f"[yellow]the rollback is done; publishing it to Prefect failed: {esc(str(exc)[:300])}[/]")
    if json_out:
        emit_json(outcome)
    raise typer.Exit(outcome.get("exit_code", 0))


def status(
    migration_id: str = typer.Argument(..., help="Migration id."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Show a migration's phases and result."""
    state = Migration.open(migration_id).read()
    if json_out:
        emit_json(state)
        return
    table = Table(title=f"migration {migration_id}: {state.get('status')}")
    for col in ("phase", "status", "seconds"):
        table.add_column(col)
    from gpumigrate.state import PHASES

    for name in PHASES:
        ph = state.get("phases", {}).get(name, {"status": "pending"})
        table.add_row(
            name, ph.get("status", "pending"), f"{ph['seconds']:.2f}" if ph.get("seconds") is not None else ""
        )
    console.print(table)
    from gpumigrate.flows.report import build_result, figure_lines

    for line in figure_lines(build_result(Migration.open(migration_id))):  # the same figures as the report's
        console.print(line, soft_wrap=True, highlight=False)


LOGS = {"policy": "audit/policy.jsonl", "cost-moves": "audit/cost-moves.jsonl"}


def audit(
    migration_id: str | None = typer.Argument(None, help="Migration id (or --log for a log kept outside migrations)."),
    log: str | None = typer.Option(
        None, "--log", help="Verify a log outside migrations: policy (plan decisions) or cost-moves."
    ),
    accept_legacy: bool = typer.Option(
        False, "--accept-legacy", help="Check format-1 (unkeyed) records as a chain only, with a warning."
    ),
    anchor: list[str] = typer.Option(
        [], "--anchor", help="Also check the heads in this anchor (as in GPUMIGRATE_AUDIT_ANCHORS), e.g. prefect."
    ),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Verify an audit log (MACs, chain, anchored heads) and summarise it. Exit 1 naming the first bad record."""
    from gpumigrate.audit import AuditLog
    from gpumigrate.audit_anchor import anchor_from_url
    from gpumigrate.audit_report import build_report, render_report
    from gpumigrate.errors import InvalidInputError
    from gpumigrate.settings import state_root

    if (migration_id is None) == (log is None):
        raise InvalidInputError("give a migration id, or --log policy|cost-moves (one of them)")
    if log is not None and log not in LOGS:
        raise InvalidInputError(f"--log {log!r} is not a log: choose {' or '.join(LOGS)}")
    extra = [anchor_from_url(url) for url in anchor]
    name = migration_id or str(log)
    try:
        if migration_id is not None:
            migration = Migration.open(migration_id)
            verified = migration.verify_audit(accept_legacy=accept_legacy, extra_anchors=extra)
            report = build_report(migration.audit, verified, migration_id=migration_id, state=migration.read())
        else:
            audit_log = AuditLog(state_root() / LOGS[str(log)])
            verified = audit_log.verify(accept_legacy=accept_legacy, extra_anchors=extra)
            report = build_report(audit_log, verified)
    except IntegrityError as exc:
        if json_out:
            emit_json({"log": name, "chain_verified": False, "error": str(exc)})
        raise
    if json_out:
        emit_json(report)
    else:
        render_report(report, console)


def retire(
    migration_id: str = typer.Argument(..., help="Migration id."),
    force: bool = typer.Option(False, "--force", help="Retire before the rollback window is over."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Zeroize the source once the cut-over held through its rollback window (refused before, unless --force)."""
    from gpumigrate.flows.retire import retire_source

    outcome = retire_source(migration_id, force=force)
    console.print(f"[green]source of {migration_id} retired[/]: {outcome['how']}")
    if json_out:
        emit_json(outcome)

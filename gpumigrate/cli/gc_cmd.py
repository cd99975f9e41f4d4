"""``gpumigrate gc``: remove what migrations left on this machine and no longer need, and say what stays and why."""

from __future__ import annotations

import typer

from gpumigrate.cli.output import console, emit_json


def register(app: typer.Typer) -> None:
    app.command("gc")(gc)


def gc(
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what would be removed; remove nothing."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Remove the files of local hosts that are down (image stores, logs), migrations' scratch and stopped front
    doors' files, unless a running migration or an open rollback window needs them. Audit records stay."""
    from gpumigrate.flows import cleanup
    from gpumigrate.infra.local import LocalProvider

    provider = LocalProvider()
    provider.reap_stale()
    items = cleanup.remove(cleanup.collect(h.name for h in provider.list_hosts()), dry_run=dry_run)
    for item in items:
        console.print(cleanup.describe(item, dry_run=dry_run), soft_wrap=True, highlight=False)
    freed = sum(i.bytes for i in items if i.kept is None)
    console.print(f"{'would free' if dry_run else 'freed'} {freed:,} bytes", highlight=False)
    if json_out:
        emit_json({"dry_run": dry_run, "freed_bytes": freed, "items": [i.to_json() for i in items]})

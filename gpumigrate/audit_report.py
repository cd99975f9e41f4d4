"""What ``gpumigrate audit`` shows: the verified chain summarised for the audit runbook."""

from __future__ import annotations

import datetime as dt
from typing import Any

from rich.console import Console
from rich.table import Table

from gpumigrate.audit import ChainHead
from gpumigrate.state import Migration


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat(timespec="seconds")


def build_report(migration: Migration, head: ChainHead) -> dict[str, Any]:
    records = migration.audit.records()
    state = migration.read()

    def pick(prefix: str) -> list[dict[str, Any]]:
        return [r for r in records if r["event"].startswith(prefix)]

    started = records[0] if records else None
    return {
        "migration_id": migration.id,
        "chain_verified": True,
        "records": head.count,
        "chain_tail_sha256": head.tail,
        "status": state.get("status"),
        "started_by": started["actor"] if started else None,
        "started_at": _iso(started["ts"]) if started else None,
        "residency": [r["data"] for r in pick("residency.")],
        "images": [r["data"] for r in pick("image.")],
        "parity": [r["data"] for r in pick("parity.")],
        "traffic": [{"at": _iso(r["ts"]), "event": r["event"], **r["data"]} for r in pick("traffic.")],
        "rollbacks": [
            {"at": _iso(r["ts"]), "event": r["event"], "actor": r["actor"], **r["data"]} for r in pick("rollback.")
        ],
        "timeline": [{"seq": r["seq"], "at": _iso(r["ts"]), "actor": r["actor"], "event": r["event"]} for r in records],
    }


def render_report(report: dict[str, Any], console: Console) -> None:
    console.print(
        f"[green]audit chain verified[/]: {report['records']} records, tail {report['chain_tail_sha256'][:16]}…  "
        f"status [bold]{report['status']}[/], started by {report['started_by']} at {report['started_at']}"
    )
    table = Table(title="timeline")
    for col in ("#", "at", "actor", "event"):
        table.add_column(col)
    for r in report["timeline"]:
        table.add_row(str(r["seq"]), r["at"], r["actor"], r["event"])
    console.print(table)
    for key in ("residency", "images", "parity", "rollbacks"):
        if report[key]:
            console.print(f"[bold]{key}[/]: {report[key]}")
    render_traffic(report, console)


def render_traffic(report: dict[str, Any], console: Console) -> None:
    """The traffic timeline (stages, cutover, rollbacks) as its own table."""
    rows = report.get("traffic") or []
    if not rows:
        return
    table = Table(title="traffic timeline")
    for col in ("at", "event", "detail"):
        table.add_column(col)
    for r in rows:
        detail = ", ".join(
            f"{k}={v}" for k, v in r.items() if k not in ("at", "event") and not isinstance(v, (dict, list))
        )
        table.add_row(r["at"], r["event"], detail[:120])
    console.print(table)

"""What ``gpumigrate audit`` shows: a verified log summarised for the audit runbook.

Every value here came from a log that anyone could have asked gpumigrate to record (ids, reasons, plan
fields): the console rendering escapes them (``rich`` markup and control characters).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpumigrate.audit import AuditLog, Verification
from gpumigrate.terminal import clean, esc


def _iso(ts: Any) -> str | None:
    try:
        return dt.datetime.fromtimestamp(float(ts), dt.UTC).isoformat(timespec="seconds")
    except (TypeError, ValueError, OverflowError, OSError):
        return None


def _who(record: dict[str, Any]) -> str:
    """The actor, with what proved it (``auth: none`` is the operator's unauthenticated claim)."""
    raw = record.get("identity")
    ident: dict[str, Any] = raw if isinstance(raw, dict) else {}
    auth = ident.get("auth", "legacy")
    actor = str(record.get("actor"))
    if auth != "none" and auth != "legacy" and ident.get("name") != actor:
        return f"{actor} (via {ident.get('name')}, {auth})"
    return f"{actor} ({auth})"


def build_report(
    log: AuditLog, verified: Verification, *, migration_id: str | None = None, state: dict[str, Any] | None = None
) -> dict[str, Any]:
    records = log.records()

    def data(r: dict[str, Any]) -> dict[str, Any]:
        return r["data"] if isinstance(r.get("data"), dict) else {}

    def pick(prefix: str) -> list[dict[str, Any]]:
        return [r for r in records if str(r.get("event", "")).startswith(prefix)]

    started = records[0] if records else None
    return {
        "migration_id": migration_id,
        "log": log.name,
        "chain_verified": True,
        "keyed": verified.legacy_records == 0,
        "legacy_records": verified.legacy_records,
        "records": verified.count,
        "chain_tail_sha256": verified.tail,
        "chain": verified.chain,
        "audit_key": verified.key,
        "anchors": verified.anchors,
        "warnings": verified.warnings,
        "status": (state or {}).get("status"),
        "started_by": _who(started) if started else None,
        "started_at": _iso(started.get("ts")) if started else None,
        "residency": [data(r) for r in pick("residency.")],
        "images": [data(r) for r in pick("image.")],
        "parity": [data(r) for r in pick("parity.")],
        "traffic": [{"at": _iso(r.get("ts")), "event": r.get("event"), **data(r)} for r in pick("traffic.")],
        "rollbacks": [
            {"at": _iso(r.get("ts")), "event": r.get("event"), "actor": _who(r), **data(r)} for r in pick("rollback.")
        ],
        "timeline": [
            {"seq": r.get("seq"), "at": _iso(r.get("ts")), "actor": _who(r), "event": r.get("event")} for r in records
        ],
    }


def _plain(value: Any) -> Text:
    return Text(clean(value))


def render_report(report: dict[str, Any], console: Console) -> None:
    kind = "keyed" if report["keyed"] else f"{report['legacy_records']} legacy (unkeyed) records"
    anchors = ", ".join(f"{esc(a['anchor'])} ({a['latest_count']})" for a in report["anchors"]) or "none"
    console.print(
        f"[green]audit chain verified[/]: {report['records']} records ({kind}), tail {report['chain_tail_sha256'][:16]}…, "
        f"anchored heads: {anchors}"
    )
    if report.get("migration_id"):
        console.print(
            f"status [bold]{esc(report['status'])}[/], started by {esc(report['started_by'])} at {report['started_at']}"
        )
    for message in report["warnings"]:
        console.print(Text.assemble(("warning:", "yellow"), " ", clean(message)), soft_wrap=True)
    table = Table(title=f"timeline of {esc(report['log'])}")
    for col in ("#", "at", "actor", "event"):
        table.add_column(col)
    for r in report["timeline"]:
        table.add_row(str(r["seq"]), str(r["at"]), _plain(r["actor"]), _plain(r["event"]))
    console.print(table)
    for key in ("residency", "images", "parity", "rollbacks"):
        if report[key]:
            console.print(Text.assemble((key, "bold"), ": ", _plain(report[key])))
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
        table.add_row(str(r["at"]), _plain(r["event"]), _plain(detail[:120]))
    console.print(table)

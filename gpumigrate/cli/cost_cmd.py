"""``gpumigrate cost`` (what a move costs and saves) and ``gpumigrate capacity`` (can the target launch).

Both check residency first: a target region the plan's data policy forbids exits 2, names the
rule and the region, and leaves a record in the policy audit log (``$GPUMIGRATE_HOME/audit/policy.jsonl``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from gpumigrate.cli.output import console, emit_json
from gpumigrate.errors import InvalidInputError
from gpumigrate.plan import load_plan


def register(app: typer.Typer) -> None:
    app.command("cost")(cost)
    app.command("capacity")(capacity)


def _usd(x: float | None) -> str:
    """Dollars and cents, the sign first (-$67.70, not $-67.70); an amount that rounds to zero is $0.00, never -$0.00."""
    if x is None:
        return "-"
    cents = round(x, 2) + 0.0
    return f"-${-cents:,.2f}" if cents < 0 else f"${cents:,.2f}"


def cost(
    plan_file: Path = typer.Argument(..., help="Plan file (YAML)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object as the last line of stdout."),
    image_gb: float | None = typer.Option(
        None, "--image-gb", help="Image size in GB (default: the target's GPU memory)."
    ),
    hours: float | None = typer.Option(
        None, "--hours", help="Savings horizon in hours (default: plan cost.horizon_hours)."
    ),
    setup_hours: float = typer.Option(0.5, "--setup-hours", help="Hours the target runs before the ramp starts."),
) -> None:
    """Migration cost (image egress, dual running) against savings over the horizon, with the break-even
    point; then the plan's cost.candidates ranked by net savings (forbidden regions never proposed)."""
    from gpumigrate.infra.cost import estimate, evaluate_move, plan_moves
    from gpumigrate.infra.residency import policy_audit_log, validate_plan_residency

    if image_gb is not None and image_gb < 0:
        raise InvalidInputError(f"--image-gb must be 0 or more, got {image_gb}")
    if hours is not None and hours <= 0:
        raise InvalidInputError(f"--hours must be more than 0, got {hours}")
    if setup_hours < 0:
        raise InvalidInputError(f"--setup-hours must be 0 or more, got {setup_hours}")
    plan = load_plan(plan_file)
    audit = policy_audit_log()
    validate_plan_residency(plan, record=audit.append)
    image_bytes = int(image_gb * 1e9) if image_gb is not None else None
    est = estimate(plan, image_bytes=image_bytes, horizon_hours=hours, setup_hours=setup_hours)
    moves = plan_moves(plan, image_bytes=image_bytes, horizon_hours=hours, setup_hours=setup_hours, record=audit.append)
    decision = evaluate_move(plan, moves=moves)
    out: dict[str, Any] = {
        "plan": str(plan_file),
        "prices_as_of": est.prices_as_of,
        "estimate": est.to_dict(),
        **moves.to_dict(),
        "decision": decision.to_dict(),
    }
    if json_out:
        emit_json(out)
        return
    _print_estimate(est.to_dict())
    if moves.proposals or moves.rejected:
        table = Table(title="candidates (best first)")
        for col in ("target", "USD/h", "migration cost", "net savings", "break-even h"):
            table.add_column(col)
        for p in moves.proposals:
            e = p.estimate
            be = "never" if e.break_even_hours is None else f"{e.break_even_hours:.1f}"
            table.add_row(
                p.target.label, _usd(e.target_hourly_usd), _usd(e.migration_cost_usd), _usd(e.net_savings_usd), be
            )
        for r in moves.rejected:
            table.add_row(r["target"], "-", "-", "-", f"left out: {r['reason']}")
        console.print(table)
    console.print(
        f"decision: {'[green]go[/]' if decision.go else '[yellow]stay[/]'} — {decision.reason}", soft_wrap=True
    )


def _print_estimate(e: dict[str, Any]) -> None:
    table = Table(title=f"move {e['source']} → {e['target']} (prices as of {e['prices_as_of']})", show_header=False)
    table.add_column("item")
    table.add_column("value")
    image = f"{e['image_gb']:.1f} GB" + (" (estimated: GPU memory)" if e["image_estimated"] else "")
    rows = [
        ("source / target per hour", f"{_usd(e['source_hourly_usd'])} / {_usd(e['target_hourly_usd'])}"),
        ("image", image),
        (
            "egress",
            " + ".join(f"{h['path']} ${h['usd_per_gb']}/GB" for h in e["egress"]) + f" = {_usd(e['egress_usd'])}",
        ),
        (
            "dual running",
            f"{e['overlap_hours']:.2f} h overlap + {e['rollback_window_hours']:.2f} h rollback window = {_usd(e['dual_running_usd'])}",
        ),
        ("migration cost", _usd(e["migration_cost_usd"])),
        (f"savings over {e['horizon_hours']:g} h", _usd(e["savings_usd"])),
        ("net savings", _usd(e["net_savings_usd"])),
        ("break-even", "never" if e["break_even_hours"] is None else f"{e['break_even_hours']:.1f} h after cutover"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)


def capacity(
    plan_file: Path = typer.Argument(..., help="Plan file (YAML)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object as the last line of stdout."),
) -> None:
    """Check that the plan's target may and can launch: residency, instance type/zone, GPU quota.
    Launches nothing. Exit 2 naming the rule (data-residency, capacity, quota) when it cannot."""
    from gpumigrate.infra import get_provider, provider_options, spec_from_plan
    from gpumigrate.infra.residency import check_region, policy_audit_log

    plan = load_plan(plan_file)
    t = plan.target
    check_region(t.provider, t.region, plan.data.allowed_jurisdictions, point="plan", record=policy_audit_log().append)
    provider = get_provider(t.provider, **provider_options(t.provider))
    report = provider.check_capacity(spec_from_plan(plan, migration_id="capacity-check")) or {}
    out = {"plan": str(plan_file), "provider": t.provider, "region": t.region, "ok": True, "report": report}
    if json_out:
        emit_json(out)
        return
    console.print(f"[green]capacity ok[/] {t.provider} {t.region} {t.instance_type or ''}: {report}", soft_wrap=True)

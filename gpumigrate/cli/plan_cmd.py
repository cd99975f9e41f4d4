"""``gpumigrate plan validate|show``."""

from __future__ import annotations

from pathlib import Path

import typer
import yaml
from rich.table import Table
from rich.text import Text

from gpumigrate.cli.output import clean, console, emit_json, esc
from gpumigrate.errors import InvalidInputError, PlanError, PolicyDeniedError
from gpumigrate.plan import load_plan, resolve_relative

app = typer.Typer(help="Check and inspect migration plans.", no_args_is_help=True)


@app.command("validate")
def validate(
    plans: list[Path] = typer.Argument(..., help="One or more plan files."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object as the last line of stdout."),
) -> None:
    """Validate plan files: exit 0 if all are valid, 2 with field paths if any is not.

    Beyond the schema and residency, what the migrate flow's preflight checks of the plan alone: a training plan's
    rules, and that the golden inputs load and fill the plan's request template."""
    results = []
    errors: list[PlanError | PolicyDeniedError | InvalidInputError] = []
    for path in plans:
        try:
            plan = load_plan(path)
            from gpumigrate.flows.plan_checks import check_inputs
            from gpumigrate.infra.residency import policy_audit_log, validate_plan_residency

            validate_plan_residency(plan, record=policy_audit_log().append)  # exit 2 on a forbidden region
            golden = plan.parity.golden_inputs
            try:
                checked = check_inputs(plan, resolve_relative(path, golden) if golden else None)
            except InvalidInputError as exc:  # golden inputs that do not load or fill the request template
                errors.append(exc)
                problem = {"field": "parity.golden_inputs", "message": str(exc)}
                results.append({"plan": str(path), "valid": False, "problems": [problem]})
                console.print(f"[red]invalid[/] {esc(path)}")
                console.print(f"  [bold]parity.golden_inputs[/]: {esc(exc)}", soft_wrap=True)
                continue
            results.append({"plan": str(path), "valid": True, "workload": plan.workload.name, **checked})
            console.print(f"[green]valid[/] {esc(path)}")
        except PlanError as exc:
            errors.append(exc)
            results.append(
                {"plan": str(path), "valid": False, "problems": [{"field": f, "message": m} for f, m in exc.problems]}
            )
            console.print(f"[red]invalid[/] {esc(path)}")
            for field, msg in exc.problems:
                console.print(f"  [bold]{esc(field)}[/]: {esc(msg)}", soft_wrap=True)
        except PolicyDeniedError as exc:
            errors.append(exc)
            denial = {"rule": exc.rule, "region": exc.region, "message": str(exc)}
            results.append({"plan": str(path), "valid": False, "denied": denial})
            console.print(f"[red]denied[/] {esc(path)}: {esc(exc)}", soft_wrap=True)
    if json_out:
        emit_json({"valid": not errors, "plans": results})
    if errors:
        raise typer.Exit(2)


@app.command("show")
def show(
    plan_file: Path = typer.Argument(..., help="Plan file."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Show a plan with all defaults filled in."""
    plan = load_plan(plan_file)
    data = plan.model_dump(mode="json")
    if json_out:
        emit_json(data)
        return
    table = Table(title=f"plan {esc(plan_file)}", show_header=True)
    table.add_column("section")
    table.add_column("settings")
    for section, value in data.items():
        shown = yaml.safe_dump(value, sort_keys=False).strip() if isinstance(value, dict) else str(value)
        table.add_row(section, Text(clean(shown)))
    console.print(table)

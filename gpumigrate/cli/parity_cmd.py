"""``gpumigrate parity check``: the output-parity smoke test (and environment check) for SREs, by hand.

Exit codes: 0 parity holds; 1 the target does not answer like the source (or the source failed);
2 bad input (plan, URL, golden file, tolerance) or an environment difference the plan forbids.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from gpumigrate.cli.output import console, emit_json, esc, fail
from gpumigrate.errors import EXIT_FAILURE, EXIT_INVALID, GpumigrateError, InvalidInputError

if TYPE_CHECKING:
    from gpumigrate.plan import ParityRequest

app = typer.Typer(help="Prove a target answers like its source: output and environment parity.", no_args_is_help=True)


@app.callback()
def _group() -> None:
    """Output-parity and environment-parity checks."""


def _from_migration(migration_id: str) -> dict[str, Any]:
    """Plan, target URL, golden inputs and artifacts directory of a migration under way."""
    from gpumigrate.plan import load_plan, resolve_relative
    from gpumigrate.state import Migration

    m = Migration.open(migration_id)
    runtime = m.read().get("runtime", {})
    plan = load_plan(m.plan_path)
    # Plan paths are relative to where the plan was submitted from (kept by the flow as plan_dir).
    plan_dir = Path(runtime.get("plan_dir") or m.dir)
    golden = resolve_relative(plan_dir / "plan.yaml", plan.parity.golden_inputs) if plan.parity.golden_inputs else None
    return {"plan": plan, "target": runtime.get("target_endpoint"), "inputs": golden,
            "out": m.artifacts / f"parity-manual-{time.strftime('%Y%m%d-%H%M%S')}"}  # fmt: skip


def _resolve(plan_file: Path | None, source: str | None, target: str | None, inputs: Path | None,
             atol: float | None, rtol: float | None, migration_id: str | None = None) -> dict[str, Any]:  # fmt: skip
    from gpumigrate.plan import Parity, load_plan, resolve_relative

    parity = Parity()
    out = None
    plan = None
    if migration_id is not None:
        if plan_file is not None:
            raise InvalidInputError("give a PLAN or --migration ID, not both (a migration keeps its own plan)")
        found = _from_migration(migration_id)
        plan, out = found["plan"], found["out"]
        target = target or found["target"]
        inputs = inputs or found["inputs"]
        if not target:
            raise InvalidInputError(f"migration {migration_id} has no target endpoint yet (provision has not run)")
    elif plan_file is not None:
        plan = load_plan(plan_file)
        if inputs is None and plan.parity.golden_inputs:
            inputs = resolve_relative(plan_file, plan.parity.golden_inputs)
    if plan is not None:
        parity = plan.parity
        source = source or plan.workload.endpoint
    if not source:
        raise InvalidInputError("no source: give --source URL, or a PLAN whose workload has an endpoint")
    if not target:
        raise InvalidInputError(
            "no target: give --target URL (the plan does not name it: the target is provisioned by the migration)"
        )
    if inputs is None:
        raise InvalidInputError("no golden inputs: give --inputs FILE (JSONL), or a PLAN with parity.golden_inputs")
    for name, value in (("--atol", atol), ("--rtol", rtol)):
        if value is not None and not value >= 0:
            raise InvalidInputError(f"{name} must be >= 0, got {value}")
    return {
        "source": source, "target": target, "inputs": inputs,
        "atol": parity.atol if atol is None else atol, "rtol": parity.rtol if rtol is None else rtol,
        "policy": dict(parity.environment), "out": out, "request": parity.request, "from_plan": plan is not None,
    }  # fmt: skip


def _request(base: ParityRequest | None, from_plan: bool, method: str | None, path: str | None,
             fields: list[str]) -> ParityRequest | None:  # fmt: skip
    """The plan's parity.request with --method/--path/--field laid over it; without a plan, those options."""
    from pydantic import ValidationError

    from gpumigrate.plan import ParityRequest

    if base is None and not (path and fields):
        if from_plan and not (method or path or fields):
            return None  # a plan from before parity.request: asked as it always was (parity/FORMAT.md)
        raise InvalidInputError("no request to send: give a PLAN with parity.request, or --path PATH and at least "
                                "one --field NAME:numeric|exact")  # fmt: skip
    doc: dict[str, Any] = base.model_dump(mode="json") if base is not None else {}
    compare = []
    for spec in fields:
        name, _, kind = spec.rpartition(":")
        if not name or kind not in ("numeric", "exact"):
            raise InvalidInputError(f"--field {spec!r}: write NAME:numeric or NAME:exact (NAME a dotted path)")
        compare.append({"field": name, "kind": kind})
    doc.update({k: v for k, v in (("method", method), ("path", path), ("compare", compare)) if v})
    try:
        return ParityRequest.model_validate(doc)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False))
        raise InvalidInputError(f"the parity request is not valid: {problems}") from None


def _environment_gate(cfg: dict[str, Any], out_dir: Path, doc: dict[str, Any], json_out: bool) -> None:
    """Compare /v1/info facts; a forbidden difference ends the command with exit 2 (nothing compared)."""
    from gpumigrate.errors import ParityError
    from gpumigrate.parity.environment import check_environment, fetch_info

    try:
        src_info, tgt_info = fetch_info(cfg["source"]), fetch_info(cfg["target"])
    except ParityError as exc:
        doc["environment"] = {"checked": False, "reason": str(exc)}
        console.print(f"[yellow]note[/] environment not compared: {esc(exc)}", soft_wrap=True)
        return
    report = check_environment(src_info, tgt_info, cfg["policy"])
    report.write(out_dir / "environment.json")
    doc["environment"] = {"checked": True, **report.to_dict(), "report": str(out_dir / "environment.json")}
    for diff in report.notes:
        console.print(f"[yellow]note[/] environment {esc(diff.describe())}", soft_wrap=True)
    if report.passed:
        return
    for diff in report.violations:
        console.print(f"[red]forbidden[/] environment {esc(diff.describe())}", soft_wrap=True)
    doc.update({"passed": False, "denied": "environment-parity"})
    if json_out:
        emit_json(doc)
    fail("the target's environment differs where the plan forbids it; output parity not run")
    raise typer.Exit(EXIT_INVALID)


@app.command("check")
def check(
    plan_file: Path | None = typer.Argument(
        None, help="Plan file: source endpoint, golden inputs, tolerances, environment policy."
    ),
    source: str | None = typer.Option(
        None, "--source", help="Source service URL (default: the plan's workload.endpoint)."
    ),
    target: str | None = typer.Option(
        None, "--target", help="Target service URL, queried directly (not through Envoy)."
    ),
    inputs: Path | None = typer.Option(
        None, "--inputs", help="Golden inputs (JSONL; default: the plan's parity.golden_inputs)."
    ),
    atol: float | None = typer.Option(
        None, "--atol", help="Absolute tolerance for float outputs (default: plan, else 1e-5)."
    ),
    rtol: float | None = typer.Option(
        None, "--rtol", help="Relative tolerance for float outputs (default: plan, else 1e-4)."
    ),
    out: Path | None = typer.Option(
        None, "--out", help="Directory for parity.json/.html (default: $GPUMIGRATE_HOME/parity/<time>)."
    ),
    environment: bool = typer.Option(
        True, "--environment/--no-environment", help="Also compare /v1/info facts by the plan's policy."
    ),
    migration_id: str | None = typer.Option(
        None, "--migration", help="Check a migration under way: its plan, target endpoint and artifacts directory."
    ),
    fast: bool = typer.Option(False, "--fast", help="Judge with the fast rules path only (no Great Expectations)."),
    method: str | None = typer.Option(None, "--method", help="HTTP method (default: the plan's, else POST)."),
    path: str | None = typer.Option(None, "--path", help="Request path, e.g. /embed (default: the plan's)."),
    field: list[str] = typer.Option(
        [], "--field", help="NAME:numeric|exact, repeatable: an answer field to compare (default: the plan's)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the result JSON as the last line of stdout."),
) -> None:
    """Run the golden inputs against source and target and compare: exit 0 pass, 1 fail, 2 bad input/denied."""
    from gpumigrate.parity.output import check_url, load_golden, redact_url, run_output_parity
    from gpumigrate.settings import state_root

    cfg = _resolve(plan_file, source, target, inputs, atol, rtol, migration_id)
    request = _request(cfg["request"], cfg["from_plan"], method.upper() if method else None, path, field)
    # Bad input is exit 2 before any request goes out.
    cfg["source"], cfg["target"] = check_url(cfg["source"], "source"), check_url(cfg["target"], "target")
    load_golden(cfg["inputs"])
    out_dir = out or cfg["out"] or state_root() / "parity" / time.strftime("%Y%m%d-%H%M%S")
    doc: dict[str, Any] = {"source": redact_url(cfg["source"]), "target": redact_url(cfg["target"])}
    if environment:
        _environment_gate(cfg, out_dir, doc, json_out)
    try:
        result = run_output_parity(cfg["source"], cfg["target"], cfg["inputs"], atol=cfg["atol"], rtol=cfg["rtol"],
                                   out_dir=out_dir, use_gx=not fast, request=request)  # fmt: skip
    except GpumigrateError as exc:
        if json_out:
            emit_json({**doc, "passed": False, "error": str(exc)})
        raise
    doc.update(result.to_dict())
    for reason in result.failures[:20]:
        console.print(f"[red]fail[/] {esc(reason)}", soft_wrap=True)
    if len(result.failures) > 20:
        console.print(f"... {len(result.failures) - 20} more in {esc(result.artifacts.get('json'))}")
    verdict = "[green]parity holds[/]" if result.passed else "[bold red]parity FAILED[/]"
    err = "—" if result.max_abs_err is None else f"{result.max_abs_err:.3g}"
    console.print(f"{verdict}: {result.cases} cases, max abs err {err}, {result.seconds:.2f} s; "
                  f"report {esc(result.artifacts.get('html'))}", soft_wrap=True)  # fmt: skip
    if json_out:
        emit_json(doc)
    if not result.passed:
        raise typer.Exit(EXIT_FAILURE)

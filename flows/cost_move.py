"""Scheduled cost-driven moves: evaluate the cost model, trigger the migrate deployment only on a go.

The ``cost-move`` deployment in ``prefect.yaml`` runs :func:`cost_move_flow` on a cron schedule
(schedules need ``prefect server start`` and a worker: see runbooks/scheduled-moves.md). The
decision itself is :func:`gpumigrate.infra.cost.evaluate_move`: it never proposes a region the
plan's residency forbids; this flow checks residency of the chosen target once more before it
triggers anything, writes the derived plan (the proposal's target in place of the plan's), and
hands it to the trigger — by default ``run_deployment("migrate/migrate", ...)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from prefect import flow

from gpumigrate.atomic import atomic_write_bytes
from gpumigrate.audit import AuditLog
from gpumigrate.errors import ResidencyError
from gpumigrate.flows import flowrun, prefect_artifacts
from gpumigrate.plan import Plan, load_plan, parse_plan
from gpumigrate.settings import state_root

MIGRATE_DEPLOYMENT = "migrate/migrate"
Trigger = Callable[[str, dict[str, Any]], Any]  # (deployment name, parameters) -> flow run (or anything)


def cost_log() -> AuditLog:
    """Decisions of scheduled moves, go or no-go, hash-chained like a migration's audit log."""
    return AuditLog(state_root() / "audit" / "cost-moves.jsonl")


def derived_plan(plan: Plan, target: str) -> Plan:
    """The plan with the proposal's ``provider:region[:instance_type]`` as its target (validated again)."""
    provider, region, *rest = target.split(":")
    data = plan.model_dump(mode="json", exclude_none=True)
    tgt = {k: v for k, v in data["target"].items() if k not in ("zone", "instance_type", "host")}
    tgt.update(provider=provider, region=region)
    if rest:
        tgt["instance_type"] = rest[0]
    if provider == "gcp":
        tgt["zone"] = f"{region}-a"
    data["target"] = tgt
    return parse_plan(data, f"cost proposal {target}")


def trigger_deployment(name: str, parameters: dict[str, Any]) -> Any:
    """The default trigger: start the migrate deployment on the Prefect server (needs a worker)."""
    from prefect.deployments import run_deployment

    return run_deployment(name=name, parameters=parameters, timeout=0)


def decide_and_trigger(
    plan_path: str | Path, *, trigger: Trigger, image_bytes: int | None = None, deployment: str = MIGRATE_DEPLOYMENT
) -> dict[str, Any]:
    """Evaluate the move; on a go that residency allows, write the derived plan and call ``trigger``."""
    from gpumigrate.infra.cost import evaluate_move
    from gpumigrate.infra.residency import check_region

    plan = load_plan(plan_path)
    log = cost_log()
    decision = evaluate_move(plan, image_bytes=image_bytes, record=lambda e, d: log.append(e, d))
    out: dict[str, Any] = {"plan": str(plan_path), **decision.to_dict(), "triggered": False}
    out.pop("estimate", None)
    if not decision.go or not decision.target:
        log.append("cost.no_go", {"plan": str(plan_path), "reason": decision.reason[:300]})
        return out
    new_plan = derived_plan(plan, decision.target)
    try:
        check_region(
            new_plan.target.provider,
            new_plan.target.region,
            plan.data.allowed_jurisdictions,
            point="cost-move",
            record=lambda e, d: log.append(e, d),
        )
    except ResidencyError as exc:
        out.update(reason=f"residency denies {decision.target}: {exc}")
        log.append("cost.no_go", {"plan": str(plan_path), "reason": out["reason"][:300]})
        return out
    dest = state_root() / "cost-moves" / f"{plan.workload.name}-{time.strftime('%Y%m%d-%H%M%S')}.yaml"
    atomic_write_bytes(
        dest, yaml.safe_dump(new_plan.model_dump(mode="json", exclude_none=True), sort_keys=False).encode()
    )
    run = trigger(deployment, {"plan_path": str(dest)})
    out.update(
        triggered=True, derived_plan=str(dest), flow_run=str(getattr(run, "id", run)) if run is not None else None
    )
    log.append(
        "cost.triggered",
        {
            "plan": str(dest),
            "target": decision.target,
            "deployment": deployment,
            "savings_usd": round(decision.savings_usd, 2),
        },
    )
    return out


@flow(name="cost-move", flow_run_name="cost-move", persist_result=False)
def cost_move_flow(
    plan_path: str, image_bytes: int | None = None, deployment: str = MIGRATE_DEPLOYMENT, trigger: Trigger | None = None
) -> dict[str, Any]:
    """Evaluate the cost model for ``plan_path``; trigger the migrate deployment only when it pays."""
    flowrun.begin()  # a worker imported this module: Prefect's settings and the audit's actor
    out = decide_and_trigger(
        plan_path, trigger=trigger or trigger_deployment, image_bytes=image_bytes, deployment=deployment
    )
    prefect_artifacts.anchor_log(cost_log())  # the decisions' chain head outside the state directory
    return out

"""Preflight: may and can this migration run? Residency, capacity, environment, the snapshot backend.

Everything here only reads and decides: a denial (exit 2) leaves nothing provisioned, frozen or moved.
"""

from __future__ import annotations

from typing import Any

from gpumigrate.environment import EnvironmentReport, collect_facts, compare
from gpumigrate.errors import PolicyDeniedError, TrafficError
from gpumigrate.flows.context import Fact, RunContext, same_endpoint
from gpumigrate.flows.events import emit
from gpumigrate.flows.facts import workload_facts
from gpumigrate.infra import spec_from_plan
from gpumigrate.infra.residency import validate_plan_residency
from gpumigrate.traffic import frontdoor


def run(ctx: RunContext) -> dict[str, Any]:
    m, plan = ctx.migration, ctx.plan
    decisions = validate_plan_residency(plan, record=m.record)
    if plan.workload.kind == "inference":
        _front_door(ctx)
    spec = spec_from_plan(plan, migration_id=m.id)
    ctx.provider().check_capacity(spec)
    emit(
        m, "infra.capacity.ok", {"provider": spec.provider, "region": spec.region, "instance_type": spec.instance_type}
    )
    wl = plan.workload
    source = workload_facts(wl.endpoint, wl.agent, side="source") if wl.endpoint or wl.agent else {}
    ctx.update(source_facts=_scalars(source))
    report = _host_environment(ctx, source)
    record: dict[str, Any] = (
        {**report.to_dict(), "differences": report.differences()}
        if report is not None
        else {"passed": None, "deferred": "the target's facts are checked in the parity phase, once it runs"}
    )
    emit(m, "parity.environment.preflight", record)
    if report is not None:
        report.raise_if_forbidden()  # a policy denial: exit 2, nothing provisioned
    found = ctx.backend().check()
    ctx.update(backend_facts=_scalars(found))
    emit(m, "snapshot.checked", {"backend": plan.snapshot.backend, **_scalars(found)})
    return {
        "residency": "allow",
        "decisions": len(decisions),
        "target_host": spec.name,
        "environment": "match" if report is not None else "deferred",
        "source_weights_digest": str(source.get("weights_digest", ""))[:64] or None,
    }


def _front_door(ctx: RunContext) -> None:
    """An inference migration shifts its clients through the front door: it must be up, and front this
    plan's endpoint, before anything is provisioned (exit 2 naming the command that starts it)."""
    wl = ctx.plan.workload
    endpoint = ctx.need(wl.endpoint, "the source endpoint")
    state_dir = ctx.traffic_dir()
    start = frontdoor.up_command(endpoint, wl.name, wl.ready_path)
    try:
        door = frontdoor.check(state_dir)
    except TrafficError as exc:
        raise PolicyDeniedError(
            "front-door", f"no front door is up for workload {wl.name} ({exc}): start it with `{start}`"
        ) from None
    if door.source and not same_endpoint(door.source, endpoint):
        raise PolicyDeniedError(
            "front-door", f"the front door in {state_dir} fronts {door.source}, not this plan's endpoint {endpoint}"
        )
    emit(ctx.migration, "traffic.frontdoor.checked", {"state_dir": str(state_dir), "listener": door.listener})


def _host_environment(ctx: RunContext, source: dict[str, Any]) -> EnvironmentReport | None:
    """The target host's facts against the source's, host-level facts only (no workload there yet).

    A local target runs on this machine, so its facts are collected here; a cloud target's facts are
    known once it runs, so the check is deferred to the parity phase (None), which compares everything.
    """
    if ctx.plan.target.provider != "local" or not source:
        return None
    return compare(source, collect_facts(), ctx.plan.parity.environment, scope="host")


def _scalars(facts: dict[str, Any]) -> dict[str, Fact]:
    """The facts a runtime record keeps (identity, versions): scalars only, never nested structures."""
    return {k: v for k, v in facts.items() if isinstance(v, (str, int, float, bool, type(None)))}

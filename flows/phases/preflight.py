"""Preflight: may and can this migration run? Residency, the transport, capacity, the image store and the
data's classification, environment, the snapshot backend.

Everything here reads and decides (the one write: an image bucket that does not exist yet is created,
private, in the target's region, so that its real location can be checked): a denial (exit 2) leaves
nothing provisioned, frozen or moved.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from gpumigrate.control import KEY_FILE_ENV, AuthError
from gpumigrate.environment import EnvironmentReport, collect_facts, compare
from gpumigrate.errors import InvalidInputError, PolicyDeniedError, TrafficError
from gpumigrate.flows import target_store
from gpumigrate.flows.context import Fact, RunContext, same_endpoint
from gpumigrate.flows.events import emit
from gpumigrate.flows.facts import FactsUnavailableError, workload_facts
from gpumigrate.flows.plan_checks import check_golden, training_rules
from gpumigrate.flows.source_checks import check_source
from gpumigrate.infra import spec_from_plan
from gpumigrate.infra.placement import check_zones
from gpumigrate.infra.residency import (
    ResidencyDecision,
    check_classification,
    check_store_location,
    key_locations,
    validate_plan_residency,
)
from gpumigrate.interfaces import HostSpec, Provider
from gpumigrate.parity.urls import redact_url
from gpumigrate.snapshot.errors import AgentUnreachableError
from gpumigrate.traffic import frontdoor
from gpumigrate.transfer.push import ensure_bucket, store_region
from gpumigrate.transfer.stores.nixl_agent import load_nixl


def run(ctx: RunContext) -> dict[str, Any]:
    m, plan = ctx.migration, ctx.plan
    if plan.workload.kind == "training":
        training_rules(plan)  # what the flow needs of a training plan: exit 2 before anything else is asked
    decisions = validate_plan_residency(plan, record=m.record)
    # What `plan validate` checks of the plan alone (golden cases that load and fill the request template): found
    # here, a mistake is exit 2 before anything is provisioned; found by the parity phase, after a freeze.
    inputs = check_golden(plan, ctx.golden_inputs())
    if plan.workload.kind == "inference":
        _front_door(ctx)
    check_transport(ctx)
    spec = spec_from_plan(plan, migration_id=m.id)
    provider = ctx.provider()
    zones = check_capacity(ctx, provider, spec)
    decisions += check_store_and_keys(ctx, provider)
    source = _source_facts(ctx)
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
    found = _check_backend(ctx)
    ctx.update(backend_facts=_scalars(found))
    emit(m, "snapshot.checked", {"backend": plan.snapshot.backend, **_scalars(found)})
    inputs.update(check_source(ctx))  # its paths, one golden answer, its losses: what the plan alone cannot show
    return {
        "residency": "allow",
        "decisions": len(decisions),
        "target_host": spec.name,
        "zones": [z for z in zones if z],
        "environment": "match" if report is not None else "deferred",
        "source_weights_digest": str(source.get("weights_digest", ""))[:64] or None,
        **inputs,
    }


class SourceNotAnsweringError(InvalidInputError):
    """Preflight could not reach the source workload (not running, or another control key): nothing moved, so
    this is the plan's or the source's set-up to fix (exit 2), never a rollback."""


def _source_not_answering(ctx: RunContext, tried: list[tuple[str, str]]) -> SourceNotAnsweringError:
    wl = ctx.plan.workload
    url = redact_url(wl.endpoint) if wl.endpoint else None
    parts = [f"its service at {url}" if url else "", f"its agent at {wl.agent}" if wl.agent else ""]
    reasons = "; ".join(f"{what}: {why}" for what, why in tried)
    return SourceNotAnsweringError(
        f"the source workload {wl.name}{f' at {url}' if url else ''} did not answer ({reasons}); nothing was moved",
        hint=f"check that the source is running ({', '.join(p for p in parts if p)}) and that it was started "
        f"with the control key gpumigrate uses ({KEY_FILE_ENV}, or the plan's workload.control_key)",
    )


def _source_facts(ctx: RunContext) -> dict[str, Any]:
    """The source's environment facts (its agent's, over its service's /v1/info if it has one); exit 2 naming
    what did not answer when neither does."""
    wl = ctx.plan.workload
    if not (wl.endpoint or wl.agent):
        return {}
    try:
        return workload_facts(wl.endpoint, wl.agent, side="source", backend=ctx.backend())
    except FactsUnavailableError as exc:
        raise _source_not_answering(ctx, exc.tried) from None


def _check_backend(ctx: RunContext) -> dict[str, Any]:
    """The snapshot backend works on the source; a source agent that cannot be reached, or that refuses this
    control key, is the source not answering (exit 2), as in :func:`_source_facts`."""
    try:
        return ctx.backend().check()
    except (AuthError, AgentUnreachableError) as exc:
        raise _source_not_answering(ctx, [(f"its agent at {ctx.plan.workload.agent}", str(exc))]) from None


def _front_door(ctx: RunContext) -> None:
    """An inference migration shifts its clients through the front door: it must be up, front this plan's
    endpoint and health-check its ready path, before anything is provisioned (exit 2 naming the command)."""
    wl = ctx.plan.workload
    endpoint = ctx.need(wl.endpoint, "the source endpoint")
    state_dir = ctx.traffic_dir()
    start = frontdoor.up_command(endpoint, wl.ready_path)
    try:
        door = frontdoor.check(state_dir)
    except TrafficError as exc:
        why = (
            f"the front door in {state_dir} is not answering ({exc.message})"
            if (state_dir / frontdoor.FRONTDOOR).exists()
            else f"no front door fronts {endpoint}"
        )
        raise PolicyDeniedError("front-door", f"{why}: start it with `{start}`") from None
    if door.source and not same_endpoint(door.source, endpoint):
        raise PolicyDeniedError(
            "front-door", f"the front door in {state_dir} fronts {door.source}, not this plan's endpoint {endpoint}"
        )
    checked = frontdoor.health_path(state_dir)
    if checked is not None and checked != wl.ready_path:
        raise PolicyDeniedError(
            "front-door",
            f"the front door health-checks the source on GET {checked}, and this plan's workload.ready_path is "
            f"{wl.ready_path}: Envoy would send clients by another rule than the migration's; set the door's path "
            f"with `{start}`",
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


# ----------------------------------------------------------------------------- where and how the bytes go
def check_transport(ctx: RunContext) -> None:
    """The plan's transport works from here, before anything moves: NIXL loads for nixl:// (its missing
    package is named; stream:// never needs it), a receiver the flow starts needs a host the flow can
    start it on (the plan says so), and a receiver the operator runs presents the pinned certificate (a
    denial otherwise)."""
    url = ctx.store_url()
    if not target_store.is_receiver(url):
        return
    if urlsplit(url).scheme == "nixl":
        load_nixl()  # the local hosts' interpreter is this one; a remote receiver says so in its HELLO
    if target_store.started_by_flow(url):
        return  # on a local target (the plan refuses one on a cloud target); started at provision
    store = target_store.receiver_store(ctx, url)
    emit(ctx.migration, "transfer.receiver.checked", {"url": redact_url(url), "store": store})


def check_capacity(ctx: RunContext, provider: Provider, spec: HostSpec) -> list[str | None]:
    """The zones that can take the target: the plan's, then its fallback zones of the same region (a
    forbidden region's never). Launches nothing; exit 2 naming the zones when none can."""
    plan = ctx.plan
    zones: list[str | None] = check_zones(
        provider,
        spec,
        allowed_jurisdictions=plan.data.allowed_jurisdictions,
        fallback_zones=plan.target.fallback_zones,
        record=ctx.migration.record,
    )
    emit(
        ctx.migration,
        "infra.capacity.ok",
        {"provider": spec.provider, "region": spec.region, "instance_type": spec.instance_type, "zones": zones},
    )
    return zones


def check_store_and_keys(ctx: RunContext, provider: Provider) -> list[ResidencyDecision]:
    """The image bucket exists in the target's region (created there when missing) and is where its cloud
    says, inside the allowed jurisdictions; the data's classification holds, wherever its key is held."""
    plan, record = ctx.plan, ctx.migration.record
    url = ctx.store_url()
    found = ensure_bucket(url, plan.target.region)
    if found is not None:
        emit(ctx.migration, "transfer.bucket.ready", {"store": redact_url(url), "region": found})
    decisions = [
        check_store_location(
            url,
            plan.data.allowed_jurisdictions,
            locate=store_region,
            plan_region=plan.transfer.store_region,
            target_provider=plan.target.provider,
            target_region=plan.target.region,
            record=record,
        )
    ]
    held = key_locations(plan, provider)
    if held:
        decisions += check_classification(plan, key_locations=held, record=record)
    return decisions

"""Provision: launch (or find) the target host, start the workload there awaiting its state, and decide
where the image lands (flows/target_store.py): a receiver on the target is started here, before the
snapshot writes to it.

The host is placed by :func:`gpumigrate.infra.placement.place`: the plan's zone, then its fallback zones
of the same region, never a region residency forbids. The workload starts through the one launcher,
``Provider.bootstrap`` (infra/launch.py; a cloud target boots it from its user data or startup script,
infra/BOOT.md), from the plan's ``workload.launch`` with gpumigrate's side of the contract in its
environment (agent address, await-restore, the state root and the control key's reference). A backend
whose restore brings the process up itself (CRIU) needs no launch: the target then serves on the
source's port, at its own address. From the moment a host exists, an undo terminates it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from gpumigrate import agent_keys, control
from gpumigrate.errors import InvalidInputError
from gpumigrate.flows import target_store
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.undo import HOST_RECORD, undo_target
from gpumigrate.infra import spec_from_plan
from gpumigrate.infra.launch import serves_http, service_url
from gpumigrate.infra.placement import place
from gpumigrate.interfaces import Host
from gpumigrate.launch import WorkloadLaunch
from gpumigrate.settings import state_root

HOST_READY_TIMEOUT_S = 300


def run(ctx: RunContext) -> dict[str, Any]:
    m, plan = ctx.migration, ctx.plan
    launch = target_launch(ctx) if ctx.backend().needs_launch else None
    provider = ctx.provider()
    spec = spec_from_plan(plan, migration_id=m.id, launch=launch)
    with HOST_RECORD:  # an undo from another thread (a stop's watchdog) waits until the host is recorded
        host = place(
            provider,
            spec,
            migration_id=m.id,
            allowed_jurisdictions=plan.data.allowed_jurisdictions,
            fallback_zones=plan.target.fallback_zones,
            record=m.record,
        )
        ctx.update(
            target_host=host, target_torn_down=False, receiver_dir=None, receiver_stopped=False
        )  # undo from here
    host = provider.wait_ready(host, timeout_s=HOST_READY_TIMEOUT_S)
    if launch is not None:
        boot = plan.target.bootstrap
        try:
            host = provider.bootstrap(host, launch, timeout_s=boot.timeout_s if boot else launch.ready_timeout_s)
        except BaseException:  # a failed task's own undo hook never runs: tear its host down here
            undo_target(ctx, reason="the workload did not start on the target")
            raise
        endpoint = service_url(host) if serves_http(launch) else None
        agent: str | None = f"{host.address}:{host.ports['agent']}"
    else:
        endpoint, agent = _restored_endpoint(host, plan.workload.endpoint), None
    ctx.update(target_host=host, target_endpoint=endpoint, target_agent=agent)
    if endpoint is not None:
        ctx.target_endpoint()  # two real endpoints, or a refusal before anything is frozen
    lands = target_store.landing(ctx, provider, host)
    ctx.update(image_store=lands.write, target_store=lands.read, receiver_dir=lands.receiver_dir)
    target_store.check_landing(ctx, host, lands)  # before any byte moves there
    return {
        "host": host.name,
        "provider": host.provider,
        "region": host.region,
        "zone": host.zone,
        "endpoint": endpoint,
        "agent": agent,
        "receiver": lands.receiver_dir is not None,
    }


def target_launch(ctx: RunContext) -> WorkloadLaunch:
    """How the workload starts on the target, awaiting the restore, with gpumigrate's env contract."""
    plan = ctx.plan
    if plan.workload.launch is None:
        raise InvalidInputError(
            "workload.launch is needed to start the workload on the target: the command that starts it "
            "(argv with {host}, {service_port}, ...), as the README's plan reference shows"
        )
    contract = {"GPUMIGRATE_HOME": str(state_root())}
    key = plan.workload.control_key
    if key is not None and key.file:  # an env reference is the target's own variable: never copied here
        contract["GPUMIGRATE_CONTROL_KEY_FILE"] = str(ctx.resolve(key.file))
    # The target's agent gets an id of the flow's choosing and its own key only (an agent key file), never one
    # that signs for the source; a cloud target derives the same key from the secret its boot agent fetches.
    agent_id = agent_keys.target_agent_id(ctx.migration.id)
    key_file = ctx.migration.dir / "target-agent.key"
    agent_keys.write_agent_key_file(key_file, control.load_key(target_store.control_ref(ctx)), agent_id)
    contract.update({agent_keys.AGENT_ID_ENV: agent_id, agent_keys.AGENT_KEY_FILE_ENV: str(key_file)})
    ctx.update(target_agent_id=agent_id)
    gpus = tuple(plan.target.rank_gpus or ())  # rank r on the target's GPU rank_gpus[r]
    launch = WorkloadLaunch.from_plan(
        plan.workload, plan_dir=ctx.plan_dir, await_restore=True, contract_env=contract, gpus=gpus
    )
    # A training job that finished leaves its host with nothing to run: the host goes down with it.
    return replace(launch, ends_host=plan.workload.kind == "training")


def _restored_endpoint(host: Host, source_endpoint: str | None) -> str | None:
    """A restored process listens where the source did: the source's port, at the target's address."""
    if not source_endpoint:
        return None
    parts = urlsplit(source_endpoint)
    return f"{parts.scheme}://{host.address}:{parts.port or 80}"

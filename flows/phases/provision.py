"""Provision: launch (or find) the target host, start the workload there awaiting its state.

The workload starts through the one launcher, ``Provider.bootstrap`` (infra/launch.py), from the
plan's ``workload.launch`` with gpumigrate's side of the contract in its environment (agent address,
await-restore, the state root and the control key's reference). A backend whose restore brings the
process up itself (CRIU) needs no launch: the target then serves on the source's port, at its own address.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gpumigrate.flows.context import Fact, RunContext
from gpumigrate.flows.undo import undo_target
from gpumigrate.infra import provision_host, spec_from_plan
from gpumigrate.infra.launch import serves_http, service_url
from gpumigrate.interfaces import Host
from gpumigrate.launch import AWAIT_RESTORE_ENV, WorkloadLaunch
from gpumigrate.settings import state_root

HOST_READY_TIMEOUT_S = 300


def run(ctx: RunContext) -> dict[str, Any]:
    m, plan = ctx.migration, ctx.plan
    launch = target_launch(ctx) if ctx.backend().needs_launch else None
    provider = ctx.provider()
    spec = spec_from_plan(plan, migration_id=m.id, launch=launch)
    host = provision_host(
        provider, spec, migration_id=m.id, allowed_jurisdictions=plan.data.allowed_jurisdictions, record=m.record
    )
    host = provider.wait_ready(host, timeout_s=HOST_READY_TIMEOUT_S)
    ctx.update(target_host=host, target_torn_down=False)  # from here on, an undo tears it down
    if launch is not None:
        try:
            host = provider.bootstrap(host, launch, timeout_s=launch.ready_timeout_s)
        except BaseException:  # a failed task's own undo hook never runs: tear its host down here
            undo_target(ctx, reason="the workload did not start on the target")
            raise
        endpoint = service_url(host) if serves_http(launch) else None
        agent: str | None = f"{host.address}:{host.ports['agent']}"
    else:
        endpoint, agent = _restored_endpoint(host, plan.workload.endpoint), None
    ctx.update(
        target_host=host,
        target_endpoint=endpoint,
        target_agent=agent,
        target_store=target_store_url(host, ctx.store_url()),  # the transfer phase pushes the image there
    )
    if endpoint is not None:
        ctx.target_endpoint()  # two real endpoints, or a refusal before anything is frozen
    return {"host": host.name, "provider": host.provider, "region": host.region, "endpoint": endpoint, "agent": agent}


def target_launch(ctx: RunContext) -> WorkloadLaunch:
    """How the workload starts on the target, awaiting the restore, with gpumigrate's env contract."""
    plan = ctx.plan
    contract = {"GPUMIGRATE_HOME": str(state_root())}
    key = plan.workload.control_key
    if key is not None and key.file:  # an env reference is the target's own variable: never copied here
        contract["GPUMIGRATE_CONTROL_KEY_FILE"] = str(ctx.resolve(key.file))
    if plan.workload.launch is not None:
        return WorkloadLaunch.from_plan(plan.workload, plan_dir=ctx.plan_dir, await_restore=True, contract_env=contract)
    return _reference_server(ctx.runtime.source_facts, {**contract, AWAIT_RESTORE_ENV: "1"})


def _reference_server(source: dict[str, Fact], contract: dict[str, str]) -> WorkloadLaunch:
    """TRANSITIONAL, for plans without ``workload.launch`` (the integration wave makes it required and
    deletes this): the reference inference server, allocating the source's model shape to restore into."""
    model = ["--seed", str(source.get("seed", 0)), "--dtype", str(source.get("dtype", "float32"))]
    model += ["--device", str(source.get("device") or "cpu")]
    model += (
        ["--params-mb", str(source["params_mb"])]
        if source.get("params_mb")
        else ["--size", str(source.get("size") or "tiny")]
    )
    argv = ("{python}", "-m", "gpumigrate.workloads.inference", "--host", "{host}", "--port", "{service_port}")
    return WorkloadLaunch(argv=(*argv, "--name", "{name}", *model), contract_env=contract)


def _restored_endpoint(host: Host, source_endpoint: str | None) -> str | None:
    """A restored process listens where the source did: the source's port, at the target's address."""
    if not source_endpoint:
        return None
    parts = urlsplit(source_endpoint)
    return f"{parts.scheme}://{host.address}:{parts.port or 80}"


def target_store_url(host: Host, plan_store: str) -> str:
    """Where the target reads the image: its own disk for local hosts, else the plan's shared store."""
    if host.provider == "local" and host.workdir and plan_store.startswith("file://"):
        return "file://" + str(Path(host.workdir) / "store")
    return plan_store

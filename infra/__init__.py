"""gpumigrate.infra — providers (local, AWS, GCP), capacity and quota, residency, pricing and cost.

The registry resolves a provider name to its class lazily, so importing this package pulls in
neither boto3 nor google-cloud-compute. A target is launched by :func:`gpumigrate.infra.placement.place`
(the flows' one call; :func:`provision_host` is it without fallback zones): residency of the region
first, then capacity and quota, then the launch — so a denial provisions nothing.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING, Any

from gpumigrate.errors import InvalidInputError, ProviderError
from gpumigrate.interfaces import Host, HostSpec, Provider
from gpumigrate.launch import WorkloadLaunch
from gpumigrate.plan import Plan

if TYPE_CHECKING:
    from gpumigrate.infra.residency import Recorder

# name -> "module:Class", imported on first use
PROVIDERS: dict[str, str] = {
    "local": "gpumigrate.infra.local:LocalProvider",
    "aws": "gpumigrate.infra.aws:AwsProvider",
    "gcp": "gpumigrate.infra.gcp:GcpProvider",
}


def get_provider(name: str, **options: Any) -> Provider:
    """Build the provider called ``name`` with its options (e.g. ``endpoint_url`` for aws)."""
    target = PROVIDERS.get(name)
    if target is None:
        raise InvalidInputError(f"unknown provider {name!r}: allowed are {', '.join(sorted(PROVIDERS))}")
    module_name, _, class_name = target.partition(":")
    try:
        cls = getattr(import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ProviderError(f"provider {name!r} is not available here: {exc}") from None
    provider: Provider = cls(**options)
    return provider


def provider_options(name: str, *, attached: bool = False, plan: Plan | None = None) -> dict[str, Any]:
    """The options every caller (migrate, capacity, cost) builds a provider with: never secrets.

    aws: ``AWS_ENDPOINT_URL`` (boto3 reads it too). gcp: ``GPUMIGRATE_GCP_ENDPOINT`` (a Compute Engine
    API endpoint) and ``GOOGLE_CLOUD_PROJECT``. Credentials stay with the standard chains. local:
    ``attached``: an attached host dies with the process that provisioned it (the demo's target); a
    migration's target is detached by default, because after the cut-over it IS the service. With
    ``plan``, a cloud provider also gets the plan's target network and bootstrap (what a launch that
    boots the workload needs: :func:`gpumigrate.infra.bootstrap.cloud_options`).
    """
    if plan is not None and name in ("aws", "gcp"):
        from gpumigrate.infra.bootstrap import cloud_options

        return {**provider_options(name, attached=attached), **cloud_options(plan)}
    if name == "aws" and os.environ.get("AWS_ENDPOINT_URL"):
        return {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}
    if name == "gcp":
        opts: dict[str, Any] = {}
        if os.environ.get("GPUMIGRATE_GCP_ENDPOINT"):
            opts["api_endpoint"] = os.environ["GPUMIGRATE_GCP_ENDPOINT"]
        if os.environ.get("GOOGLE_CLOUD_PROJECT"):
            opts["project"] = os.environ["GOOGLE_CLOUD_PROJECT"]
        return opts
    if name == "local":
        return {"attached": attached}
    return {}


def spec_from_plan(plan: Plan, *, migration_id: str, launch: WorkloadLaunch | None = None) -> HostSpec:
    """The target HostSpec of a plan; its name is stable per migration so a retry finds its host.

    ``launch`` is the workload to start there (a cloud provider puts it in the host's user data)."""
    t = plan.target
    name = (t.host or f"gm-{plan.workload.name}-{migration_id}").lower()
    if len(name) > 63:  # cloud name limits; the digest keeps two long ids apart
        name = name[:50].rstrip("-") + "-" + hashlib.sha256(name.encode()).hexdigest()[:12]
    return HostSpec(
        name=name,
        provider=t.provider,
        region=t.region,
        zone=t.zone,
        instance_type=t.instance_type,
        gpu_model=t.gpu_model,
        gpu_count=t.gpu_count,
        image=t.image,
        tags={"gpumigrate:workload": plan.workload.name},
        launch=launch,
    )


def provision_host(
    provider: Provider,
    spec: HostSpec,
    *,
    migration_id: str,
    allowed_jurisdictions: list[str] | tuple[str, ...],
    record: Recorder | None = None,
) -> Host:
    """:func:`~gpumigrate.infra.placement.place` in the spec's own zone only (no fallback zones)."""
    from gpumigrate.infra.placement import place

    return place(provider, spec, migration_id=migration_id, allowed_jurisdictions=allowed_jurisdictions, record=record)


@dataclass(frozen=True)
class HostProcess:
    """A process started on a host beside its workload (a receiver): its pid, its log, and whether it ended."""

    pid: int
    log: str
    returncode: Callable[[], int | None]  # its exit status once it ended, None while it runs


def start_on_host(
    provider: Provider, host: Host, argv: Sequence[str], *, env: Mapping[str, str], name: str
) -> HostProcess:
    """Run ``argv`` on ``host`` beside its workload. Local hosts only: a cloud target runs what its boot
    script starts and nothing else (no remote shell is opened to it), so there this is refused."""
    from gpumigrate.infra.local import LocalProvider

    if not isinstance(provider, LocalProvider):
        raise InvalidInputError(
            f"gpumigrate starts processes on local hosts only; host {host.name} is a {host.provider} machine"
        )
    started = provider.spawn(host, argv, env=env, name=name)
    pid = int(started["pid"])

    def returncode() -> int | None:
        mine = [c for c in provider.processes(host) if c.get("pid") == pid]
        if not mine:
            return -1  # the supervisor no longer knows it: gone
        code = mine[0].get("returncode")
        return None if code is None else int(code)

    return HostProcess(pid, str(started["log"]), returncode)


__all__ = [
    "PROVIDERS",
    "HostProcess",
    "get_provider",
    "provider_options",
    "provision_host",
    "spec_from_plan",
    "start_on_host",
]

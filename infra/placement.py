"""Where a cloud target lands: the plan's zone, then its fallback zones, inside the allowed region only.

A zone out of capacity (EC2 ``InsufficientInstanceCapacity``, GCE ``ZONE_RESOURCE_POOL_EXHAUSTED``,
or the type not offered there) sends the launch to the next zone. A quota refusal stops at once and
names the quota: quotas are regional, another zone of the region would meet the same one. A zone of
another region is never tried — the plan only allows the target's region, and residency may forbid
the other — and its residency decision is recorded all the same. When no zone takes the machine, the
error (exit 2) names every zone tried and why; nothing is left running, because each provider cleans
up a launch that failed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from gpumigrate.errors import CapacityError
from gpumigrate.infra.residency import Recorder, check_region, evaluate_region
from gpumigrate.interfaces import Host, HostSpec, Provider


def zone_region(provider: str, zone: str) -> str:
    """eu-central-1a → eu-central-1 (AWS), europe-west4-a → europe-west4 (GCP)."""
    if provider == "aws":
        return re.sub(r"[a-z]$", "", zone)
    if provider == "gcp":
        return zone.rsplit("-", 1)[0]
    return zone


def candidate_zones(
    spec: HostSpec, fallback_zones: Sequence[str], allowed: Sequence[str], record: Recorder | None
) -> list[str | None]:
    """The zones to try in order: the target's, then the fallbacks of the same region. A zone of
    another region is dropped, with its residency decision and the reason recorded."""
    zones: list[str | None] = [spec.zone]
    for zone in fallback_zones:
        region = zone_region(spec.provider, zone)
        if region == spec.region:
            if zone not in zones:
                zones.append(zone)
            continue
        decision = evaluate_region(spec.provider, region, allowed, point="fallback-zone")
        if record is not None:
            record(f"residency.{decision.verdict}", decision.to_record())
            record(
                "infra.zone.skipped",
                {"zone": zone, "region": region, "reason": f"not in the target region {spec.region}"},
            )
    return zones


def _no_capacity(spec: HostSpec, tried: list[tuple[str, str]]) -> CapacityError:
    zones = ", ".join(z for z, _ in tried)
    why = "; ".join(f"{z}: {reason}" for z, reason in tried)
    return CapacityError(
        f"no capacity for {spec.instance_type} in any allowed zone of {spec.region} (zones tried: {zones}). {why}",
        region=spec.region,
    )


def place(
    provider: Provider,
    spec: HostSpec,
    *,
    migration_id: str,
    allowed_jurisdictions: Sequence[str],
    fallback_zones: Sequence[str] = (),
    record: Recorder | None = None,
) -> Host:
    """Residency of the target region (exit 2), then each candidate zone: capacity and launch.

    Returns the host launched (or found: a retried migration finds its instance in whichever zone it
    landed). Raises CapacityError (exit 2) naming the zones tried when none has room or is offered.
    """
    check_region(spec.provider, spec.region, allowed_jurisdictions, point="provision", record=record)
    tried: list[tuple[str, str]] = []
    for zone in candidate_zones(spec, fallback_zones, allowed_jurisdictions, record):
        zspec = replace(spec, zone=zone)
        label = zone or f"{spec.region} (any zone)"
        try:
            provider.check_capacity(zspec)
            host = provider.provision(zspec, migration_id=migration_id)
        except CapacityError as exc:
            if exc.rule == "quota":
                raise
            tried.append((label, exc.message.removeprefix("denied by capacity: ")))
            if record is not None:
                record("infra.zone.no-capacity", {"zone": label, "instance_type": spec.instance_type})
            continue
        if record is not None:
            record(
                "infra.provisioned",
                {
                    "provider": host.provider,
                    "region": host.region,
                    "zone": host.zone,
                    "host": host.name,
                    "instance_id": host.instance_id,
                    "zones_tried": [z for z, _ in tried] + [label],
                },
            )
        return host
    raise _no_capacity(spec, tried)


def check_zones(
    provider: Provider,
    spec: HostSpec,
    *,
    allowed_jurisdictions: Sequence[str],
    fallback_zones: Sequence[str] = (),
    record: Recorder | None = None,
) -> list[Any]:
    """Preflight: the candidate zones whose capacity check passes (launches nothing). Raises like
    :func:`place` when none does."""
    check_region(spec.provider, spec.region, allowed_jurisdictions, point="plan", record=record)
    ok: list[Any] = []
    tried: list[tuple[str, str]] = []
    for zone in candidate_zones(spec, fallback_zones, allowed_jurisdictions, record):
        try:
            provider.check_capacity(replace(spec, zone=zone))
        except CapacityError as exc:
            if exc.rule == "quota":
                raise
            tried.append((zone or spec.region, exc.message.removeprefix("denied by capacity: ")))
            continue
        ok.append(zone)
    if not ok:
        raise _no_capacity(spec, tried)
    return ok

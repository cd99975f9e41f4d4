"""Data residency: where a migration's data may live, decided from ``regions.json``.

A plan declares ``data.allowed_jurisdictions`` (ISO countries such as ``DE``, blocs such as ``EU``,
``EEA``, ``EFTA``, or ``LOCAL`` / ``ANY``). Every place the data will touch is checked against it:
the target region (plan validation, provisioning), every store bucket's region and every stream
endpoint (transfer), and every candidate of the cost planner. A region the map does not know is
denied, not guessed. Each check yields a :class:`ResidencyDecision`; callers pass ``record`` (for
example ``Migration.record``) to have every decision written to the audit log, allow or deny.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from gpumigrate.audit import AuditLog
from gpumigrate.errors import GpumigrateError, InvalidInputError, PolicyDeniedError, ResidencyError
from gpumigrate.interfaces import Jurisdiction, Provider
from gpumigrate.plan import Plan
from gpumigrate.settings import state_root

RULE = "data-residency"
CLASSIFICATION_RULE = "data-classification"
ENCRYPTED_CLASSES = ("confidential", "restricted")  # data.classification values that must be encrypted
PROVIDERS = ("aws", "gcp", "local")
BUCKET_PROVIDERS = {"s3": "aws", "gs": "gcp"}

# (event, data) -> None; Migration.record and AuditLog.append both fit.
Recorder = Callable[[str, dict[str, Any]], Any]


@dataclass(frozen=True)
class ResidencyDecision:
    """One residency verdict, as written to the audit log."""

    point: str  # where it was enforced: plan, provision, store, stream, cost-planner
    provider: str
    region: str
    jurisdiction: Jurisdiction | None
    allowed: tuple[str, ...]
    verdict: Literal["allow", "deny"]
    reason: str
    rule: str = RULE

    def to_record(self) -> dict[str, Any]:
        j = self.jurisdiction
        return {
            "rule": self.rule,
            "point": self.point,
            "provider": self.provider,
            "region": self.region,
            "jurisdiction": {"country": j.country, "blocs": list(j.blocs)} if j else None,
            "allowed": list(self.allowed),
            "verdict": self.verdict,
            "reason": self.reason,
        }


@lru_cache(maxsize=1)
def region_data() -> dict[str, Any]:
    """The parsed ``regions.json`` (format in infra/DATA.md)."""
    text = resources.files("gpumigrate.infra").joinpath("regions.json").read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


def known_regions(provider: str) -> list[str]:
    return sorted(region_data()["regions"].get(provider, {}))


def _blocs_of(country: str) -> tuple[str, ...]:
    if country == "LOCAL":
        return ("LOCAL",)
    return tuple(sorted(b for b, members in region_data()["blocs"].items() if country in members))


def lookup(provider: str, region: str) -> Jurisdiction | None:
    """The jurisdiction of ``region`` or None when the map does not know it."""
    data = region_data()
    country = data["regions"].get(provider, {}).get(region)
    if country is None:
        return None
    return Jurisdiction(country=country, blocs=_blocs_of(country), source=data["sources"].get(provider, "regions.json"))


def jurisdiction(provider: str, region: str) -> Jurisdiction:
    """Jurisdiction of a region; raises ResidencyError (exit 2) for a region the map does not know."""
    if provider not in PROVIDERS:
        raise InvalidInputError(f"unknown provider {provider!r}: allowed are {', '.join(PROVIDERS)}")
    found = lookup(provider, region)
    if found is None:
        raise ResidencyError(
            f"region {region!r} of provider {provider} is not in the residency map (infra/regions.json): "
            "an unknown region is denied, not guessed",
            region=region,
        )
    return found


def permits(allowed: Iterable[str], where: Jurisdiction) -> bool:
    codes = set(allowed)
    return "ANY" in codes or where.country in codes or bool(codes.intersection(where.blocs))


def evaluate_region(provider: str, region: str, allowed: Sequence[str], *, point: str = "target") -> ResidencyDecision:
    """Decide without raising. ``ANY`` allows every region, even one the map does not know."""
    allowed_t = tuple(allowed)
    where = lookup(provider, region) if provider in PROVIDERS else None
    if "ANY" in allowed_t:
        return ResidencyDecision(
            point, provider, region, where, allowed_t, "allow", "the data policy allows ANY jurisdiction"
        )
    if where is None:
        reason = f"region {region!r} of provider {provider} is not in the residency map: denied, not guessed"
        return ResidencyDecision(point, provider, region, None, allowed_t, "deny", reason)
    label = where.country + (f" ({', '.join(where.blocs)})" if where.blocs else "")
    if permits(allowed_t, where):
        return ResidencyDecision(point, provider, region, where, allowed_t, "allow", f"{region} is in {label}")
    reason = f"{provider} region {region} is in {label}, outside the allowed jurisdictions {', '.join(allowed_t)}"
    return ResidencyDecision(point, provider, region, where, allowed_t, "deny", reason)


def enforce(decision: ResidencyDecision, record: Recorder | None = None) -> ResidencyDecision:
    """Write the decision to the audit log (when given a recorder) and raise ResidencyError on deny."""
    if record is not None:
        record(f"residency.{decision.verdict}", decision.to_record())
    if decision.verdict == "deny":
        raise ResidencyError(f"{decision.point}: {decision.reason}", region=decision.region)
    return decision


def check_region(
    provider: str, region: str, allowed: Sequence[str], *, point: str = "target", record: Recorder | None = None
) -> ResidencyDecision:
    """Raise ResidencyError (exit 2, rule data-residency, names the region) unless ``region`` is allowed."""
    return enforce(evaluate_region(provider, region, allowed, point=point), record)


def store_location(
    store_url: str, store_region: str | None, *, target_provider: str | None = None, target_region: str | None = None
) -> tuple[str, str | None, str]:
    """Where a store keeps the image: (provider, region or None when unknown, enforcement point).

    ``s3://`` is an AWS bucket and ``gs://`` a GCS bucket in ``store_region``; ``file://`` is this
    machine (LOCAL) unless ``store_region`` names where that disk is; ``stream://`` and ``nixl://`` go
    straight to the target, so they live wherever the target lives.
    """
    scheme = store_url.split("://", 1)[0]
    if scheme == "s3":
        return "aws", store_region, "store"
    if scheme == "gs":
        return "gcp", store_region, "store"
    if scheme == "file":
        if store_region is None:
            return "local", "local", "store"
        owner = next((p for p in PROVIDERS if lookup(p, store_region)), "local")
        return owner, store_region, "store"
    if scheme in ("stream", "nixl"):  # receivers on the target host
        return target_provider or "local", target_region, "stream"
    raise InvalidInputError(f"store {store_url!r}: scheme must be file, s3, gs, stream or nixl")


def check_store(
    store_url: str,
    store_region: str | None,
    allowed: Sequence[str],
    *,
    target_provider: str | None = None,
    target_region: str | None = None,
    record: Recorder | None = None,
) -> ResidencyDecision:
    """Check an image store (bucket region) or stream endpoint (the target's region) before any byte moves."""
    provider, region, point = store_location(
        store_url, store_region, target_provider=target_provider, target_region=target_region
    )
    if region is None:
        allowed_t = tuple(allowed)
        what = "the stream's target region" if point == "stream" else "transfer.store_region"
        if "ANY" in allowed_t:
            decision = ResidencyDecision(
                point, provider, "unknown", None, allowed_t, "allow", "the data policy allows ANY"
            )
        else:
            reason = f"{store_url}: the region of this store is unknown ({what} is not set): denied, not guessed"
            decision = ResidencyDecision(point, provider, "unknown", None, allowed_t, "deny", reason)
        return enforce(decision, record)
    return check_region(provider, region, allowed, point=point, record=record)


def check_store_location(
    store_url: str,
    allowed: Sequence[str],
    *,
    locate: Callable[[str], str | None],
    plan_region: str | None = None,
    target_provider: str | None = None,
    target_region: str | None = None,
    record: Recorder | None = None,
) -> ResidencyDecision:
    """Residency of the image store from where it really is, before any byte moves.

    A bucket's location comes from the cloud's own API through ``locate`` (S3 GetBucketLocation, the GCS
    bucket's ``location``: ``gpumigrate.transfer.store_region``), never from the plan; a plan whose
    ``transfer.store_region`` disagrees with it is denied too (it would mislead every later reader).
    ``file://`` and ``stream://`` stores are checked as :func:`check_store` does.
    """
    scheme = store_url.split("://", 1)[0]
    provider = BUCKET_PROVIDERS.get(scheme)
    if provider is None:
        return check_store(
            store_url,
            plan_region,
            allowed,
            target_provider=target_provider,
            target_region=target_region,
            record=record,
        )
    allowed_t = tuple(allowed)
    try:
        real = locate(store_url)
    except GpumigrateError as exc:
        reason = f"{store_url}: the bucket's location could not be read: {exc.message}"
        return enforce(ResidencyDecision("bucket", provider, "unknown", None, allowed_t, "deny", reason), record)
    if real is None:
        reason = f"{store_url}: the cloud reports no location for this bucket: denied, not guessed"
        return enforce(ResidencyDecision("bucket", provider, "unknown", None, allowed_t, "deny", reason), record)
    if plan_region is not None and plan_region.lower() != real.lower():
        reason = f"{store_url} is in {real}, the plan's transfer.store_region says {plan_region}: correct the plan"
        where = lookup(provider, real)
        return enforce(ResidencyDecision("bucket", provider, real, where, allowed_t, "deny", reason), record)
    decision = evaluate_region(provider, real, allowed_t, point="bucket")
    reason = f"{decision.reason} (the bucket's location as its cloud reports it)"
    return enforce(replace(decision, reason=reason), record)


def check_classification(
    plan: Plan, *, key_locations: Sequence[tuple[str, str | None]] = (), record: Recorder | None = None
) -> list[ResidencyDecision]:
    """``data.classification`` enforced before anything moves: ``confidential`` and ``restricted`` data
    travels only encrypted (``transfer.encryption_key``), and wherever the key is held — each
    ``(provider, region)`` of ``key_locations``, from :func:`key_locations` — must be allowed as well:
    a key kept in a forbidden jurisdiction hands the data there. ``region`` None: held where the cloud
    chooses (GCP automatic replication), denied unless ``ANY``. Raises PolicyDeniedError (exit 2)."""
    allowed = tuple(plan.data.allowed_jurisdictions)
    cls, key = plan.data.classification, plan.transfer.encryption_key
    t = plan.target
    if cls in ENCRYPTED_CLASSES and key is None:
        reason = (
            f"data classified {cls} travels only encrypted: set transfer.encryption_key "
            "({env: NAME} or {file: PATH}, the image key by reference)"
        )
        verdict: Literal["allow", "deny"] = "deny"
    else:
        verdict = "allow"
        reason = f"data classified {cls}: " + ("encrypted with the plan's image key" if key else "encryption optional")
    decision = ResidencyDecision(
        "classification", t.provider, t.region, None, allowed, verdict, reason, rule=CLASSIFICATION_RULE
    )
    if record is not None:
        record(f"residency.{verdict}", decision.to_record())
    if verdict == "deny":
        raise PolicyDeniedError(CLASSIFICATION_RULE, reason, region=t.region)
    decisions = [decision]
    for provider, region in key_locations:
        if region is None:
            if "ANY" in allowed:
                held = ResidencyDecision(
                    "key", provider, "automatic", None, allowed, "allow", "the data policy allows ANY"
                )
            else:
                why = (
                    "the image key's secret is replicated where the cloud chooses (automatic replication): "
                    "use user-managed replication in allowed locations"
                )
                held = ResidencyDecision("key", provider, "automatic", None, allowed, "deny", why)
            decisions.append(enforce(held, record))
        else:
            decisions.append(check_region(provider, region, allowed, point="key", record=record))
    return decisions


@runtime_checkable
class SecretHolder(Protocol):
    """A cloud provider whose secrets manager can say where a secret is held (AWS and GCP both)."""

    def secret_held_in(self, name: str, region: str) -> list[str | None]:
        """The regions the secret ``name`` (asked in ``region``) lives in; None: where the cloud chooses."""
        ...


def key_locations(plan: Plan, provider: Provider) -> list[tuple[str, str | None]]:
    """Where the plan's image key is held in a cloud: the target's secret (``target.bootstrap.image_key_secret``)
    asked of the secrets manager itself (AWS: the secret's region; GCP: its replicas' locations). A key
    given by env var or file is held by the orchestrator and the target, not in a cloud region: none."""
    boot = plan.target.bootstrap
    name = boot.image_key_secret if boot is not None else None
    if not name or plan.target.provider not in ("aws", "gcp") or not isinstance(provider, SecretHolder):
        return []
    return [(plan.target.provider, where) for where in provider.secret_held_in(name, plan.target.region)]


def validate_plan_residency(plan: Plan, *, record: Recorder | None = None) -> list[ResidencyDecision]:
    """Residency at plan validation, offline: the target region, the image store as the plan states it,
    and the classification's need for encryption. Raises on the first deny. The preflight checks the
    bucket's and the key's real locations besides (:func:`check_store_location`, :func:`check_classification`
    with :func:`key_locations`)."""
    allowed = plan.data.allowed_jurisdictions
    decisions = [check_region(plan.target.provider, plan.target.region, allowed, point="plan", record=record)]
    decisions.append(
        check_store(
            plan.transfer.store,
            plan.transfer.store_region,
            allowed,
            target_provider=plan.target.provider,
            target_region=plan.target.region,
            record=record,
        )
    )
    decisions += check_classification(plan, record=record)
    return decisions


def policy_audit_log() -> AuditLog:
    """The audit log for policy decisions made outside a migration (``gpumigrate plan validate``)."""
    return AuditLog(Path(state_root()) / "audit" / "policy.jsonl")

"""EC2 capacity and quota: the instance type's GPUs, the zones that offer it, the family's On-Demand
vCPU quota (Service Quotas), and EC2's capacity and quota refusals as policy denials (exit 2).

:class:`Ec2Capacity` is the capacity half of :class:`gpumigrate.infra.aws.AwsProvider`, kept apart
so each half reads at a sitting; it needs the provider's ``client(service, region)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from gpumigrate.errors import CapacityError, GpumigrateError, InvalidInputError, ProviderError
from gpumigrate.interfaces import HostSpec

T = TypeVar("T")

# Service Quotas codes of the EC2 On-Demand vCPU quotas, by instance family prefix.
QUOTA_CODES: dict[str, tuple[str, str]] = {
    "p": ("L-417A185B", "Running On-Demand P instances"),
    "g": ("L-DB2E81BA", "Running On-Demand G and VT instances"),
    "vt": ("L-DB2E81BA", "Running On-Demand G and VT instances"),
    "dl": ("L-6E869C2A", "Running On-Demand DL instances"),
    "inf": ("L-1945791B", "Running On-Demand Inf instances"),
    "trn": ("L-2C3B7624", "Running On-Demand Trn instances"),
    "f": ("L-74FC7D96", "Running On-Demand F instances"),
    "x": ("L-7295265B", "Running On-Demand X instances"),
}
STANDARD_QUOTA = ("L-1216C47A", "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances")

CAPACITY_CODES = {"InsufficientInstanceCapacity", "InsufficientHostCapacity", "InsufficientCapacity", "Unsupported"}
QUOTA_ERROR_CODES = {"VcpuLimitExceeded", "InstanceLimitExceeded", "MaxSpotInstanceCountExceeded"}
QUOTA_UNAVAILABLE = {
    "NoSuchResourceException",
    "UnknownOperationException",
    "AccessDeniedException",
    "ServiceException",
}


def family_of(instance_type: str) -> str:
    m = re.match(r"^([a-z]+)", instance_type)
    return m.group(1) if m else ""


def quota_for(instance_type: str) -> tuple[str, str]:
    """(quota code, quota name) of the vCPU quota that ``instance_type`` counts against."""
    fam = family_of(instance_type)
    for prefix in sorted(QUOTA_CODES, key=len, reverse=True):
        if fam == prefix or (len(prefix) == 1 and fam.startswith(prefix) and fam not in QUOTA_CODES):
            return QUOTA_CODES[prefix]
    return STANDARD_QUOTA


def _gpu_matches(plan_model: str, aws_name: str) -> bool:
    return plan_model.split("-")[0].lower() in aws_name.lower()


def translate(exc: Exception, what: str, region: str) -> GpumigrateError:
    """An AWS failure as our error: capacity and quota refusals are policy denials (exit 2)."""
    if isinstance(exc, NoCredentialsError):
        return ProviderError(
            "no AWS credentials found in the standard chain (environment, shared profile, SSO, instance role)"
        )
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code, msg = err.get("Code", "Unknown"), err.get("Message", "")
        if code in CAPACITY_CODES:
            return CapacityError(f"AWS has no capacity for {what} in {region}: {code}: {msg}", region=region)
        if code in QUOTA_ERROR_CODES:
            return CapacityError(f"AWS quota refuses {what} in {region}: {code}: {msg}", region=region, rule="quota")
        return ProviderError(f"AWS {what} in {region} failed: {code}: {msg}")
    return ProviderError(f"AWS {what} in {region} failed: {type(exc).__name__}: {exc}")


class Ec2Capacity:
    """Capacity and quota checks; launches nothing."""

    check_quota: bool
    last_capacity: dict[str, Any]

    def client(self, service: str, region: str) -> Any:
        raise NotImplementedError

    def _call(self, what: str, region: str, fn: Callable[..., T], **kwargs: Any) -> T:
        """Run one API call; turn AWS errors into our errors (capacity/quota → exit 2)."""
        try:
            return fn(**kwargs)
        except (ClientError, BotoCoreError) as exc:
            raise translate(exc, what, region) from None

    def instance_type_info(self, instance_type: str, region: str) -> dict[str, Any]:
        ec2 = self.client("ec2", region)
        try:
            info: dict[str, Any] = ec2.describe_instance_types(InstanceTypes=[instance_type])["InstanceTypes"][0]
            return info
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "InvalidInstanceType":
                raise CapacityError(
                    f"instance type {instance_type!r} does not exist in AWS {region}", region=region
                ) from None
            raise translate(exc, "DescribeInstanceTypes", region) from None
        except BotoCoreError as exc:
            raise translate(exc, "DescribeInstanceTypes", region) from None

    def offered_zones(self, instance_type: str, region: str) -> list[str]:
        ec2 = self.client("ec2", region)
        resp = self._call(
            f"DescribeInstanceTypeOfferings {instance_type}",
            region,
            ec2.describe_instance_type_offerings,
            LocationType="availability-zone",
            Filters=[{"Name": "instance-type", "Values": [instance_type]}],
        )
        return sorted(o["Location"] for o in resp.get("InstanceTypeOfferings", []))

    def vcpu_quota(self, instance_type: str, region: str) -> float | None:
        """The family's On-Demand vCPU quota, or None where Service Quotas cannot answer (e.g. moto)."""
        code, _ = quota_for(instance_type)
        sq = self.client("service-quotas", region)
        try:
            return float(sq.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"])
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in QUOTA_UNAVAILABLE:
                return None
            raise ProviderError(
                f"AWS Service Quotas in {region} failed: {exc.response.get('Error', {}).get('Code')}"
            ) from None
        except NoCredentialsError as exc:
            raise translate(exc, "GetServiceQuota", region) from None
        except BotoCoreError:
            return None  # e.g. no Service Quotas endpoint here: the quota stays unchecked, the launch still enforces it

    def vcpus_in_use(self, instance_type: str, region: str) -> int:
        """vCPUs of live instances counting against the same quota as ``instance_type``."""
        code, _ = quota_for(instance_type)
        ec2 = self.client("ec2", region)
        pages = ec2.get_paginator("describe_instances").paginate(
            Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}]
        )
        types: list[str] = []
        try:
            for page in pages:
                for res in page.get("Reservations", []):
                    types += [i["InstanceType"] for i in res["Instances"] if quota_for(i["InstanceType"])[0] == code]
        except (ClientError, BotoCoreError) as exc:
            raise translate(exc, "DescribeInstances", region) from None
        total = 0
        for itype in set(types):
            vcpus = self.instance_type_info(itype, region)["VCpuInfo"]["DefaultVCpus"]
            total += vcpus * types.count(itype)
        return total

    def check_capacity(self, spec: HostSpec) -> dict[str, Any]:
        """Type exists with the GPUs asked for, is offered in the zone, and the vCPU quota has room.

        Raises CapacityError (rule capacity or quota, exit 2). Launches nothing. Returns what it saw.
        """
        if not spec.instance_type:
            raise InvalidInputError("an AWS target needs target.instance_type (e.g. p5.48xlarge)")
        region, itype = spec.region, spec.instance_type
        info = self.instance_type_info(itype, region)
        gpus = (info.get("GpuInfo") or {}).get("Gpus") or []
        gpu_count = sum(int(g.get("Count", 0)) for g in gpus)
        gpu_name = gpus[0]["Name"] if gpus else "none"
        if spec.gpu_count and gpu_count < spec.gpu_count:
            raise CapacityError(f"{itype} has {gpu_count} GPUs, the target asks for {spec.gpu_count}", region=region)
        if spec.gpu_count and spec.gpu_model != "none" and not _gpu_matches(spec.gpu_model, gpu_name):
            raise CapacityError(f"{itype} carries {gpu_name} GPUs, the target asks for {spec.gpu_model}", region=region)
        zones = self.offered_zones(itype, region)
        if not zones:
            raise CapacityError(f"instance type {itype} is not offered in any zone of {region}", region=region)
        if spec.zone and spec.zone not in zones:
            raise CapacityError(
                f"instance type {itype} is not offered in zone {spec.zone}: offered in {', '.join(zones)}",
                region=region,
            )
        vcpus = int(info["VCpuInfo"]["DefaultVCpus"])
        code, qname = quota_for(itype)
        report: dict[str, Any] = {
            "instance_type": itype,
            "gpus": f"{gpu_count} x {gpu_name}",
            "zones": zones,
            "vcpus": vcpus,
            "quota_code": code,
        }
        limit = self.vcpu_quota(itype, region) if self.check_quota else None
        if limit is None:
            report["quota"] = "unchecked: Service Quotas did not answer here; a launch over quota fails with rule quota"
        else:
            used = self.vcpus_in_use(itype, region)
            report.update(quota_limit=limit, quota_in_use=used)
            if used + vcpus > limit:
                raise CapacityError(
                    f"{itype} needs {vcpus} vCPUs of quota {code} ({qname}) in {region}: limit {limit:g}, "
                    f"in use {used}; request an increase in Service Quotas",
                    region=region,
                    rule="quota",
                )
        self.last_capacity = report
        return report

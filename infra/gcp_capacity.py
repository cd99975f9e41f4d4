"""Compute Engine capacity and quota: the machine type and its GPUs in the zone, the accelerators the
zone offers, the regional GPU quota, and GCE's capacity and quota refusals as policy denials (exit 2).

:class:`GceCapacity` is the capacity half of :class:`gpumigrate.infra.gcp.GcpProvider`, kept apart so
each half reads at a sitting; it needs the provider's ``_client(cls)`` and ``project``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

from google.api_core import exceptions as gexc
from google.cloud import compute_v1

from gpumigrate.errors import CapacityError, GpumigrateError, InvalidInputError, ProviderError
from gpumigrate.interfaces import HostSpec

T = TypeVar("T")

# Plan GPU model -> GCE accelerator type and its regional quota metric.
ACCELERATORS: dict[str, tuple[str, str]] = {
    "T4": ("nvidia-tesla-t4", "NVIDIA_T4_GPUS"),
    "L4": ("nvidia-l4", "NVIDIA_L4_GPUS"),
    "A100-40GB": ("nvidia-tesla-a100", "NVIDIA_A100_GPUS"),
    "A100-80GB": ("nvidia-a100-80gb", "NVIDIA_A100_80GB_GPUS"),
    "H100": ("nvidia-h100-80gb", "NVIDIA_H100_GPUS"),
    "H200": ("nvidia-h200-141gb", "NVIDIA_H200_GPUS"),
    "B200": ("nvidia-b200", "NVIDIA_B200_GPUS"),
}
CAPACITY_CODES = (
    "ZONE_RESOURCE_POOL_EXHAUSTED",
    "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
    "RESOURCE_POOL_EXHAUSTED",
)
QUOTA_CODES = ("QUOTA_EXCEEDED",)
_QUOTA_TEXT = re.compile(r"Quota '[A-Z0-9_]+' exceeded|quotaExceeded")


def op_error_codes(op: compute_v1.Operation) -> list[tuple[str, str]]:
    return [(e.code, e.message) for e in (op.error.errors if op.error else [])]


def translate(exc: Exception, what: str, region: str) -> GpumigrateError:
    """A GCE failure as our error: capacity and quota refusals are policy denials (exit 2).

    Operation errors carry codes (QUOTA_EXCEEDED); an HTTP 403 on insert says "Quota 'X' exceeded".
    """
    text = str(exc)
    if any(code in text for code in QUOTA_CODES) or _QUOTA_TEXT.search(text):
        return CapacityError(f"GCP quota refuses {what} in {region}: {text}", region=region, rule="quota")
    if any(code in text for code in CAPACITY_CODES):
        return CapacityError(f"GCP has no capacity for {what} in {region}: {text}", region=region)
    return ProviderError(f"GCP {what} in {region} failed: {type(exc).__name__}: {text}")


class GceCapacity:
    """Capacity and quota checks; inserts nothing."""

    project: str
    last_capacity: dict[str, Any]

    def _client(self, cls: type[T]) -> T:
        raise NotImplementedError

    def _call(self, what: str, where: str, fn: Callable[..., T], **kwargs: Any) -> T:
        try:
            return fn(**kwargs)
        except gexc.GoogleAPICallError as exc:
            raise translate(exc, what, where) from None

    @staticmethod
    def _region_of(spec: HostSpec) -> str:
        if not spec.zone:
            raise InvalidInputError("a GCP target needs target.zone (e.g. europe-west4-a)")
        return spec.region

    def machine_type(self, zone: str, machine_type: str, region: str) -> compute_v1.MachineType:
        client = self._client(compute_v1.MachineTypesClient)
        try:
            return client.get(project=self.project, zone=zone, machine_type=machine_type)
        except gexc.NotFound:
            raise CapacityError(f"machine type {machine_type} is not offered in zone {zone}", region=region) from None
        except gexc.GoogleAPICallError as exc:
            raise translate(exc, f"machine type {machine_type}", region) from None

    def accelerators_in_zone(self, zone: str, region: str) -> dict[str, int]:
        """Accelerator type name -> maximum cards per instance, for the zone."""
        client = self._client(compute_v1.AcceleratorTypesClient)
        items = self._call("list accelerator types", region, client.list, project=self.project, zone=zone)
        return {a.name: a.maximum_cards_per_instance for a in items}

    def gpu_quota(self, region: str, metric: str) -> tuple[float, float] | None:
        """(limit, usage) of a regional quota metric, or None when the region lists no such metric."""
        client = self._client(compute_v1.RegionsClient)
        reg = self._call(f"get region {region}", region, client.get, project=self.project, region=region)
        for q in reg.quotas:
            if q.metric == metric:
                return float(q.limit), float(q.usage)
        return None

    def _gpus_of(self, spec: HostSpec, mt: compute_v1.MachineType) -> tuple[str, int, bool]:
        """(accelerator type, count, built into the machine type?) for ``spec``."""
        if mt.accelerators:
            acc = mt.accelerators[0]
            return acc.guest_accelerator_type, int(acc.guest_accelerator_count), True
        if spec.gpu_count == 0:
            return "", 0, False
        if spec.gpu_model not in ACCELERATORS:
            raise CapacityError(f"GCP has no accelerator for GPU model {spec.gpu_model}", region=spec.region)
        return ACCELERATORS[spec.gpu_model][0], spec.gpu_count, False

    def check_capacity(self, spec: HostSpec) -> dict[str, Any]:
        """Machine type and GPUs offered in the zone, and the regional GPU quota has room. Raises
        CapacityError (rule capacity or quota, exit 2); inserts nothing. Returns what it saw."""
        region = self._region_of(spec)
        if not spec.instance_type:
            raise InvalidInputError("a GCP target needs target.instance_type (e.g. a2-highgpu-1g)")
        zone = str(spec.zone)
        mt = self.machine_type(zone, spec.instance_type, region)
        acc_type, count, built_in = self._gpus_of(spec, mt)
        report: dict[str, Any] = {
            "machine_type": spec.instance_type,
            "zone": zone,
            "gpus": f"{count} x {acc_type or 'none'}",
        }
        if spec.gpu_count and spec.gpu_model in ACCELERATORS and acc_type != ACCELERATORS[spec.gpu_model][0]:
            raise CapacityError(
                f"{spec.instance_type} carries {acc_type or 'no GPUs'}, the target asks for {spec.gpu_model}",
                region=region,
            )
        if spec.gpu_count and count < spec.gpu_count:
            raise CapacityError(
                f"{spec.instance_type} has {count} GPUs, the target asks for {spec.gpu_count}", region=region
            )
        if count:
            offered = self.accelerators_in_zone(zone, region)
            if acc_type not in offered:
                names = ", ".join(sorted(offered)) or "none"
                raise CapacityError(f"zone {zone} offers no {acc_type} (offers: {names})", region=region)
            if not built_in and count > offered[acc_type]:
                raise CapacityError(
                    f"{acc_type} allows at most {offered[acc_type]} per instance, the target asks for {count}",
                    region=region,
                )
            metric = next((m for a, m in ACCELERATORS.values() if a == acc_type), None)
            quota = self.gpu_quota(region, metric) if metric else None
            if metric and quota is None:
                raise CapacityError(f"region {region} has no {metric} quota: request one", region=region, rule="quota")
            if quota is not None:
                limit, usage = quota
                report.update(quota_metric=metric, quota_limit=limit, quota_usage=usage)
                if usage + count > limit:
                    raise CapacityError(
                        f"{count} x {acc_type} needs quota {metric} in {region}: limit {limit:g}, in use {usage:g}; "
                        "request an increase in IAM & Admin > Quotas",
                        region=region,
                        rule="quota",
                    )
        self.last_capacity = report
        return report

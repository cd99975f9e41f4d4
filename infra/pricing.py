"""Prices from the dated ``prices.json``: instance USD/hour and egress USD/GB by path.

The file (format in infra/DATA.md) carries its sources and its ``as_of`` date; every figure a
command prints comes with that date so nobody mistakes a planning number for a bill.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any, Literal

from gpumigrate.errors import InvalidInputError

EgressPath = Literal["none", "intra_region", "inter_region", "internet"]


@lru_cache(maxsize=1)
def price_data() -> dict[str, Any]:
    text = resources.files("gpumigrate.infra").joinpath("prices.json").read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


def as_of() -> str:
    return str(price_data()["as_of"])


def hourly(provider: str, region: str, instance_type: str | None) -> float:
    """On-demand USD per hour; InvalidInputError naming what is known when the file has no price."""
    table = price_data()["instances"].get(provider)
    if table is None:
        raise InvalidInputError(
            f"no prices for provider {provider!r}: known are {', '.join(price_data()['instances'])}"
        )
    if "*" in table:  # the local provider: one price for everything
        return float(table["*"]["*"])
    if not instance_type:
        raise InvalidInputError(f"a {provider} price needs an instance type")
    by_region = table.get(instance_type)
    if by_region is None:
        raise InvalidInputError(
            f"no {provider} price for instance type {instance_type!r} (prices.json as of {as_of()}): "
            f"known types are {', '.join(sorted(table))}"
        )
    if region not in by_region:
        raise InvalidInputError(
            f"no {provider} price for {instance_type} in region {region!r} (prices.json as of {as_of()}): "
            f"priced regions are {', '.join(sorted(by_region))}"
        )
    return float(by_region[region])


def machine_gpus(provider: str, instance_type: str | None) -> tuple[str, int] | None:
    """(gpu_model, gpu_count) of a known machine type, else None."""
    if not instance_type:
        return None
    info = price_data()["machines"].get(provider, {}).get(instance_type)
    return (info["gpu_model"], int(info["gpu_count"])) if info else None


def gpu_memory_gb(gpu_model: str) -> float:
    return float(price_data()["gpu_memory_gb"].get(gpu_model, 0))


def egress_path(src_provider: str, src_region: str, dst_provider: str, dst_region: str) -> EgressPath:
    """How bytes travel: within a region, between regions of one cloud, or out over the internet."""
    if src_provider == "local" and dst_provider == "local":
        return "none"
    if src_provider != dst_provider:
        return "internet"
    return "intra_region" if src_region == dst_region else "inter_region"


@dataclass(frozen=True)
class EgressHop:
    src: str  # provider:region
    dst: str
    path: EgressPath
    usd_per_gb: float

    def to_dict(self) -> dict[str, Any]:
        return {"from": self.src, "to": self.dst, "path": self.path, "usd_per_gb": self.usd_per_gb}


def egress_hop(src_provider: str, src_region: str, dst_provider: str, dst_region: str) -> EgressHop:
    """The egress charge of one hop is billed by the sending side's provider."""
    path = egress_path(src_provider, src_region, dst_provider, dst_region)
    rate = 0.0 if path == "none" else float(price_data()["egress_per_gb"][src_provider][path])
    return EgressHop(f"{src_provider}:{src_region}", f"{dst_provider}:{dst_region}", path, rate)

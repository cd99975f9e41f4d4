"""The plan's ``target`` section: the host the workload moves to, and for a cloud target its network (who
may reach it) and bootstrap (how it installs gpumigrate and starts the workload at boot, infra/BOOT.md)."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from gpumigrate.plan.base import PlanModel

GPU_MODELS = ("none", "T4", "L4", "A10G", "A100-40GB", "A100-80GB", "H100", "H200", "B200")
_ZONE_RE = re.compile(r"^[a-z][a-z0-9-]{1,40}[a-z0-9]$")
_SECRET_RE = re.compile(r"^[A-Za-z0-9/_+=.@:-]{1,512}$")
_WHEEL_RE = re.compile(r"^https://[^\s#]+\.whl#sha256=[0-9a-f]{64}$")


def _zone_in_region(zone: str, region: str) -> bool:
    """eu-central-1a is in eu-central-1 (AWS: a letter); europe-west4-a in europe-west4 (GCP: -letter)."""
    return re.fullmatch(re.escape(region) + r"-?[a-z]", zone) is not None


def _cidrs(v: list[str]) -> list[str]:
    for text in v:
        try:
            net = ipaddress.ip_network(text, strict=False)
        except ValueError:
            raise ValueError(f"{text!r} is not an address or CIDR block such as 10.0.1.15 or 10.0.2.0/24") from None
        if net.prefixlen == 0:
            raise ValueError(f"{text!r} admits every address: name the orchestrator's and front door's addresses")
    return v


class TargetNetwork(PlanModel):
    """Where a cloud target sits and who may reach it (AWS security group / GCP firewall rules).

    The agent port admits only ``orchestrator``; the service port admits ``orchestrator`` and
    ``frontdoor``. Nothing else is opened (no SSH)."""

    vpc: str | None = Field(default=None, description="AWS VPC id or GCP network name; default: the default one.")
    subnets: list[str] = Field(
        default_factory=list,
        description="AWS: subnet ids, one per zone the target may land in; GCP: the region's subnetwork. "
        "Default: the default subnet of each zone (AWS) or the network's own (GCP).",
    )
    public_ip: bool = Field(default=False, description="Give the target a public address and reach it there.")
    orchestrator: list[str] = Field(
        default_factory=list,
        description="Addresses/CIDRs the orchestrator reaches the target from. Default (private addressing "
        "only): the address this orchestrator uses towards the instance, as a /32.",
    )
    frontdoor: list[str] = Field(
        default_factory=list, description="Addresses/CIDRs of the front door (Envoy); default: the orchestrator's."
    )
    service_port: Annotated[int, Field(ge=1, le=65535)] = 8000
    agent_port: Annotated[int, Field(ge=1, le=65535)] = 7070

    @field_validator("orchestrator", "frontdoor")
    @classmethod
    def _nets(cls, v: list[str]) -> list[str]:
        return _cidrs(v)

    @model_validator(mode="after")
    def _distinct(self) -> TargetNetwork:
        if self.service_port == self.agent_port:
            raise ValueError("service_port and agent_port must differ")
        if self.public_ip and not self.orchestrator:
            raise ValueError(
                "public_ip needs 'orchestrator' (the address the orchestrator reaches the target from is "
                "not knowable from here behind NAT)"
            )
        return self


class TargetBootstrap(PlanModel):
    """How a cloud target gets gpumigrate and starts the workload at boot (infra/BOOT.md).

    Secrets reach the machine by reference only: the instance profile / service account named by
    ``identity`` reads the two secrets from AWS Secrets Manager / GCP Secret Manager at boot."""

    wheel: str | None = Field(
        default=None,
        description="https URL of the gpumigrate wheel to install, pinned: ending in #sha256=<64 hex>. "
        "Without it the machine image must have gpumigrate installed for 'python'.",
    )
    python: str = Field(default="python3", description="The interpreter on the machine image.")
    identity: str | None = Field(
        default=None, description="AWS instance profile name or ARN; GCP service account e-mail."
    )
    control_key_secret: str = Field(description="Secret name of the control key (gpumigrate/CONTROL.md).")
    image_key_secret: str | None = Field(
        default=None, description="Secret name of the image key (needed when transfer.encryption_key is set)."
    )
    timeout_s: Annotated[float, Field(gt=0, le=7200)] = 1200

    @field_validator("wheel")
    @classmethod
    def _wheel(cls, v: str | None) -> str | None:
        if v is not None and not _WHEEL_RE.match(v):
            raise ValueError("must be an https URL of a .whl pinned by its digest: https://host/path.whl#sha256=<hex>")
        return v

    @field_validator("control_key_secret", "image_key_secret")
    @classmethod
    def _secret(cls, v: str | None) -> str | None:
        if v is not None and not _SECRET_RE.match(v):
            raise ValueError("must be a secret name or ARN/resource name (letters, digits and /_+=.@:-)")
        return v

    @field_validator("python")
    @classmethod
    def _python(cls, v: str) -> str:
        if not re.match(r"^[A-Za-z0-9_./-]+$", v):
            raise ValueError("must be an interpreter name or absolute path, such as python3 or /opt/venv/bin/python")
        return v


class Target(PlanModel):
    provider: Literal["local", "aws", "gcp"]
    region: str
    zone: str | None = None
    instance_type: str | None = Field(
        default=None, description="Cloud machine type, e.g. p5.48xlarge or a3-highgpu-8g."
    )
    gpu_model: Literal["none", "T4", "L4", "A10G", "A100-40GB", "A100-80GB", "H100", "H200", "B200"] = "none"
    gpu_count: Annotated[int, Field(ge=0, le=16)] = 0
    host: str | None = Field(default=None, description="Local provider: name of the target host.")
    image: str | None = Field(default=None, description="Machine image (AMI id or GCE image) for cloud targets.")
    fallback_zones: list[str] = Field(
        default_factory=list,
        description="Other zones of the same region to try, in order, when 'zone' has no capacity.",
    )
    network: TargetNetwork = Field(default_factory=TargetNetwork, description="Cloud targets: addressing and firewall.")
    bootstrap: TargetBootstrap | None = Field(
        default=None, description="Cloud targets: how the machine installs gpumigrate and starts the workload."
    )
    rank_gpus: list[Annotated[int, Field(ge=0, le=255)]] | None = Field(
        default=None,
        description="Rank r of the workload runs on the target's GPU rank_gpus[r] (its CUDA index on that host), "
        "e.g. [1, 0] swaps two ranks' GPUs: the target starts with CUDA_VISIBLE_DEVICES in this order, so a program "
        "that puts each rank on its local rank's device lands there. One entry per rank (workload.ranks), no GPU "
        "twice; default: as the launch puts them.",
    )

    @field_validator("rank_gpus")
    @classmethod
    def _rank_gpus(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or len(set(v)) != len(v)):
            raise ValueError("must list one GPU per rank, none twice, such as [1, 0]")
        return v

    @field_validator("region")
    @classmethod
    def _region(cls, v: str) -> str:
        if not re.match(r"^[a-z][a-z0-9-]{1,40}$", v):
            raise ValueError("must be a region name such as eu-central-1, europe-west4 or local-b")
        return v

    @model_validator(mode="after")
    def _cloud_fields(self) -> Target:
        if self.provider in ("aws", "gcp") and not self.instance_type:
            raise ValueError(f"provider {self.provider} needs 'instance_type'")
        if self.provider == "gcp" and not self.zone:
            raise ValueError("provider gcp needs 'zone' (e.g. europe-west4-a)")
        if self.zone and not self.zone.startswith(self.region):
            raise ValueError(f"zone {self.zone!r} is not in region {self.region!r}")
        if self.gpu_model == "none" and self.gpu_count:
            raise ValueError("gpu_count > 0 needs a gpu_model")
        for zone in self.fallback_zones:
            if not _ZONE_RE.match(zone) or not _zone_in_region(zone, self.region):
                raise ValueError(f"fallback zone {zone!r} is not a zone of region {self.region!r}")
            if zone == self.zone:
                raise ValueError(f"fallback zone {zone!r} is the target's own zone")
        if self.provider == "local" and (self.bootstrap is not None or self.network != TargetNetwork()):
            raise ValueError("network and bootstrap are for cloud targets (aws, gcp); a local host needs neither")
        return self

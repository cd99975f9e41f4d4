"""The migration plan: a YAML file validated into typed pydantic models.

Every validation problem is reported with its field path (``target.region``,
``traffic.stages[2].weight``) and what is allowed, and the CLI turns it into exit code 2.
The plan never holds secrets: encryption keys are named by reference (an env var or a file).
"""

from __future__ import annotations

import difflib
import ipaddress
import re
import string
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gpumigrate.bounds import TransferBounds, parse_rate
from gpumigrate.errors import PlanError

_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_HOSTPORT_RE = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Endpoint(_Model):
    """Where a workload listens: ``http://host:port``."""

    url: str

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not re.match(r"^https?://[^/\s]+(:\d+)?(/.*)?$", v):
            raise ValueError("must be an http(s) URL such as http://127.0.0.1:8000")
        return v.rstrip("/")


LAUNCH_PLACEHOLDERS = ("host", "service_port", "agent_port", "agent_addr", "python", "plan_dir", "name")
_HTTP_PATH_RE = re.compile(r"^/[A-Za-z0-9._~!$&'()*+,;=:@%/-]*$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _placeholders(text: str) -> list[str]:
    """The ``{name}`` fields of a launch string (``{{``/``}}`` are literal braces)."""
    try:
        return [name for _, name, _, _ in string.Formatter().parse(text) if name is not None]
    except ValueError as exc:
        raise ValueError(f"{text!r}: {exc} (write {{{{ and }}}} for literal braces)") from None


def _check_placeholders(text: str) -> str:
    for name in _placeholders(text):
        if name not in LAUNCH_PLACEHOLDERS:
            allowed = ", ".join("{" + p + "}" for p in LAUNCH_PLACEHOLDERS)
            raise ValueError(f"{text!r} uses {{{name}}}: allowed placeholders are {allowed}")
    return text


class Launch(_Model):
    """How the workload starts on a target host. The flow starts it with ``GPUMIGRATE_AWAIT_RESTORE=1``,
    ``GPUMIGRATE_AGENT_ADDR`` and the control key's reference in its environment, waits until it is
    alive, and restores its state through the agent. Placeholders: ``{host}`` (the address to bind on
    the target), ``{service_port}``, ``{agent_port}``, ``{agent_addr}`` (host:agent_port), ``{python}``
    (the Python that runs gpumigrate there), ``{plan_dir}`` (the plan's folder, on local hosts),
    ``{name}`` (the target host's name)."""

    argv: list[str] = Field(min_length=1, description="Program and arguments; placeholders allowed.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment; placeholders allowed.")
    cwd: str | None = Field(default=None, description="Working directory, relative to the plan's folder.")
    ready_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 300

    @field_validator("argv")
    @classmethod
    def _argv(cls, v: list[str]) -> list[str]:
        for arg in v:
            _check_placeholders(arg)
        if not v[0].strip():
            raise ValueError("the program (argv[0]) is empty")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for name, value in v.items():
            if not _ENV_NAME_RE.match(name):
                raise ValueError(f"{name!r} is not an environment variable name")
            _check_placeholders(value)
        return v

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, v: str | None) -> str | None:
        return _check_placeholders(v) if v is not None else v


def _http_path(v: str) -> str:
    if not _HTTP_PATH_RE.match(v):
        raise ValueError("must be an HTTP path starting with '/', such as /readyz")
    return v


class KeyRef(_Model):
    """Where the encryption key lives. Exactly one of env/file; the key itself never enters the plan."""

    env: str | None = None
    file: str | None = None

    @model_validator(mode="after")
    def _one(self) -> KeyRef:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of 'env' (an environment variable name) or 'file' (a path)")
        if self.env is not None and not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", self.env):
            raise ValueError("'env' must be an environment variable name")
        return self


class Workload(_Model):
    name: str = Field(description="Stable name of the workload, used in tags and audit records.")
    kind: Literal["inference", "training"]
    source_host: str = Field(description="Name of the source host (a local host name or a cloud instance id).")
    endpoint: str | None = Field(default=None, description="Service URL of the source (inference).")
    agent: str | None = Field(default=None, description="host:port of the snapshot agent's control address.")
    ranks: Annotated[int, Field(ge=1, le=64)] = Field(
        default=1,
        description="World size: the workload runs as N torch.distributed ranks, each embedding the agent "
        "(attach(process_group=...)); rank r's agent listens on the agent port + r (agent is rank 0's). "
        "They freeze together and travel as one world image (snapshot/PROTOCOL.md, 'Ranks').",
    )
    source_region: str = Field(default="local-a", description="Region the source runs in (for residency).")
    source_provider: Literal["local", "aws", "gcp"] = "local"
    source_instance_type: str | None = Field(
        default=None, description="Machine type the source runs on (for the cost model); default: the target's type."
    )
    launch: Launch | None = Field(
        default=None,
        description="How the workload starts on a target (required with snapshot.backend agent: the flow starts "
        "the target's workload only this way).",
    )
    health_path: str = Field(default="/healthz", description="Answers 200 while the process lives.")
    ready_path: str = Field(default="/readyz", description="Answers 200 once the workload serves (after a restore).")
    control_key: KeyRef | None = Field(
        default=None,
        description="The control key's reference (agent, receiver); default: GPUMIGRATE_CONTROL_KEY[_FILE], "
        "else <state root>/control.key (gpumigrate/CONTROL.md).",
    )

    @field_validator("health_path", "ready_path")
    @classmethod
    def _paths(cls, v: str) -> str:
        return _http_path(v)

    @field_validator("ready_path")
    @classmethod
    def _ready_is_not_health(cls, v: str, info: ValidationInfo) -> str:
        if v == info.data.get("health_path"):
            raise ValueError(
                f"{v} is also workload.health_path: they must differ. The health path answers 200 while the process "
                "lives, also while a target awaits its restore (gpumigrate waits on it to start the target); the ready "
                "path answers 200 once it serves (after the restore). The SDK's ReadinessMiddleware serves /healthz "
                "and /readyz"
            )
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _ID_RE.match(v):
            raise ValueError("must be lowercase letters, digits and '-', 1-63 characters, starting alphanumeric")
        return v

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^https?://[^/\s]+(:\d+)?(/.*)?$", v):
            raise ValueError("must be an http(s) URL such as http://127.0.0.1:8000")
        return v.rstrip("/") if v else v

    @field_validator("agent")
    @classmethod
    def _agent(cls, v: str | None) -> str | None:
        if v is not None and not _HOSTPORT_RE.match(v):
            raise ValueError("must be host:port, such as 127.0.0.1:7070")
        if v is not None and not 0 < int(v.rsplit(":", 1)[1]) < 65536:
            raise ValueError("port must be 1-65535")
        return v

    @model_validator(mode="after")
    def _inference_needs_endpoint(self) -> Workload:
        if self.kind == "inference" and not self.endpoint:
            raise ValueError("an inference workload needs 'endpoint' (the URL clients call)")
        return self


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


class TargetNetwork(_Model):
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


class TargetBootstrap(_Model):
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


class Target(_Model):
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


class DataPolicy(_Model):
    classification: Literal["public", "internal", "confidential", "restricted"]
    allowed_jurisdictions: list[str] = Field(
        min_length=1,
        description="Countries (ISO 3166 alpha-2, e.g. DE) or blocs (EU, EEA, US, ...) the data may live in.",
    )

    @field_validator("allowed_jurisdictions")
    @classmethod
    def _codes(cls, v: list[str]) -> list[str]:
        for code in v:
            if not re.match(r"^[A-Z]{2,5}$|^ANY$|^LOCAL$", code):
                raise ValueError(
                    f"{code!r} is not a jurisdiction code: use ISO country codes (DE) or blocs (EU, EEA, US), ANY or LOCAL"
                )
        return v


class Snapshot(_Model):
    backend: Literal["agent", "cuda-driver", "criu"] = "agent"
    precopy_rounds: Annotated[int, Field(ge=0, le=50)] = 3
    max_downtime_ms: Annotated[int, Field(gt=0, le=600_000)] = 500
    freeze_lease_s: Annotated[float, Field(gt=0, le=86_400)] = Field(
        default=60,
        description="The freeze is a lease: a frozen source resumes by itself unless the orchestrator renews it "
        "within this many seconds (the flow renews it while it works on the frozen source).",
    )
    keep_parked_source: bool = Field(
        default=False,
        description="Training: after the cut-over the source stays parked at its safe point, its state zeroized, for "
        "one freeze lease (freeze_lease_s), then its process ends (exit 0). true: it stays parked until you stop it.",
    )


# Receivers (stream://, nixl://) take options after "?": the certificate pinned as
# fingerprint=sha256:<64 hex> (receiver.json gives it), connections=N, and for nixl:// the UCX
# transports (transports=tcp), landing slots per connection (slots=N) and inline=0 (every chunk by NIXL).
_RECEIVER_OPTION = (
    r"(fingerprint=sha256:[0-9a-fA-F]{64}|connections=\d{1,2}|transports=[a-z0-9_]+(,[a-z0-9_]+)*|slots=\d{1,2}"
    r"|inline=[01])"
)
_STORE_RE = re.compile(
    r"^(file://.+|s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?|gs://[a-z0-9][a-z0-9._\-]{1,61}[a-z0-9](/.*)?"
    rf"|(stream|nixl)://[A-Za-z0-9_.\-\[\]:]+:\d{{1,5}}(\?{_RECEIVER_OPTION}(&{_RECEIVER_OPTION})*)?)$"
)

# A receiver the flow starts on the target itself (flows/target_store.py): stream://target or nixl://target,
# with the sender's options but no fingerprint (the receiver makes a fresh certificate, which the flow pins).
_ON_TARGET_OPTION = r"(connections=\d{1,2}|transports=[a-z0-9_]+(,[a-z0-9_]+)*|slots=\d{1,2}|inline=[01])"
_ON_TARGET_RE = re.compile(rf"^(stream|nixl)://target(\?{_ON_TARGET_OPTION}(&{_ON_TARGET_OPTION})*)?$")


class Transfer(_Model):
    store: str = Field(
        description="file:///path, s3://bucket/prefix, gs://bucket/prefix, or a receiver: "
        "stream://host:port or nixl://host:port, optionally ?fingerprint=sha256:<hex>; "
        "stream://target or nixl://target: a receiver the flow starts on the target"
    )
    compression: Literal["auto", "none", "zstd", "byteplane"] = Field(
        default="auto",
        description="auto picks per chunk (byte-plane for float tensors, zstd, or none when a sample gains < 5%).",
    )
    encryption_key: KeyRef | None = None
    parallelism: Annotated[int, Field(ge=1, le=64)] = Field(
        default=4,
        description="Host threads a pre-copy round of the live source seals and stores its chunks with (and the "
        "connections or requests a store uses). The frozen final round takes every core: the source serves nobody "
        "then (gpumigrate/bounds.py).",
    )
    rate_limit: int | None = Field(
        default=None,
        description="Bytes per second a pre-copy round of the live source may move, device copies included: a whole "
        "number or a size per second such as 500MB/s or 2GiB/s (at least 1 MiB/s). Unset: no cap.",
    )
    pacing: Literal["adaptive", "off"] = Field(
        default="adaptive",
        description="adaptive: a pre-copy round slows down while the source's own requests (as its SDK's safe point "
        "times them) take longer than before the round, and speeds up again when they do not or the source is idle "
        "(transfer/pacing.py). off: it moves as fast as parallelism and rate_limit allow.",
    )
    store_region: str | None = Field(default=None, description="Region of the store (bucket) for residency checks.")
    restore_from: Literal["store", "source"] = Field(
        default="store",
        description="store: the target loads the image from the store. source (agent backend, a local target on the "
        "source's host): the target copies the source's tensors straight out of its memory (CUDA IPC on a GPU, "
        "NIXL for host memory), each chunk checked against the image's signed manifest (a workload of several ranks: "
        "target rank r copies source rank r's); the image is still written.",
    )

    @field_validator("rate_limit", mode="before")
    @classmethod
    def _rate(cls, v: object) -> int | None:
        return None if v is None else parse_rate(v)

    @field_validator("store")
    @classmethod
    def _store(cls, v: str) -> str:
        if not (_STORE_RE.match(v) or _ON_TARGET_RE.match(v)):
            raise ValueError(
                "must be file:///path, s3://bucket/prefix, gs://bucket/prefix, stream://host:port or "
                "nixl://host:port (a receiver's URL may add ?fingerprint=sha256:HEX with 64 hex digits), or "
                "stream://target / nixl://target (a receiver the flow starts on the target)"
            )
        return v

    def bounds(self) -> TransferBounds:
        """What a live capture round may take from its host (gpumigrate/bounds.py)."""
        return TransferBounds(self.parallelism, self.rate_limit, self.pacing)


class FieldCheck(_Model):
    """One field of the workload's JSON answer to compare between source and target."""

    field: str = Field(description="Dotted path into the JSON answer; integer parts index lists (data.0.embedding).")
    kind: Literal["numeric", "exact"] = Field(
        description="numeric: numbers (or arrays of them) within atol + rtol*|source|; exact: equal as JSON."
    )
    atol: Annotated[float, Field(ge=0)] | None = Field(default=None, description="Overrides parity.atol.")
    rtol: Annotated[float, Field(ge=0)] | None = Field(default=None, description="Overrides parity.rtol.")

    @field_validator("field")
    @classmethod
    def _path(cls, v: str) -> str:
        if not re.match(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$", v):
            raise ValueError("must be a dotted path of names and list indexes, such as embedding or data.0.embedding")
        return v


class ParityRequest(_Model):
    """How parity asks the workload a question: each golden case becomes one HTTP request."""

    method: Literal["GET", "POST", "PUT"] = "POST"
    path: str = Field(description="Request path on the service, such as /v1/generate or /embed.")
    body: Any = Field(
        default=None,
        description="null: the golden case without its id, as is. Otherwise a JSON template: a string that is "
        "exactly '{name}' becomes the case's value of that name.",
    )
    headers: dict[str, str] = Field(default_factory=dict)
    compare: list[FieldCheck] = Field(min_length=1, description="Which fields of the JSON answer to compare, and how.")
    timeout_s: Annotated[float, Field(gt=0, le=600)] = 30

    @field_validator("path")
    @classmethod
    def _p(cls, v: str) -> str:
        return _http_path(v)


class StreamRequest(_Model):
    """A streamed request the ramp sends to each side every interval, through the front door's probe listener: its
    server-sent events give the time to first token and the gaps between tokens that the ramp's gates read."""

    path: str = Field(description="Request path on the service, such as /v1/completions.")
    body: Any = Field(
        description="The JSON body (POST), asking for a stream; a template as in parity.request: a string that is "
        "exactly '{name}' becomes the golden case's value of that name (the first cases are sent)."
    )
    headers: dict[str, str] = Field(default_factory=dict)
    text_field: str | None = Field(
        default=None,
        description="Dotted path of each event's text (choices.0.text, choices.0.delta.content): only events that "
        "carry text count as tokens, and both sides' streamed texts must be equal. Default: every data event.",
    )
    timeout_s: Annotated[float, Field(gt=0, le=600)] = 30

    @field_validator("path")
    @classmethod
    def _p(cls, v: str) -> str:
        return _http_path(v)

    @field_validator("text_field")
    @classmethod
    def _field(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$", v):
            raise ValueError("must be a dotted path of names and list indexes, such as choices.0.text")
        return v


class TrainingParity(_Model):
    """Training: the target's next steps must give the losses the source gives for the same steps."""

    steps: Annotated[int, Field(ge=1, le=1000)] = 3
    atol: Annotated[float, Field(ge=0)] = 0.0
    rtol: Annotated[float, Field(ge=0)] = 0.0


class Parity(_Model):
    golden_inputs: str | None = Field(default=None, description="JSONL file of golden inputs, relative to the plan.")
    request: ParityRequest | None = Field(default=None, description="How golden inputs are asked (inference).")
    stream: StreamRequest | None = Field(
        default=None,
        description="A streamed request (an LLM server's): the ramp's gates then read time to first token and "
        "inter-token gaps from it, through the front door, per side (traffic.gates.max_ttft_ratio, ...).",
    )
    training: TrainingParity = Field(default_factory=TrainingParity)
    atol: Annotated[float, Field(ge=0)] = 1e-5
    rtol: Annotated[float, Field(ge=0)] = 1e-4
    environment: dict[str, Literal["must_match", "may_differ"]] = Field(default_factory=dict)


class Stage(_Model):
    weight: Annotated[float, Field(gt=0, le=100, description="Percent of traffic to the target.")]
    hold_s: Annotated[float, Field(ge=0, le=86_400)] = 10


class Gates(_Model):
    min_success_rate: Annotated[float, Field(ge=0, le=1)] = 0.999
    max_p99_ratio: Annotated[float, Field(ge=1)] = 1.5
    max_p99_ms: Annotated[float, Field(gt=0)] | None = None
    min_requests: Annotated[int, Field(ge=1)] = 20
    failures_to_rollback: Annotated[int, Field(ge=1, le=10)] = 1
    max_ttft_ratio: Annotated[float, Field(ge=1)] = Field(
        default=2.0,
        description="With parity.stream: the target's p99 time to first token over the source's (same window).",
    )
    max_inter_token_ratio: Annotated[float, Field(ge=1)] = Field(
        default=1.5, description="With parity.stream: the target's p99 gap between two tokens over the source's."
    )
    max_inter_token_ms: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="With parity.stream: the largest gap between two tokens any probe may see."
    )


def _default_stages() -> list[Stage]:
    return [Stage(weight=w) for w in (1, 5, 25, 50, 100)]


class Traffic(_Model):
    stages: list[Stage] = Field(default_factory=_default_stages, min_length=1)
    gates: Gates = Field(default_factory=Gates)
    analysis_interval_s: Annotated[float, Field(gt=0, le=600)] = 2.0
    rollback_window_s: Annotated[float, Field(ge=0, le=7 * 86_400)] = 600
    manual_gate: bool = False
    drain_s: Annotated[float, Field(ge=0, le=3600)] = Field(
        default=60,
        description="On a rollback, how long the target keeps serving the work in flight on it (its own streams, and "
        "those it continues for the source's clients after a hand-over) before it is torn down.",
    )

    @field_validator("stages")
    @classmethod
    def _increasing(cls, v: list[Stage]) -> list[Stage]:
        weights = [s.weight for s in v]
        if any(b <= a for a, b in zip(weights, weights[1:], strict=False)):
            raise ValueError(f"stage weights must strictly increase, got {weights}")
        if weights[-1] != 100:
            raise ValueError(f"the last stage must be the cutover at weight 100, got {weights[-1]}")
        return v


class Cost(_Model):
    horizon_hours: Annotated[float, Field(gt=0, le=24 * 365)] = 24 * 30
    min_savings_usd: Annotated[float, Field(ge=0)] = 0
    schedule: str | None = Field(default=None, description="cron expression for scheduled cost-driven moves")
    candidates: list[str] = Field(
        default_factory=list, description="provider:region[:instance_type] the cost planner may propose"
    )


class Plan(_Model):
    version: Literal[1] = 1
    workload: Workload
    target: Target
    data: DataPolicy
    snapshot: Snapshot = Field(default_factory=Snapshot)
    transfer: Transfer
    parity: Parity = Field(default_factory=Parity)
    traffic: Traffic = Field(default_factory=Traffic)
    cost: Cost = Field(default_factory=Cost)

    @model_validator(mode="after")
    def _cross(self) -> Plan:
        # Messages of rules that span sections start with the field they ask for: parse_plan reports
        # them under that path.
        if self.snapshot.backend == "agent" and self.workload.launch is None:
            raise ValueError(
                "workload.launch: required with snapshot.backend agent: how gpumigrate starts the workload on the "
                "target (argv, env, cwd; see examples/byo/plan.yaml for a service, examples/train/plan.yaml for "
                "a training loop)"
            )
        if self.parity.golden_inputs is not None and self.parity.request is None:
            raise ValueError(
                "parity.request: required with parity.golden_inputs: the method and path each golden input is "
                "sent to, the request body, and which fields of the answer are compared (see examples/byo/plan.yaml)"
            )
        stream = self.parity.stream
        if stream is not None and self.parity.golden_inputs is None and _has_placeholder(stream.body):
            raise ValueError(
                "parity.golden_inputs: required when parity.stream.body has placeholders ('{name}' strings are filled "
                "from the golden cases); or write the streamed request's body out in full"
            )
        if self.snapshot.backend == "cuda-driver" and self.target.provider != "local":
            raise ValueError(
                "snapshot.backend cuda-driver restores on the same host only: use agent or criu across hosts"
            )
        boot = self.target.bootstrap
        if boot is not None and self.transfer.encryption_key is not None and boot.image_key_secret is None:
            raise ValueError(
                "target.bootstrap.image_key_secret is needed: the target must read the image key "
                "(transfer.encryption_key) from a secrets manager to restore the image"
            )
        gpus = self.target.rank_gpus
        if gpus is not None and len(gpus) != self.workload.ranks:
            raise ValueError(
                f"target.rank_gpus: lists {len(gpus)} GPU(s) for a workload of {self.workload.ranks} rank(s) "
                "(workload.ranks): one GPU per rank, rank 0's first"
            )
        launch_env = self.workload.launch.env if self.workload.launch is not None else {}
        if gpus is not None and "CUDA_VISIBLE_DEVICES" in launch_env:
            raise ValueError(
                "target.rank_gpus: the launch's env sets CUDA_VISIBLE_DEVICES too; say the ranks' GPUs in one place"
            )
        if self.transfer.restore_from == "source" and (
            self.snapshot.backend != "agent" or self.target.provider != "local"
        ):
            raise ValueError(
                "transfer.restore_from: source needs snapshot.backend agent and a local target on the source's host "
                "(the target copies the source's memory; target rank r from source rank r); use store to load the "
                "image from the store"
            )
        if _ON_TARGET_RE.match(self.transfer.store) and self.target.provider != "local":
            raise ValueError(
                f"transfer.store {self.transfer.store} starts a receiver on the target, which gpumigrate does on "
                f"local hosts only: for a {self.target.provider} target use a bucket in its region (s3://, gs://) "
                "or a receiver you run there (stream://HOST:PORT?fingerprint=sha256:HEX)"
            )
        return self


def _has_placeholder(template: Any) -> bool:
    """Whether a body template holds a string that is exactly ``{name}`` (parity/request.py fills those)."""
    if isinstance(template, str):
        return len(template) > 2 and template[0] == "{" and template[-1] == "}" and template[1:-1].isidentifier()
    if isinstance(template, dict):
        return any(_has_placeholder(v) for v in template.values())
    if isinstance(template, list):
        return any(_has_placeholder(v) for v in template)
    return False


def _loc(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("function-after", "function-before") or str(part).startswith(("function-", "literal[")):
            continue
        else:
            path += ("." if path else "") + str(part)
    return path or "(plan)"


def _unknown_field(loc: tuple[int | str, ...]) -> str:
    """An unknown field's message: the fields allowed where it stands, and the closest one."""
    model: Any = Plan
    for part in loc[:-1]:
        if isinstance(part, int):  # an item of a list: _model_in already took the list's item model
            continue
        field = model.model_fields.get(str(part)) if model is not None else None
        model = _model_in(field.annotation) if field is not None else None
    if model is None:
        return "unknown field (check the spelling; see examples/ for the allowed fields)"
    allowed = sorted(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown field: {hint}allowed here: {', '.join(allowed)}"


def _model_in(annotation: Any) -> Any:
    """The pydantic model an annotation holds (itself, or inside Optional/list/Annotated), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


_NAMED_FIELD = re.compile(r"^([a-z_]+(?:\.[a-z_]+)+): (.+)$", re.DOTALL)


def parse_plan(data: object, source: str = "<plan>") -> Plan:
    """Validate already-parsed YAML/JSON data. Raises :class:`PlanError` with field paths."""
    if not isinstance(data, dict):
        raise PlanError(
            source, [("(plan)", "the plan must be a YAML mapping with workload, target, data and transfer")]
        )
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            msg = err["msg"].removeprefix("Value error, ")
            loc = _loc(err["loc"])
            if err["type"] == "extra_forbidden":
                msg = _unknown_field(err["loc"])
            elif err["type"] == "missing":
                msg = "required field is missing"
            elif loc == "(plan)" and (named := _NAMED_FIELD.match(msg)):
                loc, msg = named.group(1), named.group(2)
            problems.append((loc, msg))
        raise PlanError(source, problems) from None


MAX_ALIASES = 20


class _PlanLoader(yaml.SafeLoader):
    """Safe YAML with a cap on aliases: a few are fine (``yaml.safe_dump`` writes them for shared values), but
    nested ones expand exponentially wherever a value is walked (``parity.request.body`` is free-form)."""

    aliases = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise yaml.YAMLError(f"more than {MAX_ALIASES} aliases (*name): write the values out")
        node: yaml.Node | None = super().compose_node(parent, index)
        return node


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file."""
    p = Path(path)
    if p.is_dir():
        raise PlanError(str(p), [("(file)", "is a directory: give a plan file (YAML) inside it")])
    if not p.is_file():
        raise PlanError(str(p), [("(file)", "no such file")])
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=_PlanLoader)  # noqa: S506 (a SafeLoader)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise PlanError(str(p), [("(yaml)", f"not valid YAML{where}: {first}")]) from None
    except RecursionError:
        raise PlanError(str(p), [("(yaml)", "nested too deeply to be a plan")]) from None
    return parse_plan(data, str(p))


def resolve_relative(plan_path: str | Path, value: str) -> Path:
    """Paths inside a plan are relative to the plan file."""
    v = Path(value)
    return v if v.is_absolute() else (Path(plan_path).parent / v).resolve()

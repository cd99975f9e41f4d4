"""The plan's ``workload`` section: what moves, where its source runs, and how it starts on a target
(``workload.launch``, the contract gpumigrate/launch.py carries out)."""

from __future__ import annotations

import re
import string
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from gpumigrate.plan.base import KeyRef, PlanModel, http_path

_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_HOSTPORT_RE = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")


class Endpoint(PlanModel):
    """Where a workload listens: ``http://host:port``."""

    url: str

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not re.match(r"^https?://[^/\s]+(:\d+)?(/.*)?$", v):
            raise ValueError("must be an http(s) URL such as http://127.0.0.1:8000")
        return v.rstrip("/")


LAUNCH_PLACEHOLDERS = ("host", "service_port", "agent_port", "agent_addr", "python", "plan_dir", "name")
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


class Launch(PlanModel):
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


class Workload(PlanModel):
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
        return http_path(v)

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

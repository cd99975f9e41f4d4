"""What every part of the plan builds on: a strict, frozen pydantic model (an unknown field is an error, a
validated plan never changes), the HTTP path check the workload and parity sections share, and the reference
by which a secret is named (the secret itself never enters the plan)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, model_validator

_HTTP_PATH_RE = re.compile(r"^/[A-Za-z0-9._~!$&'()*+,;=:@%/-]*$")


class PlanModel(BaseModel):
    """Every part of the plan: a misspelt field is an error rather than a default silently taken, and a validated
    plan cannot change under the flow that reads it."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def http_path(v: str) -> str:
    if not _HTTP_PATH_RE.match(v):
        raise ValueError("must be an HTTP path starting with '/', such as /readyz")
    return v


class KeyRef(PlanModel):
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

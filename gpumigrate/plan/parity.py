"""The plan's ``parity`` section: how parity asks the workload questions (golden requests, a streamed
request) and compares the source's and the target's answers, or a training job's next losses."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from gpumigrate.plan.base import PlanModel, http_path


class FieldCheck(PlanModel):
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


class ParityRequest(PlanModel):
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
        return http_path(v)


class StreamRequest(PlanModel):
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
        return http_path(v)

    @field_validator("text_field")
    @classmethod
    def _field(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$", v):
            raise ValueError("must be a dotted path of names and list indexes, such as choices.0.text")
        return v


class TrainingParity(PlanModel):
    """Training: the target's next steps must give the losses the source gives for the same steps."""

    steps: Annotated[int, Field(ge=1, le=1000)] = 3
    atol: Annotated[float, Field(ge=0)] = 0.0
    rtol: Annotated[float, Field(ge=0)] = 0.0


class Parity(PlanModel):
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

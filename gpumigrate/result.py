"""The JSON contract of ``migrate`` and ``demo`` (last line of stdout with ``--json``).

Fields not reached are ``None`` (JSON null), never invented.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class PhaseResult(BaseModel):
    status: str
    seconds: float | None = None


class Requests(BaseModel):
    total: int | None = None
    failed: int | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    measured_by: str | None = Field(
        default=None,
        description="What the request figures count and where they come from: every request through the front "
        "door from the first freeze to the end of the migration, from the front door's access log.",
    )


class Bytes(BaseModel):
    image: int | None = None
    sent: int | None = None
    stored: int | None = None
    preloaded: int | None = Field(
        default=None,
        description="Bytes the target loaded from the pre-copy images while the source ran (a backend that pre-loads).",
    )
    restored: int | None = Field(
        default=None,
        description="Bytes the final restore loaded: what the final image changed since the last pre-load "
        "(a backend that pre-loads; the whole image when nothing was pre-loaded).",
    )


class ParitySummary(BaseModel):
    passed: bool | None = None
    cases: int | None = None
    max_abs_err: float | None = None


class RollbackSummary(BaseModel):
    triggered: bool | None = None
    reason: str | None = None
    seconds_to_detect: float | None = None
    trigger: str | None = Field(
        default=None,
        description="What rolled it back: gate, inconclusive, manual (a request, the run page's form), cancel "
        "(Prefect's Cancel), lease (the control plane, when the ramp stopped renewing), external, error, parity.",
    )
    actor: str | None = Field(default=None, description="Who asked for it, as they said (the form's 'acting as').")


class Streams(BaseModel):
    """A workload that streams (an LLM server): what its clients' streams went through."""

    handed_over: int | None = Field(
        default=None, description="Requests in flight the source handed to the restored target (their streams relayed)."
    )
    handover_ms: float | None = Field(
        default=None,
        description="From the freeze to the hand-over: no moved stream paused longer than this at the cut-over.",
    )
    probes: dict[str, dict[str, float | int | None]] | None = Field(
        default=None,
        description="The ramp's streamed probes over the whole ramp, per side: streams, errors, ttft_p99_ms, "
        "itl_p99_ms, itl_max_ms (through the front door's probe listener; parity.stream).",
    )


class MigrationResult(BaseModel):
    migration_id: str | None = None
    status: Literal["completed", "rolled_back", "denied", "failed"]
    phases: dict[str, PhaseResult] = Field(default_factory=dict)
    requests: Requests = Field(default_factory=Requests)
    downtime_ms: float | None = Field(
        default=None,
        description="Inference: the client-visible stall, the longest extra wait any request through the front door "
        "saw around the freeze (its duration beyond the median before the freeze; 0 when no request was in flight "
        "then), from the front door's access log; the same in the report, the Prefect artifacts and `status`. Null "
        "where not measured (training: see pause_ms; a front door that is not gpumigrate's).",
    )
    pause_ms: float | None = Field(
        default=None,
        description="Training: from the source's freeze to the target's first completed step after its restore.",
    )
    bytes: Bytes = Field(default_factory=Bytes)
    streams: Streams = Field(default_factory=Streams)
    parity: ParitySummary = Field(default_factory=ParitySummary)
    rollback: RollbackSummary = Field(default_factory=RollbackSummary)
    error: str | None = None
    report: str | None = Field(default=None, description="Path of the human report (markdown/HTML).")
    chart: str | None = Field(default=None, description="Path of the ramp chart (PNG).")

    @property
    def exit_code(self) -> int:
        return {"completed": 0, "denied": 2, "rolled_back": 3, "failed": 1}[self.status]

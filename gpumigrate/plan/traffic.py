"""The plan's ``traffic`` section: the ramp's stages, the gates each analysis interval is judged by, and
the rollback window (traffic/ramp/ runs them)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from gpumigrate.plan.base import PlanModel


class Stage(PlanModel):
    weight: Annotated[float, Field(gt=0, le=100, description="Percent of traffic to the target.")]
    hold_s: Annotated[float, Field(ge=0, le=86_400)] = 10


class Gates(PlanModel):
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


class Traffic(PlanModel):
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

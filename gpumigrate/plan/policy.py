"""The plan's two policies: ``data``, where the workload's data may live (infra/residency.py checks it
before any byte moves), and ``cost``, when a cost-driven move pays (infra/cost.py, flows/cost_move.py)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator

from gpumigrate.plan.base import PlanModel


class DataPolicy(PlanModel):
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


class Cost(PlanModel):
    horizon_hours: Annotated[float, Field(gt=0, le=24 * 365)] = 24 * 30
    min_savings_usd: Annotated[float, Field(ge=0)] = 0
    schedule: str | None = Field(default=None, description="cron expression for scheduled cost-driven moves")
    candidates: list[str] = Field(
        default_factory=list, description="provider:region[:instance_type] the cost planner may propose"
    )

"""The outcome of one parity check: built by ``output.py``, written out by ``report.py``.

Its own module, below both, so the report does not import the code that runs the check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class OutputParityResult:
    passed: bool
    cases: int
    max_abs_err: float | None
    failures: list[str]
    seconds: float  # the whole check: querying both sides, judging, writing reports
    judge_seconds: float  # building the frame and validating it (GX included when used)
    judged_by: str  # "great_expectations" or "rules" (the fast path)
    artifacts: dict[str, str] = field(default_factory=dict)  # name -> path

    def summary(self) -> dict[str, Any]:
        """The ``parity`` fields of the CLI's JSON contract (gpumigrate.result.ParitySummary)."""
        return {"passed": self.passed, "cases": self.cases, "max_abs_err": self.max_abs_err}

    def to_dict(self) -> dict[str, Any]:
        return {**self.summary(), "failures": self.failures, "seconds": round(self.seconds, 4),
                "judge_seconds": round(self.judge_seconds, 4), "judged_by": self.judged_by,
                "artifacts": self.artifacts}  # fmt: skip

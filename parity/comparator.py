"""Comparators implementing :class:`gpumigrate.interfaces.OutputComparator`.

:class:`ToleranceComparator` is the fast path for the traffic gates' live probes: pandas + numpy,
no Great Expectations import, about a millisecond for a handful of cases. :class:`GXComparator`
judges with the GX suite (the preflight smoke test). Both build the same frame with the same rules
(:mod:`gpumigrate.parity.rules`); tests check that they agree on the same inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpumigrate.interfaces import ParityReport
from gpumigrate.parity.rules import Rules, Verdict, build_frame, evaluate


def _report(verdict: Verdict, passed: bool, extra: Sequence[str] = ()) -> ParityReport:
    failures = list(verdict.failures) + list(extra)
    return ParityReport(passed=passed, cases=verdict.cases, max_abs_err=verdict.max_abs_err, failures=tuple(failures))


class ToleranceComparator:
    """Fast comparison with the parity rules (exact ids, abs+rel tolerance for floats, NaN/shape checks)."""

    def __init__(self, atol: float = 1e-5, rtol: float = 1e-4, *, rules: Rules | None = None) -> None:
        self.rules = rules or Rules(atol=atol, rtol=rtol)

    def verdict(self, source: Sequence[Mapping[str, Any]], target: Sequence[Mapping[str, Any]]) -> Verdict:
        return evaluate(build_frame(source, target, self.rules), self.rules)

    def compare(self, source: Sequence[Mapping[str, Any]], target: Sequence[Mapping[str, Any]]) -> ParityReport:
        verdict = self.verdict(source, target)
        return _report(verdict, verdict.passed)


class GXComparator:
    """The same rules judged by the Great Expectations suite (imports GX on first use: seconds)."""

    def __init__(self, atol: float = 1e-5, rtol: float = 1e-4, *, rules: Rules | None = None) -> None:
        self.rules = rules or Rules(atol=atol, rtol=rtol)

    def compare(self, source: Sequence[Mapping[str, Any]], target: Sequence[Mapping[str, Any]]) -> ParityReport:
        from gpumigrate.parity.gx_suite import validate_frame

        frame = build_frame(source, target, self.rules)
        verdict = evaluate(frame, self.rules)
        outcome = validate_frame(frame)
        extra = []
        if outcome.success != verdict.passed:  # would mean the suite and the rules drifted apart
            extra.append(f"GX suite and rules disagree (gx={outcome.success}, rules={verdict.passed}): failing closed")
        return _report(verdict, outcome.success and verdict.passed, extra)

"""The ramp's judgement of a stage, apart from the loop that gathers its figures (controller.py): which
window an interval is judged over, and when the verdicts promote the stage or end the ramp.

A fail counts toward ``failures_to_rollback`` consecutive fails. Past the stage's hold, a pass promotes the
stage and an inconclusive interval counts toward ``max_inconclusive``; past that, ``inconclusive_policy``
decides (default ``rollback``: a canary nobody could judge is not promoted). An interval whose figures could
not be read is inconclusive too, so a dead Envoy cannot hold the split (and the lease) forever.
"""

from __future__ import annotations

import time

from gpumigrate.traffic.analysis import Analysis, Measurement, Verdict
from gpumigrate.traffic.ramp.records import StageRecord
from gpumigrate.traffic.ramp.settings import RampSettings
from gpumigrate.traffic.state import DesiredState
from gpumigrate.traffic.stats import ClusterWindow, StatsSnapshot, window


class RolledBack(Exception):
    """The ramp ends with all traffic on the source: why, what triggered it (the result's ``trigger``), and
    the monotonic time the trouble was first seen, where known (it gives ``seconds_to_detect``)."""

    def __init__(self, reason: str, trigger: str, detect_from: float | None) -> None:
        super().__init__(reason)
        self.reason, self.trigger, self.detect_from = reason, trigger, detect_from


def analysis_window(
    snaps: list[StatsSnapshot], target: str, min_requests: int
) -> tuple[dict[str, ClusterWindow], float]:
    """Shortest trailing window (in intervals, within the stage) with min_requests target requests."""
    cur = snaps[-1]
    for old in reversed(snaps[:-1]):
        w = window(old, cur)
        if w[target].requests >= min_requests:
            return w, cur.ts - old.ts
    return window(snaps[0], cur), cur.ts - snaps[0].ts


def baseline_analysis(baseline_p99: float | None, source_requests: int) -> Analysis:
    """A baseline interval's analysis: inconclusive (the source alone is not judged), with the baseline so far."""
    return Analysis(
        Verdict.INCONCLUSIVE,
        [
            Measurement(
                "baseline_p99_ms",
                Verdict.PASS if baseline_p99 else Verdict.INCONCLUSIVE,
                baseline_p99,
                None,
                f"source p99 over {source_requests} requests",
            )
        ],
    )


class StageJudge:
    """One stage's verdicts, interval by interval. ``started``: when the stage's weight was applied
    (monotonic), from which its hold runs."""

    def __init__(self, rec: StageRecord, settings: RampSettings, started: float) -> None:
        self.rec, self.settings, self.started = rec, settings, started
        self.fails = 0
        self.fail_from: float | None = None  # when the first window of the current run of fails began

    def unreadable(self, reason: str) -> None:
        """An interval whose figures could not be read: inconclusive, never a pass."""
        self.rec.intervals += 1
        self.rec.inconclusive += 1
        self._inconclusive_policy(reason)

    def passed(self, analysis: Analysis, window_s: float) -> bool:
        """Whether this interval's analysis promotes the stage; raises :class:`RolledBack` where it ends the ramp."""
        rec = self.rec
        rec.intervals += 1
        if analysis.verdict == Verdict.FAIL:
            self.fails += 1
            self.fail_from = self.fail_from if self.fail_from is not None else time.monotonic() - window_s
            if self.fails >= self.settings.gates.failures_to_rollback:
                rec.outcome = "rolled_back"
                raise RolledBack(f"gate failed at {rec.weight:g}%: {analysis.reason}", "gate", self.fail_from)
            return False
        self.fails, self.fail_from = 0, None
        if time.monotonic() - self.started + 1e-3 < rec.hold_s:
            return False
        if analysis.verdict == Verdict.PASS:
            return True
        rec.inconclusive += 1
        self._inconclusive_policy(analysis.reason)
        return False

    def _inconclusive_policy(self, reason: str) -> None:
        """Past ``max_inconclusive`` inconclusive intervals, the ``rollback`` policy ends the ramp."""
        s, rec = self.settings, self.rec
        if rec.inconclusive > s.max_inconclusive and s.inconclusive_policy == "rollback":
            rec.outcome = "rolled_back"
            raise RolledBack(
                f"stage {rec.weight:g}% stayed inconclusive for {rec.inconclusive} intervals: {reason}",
                "inconclusive",
                None,
            )


def rolled_back_outside(state: DesiredState) -> tuple[str, None]:
    """Trigger and detection start of a rollback someone else wrote: the control plane's lease watch,
    or a person (``gpumigrate traffic rollback``, ``gpumigrate rollback ID``)."""
    trigger = "lease" if (state.rolled_back or {}).get("trigger") == "lease" else "external"
    return trigger, None

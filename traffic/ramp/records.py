"""What a ramp records: a :class:`Sample` per analysis interval, a :class:`StageRecord` per stage, the
:class:`RampResult` the flow reports, and ``ramp.json``, its live progress that any process can show
(``gpumigrate traffic watch``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gpumigrate.atomic import atomic_write_json

PROGRESS_FILE = "ramp.json"


@dataclass
class Sample:
    t: float  # seconds since the ramp started
    ts: float  # epoch seconds
    stage: int  # -1 for the baseline
    weight: float
    clusters: dict[str, dict[str, Any]]  # per upstream, over this interval alone
    window_s: float  # the analysis window (may span several intervals at low traffic)
    analysis: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "t": round(self.t, 3),
            "ts": self.ts,
            "stage": self.stage,
            "weight": self.weight,
            "clusters": self.clusters,
            "window_s": round(self.window_s, 3),
            "analysis": self.analysis,
        }


@dataclass
class StageRecord:
    index: int
    weight: float
    hold_s: float
    started_t: float
    ended_t: float | None = None
    intervals: int = 0
    inconclusive: int = 0
    outcome: str = "running"  # passed | rolled_back | running

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "weight": self.weight,
            "hold_s": self.hold_s,
            "started_t": round(self.started_t, 3),
            "ended_t": None if self.ended_t is None else round(self.ended_t, 3),
            "intervals": self.intervals,
            "inconclusive": self.inconclusive,
            "outcome": self.outcome,
        }


@dataclass
class RampResult:
    status: Literal["completed", "rolled_back"]
    stages: list[StageRecord]
    samples: list[Sample]
    baseline_p99_ms: float | None
    reason: str | None = None
    trigger: str | None = None  # gate | manual | external | inconclusive | error
    seconds_to_detect: float | None = None  # start of the first failing window → rollback decided
    rolled_back_at: float | None = None  # epoch seconds when 100% source was written
    rollback_applied_s: float | None = None  # write → every Envoy ACKed
    seconds: float = 0.0
    figures: dict[str, Any] | None = None  # what clients saw, from Envoy (ClientFigures); None if unread
    streams: dict[str, Any] | None = None  # the streamed probes over the whole ramp, per side (StreamWindow)
    final_weight: float = 0.0  # percent on the target when the ramp ended (0 after a rollback)
    progress_pct: float = 0.0  # share of the plan's stages passed (100 only when completed)

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "final_weight": self.final_weight,
            "progress_pct": round(self.progress_pct, 1),
            "figures": self.figures,
            "streams": self.streams,
            "reason": self.reason,
            "trigger": self.trigger,
            "seconds_to_detect": None if self.seconds_to_detect is None else round(self.seconds_to_detect, 3),
            "rolled_back_at": self.rolled_back_at,
            "rollback_applied_s": self.rollback_applied_s,
            "baseline_p99_ms": self.baseline_p99_ms,
            "seconds": round(self.seconds, 3),
            "stages": [s.to_json() for s in self.stages],
            "samples": [s.to_json() for s in self.samples],
        }


def write_progress(state_dir: Path, status: str, weight: float, sample: Sample | None, **extra: Any) -> None:
    """``ramp.json`` in the state directory: what ``gpumigrate traffic watch`` shows from any process."""
    doc = {
        "status": status,
        "weight": weight,
        "updated": time.time(),
        "sample": sample.to_json() if sample else None,
        **extra,
    }
    try:
        atomic_write_json(state_dir / PROGRESS_FILE, doc, mode=0o600)
    except OSError:  # progress is a view; never a reason to stop a ramp
        pass

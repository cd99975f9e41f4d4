"""The ramp's settings: the plan's ``traffic`` section (stages, analysis interval, gates) and the knobs the plan
does not carry (the baseline, the inconclusive policy, the traffic lease, how often clients' figures are read)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from gpumigrate.traffic.analysis import GateSettings

if TYPE_CHECKING:  # the control plane process never loads the plan's models
    from gpumigrate.plan import Traffic


@dataclass(frozen=True)
class RampSettings:
    stages: tuple[tuple[float, float], ...]  # (target weight percent, hold seconds)
    interval_s: float = 2.0
    gates: GateSettings = field(default_factory=GateSettings)
    baseline_intervals: int = 2
    # A source whose requests last seconds (an LLM's streams, on a loaded host) may end fewer than min_requests in
    # those intervals: the baseline then goes on measuring until it has them, for this long at most.
    baseline_max_s: float = 10.0
    max_inconclusive: int = 20
    inconclusive_policy: Literal["rollback", "hold"] = "rollback"
    apply_timeout_s: float = 20.0
    lease_intervals: int = 3  # intervals without a renewal before the control plane returns traffic by itself
    # ... but never less than this: a live controller can block this long (an admin read times out at
    # 5 s; the flow's per-interval callback calls Prefect's API) and must not lose a healthy split.
    lease_min_s: float = 10.0
    figures_every_s: float = 0.25  # how often the client figures are sampled: the downtime's resolution
    # How long the first stage waits for every Envoy to see the target pass a health check (at least
    # three intervals): a restored target is ready already, so this is Envoy's check cadence plus load.
    target_healthy_wait_s: float = 15.0

    @property
    def lease_s(self) -> float:
        """How long the control plane waits for a renewal before it takes the split back."""
        return max(self.lease_intervals * self.interval_s, self.lease_min_s, self.interval_s)

    @classmethod
    def from_plan(cls, traffic: Traffic, **extra: Any) -> RampSettings:
        """From ``gpumigrate.plan.Traffic``; ``extra`` may set any other field (gate extras via ``gates``)."""
        gates = extra.pop("gates", None) or GateSettings.from_plan(traffic.gates)
        return cls(
            stages=tuple((s.weight, s.hold_s) for s in traffic.stages),
            interval_s=traffic.analysis_interval_s,
            gates=gates,
            **extra,
        )

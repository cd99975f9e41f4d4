"""The cost model: what a move costs, what it saves, and when it pays for itself.

Migration cost = egress of the image bytes along the path they travel (source → bucket → target,
or source → target for a stream) + dual running: the target runs before it takes all traffic
(``setup_hours`` for provision/snapshot/transfer/restore plus the ramp's stage holds) and the
source stays warm through the rollback window after the cutover. Savings = (source $/h − target
$/h) × the plan's horizon. Break-even = migration cost ÷ hourly savings (hours after the cutover).
The planner ranks candidate targets by net savings and never proposes a region that the plan's
residency policy forbids (each candidate passes :func:`gpumigrate.infra.residency.evaluate_region`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpumigrate.errors import InvalidInputError
from gpumigrate.infra import pricing
from gpumigrate.infra.residency import Recorder, ResidencyDecision, evaluate_region
from gpumigrate.plan import Plan

SETUP_HOURS = 0.5  # target running before the ramp starts: provision, snapshot, transfer, restore, parity
GB = 1e9


@dataclass(frozen=True)
class Placement:
    """Where a workload runs: provider, region and machine type."""

    provider: str
    region: str
    instance_type: str | None = None

    @property
    def label(self) -> str:
        return ":".join(x for x in (self.provider, self.region, self.instance_type) if x)

    @classmethod
    def parse(cls, text: str) -> Placement:
        parts = text.split(":")
        if len(parts) not in (2, 3) or parts[0] not in ("aws", "gcp", "local") or not all(parts):
            raise InvalidInputError(
                f"cost candidate {text!r} is not provider:region[:instance_type] (provider aws, gcp or local)"
            )
        return cls(parts[0], parts[1], parts[2] if len(parts) == 3 else None)


@dataclass(frozen=True)
class CostEstimate:
    source: Placement
    target: Placement
    source_hourly_usd: float
    target_hourly_usd: float
    image_gb: float
    image_estimated: bool
    egress_hops: tuple[pricing.EgressHop, ...]
    egress_usd: float
    overlap_hours: float
    rollback_window_hours: float
    dual_running_usd: float
    horizon_hours: float
    prices_as_of: str

    @property
    def migration_cost_usd(self) -> float:
        return self.egress_usd + self.dual_running_usd

    @property
    def hourly_savings_usd(self) -> float:
        return self.source_hourly_usd - self.target_hourly_usd

    @property
    def savings_usd(self) -> float:
        """Gross savings over the horizon."""
        return self.hourly_savings_usd * self.horizon_hours

    @property
    def net_savings_usd(self) -> float:
        return self.savings_usd - self.migration_cost_usd

    @property
    def break_even_hours(self) -> float | None:
        """Hours after the cutover until the move has paid for itself; None if it never does."""
        if self.hourly_savings_usd <= 0:
            return None
        return self.migration_cost_usd / self.hourly_savings_usd

    def to_dict(self) -> dict[str, Any]:
        def r(x: float | None) -> float | None:  # money in JSON: 4 decimals, never -0.0
            return None if x is None else round(x, 4) + 0.0

        return {
            "source": self.source.label,
            "target": self.target.label,
            "source_hourly_usd": r(self.source_hourly_usd),
            "target_hourly_usd": r(self.target_hourly_usd),
            "hourly_savings_usd": r(self.hourly_savings_usd),
            "image_gb": r(self.image_gb),
            "image_estimated": self.image_estimated,
            "egress": [h.to_dict() for h in self.egress_hops],
            "egress_usd": r(self.egress_usd),
            "overlap_hours": r(self.overlap_hours),
            "rollback_window_hours": r(self.rollback_window_hours),
            "dual_running_usd": r(self.dual_running_usd),
            "migration_cost_usd": r(self.migration_cost_usd),
            "horizon_hours": r(self.horizon_hours),
            "savings_usd": r(self.savings_usd),
            "net_savings_usd": r(self.net_savings_usd),
            "break_even_hours": r(self.break_even_hours),
            "prices_as_of": self.prices_as_of,
        }


def source_placement(plan: Plan) -> Placement:
    """The source's machine type is ``workload.source_instance_type``, else assumed equal to the target's."""
    w = plan.workload
    itype = w.source_instance_type or (plan.target.instance_type if w.source_provider == plan.target.provider else None)
    if itype is None and w.source_provider != "local":
        gpus = (plan.target.gpu_model, plan.target.gpu_count)
        itype = equivalent_type(w.source_provider, *gpus)
    return Placement(w.source_provider, w.source_region, itype)


def equivalent_type(provider: str, gpu_model: str, gpu_count: int) -> str | None:
    """A priced machine type of ``provider`` with the same GPUs, for candidates given without a type."""
    machines = pricing.price_data()["machines"].get(provider, {})
    for name, info in sorted(machines.items()):
        if info["gpu_model"] == gpu_model and int(info["gpu_count"]) == gpu_count:
            return str(name)
    return None


def estimate_image_gb(plan: Plan) -> float:
    """Without a measured image: the target's GPU memory, an upper bound of the state the agent ships."""
    return pricing.gpu_memory_gb(plan.target.gpu_model) * plan.target.gpu_count


def _hops(plan: Plan, source: Placement, target: Placement) -> list[pricing.EgressHop]:
    store = plan.transfer.store
    region = plan.transfer.store_region
    if store.startswith(("s3://", "gs://")) and region:
        store_provider = "aws" if store.startswith("s3://") else "gcp"
        return [
            pricing.egress_hop(source.provider, source.region, store_provider, region),
            pricing.egress_hop(store_provider, region, target.provider, target.region),
        ]
    return [pricing.egress_hop(source.provider, source.region, target.provider, target.region)]


def estimate(
    plan: Plan,
    target: Placement | None = None,
    *,
    image_bytes: int | None = None,
    horizon_hours: float | None = None,
    setup_hours: float = SETUP_HOURS,
) -> CostEstimate:
    """Cost of moving the plan's workload to ``target`` (default: the plan's own target)."""
    if target is None:
        target = Placement(plan.target.provider, plan.target.region, plan.target.instance_type)
    source = source_placement(plan)
    if source.provider != "local" and source.instance_type is None:
        raise InvalidInputError(
            "cannot price the source: set workload.source_instance_type (the source's machine type)"
        )
    src_hourly = pricing.hourly(source.provider, source.region, source.instance_type)
    dst_hourly = pricing.hourly(target.provider, target.region, target.instance_type)
    image_gb = image_bytes / GB if image_bytes is not None else estimate_image_gb(plan)
    hops = _hops(plan, source, target)
    egress = sum(h.usd_per_gb for h in hops) * image_gb
    ramp_hours = sum(s.hold_s for s in plan.traffic.stages) / 3600
    overlap = setup_hours + ramp_hours
    window = plan.traffic.rollback_window_s / 3600
    dual = dst_hourly * overlap + src_hourly * window
    return CostEstimate(
        source=source,
        target=target,
        source_hourly_usd=src_hourly,
        target_hourly_usd=dst_hourly,
        image_gb=image_gb,
        image_estimated=image_bytes is None,
        egress_hops=tuple(hops),
        egress_usd=egress,
        overlap_hours=overlap,
        rollback_window_hours=window,
        dual_running_usd=dual,
        horizon_hours=horizon_hours if horizon_hours is not None else plan.cost.horizon_hours,
        prices_as_of=pricing.as_of(),
    )


@dataclass(frozen=True)
class Proposal:
    target: Placement
    estimate: CostEstimate
    residency: ResidencyDecision

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target.label, **self.estimate.to_dict(), "residency": self.residency.to_record()}


@dataclass
class MovePlan:
    proposals: list[Proposal] = field(default_factory=list)  # allowed and priced, best net savings first
    rejected: list[dict[str, str]] = field(default_factory=list)  # {"target", "reason"}

    def to_dict(self) -> dict[str, Any]:
        return {"proposals": [p.to_dict() for p in self.proposals], "rejected": self.rejected}


def plan_moves(
    plan: Plan,
    candidates: Sequence[str] | None = None,
    *,
    image_bytes: int | None = None,
    horizon_hours: float | None = None,
    setup_hours: float = SETUP_HOURS,
    record: Recorder | None = None,
) -> MovePlan:
    """Price every candidate the residency policy allows; say why each other one was left out."""
    texts = list(candidates) if candidates is not None else list(plan.cost.candidates)
    if not texts:
        texts = [Placement(plan.target.provider, plan.target.region, plan.target.instance_type).label]
    result = MovePlan()
    allowed = plan.data.allowed_jurisdictions
    source = source_placement(plan)
    for text in texts:
        cand = Placement.parse(text)
        decision = evaluate_region(cand.provider, cand.region, allowed, point="cost-planner")
        if record is not None:
            record(f"residency.{decision.verdict}", decision.to_record())
        if decision.verdict == "deny":
            result.rejected.append({"target": cand.label, "reason": decision.reason})
            continue
        if cand.instance_type is None and cand.provider != "local":
            itype = equivalent_type(cand.provider, plan.target.gpu_model, plan.target.gpu_count)
            if itype is None:
                reason = f"no {cand.provider} machine type with {plan.target.gpu_count} x {plan.target.gpu_model}"
                result.rejected.append({"target": cand.label, "reason": reason})
                continue
            cand = Placement(cand.provider, cand.region, itype)
        if cand == source:
            result.rejected.append({"target": cand.label, "reason": "this is where the workload runs now"})
            continue
        try:
            est = estimate(plan, cand, image_bytes=image_bytes, horizon_hours=horizon_hours, setup_hours=setup_hours)
        except InvalidInputError as exc:
            result.rejected.append({"target": cand.label, "reason": exc.message})
            continue
        result.proposals.append(Proposal(cand, est, decision))
    result.proposals.sort(key=lambda p: p.estimate.net_savings_usd, reverse=True)
    return result


def propose_moves(
    plan: Plan, candidates: Sequence[str] | None = None, *, image_bytes: int | None = None
) -> list[Proposal]:
    """Allowed, priced candidates ranked by net savings (best first). Never a forbidden region."""
    return plan_moves(plan, candidates, image_bytes=image_bytes).proposals


@dataclass(frozen=True)
class CostDecision:
    savings_usd: float  # net savings over the horizon of the best proposal (0 when there is none)
    break_even_hours: float | None
    go: bool
    reason: str
    target: str | None  # provider:region:instance_type of the best proposal
    estimate: CostEstimate | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "go": self.go,
            "target": self.target,
            "savings_usd": round(self.savings_usd, 4),
            "break_even_hours": None if self.break_even_hours is None else round(self.break_even_hours, 4),
            "reason": self.reason,
            "estimate": self.estimate.to_dict() if self.estimate else None,
        }


def evaluate_move(
    plan: Plan,
    *,
    image_bytes: int | None = None,
    horizon_hours: float | None = None,
    setup_hours: float = SETUP_HOURS,
    record: Recorder | None = None,
    moves: MovePlan | None = None,
) -> CostDecision:
    """Should the scheduled cost-driven move run now? Go when the best allowed candidate's net savings
    over the horizon reach ``cost.min_savings_usd`` (and are positive, so it breaks even in the horizon)."""
    if moves is None:
        moves = plan_moves(
            plan, image_bytes=image_bytes, horizon_hours=horizon_hours, setup_hours=setup_hours, record=record
        )
    if not moves.proposals:
        why = "; ".join(f"{r['target']}: {r['reason']}" for r in moves.rejected) or "no candidates"
        return CostDecision(0.0, None, False, f"no allowed, priced candidate ({why})", None)
    best = moves.proposals[0]
    est = best.estimate
    net, be = est.net_savings_usd, est.break_even_hours
    floor = plan.cost.min_savings_usd
    if be is None:
        more = round(-est.hourly_savings_usd, 2)
        reason = (
            f"{best.target.label} costs {more:.2f} USD/h more than the source: no savings"
            if more > 0
            else f"{best.target.label} costs the same per hour as the source "
            f"({est.target_hourly_usd:.2f} USD/h): no savings"
        )
        return CostDecision(net, None, False, reason, best.target.label, est)
    if net <= 0 or net < floor:
        reason = (
            f"{best.target.label} saves {net:.2f} USD net over {est.horizon_hours:g} h, "
            f"below the minimum {floor:.2f} USD (break-even after {be:.1f} h)"
        )
        return CostDecision(net, be, False, reason, best.target.label, est)
    reason = f"{best.target.label} saves {net:.2f} USD net over {est.horizon_hours:g} h, break-even after {be:.1f} h"
    return CostDecision(net, be, True, reason, best.target.label, est)

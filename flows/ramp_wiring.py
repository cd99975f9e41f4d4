"""The ramp phase's glue to ``traffic/``: add the target upstream, run the controller, flatten samples.

The controller is the traffic library's; this module only supplies what it needs from the
migration — the front door (control-plane dir, Envoy admin URLs), the stages and gates of the plan,
parity probes with the parity library's comparator (traffic never imports parity), the rollback
signal (``Migration.rollback_requested``) and a per-interval callback for progress and audit.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from gpumigrate.flows import frontdoor
from gpumigrate.flows.events import emit, notify
from gpumigrate.flows.prefect_artifacts import Progress

SOURCE, TARGET = "source", "target"
PROBE_CASES = 2  # golden inputs sent through Envoy to each side every interval: a few are enough


def flatten(sample: dict[str, Any]) -> dict[str, Any]:
    """One interval as the chart and the live view want it."""
    clusters = sample.get("clusters", {})
    tgt, src = clusters.get(TARGET, {}), clusters.get(SOURCE, {})
    analysis = sample.get("analysis", {})
    return {
        "t": sample.get("t"),
        "weight": sample.get("weight"),
        "stage": sample.get("stage"),
        "error_rate": tgt.get("error_rate"),
        "p99_ms": tgt.get("p99_ms"),
        "rps": tgt.get("rps"),
        "source_p99_ms": src.get("p99_ms"),
        "source_rps": src.get("rps"),
        "verdict": analysis.get("verdict"),
        "reason": (analysis.get("reason") or "")[:200],
    }


def _add_target(store: Any, host: str, port: int) -> Any:
    from gpumigrate.traffic.state import Upstream

    def change(s: Any) -> None:
        s.upstreams[TARGET] = Upstream(TARGET, host, port)
        s.primary = SOURCE
        s.weights = {name: (100.0 if name == SOURCE else 0.0) for name in s.upstreams}
        s.rolled_back = None  # a new ramp: an earlier migration's rollback mark does not apply

    return store.update(change)


class ProbeComparator:
    """Adapts the parity comparator to live probes: the prober's rows are answers in input order, the
    comparator wants each row to carry its golden case id. A comparator error is a failed round (never
    a dead probe thread, which would leave every interval inconclusive)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def compare(self, source: Any, target: Any) -> Any:
        from gpumigrate.interfaces import ParityReport

        src = [{**r, "id": f"probe-{i}"} for i, r in enumerate(source)]
        tgt = [{**r, "id": f"probe-{i}"} for i, r in enumerate(target)]
        try:
            return self.inner.compare(src, tgt)
        except Exception as exc:
            return ParityReport(
                passed=False, cases=len(src), max_abs_err=None, failures=(f"probe comparison failed: {exc}",)
            )


def _prober(ctx: Any, listener: str | None) -> Any:
    golden = ctx.golden_inputs()
    if golden is None or not listener:
        return None
    from gpumigrate.parity.comparator import ToleranceComparator
    from gpumigrate.parity.output import load_golden
    from gpumigrate.traffic.probes import Prober

    inputs = [c.request for c in load_golden(golden)][:PROBE_CASES]
    comparator = ProbeComparator(ToleranceComparator(atol=ctx.plan.parity.atol, rtol=ctx.plan.parity.rtol))
    return Prober(listener, inputs, comparator, every_s=ctx.plan.traffic.analysis_interval_s)


def run_ramp(ctx: Any) -> dict[str, Any]:
    from gpumigrate.flows.wiring import traffic_dir
    from gpumigrate.traffic.ramp import RampController, RampSettings
    from gpumigrate.traffic.state import StateStore

    m, plan = ctx.migration, ctx.plan
    state_dir = traffic_dir(ctx)
    door = frontdoor.read(state_dir)
    nodes = door.get("nodes") or []
    store = StateStore(state_dir)
    target = urlsplit(ctx.need("target_endpoint"))
    state = _add_target(store, target.hostname or "127.0.0.1", target.port or 80)
    if nodes:
        store.wait_applied(state.version, nodes, timeout_s=30)
    emit(m, "traffic.target_added", {"upstream": TARGET, "endpoint": ctx.need("target_endpoint"), "weight": 0})
    settings = RampSettings.from_plan(plan.traffic)
    progress = Progress(f"traffic ramp of {m.id}")
    stages = [s.weight for s in plan.traffic.stages]
    last_weight = [0.0]

    def on_interval(sample: Any) -> None:
        flat = flatten(sample.to_json())
        notify(m.id, "traffic.interval", flat)
        w = float(flat.get("weight") or 0)
        if w != last_weight[0]:
            last_weight[0] = w
            emit(m, "traffic.stage", {"weight": w, "stage": flat.get("stage")})
        done = sum(1 for s in stages if s <= w)
        progress.update(100.0 * done / len(stages))

    controller = RampController(
        state_dir,
        door["admin_urls"],
        settings,
        nodes=nodes,
        source=SOURCE,
        target=TARGET,
        prober=_prober(ctx, door.get("probe_listener")),
        rollback_signal=m.rollback_requested,
        on_interval=on_interval,
    )
    result = controller.run()
    progress.update(100.0, force=True)
    samples = [flatten(s.to_json()) for s in result.samples]
    if result.status != "completed":  # the chart shows the weight falling back to the source
        samples.append(
            {
                "t": round(result.seconds, 3),
                "weight": 0.0,
                "stage": None,
                "error_rate": None,
                "p99_ms": None,
                "source_p99_ms": None,
                "verdict": "rolled_back",
                "reason": result.reason,
            }
        )
    out = {
        "status": result.status,
        "reason": result.reason,
        "trigger": result.trigger,
        "seconds_to_detect": result.seconds_to_detect,
        "stages": len(result.stages),
        "samples": samples,
        "rollback_applied_s": result.rollback_applied_s,
    }
    if result.status != "completed":
        emit(
            m,
            "traffic.rolled_back",
            {
                "reason": (result.reason or "")[:300],
                "trigger": result.trigger,
                "seconds_to_detect": result.seconds_to_detect,
                "applied_s": result.rollback_applied_s,
            },
        )
    return out

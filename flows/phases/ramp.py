"""Ramp: the target beside the source behind the front door, then the plan's stages under live gates.

The decision of each interval is the traffic library's ramp controller (stages, gates, rollback on
a failed gate or a rollback request); this phase hands it what it needs from the migration — the
front door, the plan's stages and gates, parity probes judged by the parity library's comparator
(traffic never imports parity), the rollback signal, who holds the traffic lease — and records what
it decided: the outcome and its trigger (a lease the control plane took back included), and what the
clients saw through the front door during the ramp (Envoy's own stats, in the audit; the result's figures span
the whole migration: flows/client_figures.py).
With a streamed request in the plan (``parity.stream``), streamed probes through the front door give each side's
time to first token and inter-token gaps, which the gates read and the result keeps (``streams``). A training job
has no clients: nothing to shift, the phase is skipped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from gpumigrate.errors import RolledBackError
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit, notify
from gpumigrate.flows.prefect_artifacts import Progress
from gpumigrate.flows.report import Sample, merge_result, ramp_chart
from gpumigrate.interfaces import OutputComparator, ParityReport
from gpumigrate.parity.comparator import ToleranceComparator
from gpumigrate.parity.output import load_golden
from gpumigrate.parity.request import build_requests, comparator_for, stream_bodies
from gpumigrate.traffic import frontdoor
from gpumigrate.traffic.probes import Prober
from gpumigrate.traffic.ramp import RampController, RampResult, RampSettings
from gpumigrate.traffic.ramp import Sample as Interval
from gpumigrate.traffic.streamprobe import StreamProber

PROBE_CASES = 2  # golden inputs sent through Envoy to each side every interval: a few are enough
SAMPLES_KEPT = 2000


def run(ctx: RunContext) -> dict[str, Any]:
    m = ctx.migration
    if ctx.plan.workload.kind == "training":
        return {"skipped": "a training job has no clients to shift"}
    result = _drive(ctx)
    record_figures(ctx, result.figures)
    record_streams(ctx, result.streams)
    samples = [flatten(s.to_json()) for s in result.samples]
    if result.status != "completed":  # the chart shows the weight falling back to the source
        samples.append(
            {"t": round(result.seconds, 3), "weight": 0.0, "verdict": "rolled_back", "reason": result.reason}
        )
    ctx.update(ramp_samples=samples[-SAMPLES_KEPT:])
    chart = ramp_chart(samples, m.artifacts / "ramp.png", title=f"migration {m.id}")
    if chart:
        merge_result(m, chart=str(chart))
    if result.status != "completed":
        reason = result.reason or "a gate failed"
        detect = None if result.seconds_to_detect is None else round(result.seconds_to_detect, 3)
        detail = {"reason": reason[:300], "trigger": result.trigger, "seconds_to_detect": detect}
        # Written is not applied: ``applied`` says whether every Envoy confirmed the split back to the source.
        applied = result.rollback_applied_s is not None
        emit(m, "traffic.rolled_back", {**detail, "applied": applied, "applied_s": result.rollback_applied_s})
        emit(m, f"rollback.{'manual' if result.trigger == 'manual' else 'automatic'}", detail)
        merge_result(m, rollback={"trigger": result.trigger})
        raise RolledBackError(reason, seconds_to_detect=detect)
    emit(m, "traffic.cutover", {"weight": 100})
    return {"stages": len(result.stages), "intervals": len(samples)}


def _drive(ctx: RunContext) -> RampResult:
    m, plan = ctx.migration, ctx.plan
    state_dir = ctx.traffic_dir()
    door = frontdoor.read(state_dir)
    endpoint = ctx.target_endpoint()
    target = urlsplit(endpoint)
    frontdoor.add_target(state_dir, target.hostname or "127.0.0.1", target.port or 80, nodes=door.nodes)
    emit(m, "traffic.target_added", {"upstream": frontdoor.TARGET, "endpoint": endpoint, "weight": 0})
    progress = Progress(f"traffic ramp of {m.id}: share of the plan's stages passed")
    stages = [s.weight for s in plan.traffic.stages]
    last_weight = [0.0]

    def on_interval(sample: Interval) -> None:
        flat = flatten(sample.to_json())
        notify(m.id, "traffic.interval", flat)
        weight = float(flat.get("weight") or 0)
        if weight != last_weight[0]:
            last_weight[0] = weight
            emit(m, "traffic.stage", {"weight": weight, "stage": flat.get("stage")})
        progress.update(100.0 * sum(1 for s in stages if s <= weight) / len(stages))

    controller = RampController(
        state_dir,
        door.admin_urls,
        RampSettings.from_plan(plan.traffic),
        nodes=door.nodes,
        source=frontdoor.SOURCE,
        target=frontdoor.TARGET,
        prober=_prober(ctx, door.probe_listener),
        stream_prober=_stream_prober(ctx, door.probe_listener),
        rollback_signal=m.rollback_requested,
        on_interval=on_interval,
        lease_holder=lease_holder(ctx),
    )
    result = controller.run()
    progress.update(result.progress_pct, force=True)  # the truth: 100 only when every stage passed
    return result


def lease_holder(ctx: RunContext) -> str:
    """Who holds the traffic lease while this ramp runs: what ``traffic status`` and the control plane's
    log name when the lease lapses (the migration, its flow run, the process)."""
    rt = ctx.runtime
    run = ctx.migration.read().get("flow_run_id")
    return f"migration {ctx.migration.id} (flow run {run or '-'}, pid {rt.flow_pid or '-'} on {rt.flow_host or '-'})"


def record_figures(ctx: RunContext, figures: Mapping[str, Any] | None) -> None:
    """What clients saw during the ramp, from Envoy's stats, into the audit. The result's requests and downtime
    span the whole migration from its first freeze (flows/client_figures.py): one figure, never this window's."""
    if not figures:
        return
    kept = {k: v for k, v in figures.items() if isinstance(v, (str, int, float, type(None)))}
    emit(ctx.migration, "traffic.figures", {**kept, "window": "the ramp"})


def record_streams(ctx: RunContext, streams: Mapping[str, Any] | None) -> None:
    """The streamed probes over the whole ramp, per side (time to first token, inter-token gaps), into the result."""
    if not streams:
        return
    emit(ctx.migration, "traffic.streams", dict(streams))
    merge_result(ctx.migration, streams={"probes": dict(streams)})


def flatten(sample: Mapping[str, Any]) -> Sample:
    """One interval as the chart and the live view want it."""
    clusters = sample.get("clusters", {})
    tgt, src = clusters.get(frontdoor.TARGET, {}), clusters.get(frontdoor.SOURCE, {})
    tgt_streams, src_streams = tgt.get("streams") or {}, src.get("streams") or {}
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
        "in_flight": tgt.get("in_flight"),
        "source_in_flight": src.get("in_flight"),
        "itl_p99_ms": tgt_streams.get("itl_p99_ms"),
        "source_itl_p99_ms": src_streams.get("itl_p99_ms"),
        "ttft_p99_ms": tgt_streams.get("ttft_p99_ms"),
        "source_ttft_p99_ms": src_streams.get("ttft_p99_ms"),
        "verdict": analysis.get("verdict"),
        "reason": (analysis.get("reason") or "")[:200],
    }


class ProbeComparator:
    """Adapts the parity comparator to live probes: the prober's rows are answers in input order, the
    comparator wants each row to carry its golden case id. A comparator error is a failed round (never
    a dead probe thread, which would leave every interval inconclusive)."""

    def __init__(self, inner: OutputComparator) -> None:
        self.inner = inner

    def compare(self, source: Sequence[Mapping[str, Any]], target: Sequence[Mapping[str, Any]]) -> ParityReport:
        src = [{**r, "id": f"probe-{i}"} for i, r in enumerate(source)]
        tgt = [{**r, "id": f"probe-{i}"} for i, r in enumerate(target)]
        try:
            return self.inner.compare(src, tgt)
        except Exception as exc:
            return ParityReport(
                passed=False, cases=len(src), max_abs_err=None, failures=(f"probe comparison failed: {exc}",)
            )


def _prober(ctx: RunContext, listener: str | None) -> Prober | None:
    golden = ctx.golden_inputs()
    if golden is None or not listener:
        return None
    cases = load_golden(golden)[:PROBE_CASES]
    parity, every_s = ctx.plan.parity, ctx.plan.traffic.analysis_interval_s
    if parity.request is None:  # TRANSITIONAL: a plan without parity.request is asked as the reference server
        comparator = ProbeComparator(ToleranceComparator(atol=parity.atol, rtol=parity.rtol))
        return Prober(listener, [c.request for c in cases], comparator, every_s=every_s)
    if parity.request.method != "POST" or parity.request.headers:
        # The prober POSTs JSON bodies; other requests are checked by the parity phase only.
        emit(ctx.migration, "traffic.probes.skipped", {"reason": "live probes send POST requests without headers"})
        return None
    queries = build_requests(cases, parity.request)
    comparator = ProbeComparator(comparator_for(parity.request, atol=parity.atol, rtol=parity.rtol))
    return Prober(listener, [q.body for q in queries], comparator, path=parity.request.path, every_s=every_s)


def _stream_prober(ctx: RunContext, listener: str | None) -> StreamProber | None:
    """The plan's streamed request (``parity.stream``), filled from the first golden cases, to each side."""
    stream = ctx.plan.parity.stream
    if stream is None or not listener:
        return None
    golden = ctx.golden_inputs()
    cases = load_golden(golden)[:PROBE_CASES] if golden is not None else []
    bodies = stream_bodies(cases, stream)
    return StreamProber(listener, bodies, path=stream.path, text_field=stream.text_field, headers=stream.headers,
                        every_s=ctx.plan.traffic.analysis_interval_s, timeout_s=stream.timeout_s)  # fmt: skip

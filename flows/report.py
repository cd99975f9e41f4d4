"""What a migration leaves behind for people: the result contract, a markdown report and a ramp chart.

Everything here reads the migration's state record and the ramp samples; nothing needs Prefect, so
the CLI, the demo and tests build the same report. :mod:`gpumigrate.flows.prefect_artifacts`
publishes the same content as Prefect artifacts when running inside a flow.
"""

from __future__ import annotations

import base64
import datetime as dt
from pathlib import Path
from typing import Any, Literal

from gpumigrate.atomic import atomic_write_bytes, atomic_write_json
from gpumigrate.result import (
    Bytes,
    MigrationResult,
    ParitySummary,
    PhaseResult,
    Requests,
    RollbackSummary,
    Streams,
)
from gpumigrate.state import PHASES, Migration

FinalStatus = Literal["completed", "rolled_back", "denied", "failed"]
FINAL_STATUSES: tuple[FinalStatus, ...] = ("completed", "rolled_back", "denied", "failed")
Sample = dict[str, Any]  # {"t": s since ramp start, "weight": %, "error_rate": 0..1, "p99_ms": ms | None}


def ramp_chart(samples: list[Sample], path: Path, *, title: str = "") -> Path | None:
    """Plot target weight, target error rate and p99 (source and target) over the ramp. None if no samples."""
    if not samples:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display here, and never a GUI backend inside a flow
    import matplotlib.pyplot as plt

    t = [s.get("t", i) for i, s in enumerate(samples)]
    fig, (ax_w, ax_e, ax_p) = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    ax_w.step(t, [s.get("weight") or 0 for s in samples], where="post", color="tab:blue")
    ax_w.set_ylabel("target weight %")
    ax_w.set_ylim(-5, 105)
    ax_e.plot(t, [100 * (s.get("error_rate") or 0) for s in samples], color="tab:red", marker=".")
    ax_e.set_ylabel("target errors %")
    lines = [("p99_ms", "target p99", "tab:purple"), ("source_p99_ms", "source p99", "tab:gray")]
    # A streaming workload's inter-token gaps (the ramp's streamed probes), on the same axis.
    lines += [("itl_p99_ms", "target inter-token p99", "tab:orange"), ("source_itl_p99_ms", "source inter-token p99",
              "tab:olive")]  # fmt: skip
    for key, label, color in lines:
        ys = [s.get(key) for s in samples]
        if any(y is not None for y in ys):
            ax_p.plot(t, [y if y is not None else float("nan") for y in ys], label=label, color=color, marker=".")
    ax_p.set_ylabel("p99 ms")
    ax_p.set_xlabel("seconds since ramp start")
    if ax_p.get_legend_handles_labels()[0]:
        ax_p.legend(loc="upper left")
    for s_t, s in zip(t, samples, strict=False):
        if s.get("verdict") == "fail":
            for ax in (ax_w, ax_e, ax_p):
                ax.axvline(s_t, color="red", linestyle="--", linewidth=1)
    fig.suptitle(title or "traffic ramp")
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


def chart_data_uri(chart: str | Path | None) -> str | None:
    """The chart as a ``data:`` URI (PNG, base64): it displays wherever the markdown is shown, the Prefect
    UI included, with no file or URL that the reader's browser would have to reach. None without a chart."""
    if not chart:
        return None
    try:
        return "data:image/png;base64," + base64.b64encode(Path(chart).read_bytes()).decode("ascii")
    except OSError:
        return None


def build_result(migration: Migration, *, status: str | None = None, error: str | None = None) -> MigrationResult:
    """The JSON contract from the state record. Fields that no phase reached stay null."""
    state = migration.read()
    phases = state.get("phases", {})
    res = state.get("result", {})
    final_status = status or state.get("status")
    return MigrationResult(
        migration_id=migration.id,
        status=_final(final_status),
        phases={
            n: PhaseResult(status=p.get("status", "pending"), seconds=p.get("seconds"))
            for n, p in phases.items()
            if n in PHASES
        },
        requests=Requests(**res.get("requests", {})),
        downtime_ms=res.get("downtime_ms"),
        pause_ms=res.get("pause_ms"),
        bytes=Bytes(**res.get("bytes", {})),
        streams=Streams(**res.get("streams", {})),
        parity=ParitySummary(**res.get("parity", {})),
        rollback=RollbackSummary(**res.get("rollback", {})),
        error=error or res.get("error"),
        report=res.get("report"),
        chart=res.get("chart"),
    )


def _final(status: str | None) -> FinalStatus:
    """A migration that ended otherwise (still running, paused: its process died) is reported failed."""
    for known in FINAL_STATUSES:
        if status == known:
            return known
    return "failed"


def merge_result(migration: Migration, **sections: Any) -> None:
    """Fold fields into ``state.result`` (dicts are merged one level deep, None never overwrites)."""

    def change(state: dict[str, Any]) -> None:
        res = state.setdefault("result", {})
        for key, value in sections.items():
            if isinstance(value, dict):
                res.setdefault(key, {}).update({k: v for k, v in value.items() if v is not None})
            elif value is not None:
                res[key] = value

    migration.mutate(change)


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


STREAM_COLUMNS = ("in_flight", "source_in_flight", "ttft_p99_ms", "source_ttft_p99_ms", "itl_p99_ms",
                  "source_itl_p99_ms")  # fmt: skip


def stream_rows(samples: list[Sample]) -> list[dict[str, Any]]:
    """The ramp's intervals as the streams saw them: requests in flight per side (streams being answered), time
    to first token and inter-token p99 per side. Empty for a workload that does not stream."""
    if not any(s.get("itl_p99_ms") is not None or s.get("in_flight") for s in samples):
        return []
    return [{"t": s.get("t"), "weight": s.get("weight"), **{k: s.get(k) for k in STREAM_COLUMNS}} for s in samples]


def phase_rows(migration: Migration) -> list[dict[str, Any]]:
    phases = migration.read().get("phases", {})
    rows = []
    for name in PHASES:
        p = phases.get(name, {"status": "pending"})
        detail = {k: v for k, v in (p.get("result") or {}).items() if isinstance(v, (str, int, float, bool))}
        rows.append(
            {
                "phase": name,
                "status": p.get("status", "pending"),
                "seconds": p.get("seconds"),
                "detail": ", ".join(f"{k}={_fmt(v)}" for k, v in list(detail.items())[:6]),
            }
        )
    return rows


def summary_markdown(migration: Migration, result: MigrationResult, *, chart_src: str | None = None) -> str:
    """The human report. ``chart_src``: how the chart is referenced (default: its file name, beside
    ``report.md``; the Prefect artifact draws it from a data URI)."""
    state = migration.read()
    created = dt.datetime.fromtimestamp(state.get("created", 0), dt.UTC).isoformat(timespec="seconds")
    lines = [
        f"# Migration `{migration.id}`: **{result.status}**",
        "",
        f"Started {created}. Exit code {result.exit_code}.",
        "",
        "| phase | status | seconds | detail |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {r['phase']} | {r['status']} | {_fmt(r['seconds'])} | {r['detail']} |" for r in phase_rows(migration)]
    by, pa, rb = result.bytes, result.parity, result.rollback
    lines += [
        "",
        "## Figures",
        "",
        *figure_lines(result),
        *([f"- training pause (freeze → target's first step): {_fmt(result.pause_ms)} ms"] if result.pause_ms else []),
        f"- bytes: image {_fmt(by.image)}, sent {_fmt(by.sent)}, stored {_fmt(by.stored)}",
        *(
            [f"- pre-loaded: {_fmt(by.preloaded)} bytes; the final restore loaded {_fmt(by.restored)}"]
            if by.preloaded
            else []
        ),
        *_stream_lines(result),
        f"- parity: passed {_fmt(pa.passed)}, {_fmt(pa.cases)} cases, max abs err {_fmt(pa.max_abs_err)}",
        f"- rollback: triggered {_fmt(rb.triggered)}, reason {_fmt(rb.reason)}"
        + (f", detected in {seconds(rb.seconds_to_detect)}" if rb.seconds_to_detect is not None else ""),
    ]
    lines += _provenance(result)
    lines += _window(migration.id, state, result.status)
    if result.error:
        lines += ["", f"**Error:** {result.error}"]
    if result.chart:
        lines += ["", "## Ramp", "", f"![traffic ramp]({chart_src or Path(result.chart).name})"]
    lines += ["", f"Audit: `gpumigrate audit {migration.id}`.", ""]
    return "\n".join(lines)


def figure_lines(result: MigrationResult) -> list[str]:
    """The clients' figures, one way for the report, the Prefect summary, ``status`` and the CLI's summary: the
    client-visible stall (the one downtime figure) and the requests it was judged over (flows/client_figures.py)."""
    rq = result.requests
    if rq.total is None and result.downtime_ms is None:
        return []
    latency = "".join(f", {name} {_fmt(ms)} ms" for name, ms in (("p50", rq.p50_ms), ("p99", rq.p99_ms)) if ms)
    return [
        f"- downtime (client-visible stall): {_fmt(result.downtime_ms)} ms, the longest extra wait any request "
        "through the front door saw around the freeze",
        f"- requests: {_fmt(rq.total)}, {_fmt(rq.failed)} failed{latency}: every request through the front door "
        "from the first freeze to the end",
    ]


def seconds(value: float) -> str:
    """A duration as people read it: 0.989 s, 12.3 s, 95 s."""
    return f"{value:.3g} s" if value < 100 else f"{value:.0f} s"


def _stream_lines(result: MigrationResult) -> list[str]:
    """A streaming workload's figures: streams handed over at the cut-over, and the streamed probes per side."""
    st = result.streams
    out = []
    if st.handed_over is not None:
        out.append(f"- streams handed over: {_fmt(st.handed_over)}, paused at most {_fmt(st.handover_ms)} ms")
    for side, p in (st.probes or {}).items():
        out.append(
            f"- {side} streams: {_fmt(p.get('streams'))} probed, time to first token p99 {_fmt(p.get('ttft_p99_ms'))} "
            f"ms, inter-token gap p99 {_fmt(p.get('itl_p99_ms'))} ms, max {_fmt(p.get('itl_max_ms'))} ms"
        )
    return out


def _provenance(result: MigrationResult) -> list[str]:
    """Who rolled back (the form's 'acting as', Cancel, the lease)."""
    out = []
    rb = result.rollback
    if rb.triggered and (rb.trigger or rb.actor):
        out.append(f"- rolled back by: {_fmt(rb.trigger)}{f' ({rb.actor})' if rb.actor else ''}")
    return out


def _window(migration_id: str, state: dict[str, Any], status: str) -> list[str]:
    """Where the rollback window stands after a cut-over: the source warm until when, or retired."""
    runtime = state.get("runtime") or {}
    deadline = runtime.get("rollback_deadline")
    if status != "completed" or deadline is None:
        return []
    if runtime.get("source_retired") or runtime.get("source_zeroized"):
        return ["", "The source is retired (its state zeroized and verified): the cut-over is final."]
    until = dt.datetime.fromtimestamp(float(deadline), dt.UTC).isoformat(timespec="seconds")
    page = "**Resume → roll back** on the migration's run page, " if state.get("window_hold") else ""
    return [
        "",
        f"**The source is kept warm until {until}.** Until then {page}the `rollback` deployment or "
        f"`gpumigrate rollback {migration_id}` puts all traffic back on it; after it, "
        f"{'the run retires the source' if page else f'`gpumigrate retire {migration_id}` retires it'}.",
    ]


def write_report(migration: Migration, result: MigrationResult) -> Path:
    path = migration.artifacts / "report.md"
    atomic_write_bytes(path, summary_markdown(migration, result).encode())
    return path


def write_outputs(migration: Migration, *, status: str, error: str | None) -> MigrationResult:
    """Report and result contract, written to the artifacts dir; the flow, the rollback and the CLI return it."""
    result = build_result(migration, status=status, error=error)
    merge_result(migration, report=str(write_report(migration, result)))
    result = build_result(migration, status=status, error=error)
    write_report(migration, result)
    atomic_write_json(migration.artifacts / "result.json", result.model_dump(mode="json"))
    return result

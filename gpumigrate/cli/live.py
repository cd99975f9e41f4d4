"""Progress views on stderr, fed by migration events (:mod:`gpumigrate.flows.events`).

``PhaseLines`` prints one line per phase change (``gpumigrate migrate``); ``LiveView`` redraws a
table of phases, the ramp's weight and gate verdicts, and the load generator's figures
(``gpumigrate demo``); :func:`summary` prints the outcome. They only read events; a view that fails
never touches the migration. :func:`watching` is what the commands hand the flows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gpumigrate.cli.output import console
from gpumigrate.flows.events import listening
from gpumigrate.flows.report import figure_lines, seconds
from gpumigrate.result import MigrationResult
from gpumigrate.state import PHASES

_STYLE = {"completed": "green", "running": "yellow", "failed": "red", "rolled_back": "magenta", "skipped": "cyan"}


class PhaseLines:
    def __init__(self, migration_id: str) -> None:
        self.migration_id = migration_id
        self._last_pct = -1

    def on_event(self, event: str, data: dict[str, Any]) -> None:
        if event.startswith("phase.") and event.count(".") == 2:
            _, name, what = event.split(".")
            extra = ""
            if what == "completed":
                extra = "  " + ", ".join(
                    f"{k}={v}" for k, v in list(data.items())[:4] if isinstance(v, (str, int, float))
                )
            console.print(f"[{_STYLE.get(what, 'white')}]{what:>9}[/] {name}{extra}", soft_wrap=True)
        elif event == "transfer.progress" and data.get("total"):
            pct = int(100 * data["done"] / data["total"]) // 25 * 25
            if pct != self._last_pct:
                self._last_pct = pct
                console.print(f"          transfer {pct}% of {data['total']} bytes")
        elif event.startswith(("traffic.stage", "rollback.", "traffic.cutover", "traffic.gate", "work.")):
            console.print(f"          {event} {data}", soft_wrap=True)


class LiveView:
    """A rich Live panel for the demo: phases, pre-copy and transfer progress, the ramp, notable events."""

    def __init__(self, migration_id: str) -> None:
        self.migration_id = migration_id
        self.phases: dict[str, str] = dict.fromkeys(PHASES, "pending")
        self.notes: dict[str, str] = {}
        self.ramp: dict[str, Any] = {}
        self.streams = ""  # the demo's streaming clients, as they last reported
        self.events: list[str] = []
        self._lock = threading.Lock()
        self._live = Live(self._render(), console=console, refresh_per_second=4, transient=False)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def on_event(self, event: str, data: dict[str, Any]) -> None:
        with self._lock:
            if event.startswith("phase.") and event.count(".") == 2:
                _, name, what = event.split(".")
                if name in self.phases and what in ("started", "completed", "failed", "skipped"):
                    self.phases[name] = "running" if what == "started" else what
            elif event == "transfer.progress" and data.get("total"):
                self.notes["transfer"] = f"{100 * data['done'] / data['total']:.0f}% of {data['total']:,} B"
            elif event == "snapshot.precopy":
                self.notes["snapshot"] = f"pre-copy round {data.get('round')}: {data.get('bytes_dirty', 0):,} B dirty"
            elif event == "traffic.interval":
                self.ramp = data
            elif event == "demo.streams":
                self.streams = (
                    f"clients' streams: {data.get('in_flight', 0)} in flight, {data.get('completed', 0)} done, "
                    f"{data.get('broken', 0)} broken, {data.get('differ', 0)} differ; longest gap "
                    f"{data.get('max_gap_ms', 0):.0f} ms"
                )
            elif event.startswith(("traffic.stage", "traffic.cutover", "rollback.", "fault.", "traffic.gate", "work.")):
                self.events.append(
                    f"{time.strftime('%H:%M:%S')} {event} "
                    + " ".join(f"{k}={v}" for k, v in data.items() if isinstance(v, (str, int, float)))[:110]
                )
                self.events = self.events[-6:]

    def _render(self) -> Group:
        t = Table(title=f"migration {self.migration_id}", expand=False)
        t.add_column("phase")
        t.add_column("status")
        t.add_column("")
        for name, st in self.phases.items():
            t.add_row(name, Text(st, style=_STYLE.get(st, "dim")), self.notes.get(name, ""))
        parts: list[Any] = [t]
        if self.ramp:
            r = self.ramp
            parts.append(
                Text(
                    f"ramp: target weight {r.get('weight', 0):.0f}%  target errors "
                    f"{100 * (r.get('error_rate') or 0):.2f}%  p99 target {_ms(r.get('p99_ms'))} / "
                    f"source {_ms(r.get('source_p99_ms'))}  verdict {r.get('verdict', '')}"
                )
            )
            if r.get("itl_p99_ms") is not None or r.get("in_flight"):
                parts.append(
                    Text(
                        f"streams: in flight target {r.get('in_flight') or 0} / source {r.get('source_in_flight') or 0}"
                        f"  inter-token p99 target {r.get('itl_p99_ms') or 0:.1f} ms / source "
                        f"{r.get('source_itl_p99_ms') or 0:.1f} ms  first token p99 target "
                        f"{r.get('ttft_p99_ms') or 0:.0f} ms"
                    )
                )
        if self.streams:
            parts.append(Text(self.streams))
        parts += [Text(e, style="dim") for e in self.events]
        return Group(*parts)

    def __enter__(self) -> LiveView:
        self._live.start()

        def loop() -> None:
            while not self._stop.wait(0.25):
                with self._lock:
                    self._live.update(self._render())

        self._thread = threading.Thread(target=loop, name="live-view", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        with self._lock:
            self._live.update(self._render())
        self._live.stop()
        if not console.is_terminal:
            console.line()  # its last render ends without a line break where it is not a terminal (a log, a pipe)


def _ms(value: Any) -> str:
    """A p99 in the live view; a side that answered no request in the interval has none (after the cut-over, the
    source), which is no 0.0 ms."""
    return "–" if value is None else f"{float(value):.1f} ms"


def summary(result: MigrationResult) -> None:
    """The outcome in a few lines: status, requests, bytes, parity, rollback, where the report is."""
    color = {"completed": "green", "rolled_back": "magenta", "denied": "yellow"}.get(result.status, "red")
    console.print(f"[bold {color}]{result.status}[/] migration {result.migration_id} (exit {result.exit_code})")
    if result.error:
        console.print(f"  {result.error}", soft_wrap=True)
    by, pa, rb = result.bytes, result.parity, result.rollback
    for line in figure_lines(result):
        console.print(f"  {line[2:]}", soft_wrap=True, highlight=False)
    if result.pause_ms is not None:
        console.print(f"  training pause (freeze to the target's first step): {result.pause_ms:,.0f} ms")
    if by.image is not None:
        console.print(f"  bytes: image {by.image:,}, sent {by.sent or 0:,}, stored {by.stored or 0:,}")
    st = result.streams
    if st.handed_over is not None:
        console.print(f"  streams: {st.handed_over} handed over, paused at most {st.handover_ms} ms", soft_wrap=True)
    for side, p in (st.probes or {}).items():
        console.print(
            f"  {side} streams: first token p99 {p.get('ttft_p99_ms')} ms, inter-token p99 {p.get('itl_p99_ms')} ms,"
            f" max {p.get('itl_max_ms')} ms",
            soft_wrap=True,
        )
    if pa.passed is not None:
        err = f", max abs err {pa.max_abs_err:.3g}" if pa.max_abs_err is not None else ""
        console.print(f"  parity: {'passed' if pa.passed else 'FAILED'} on {pa.cases} cases{err}")
    if rb.triggered:
        detected = f" (detected in {seconds(rb.seconds_to_detect)})" if rb.seconds_to_detect is not None else ""
        console.print(f"  rollback: {rb.reason}{detected}", soft_wrap=True)
    # soft_wrap: a path must stay on one line, copy-pasteable.
    if result.report:
        console.print(f"  report: {result.report}", soft_wrap=True, highlight=False)
    if result.chart:
        console.print(f"  chart:  {result.chart}", soft_wrap=True, highlight=False)


@contextmanager
def watching(migration_id: str, *, live: bool = False) -> Iterator[None]:
    """A view of ``migration_id``'s events while the block runs: the live panel, or one line per phase."""
    if not live:
        with listening(migration_id, PhaseLines(migration_id).on_event):
            yield
        return
    view = LiveView(migration_id)
    with listening(migration_id, view.on_event), view:
        yield

"""The demo's live view where it is not a terminal (a log, a pipe: issue 35, finding 9): its last render ends with
a line break, so the next line ("completed migration ...") starts its own; after the cut-over the source answers
no request, and its p99 reads as none, not "0.0 ms"."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from gpumigrate.cli import live


def test_the_live_view_ends_its_line_and_shows_no_p99_for_a_side_without_traffic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = io.StringIO()
    piped = Console(file=out, force_terminal=False, width=200, highlight=False)
    monkeypatch.setattr(live, "console", piped)
    with live.LiveView("m-live") as view:
        view.on_event("traffic.interval", {"weight": 100, "error_rate": 0, "p99_ms": 4.25, "source_p99_ms": None,
                                           "verdict": "pass"})  # fmt: skip
        view.on_event("traffic.cutover", {"weight": 100})
    piped.print("completed migration m-live (exit 0)")
    text = out.getvalue()
    assert "p99 target 4.2 ms / source –" in text and "source 0.0 ms" not in text
    assert any(line.startswith("completed migration m-live") for line in text.splitlines()), text[-400:]

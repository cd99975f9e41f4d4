"""Streamed probes: time to first token and the gaps between tokens, per side, through the probe listener.

A generation server answers a streamed request with server-sent events (``text/event-stream``): one ``data:`` event
per chunk of tokens and, in OpenAI's format and most servers', a last ``data: [DONE]``. Request latency (Envoy's
``upstream_rq_time``) says nothing about how such an answer feels: a stream that starts late, or stalls between
tokens, can still finish in time. So every round sends the same streamed requests to each side through Envoy's probe
listener (the header route that tags each answer with its side), and times the events as their bytes arrive: the
time to the first token event (TTFT) and every gap between two token events (inter-token latency, ITL).

A *token event* is a ``data:`` event other than ``[DONE]``; with ``text_field`` (a dotted path into the event's
JSON, ``choices.0.text``) only those whose field holds a non-empty string, so that a chat stream's opening role
chunk and a closing usage chunk are not read as tokens. With ``text_field`` the two sides' streamed texts are also
compared per request, exactly (the plan's streamed request is deterministic: greedy, or seeded): a target that streams other
text fails the gate. Rounds run on their own thread; the analysis reads the timings of the rounds that finished
within its window (``window``).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from gpumigrate.traffic.probes import RoundLoop
from gpumigrate.traffic.resources import PROBE_HEADER, SIDE_HEADER

KEPT = 2000  # timed streams kept per side


@dataclass(frozen=True)
class StreamTiming:
    """One streamed answer: when it ended (monotonic), its TTFT, the gaps between its token events, its text, and
    which of the prober's requests it answered (``key``: the two sides' texts compare per request)."""

    at: float
    ttft_ms: float | None
    gaps_ms: tuple[float, ...]
    text: str | None = None
    error: str | None = None
    key: int = 0


@dataclass(frozen=True)
class StreamWindow:
    """One side's streamed answers in a window."""

    streams: int
    errors: tuple[str, ...]
    ttft_p99_ms: float | None
    itl_p99_ms: float | None
    itl_max_ms: float | None
    texts: tuple[tuple[int, str | None], ...] = field(default=())  # (request's key, streamed text)

    def to_json(self) -> dict[str, Any]:
        return {
            "streams": self.streams,
            "errors": len(self.errors),
            "ttft_p99_ms": _round(self.ttft_p99_ms),
            "itl_p99_ms": _round(self.itl_p99_ms),
            "itl_max_ms": _round(self.itl_max_ms),
        }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


def p99(values: Sequence[float]) -> float | None:
    """The 99th percentile (nearest rank) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def summarize(timings: Sequence[StreamTiming]) -> StreamWindow:
    good = [t for t in timings if t.error is None]
    gaps = [g for t in good for g in t.gaps_ms]
    return StreamWindow(
        streams=len(timings),
        errors=tuple(t.error for t in timings if t.error is not None),
        ttft_p99_ms=p99([t.ttft_ms for t in good if t.ttft_ms is not None]),
        itl_p99_ms=p99(gaps),
        itl_max_ms=max(gaps) if gaps else None,
        texts=tuple((t.key, t.text) for t in good),
    )


def _field(event: Any, path: str) -> Any:
    for part in path.split("."):
        if isinstance(event, list) and part.isdigit() and int(part) < len(event):
            event = event[int(part)]
        elif isinstance(event, dict):
            event = event.get(part)
        else:
            return None
    return event


class StreamProber(RoundLoop):
    THREAD_NAME = "stream-probes"

    def __init__(
        self,
        probe_url: str,
        bodies: Sequence[Mapping[str, Any]],
        *,
        path: str,
        source: str = "source",
        target: str = "target",
        text_field: str | None = None,
        headers: Mapping[str, str] | None = None,
        every_s: float = 1.0,
        timeout_s: float = 30.0,
    ) -> None:
        self.url = probe_url.rstrip("/") + path
        self.bodies = [dict(b) for b in bodies]
        self.source, self.target = source, target
        self.text_field = text_field
        self.headers = dict(headers or {})
        self.every_s = every_s
        self.rounds = 0
        self._timings: dict[str, deque[StreamTiming]] = {source: deque(maxlen=KEPT), target: deque(maxlen=KEPT)}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client = httpx.Client(timeout=httpx.Timeout(timeout_s), trust_env=False)

    def time_stream(self, side: str, body: Mapping[str, Any], key: int = 0) -> StreamTiming:
        """One streamed request to ``side``, timed from the moment it is sent; ``key`` names the request."""
        timing = self._time_stream(side, body)
        return replace(timing, key=key)

    def _time_stream(self, side: str, body: Mapping[str, Any]) -> StreamTiming:
        sent = time.monotonic()
        events: list[float] = []
        text: list[str] = []
        try:
            headers = {**self.headers, PROBE_HEADER: side}
            with self._client.stream("POST", self.url, json=dict(body), headers=headers) as r:
                if r.status_code != 200:
                    return StreamTiming(time.monotonic(), None, (), error=f"{side}: HTTP {r.status_code}")
                if r.headers.get(SIDE_HEADER) != side:
                    got = r.headers.get(SIDE_HEADER) or "the client split"
                    return StreamTiming(time.monotonic(), None, (), error=f"{side}: answered by {got}, not {side}")
                done = False
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        done = True
                        break
                    now = time.monotonic()
                    piece = self._token(payload)
                    if piece is None:
                        continue
                    if isinstance(piece, Exception):
                        return StreamTiming(now, None, (), error=f"{side}: {piece}")
                    events.append(now)
                    text.append(piece)
                if not done:
                    return StreamTiming(time.monotonic(), None, (), error=f"{side}: the stream ended without [DONE]")
        except httpx.HTTPError as exc:
            return StreamTiming(time.monotonic(), None, (), error=f"{side}: {type(exc).__name__}")
        if not events:
            return StreamTiming(time.monotonic(), None, (), error=f"{side}: the stream carried no token")
        gaps = tuple((b - a) * 1000 for a, b in zip(events, events[1:], strict=False))
        joined = "".join(text) if self.text_field else None
        return StreamTiming(time.monotonic(), (events[0] - sent) * 1000, gaps, joined)

    def _token(self, payload: str) -> str | Exception | None:
        """The event's text (``""`` without a text field: every event is a token), None when it is not a token
        event, an error for an event that reports one."""
        try:
            event = json.loads(payload)
        except ValueError:
            return "" if self.text_field is None else None
        if isinstance(event, dict) and "error" in event:
            err = event["error"]
            return RuntimeError(str(err.get("message") if isinstance(err, dict) else err)[:200])
        if self.text_field is None:
            return ""
        value = _field(event, self.text_field)
        return value if isinstance(value, str) and value else None

    def run_round(self) -> None:
        for key, body in enumerate(self.bodies):
            for side in (self.source, self.target):
                timing = self.time_stream(side, body, key)
                with self._lock:
                    self._timings[side].append(timing)
        with self._lock:
            self.rounds += 1

    def window(self, newer_than: float = 0.0) -> dict[str, StreamWindow]:
        """Each side's streams that ended after ``newer_than`` (monotonic seconds)."""
        with self._lock:
            return {side: summarize([t for t in kept if t.at >= newer_than]) for side, kept in self._timings.items()}

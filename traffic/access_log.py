"""What every client met at the front door, one request at a time: Envoy's access log of its client listener.

Envoy writes one JSON line per request of the client listener (never the probe listener) to
``<Envoy's work directory>/access-<node>.log``, flushed every :data:`FLUSH_MS` (format: STATE_FORMAT.md, "Access
log"). A migration marks where the log stands before its snapshot (:func:`mark`), reads the requests written since
(:func:`read_since`: a rotation in between is followed), and judges them (:func:`figures`).

Why the access log and not Envoy's counters: the figure is the longest extra wait any one request saw, which a
histogram of latencies bucketed 300-400 ms cannot tell to the millisecond, and counters sampled every 250 ms
cannot either; a held request shows no failure at all, so a "no good answer" stretch reads 0 ms for a freeze that
held every client for 18 ms (issue 35, finding 6).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIELDS = {
    "start": "%START_TIME(%s.%3f)%",  # epoch seconds the request arrived at the front door
    "ms": "%DURATION%",  # from its first byte in to its last byte out
    "code": "%RESPONSE_CODE%",  # 0: ended with no answer
    "flags": "%RESPONSE_FLAGS%",
    "upstream": "%UPSTREAM_CLUSTER%",
}
FLUSH_MS = 200  # Envoy's --file-flush-interval-msec: a request is in the file this long after it ended
ROTATE_BYTES = 64 * 1024 * 1024  # the detached door keeps the current file and one rotated one (``.1``)
BASELINE_REQUESTS = 200  # the baseline is the median of the last this many requests answered before the freeze

STALL_DEFINITION = (
    "the longest extra wait any request through the front door saw around the freeze: among the requests in "
    "flight at any moment from the first freeze to the resume, the longest duration beyond the median duration "
    "of the requests answered before the freeze (Envoy's access log)"
)
REQUESTS_DEFINITION = "every request through the front door from the first freeze to the end of the migration"


@dataclass(frozen=True)
class Request:
    start: float  # epoch seconds
    ms: float
    code: int
    upstream: str

    @property
    def end(self) -> float:
        return self.start + self.ms / 1000

    @property
    def failed(self) -> bool:
        return self.code == 0 or self.code >= 500


@dataclass(frozen=True)
class Mark:
    """Where an access log stood: its file, the file's inode and its size then."""

    path: str
    inode: int
    offset: int


def mark(path: str | Path) -> Mark:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return Mark(str(path), 0, 0)
    return Mark(str(path), st.st_ino, st.st_size)


def rotate(path: str | Path) -> bool:
    """Move a log over :data:`ROTATE_BYTES` to ``<path>.1`` (replacing the last one); True when it did (Envoy must
    then reopen its logs: ``POST /reopen_logs``)."""
    p = Path(path)
    try:
        if p.stat().st_size < ROTATE_BYTES:
            return False
    except FileNotFoundError:
        return False
    p.replace(p.with_name(p.name + ".1"))
    return True


def _lines(path: Path, offset: int) -> Iterator[bytes]:
    with contextlib.suppress(FileNotFoundError), open(path, "rb") as fh:
        fh.seek(offset)
        yield from fh


def read_since(at: Mark) -> list[Request]:
    """The requests written to the log since ``at``: the rotated file's rest when the log was rotated since."""
    current = Path(at.path)
    rotated = current.with_name(current.name + ".1")
    sources: list[tuple[Path, int]] = []
    with contextlib.suppress(FileNotFoundError):
        if at.inode and os.stat(rotated).st_ino == at.inode:
            sources.append((rotated, at.offset))
    now = mark(current)
    if at.inode and now.inode == at.inode:
        sources.append((current, at.offset))
    else:
        sources.append((current, 0))
    return [r for path, offset in sources for r in parse(_lines(path, offset))]


def parse(lines: Iterable[bytes]) -> Iterator[Request]:
    """The requests of access-log lines; a line cut short by a write in progress is skipped."""
    for raw in lines:
        try:
            doc = json.loads(raw)
            yield Request(float(doc["start"]), float(doc["ms"] or 0), int(doc["code"] or 0), str(doc.get("upstream")))
        except (ValueError, KeyError, TypeError):
            continue


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def figures(requests: Iterable[Request], *, froze_at: float, resumed_at: float | None, end: float) -> dict[str, Any]:
    """The migration's client figures (:data:`REQUESTS_DEFINITION`, :data:`STALL_DEFINITION`) from the log's
    requests: a request counts from the first freeze (``froze_at``) to ``end``; the stall is judged over the requests
    in flight between the freeze and the resume (``resumed_at``; None: the source never resumed, so up to ``end``)."""
    every = list(requests)
    span = [r for r in every if r.end >= froze_at and r.start <= end]
    before = [r.ms for r in every if r.end < froze_at and not r.failed][-BASELINE_REQUESTS:]
    until = end if resumed_at is None else resumed_at
    held = [r for r in span if r.start <= until]
    baseline = statistics.median(before) if before else 0.0
    stall = max((r.ms - baseline for r in held), default=0.0)
    durations = [r.ms for r in span]
    return {
        "requests": len(span),
        "failed": sum(1 for r in span if r.failed),
        "p50_ms": _pct(durations, 0.5),
        "p99_ms": _pct(durations, 0.99),
        "stall_ms": round(max(0.0, stall), 1),
        "baseline_ms": round(baseline, 2),
        "in_freeze": len(held),
        "freeze_s": round(until - froze_at, 3),
    }

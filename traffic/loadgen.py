"""Open-loop load generator (async httpx): a fixed request rate, whatever the latency.

Open loop matters: a closed loop (next request after the last answer) slows down when the
server does and hides exactly the stalls a migration can cause. Requests start on a fixed
schedule; each records (start, latency, ok). The report has totals, failures, latency percentiles
overall and per second, and ``downtime_ms``: the longest stretch in which no request succeeded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class LoadReport:
    url: str
    rps: float
    seconds: float
    total: int
    ok: int
    failed: int
    errors: dict[str, int]
    p50_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    downtime_ms: float
    per_second: list[dict[str, Any]] = field(default_factory=list)
    stall_ms: float | None = None  # the longest extra wait a request saw: its latency beyond the median
    achieved_rps: float = 0.0
    started_at: float | None = None  # epoch seconds of the first request (to line up fault windows)
    records: list[list[Any]] | None = None  # [start s, latency ms, ok] per request, when asked for
    skipped: int = 0  # request slots not sent because this generator was not scheduled in time (CATCH_UP_S)

    def p99_between(self, t_from: float, t_to: float) -> float | None:
        """p99 of successful requests started in [t_from, t_to) (needs ``records``)."""
        return _pct(sorted(r[1] for r in self.records or [] if r[2] and t_from <= r[0] < t_to), 0.99)

    def count_between(self, t_from: float, t_to: float) -> tuple[int, int]:
        """(failed, total) of requests started in [t_from, t_to) (needs ``records``)."""
        rows = [r for r in self.records or [] if t_from <= r[0] < t_to]
        return sum(1 for r in rows if not r[2]), len(rows)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LoadReport:
        return cls(**d)

    def to_json(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def summary(self) -> dict[str, Any]:
        """The report without its per-second rows and records: one line a person reads."""
        return {k: v for k, v in self.__dict__.items() if k not in ("per_second", "records")}

    def stall_between(self, t_from: float, t_to: float, *, baseline_before: float) -> float | None:
        """The client side of the front door's stall figure (traffic/access_log.py): among requests in flight at any
        moment in [t_from, t_to] (epoch seconds), the longest latency beyond the median latency of the requests
        answered before ``baseline_before``. Needs ``records`` and ``started_at``."""
        if not self.records or self.started_at is None:
            return None
        t0 = self.started_at
        before = sorted(r[1] for r in self.records if r[2] and t0 + r[0] + r[1] / 1000 < baseline_before)
        base = before[len(before) // 2] if before else 0.0
        held = [r[1] for r in self.records if t0 + r[0] <= t_to and t0 + r[0] + r[1] / 1000 >= t_from]
        return round(max((ms - base for ms in held), default=0.0), 1)

    def failures_between(self, t_from: float, t_to: float) -> tuple[int, int]:
        """(failed, total) for requests started in [t_from, t_to) seconds since the load began."""
        failed = total = 0
        for b in self.per_second:
            if t_from <= b["t"] < t_to:
                failed += b["failed"]
                total += b["total"]
        return failed, total


REQUEST_TIMEOUT_S = 30.0  # one request's whole deadline (LoadGenerator's default timeout_s)
REPORT_SLACK_S = 60.0  # what LoadProcess.wait allows beyond that for the process to write its report and exit
CATCH_UP_S = 1.0  # request slots later than this (the generator itself was not scheduled) are skipped, not burst


def _pct(sorted_vals: list[float], q: float) -> float | None:
    if not sorted_vals:
        return None
    i = min(len(sorted_vals) - 1, max(0, int(round(q * (len(sorted_vals) - 1)))))
    return round(sorted_vals[i], 3)


class LoadGenerator:
    """``run()`` blocks; ``start()``/``stop()`` run it on a background thread (tests, bench, demo)."""

    def __init__(
        self,
        url: str,
        *,
        rps: float,
        seconds: float,
        body: dict[str, Any] | None = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
        max_in_flight: int = 4096,
        connections: int = 64,
        bucket_s: float = 1.0,
        keep_records: bool = False,
    ) -> None:
        if rps <= 0 or seconds <= 0:
            raise ValueError("rps and seconds must be positive")
        self.url = url
        self.rps = rps
        self.seconds = seconds
        self.body = body or {"prompt": "hello", "max_new_tokens": 4}
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self.connections = connections
        self.bucket_s = bucket_s
        self.keep_records = keep_records
        self.records: list[tuple[float, float, bool, str]] = []  # (start s, latency ms, ok, error kind)
        self.started_at: float | None = None  # epoch seconds of the first request
        self.skipped = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.report: LoadReport | None = None
        self.on_start: Any = None  # called with the epoch of the first request

    async def _one(self, client: httpx.AsyncClient, t0: float, sem: asyncio.Semaphore) -> None:
        start = time.monotonic()
        try:
            # One deadline for the whole request (httpx's timeout is per phase: a wait for a pooled connection,
            # then a slow read, could each take it), so the last request ends timeout_s after it started.
            r = await asyncio.wait_for(client.post(self.url, json=self.body), self.timeout_s)
            ok, kind = r.status_code == 200, ("" if r.status_code == 200 else f"http_{r.status_code}")
        except httpx.HTTPError as exc:
            ok, kind = False, type(exc).__name__
        except TimeoutError:
            ok, kind = False, "timeout"
        finally:
            sem.release()
        self.records.append((start - t0, (time.monotonic() - start) * 1000, ok, kind))

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=self.connections, max_keepalive_connections=self.connections)
        sem = asyncio.Semaphore(self.max_in_flight)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits) as client:
            t0 = time.monotonic()
            self.started_at = time.time()
            if self.on_start is not None:
                self.on_start(self.started_at)
            # Finished tasks are dropped at once: a list of every task ever started grows for the whole
            # run, and the collector's ever longer sweeps over it show up as client latency.
            tasks: set[asyncio.Task[None]] = set()
            n = int(self.rps * self.seconds)
            i = 0
            while i < n and not self._stop.is_set():
                delay = t0 + i / self.rps - time.monotonic()
                if delay < -CATCH_UP_S:
                    # This process was not scheduled for a while (a loaded machine): the slots it slept through
                    # are not sent in one burst, which would measure this client's own backlog, not the server.
                    behind = min(int(-delay * self.rps), n - i)  # never past the run's last slot
                    self.skipped += behind
                    i += behind
                    continue
                if delay > 0:
                    await asyncio.sleep(delay)
                i += 1
                if sem.locked():  # too many in flight: count it as a failure instead of queueing silently
                    self.records.append((time.monotonic() - t0, 0.0, False, "overload"))
                    continue
                await sem.acquire()
                task = asyncio.create_task(self._one(client, t0, sem))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                await asyncio.sleep(0)  # let the requests already started make progress between two sends
            if tasks:
                await asyncio.gather(*tasks)
            self._elapsed = time.monotonic() - t0

    def run(self) -> LoadReport:
        self._elapsed = 0.0
        asyncio.run(self._run())
        self.report = self._summarise()
        return self.report

    def start(self) -> LoadGenerator:
        self._thread = threading.Thread(target=self.run, daemon=True, name="loadgen")
        self._thread.start()
        deadline = time.monotonic() + 5
        while self.started_at is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._stop.set()

    def wait(self, timeout_s: float | None = None) -> LoadReport:
        """The report once the run ended; after :meth:`stop`, at most one request timeout away (its last requests),
        and the default bound leaves a loaded machine a minute more than that."""
        limit = timeout_s if timeout_s is not None else self.timeout_s + REPORT_SLACK_S
        if self._thread is not None:
            self._thread.join(limit)
        if self.report is None:
            raise RuntimeError(
                f"the load generator did not finish its report within {limit:.0f}s "
                f"(its requests time out after {self.timeout_s:.0f}s)"
            )
        return self.report

    def elapsed(self) -> float:
        """Seconds since the first request (for marking fault windows)."""
        return 0.0 if self.started_at is None else time.time() - self.started_at

    def _summarise(self) -> LoadReport:
        recs = sorted(self.records)
        lat = sorted(r[1] for r in recs if r[2])
        errors: dict[str, int] = {}
        for r in recs:
            if not r[2]:
                errors[r[3]] = errors.get(r[3], 0) + 1
        buckets: dict[int, list[tuple[float, float, bool, str]]] = {}
        for r in recs:
            buckets.setdefault(int(r[0] // self.bucket_s), []).append(r)
        per_second = []
        for b in sorted(buckets):
            rows = buckets[b]
            bl = sorted(r[1] for r in rows if r[2])
            per_second.append(
                {
                    "t": round(b * self.bucket_s, 3),
                    "total": len(rows),
                    "failed": sum(1 for r in rows if not r[2]),
                    "p50_ms": _pct(bl, 0.5),
                    "p99_ms": _pct(bl, 0.99),
                }
            )
        # Downtime: longest gap between successive successful completions (and the run's edges).
        done = sorted(r[0] + r[1] / 1000 for r in recs if r[2])
        edges = [0.0, *done, max(self._elapsed, done[-1] if done else 0.0)]
        gap = max((b - a for a, b in zip(edges, edges[1:], strict=False)), default=0.0)
        ok = sum(1 for r in recs if r[2])
        return LoadReport(
            url=self.url,
            rps=self.rps,
            seconds=self.seconds,
            total=len(recs),
            ok=ok,
            failed=len(recs) - ok,
            errors=errors,
            p50_ms=_pct(lat, 0.5),
            p99_ms=_pct(lat, 0.99),
            max_ms=_pct(lat, 1.0),
            downtime_ms=round(gap * 1000, 1),
            per_second=per_second,
            stall_ms=None if not lat else round(lat[-1] - lat[len(lat) // 2], 1),
            achieved_rps=round(len(recs) / self._elapsed, 1) if self._elapsed else 0.0,
            started_at=self.started_at,
            records=[[round(r[0], 4), round(r[1], 3), r[2]] for r in recs] if self.keep_records else None,
            skipped=self.skipped,
        )


class LoadProcess:
    """The load generator in its own process, so its timing is not coupled to the caller's GIL."""

    def __init__(
        self, url: str, *, rps: float, seconds: float, body: dict[str, Any] | None = None, keep_records: bool = False
    ) -> None:
        cmd = [sys.executable, "-m", "gpumigrate.traffic.loadgen", url, "--rps", str(rps), "--seconds", str(seconds)]
        self.request_timeout_s = REQUEST_TIMEOUT_S
        if keep_records:
            cmd.append("--records")
        if body is not None:
            cmd += ["--body", json.dumps(body)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.started_at: float | None = None
        line = self.proc.stdout.readline() if self.proc.stdout else b""  # "started <epoch>"
        if line.startswith(b"started "):
            self.started_at = float(line.split()[1])

    def elapsed(self) -> float:
        return 0.0 if self.started_at is None else time.time() - self.started_at

    def stop(self) -> None:
        """Stop scheduling new requests; in-flight ones finish and are counted."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGINT)

    def wait(self, timeout_s: float | None = None) -> LoadReport:
        """The report, once the process printed it and exited. After :meth:`stop` that takes at most one request
        timeout (its last requests) plus the time to write the report; the default bound leaves a loaded machine
        a minute more than that."""
        limit = timeout_s if timeout_s is not None else self.request_timeout_s + REPORT_SLACK_S
        try:
            out, err = self.proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            self.kill()
            _, err = self.proc.communicate()
            raise RuntimeError(
                f"the load generator (pid {self.proc.pid}) did not exit with its report within {limit:.0f}s "
                f"(its requests time out after {self.request_timeout_s:.0f}s); its stderr: {err.decode()[-500:]!r}"
            ) from None
        lines = out.decode().strip().splitlines()
        if self.proc.returncode != 0 or not lines:
            raise RuntimeError(f"load generator failed ({self.proc.returncode}): {err.decode()[-500:]}")
        return LoadReport.from_json(json.loads(lines[-1]))

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=5)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m gpumigrate.traffic.loadgen", description="open-loop HTTP load")
    ap.add_argument("url")
    ap.add_argument("--rps", type=float, required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--body", default=None, help="JSON body to POST")
    ap.add_argument("--records", action="store_true", help="include every request's (start, latency, ok)")
    args = ap.parse_args(argv)
    gen = LoadGenerator(
        args.url,
        rps=args.rps,
        seconds=args.seconds,
        body=json.loads(args.body) if args.body else None,
        keep_records=args.records,
    )
    signal.signal(signal.SIGINT, lambda *_: gen.stop())
    signal.signal(signal.SIGTERM, lambda *_: gen.stop())
    gen.on_start = lambda t: print(f"started {t}", flush=True)
    report = gen.run()
    print(json.dumps(report.to_json()), flush=True)


if __name__ == "__main__":
    main()

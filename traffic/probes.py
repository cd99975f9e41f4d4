"""Parity probes: golden inputs sent through Envoy's probe listener to each side by its header route.

The probe listener (``Envoy.probe_url``, loopback only) tags every answer with the side that gave it;
an answer without the right tag (a client listener's URL given by mistake, where the header is
stripped and the split decides) is a failed probe, never a comparison of one side with itself.

Every side gets the same inputs; the injected :class:`~gpumigrate.interfaces.OutputComparator`
(``parity/`` implements it; the traffic layer never imports ``parity``) judges the outputs.
Rounds run on their own thread so a slow target never delays the analysis clock: the analysis
takes the latest finished round.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Self

import httpx

from gpumigrate.interfaces import OutputComparator, ParityReport
from gpumigrate.traffic.resources import PROBE_HEADER, SIDE_HEADER


class RoundLoop:
    """A prober's thread: one round every ``every_s`` until stopped, then its client closes. A subclass sets
    ``every_s``, ``_client`` (an httpx.Client), ``_stop`` and ``_thread`` in its constructor and defines
    ``run_round``; ``THREAD_NAME`` names the thread."""

    THREAD_NAME = "probes"
    every_s: float
    _client: httpx.Client
    _stop: threading.Event
    _thread: threading.Thread | None

    def run_round(self) -> object:
        raise NotImplementedError

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.run_round()
            self._stop.wait(max(0.0, self.every_s - (time.monotonic() - started)))
        self._client.close()

    def start(self) -> Self:
        self._thread = threading.Thread(target=self._loop, daemon=True, name=self.THREAD_NAME)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is None:
            self._client.close()
        else:
            # A round stuck on a slow target must not delay the caller (a rollback result); the
            # daemon thread ends after its current request times out.
            self._thread.join(timeout=0.5)


class Prober(RoundLoop):
    THREAD_NAME = "parity-probes"

    def __init__(
        self,
        probe_url: str,
        inputs: Sequence[Mapping[str, Any]],
        comparator: OutputComparator,
        *,
        source: str = "source",
        target: str = "target",
        path: str = "/v1/generate",
        every_s: float = 1.0,
        timeout_s: float = 5.0,
    ) -> None:
        self.url = probe_url.rstrip("/") + path
        self.inputs = list(inputs)
        self.comparator = comparator
        self.source, self.target = source, target
        self.every_s = every_s
        self.timeout_s = timeout_s
        self.rounds = 0
        self._latest: tuple[float, ParityReport] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Kept open across rounds: a new client per round builds a TLS context, which costs CPU on
        # the cores that serve the traffic being measured. Only the probe thread uses it once started.
        self._client = httpx.Client(timeout=timeout_s, trust_env=False)

    def _ask(self, client: httpx.Client, side: str, body: Mapping[str, Any]) -> dict[str, Any]:
        try:
            r = client.post(self.url, json=dict(body), headers={PROBE_HEADER: side})
        except httpx.HTTPError as exc:
            return {"_error": f"{side}: {type(exc).__name__}"}
        if r.status_code != 200:
            return {"_error": f"{side}: HTTP {r.status_code}"}
        if r.headers.get(SIDE_HEADER) != side:
            return {
                "_error": f"{side}: answered by {r.headers.get(SIDE_HEADER) or 'the client split'}, not {side} (is the URL Envoy's probe listener?)"
            }
        try:
            return dict(r.json())
        except ValueError:
            return {"_error": f"{side}: response is not JSON"}

    def run_round(self) -> ParityReport:
        """One round: every input to both sides, then compare. Errors count as disagreement."""
        src = [self._ask(self._client, self.source, b) for b in self.inputs]
        tgt = [self._ask(self._client, self.target, b) for b in self.inputs]
        errors = tuple(row["_error"] for row in src + tgt if "_error" in row)
        if errors:
            report = ParityReport(
                passed=False,
                cases=len(self.inputs),
                max_abs_err=None,
                failures=tuple(f"probe failed: {e}" for e in errors),
            )
        else:
            try:
                report = self.comparator.compare(src, tgt)
            except Exception as exc:  # a broken comparator is a failed round, never a dead probe thread
                report = ParityReport(
                    passed=False,
                    cases=len(self.inputs),
                    max_abs_err=None,
                    failures=(f"probe comparison failed: {type(exc).__name__}: {exc}",),
                )
        with self._lock:
            self._latest = (time.monotonic(), report)
            self.rounds += 1
        return report

    def latest(self, newer_than: float = 0.0) -> ParityReport | None:
        """The last finished round, if it finished after ``newer_than`` (monotonic seconds)."""
        with self._lock:
            if self._latest is None or self._latest[0] < newer_than:
                return None
            return self._latest[1]

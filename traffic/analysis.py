"""Analysis gates, Argo-style: each metric gives pass, fail or inconclusive, and so does the whole.

Rules (documented in ``traffic/README.md``):

* **fail** if any metric fails: the target has no healthy host or is ejected; its success rate
  (retried failures included) is below ``min_success_rate``; its p99 exceeds the baseline by more
  than ``max_p99_ratio`` (and by more than ``p99_slack_ms``, so that 2 ms vs 4 ms is not a
  regression) or exceeds ``max_p99_ms``; the last parity probe round disagreed; with streamed probes
  (``streamprobe.py``), the target's p99 time to first token or p99 inter-token gap exceeds the source's
  (same window, same requests) by more than ``max_ttft_ratio`` / ``max_inter_token_ratio`` (and by more
  than ``stream_slack_ms``), its largest gap exceeds ``max_inter_token_ms``, a streamed probe failed, or
  the two sides streamed different text.
* **inconclusive** if nothing failed but a metric lacks data: fewer than ``min_requests`` target
  requests in the window, no parity probe round yet, or no streamed probe on either side yet.
  Inconclusive never passes a stage.
* **pass** otherwise.

The window is the shortest run of recent intervals (within the stage) that holds ``min_requests``
target requests: one interval at high traffic (fast detection), several at 1% weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from gpumigrate.interfaces import ParityReport
from gpumigrate.traffic.stats import ClusterWindow
from gpumigrate.traffic.streamprobe import StreamWindow

if TYPE_CHECKING:  # the control plane process never loads the plan's models
    from gpumigrate.plan import Gates


class Verdict(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class GateSettings:
    """The plan's gates (``gpumigrate.plan.Gates``) plus the few knobs the plan does not carry."""

    min_success_rate: float = 0.999
    max_p99_ratio: float = 1.5
    max_p99_ms: float | None = None
    min_requests: int = 20
    failures_to_rollback: int = 1
    p99_slack_ms: float = 100.0
    max_ttft_ratio: float = 2.0
    max_inter_token_ratio: float = 1.5
    max_inter_token_ms: float | None = None
    stream_slack_ms: float = 50.0  # as p99_slack_ms, for the streamed probes' figures (a shared CPU's noise)

    @classmethod
    def from_plan(cls, gates: Gates, **extra: Any) -> GateSettings:
        return cls(
            min_success_rate=gates.min_success_rate,
            max_p99_ratio=gates.max_p99_ratio,
            max_p99_ms=gates.max_p99_ms,
            min_requests=gates.min_requests,
            failures_to_rollback=gates.failures_to_rollback,
            max_ttft_ratio=gates.max_ttft_ratio,
            max_inter_token_ratio=gates.max_inter_token_ratio,
            max_inter_token_ms=gates.max_inter_token_ms,
            **extra,
        )


@dataclass(frozen=True)
class Measurement:
    metric: str
    verdict: Verdict
    value: float | None
    threshold: float | None
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "verdict": str(self.verdict),
            "value": self.value,
            "threshold": self.threshold,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class Analysis:
    verdict: Verdict
    measurements: list[Measurement] = field(default_factory=list)

    @property
    def reason(self) -> str:
        bad = [m for m in self.measurements if m.verdict == self.verdict]
        return "; ".join(m.detail for m in bad) if bad else str(self.verdict)

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": str(self.verdict),
            "reason": self.reason,
            "measurements": [m.to_json() for m in self.measurements],
        }


def analyze(
    target: ClusterWindow,
    baseline_p99_ms: float | None,
    gates: GateSettings,
    *,
    probe: ParityReport | None,
    probes_expected: bool,
    target_name: str = "target",
    streams: tuple[StreamWindow, StreamWindow] | None = None,
) -> Analysis:
    """One verdict for one window of the target's figures. ``streams``: the (source, target) streamed probes of
    the window, where the plan asks for them."""
    ms: list[Measurement] = []
    if target.healthy == 0:
        ms.append(
            Measurement("health", Verdict.FAIL, 0, 1, f"{target_name} has no healthy host (active health checks)")
        )
    elif target.ejected > 0:
        ms.append(
            Measurement(
                "health",
                Verdict.FAIL,
                target.ejected,
                0,
                f"{target_name} ejected by outlier detection (consecutive 5xx)",
            )
        )
    else:
        ms.append(Measurement("health", Verdict.PASS, target.healthy, 1, "healthy"))

    enough = target.requests >= gates.min_requests
    sr = target.success_rate
    if sr is not None and target.failures and (enough or _already_too_many(target, gates)):
        ok = sr >= gates.min_success_rate
        ms.append(
            Measurement(
                "success_rate",
                Verdict.PASS if ok else Verdict.FAIL,
                round(sr, 5),
                gates.min_success_rate,
                f"{target_name} success rate {sr:.4f} (< {gates.min_success_rate}) over "
                f"{target.requests} requests, {target.failures} failed or retried",
            )
        )
    elif enough:
        ms.append(
            Measurement(
                "success_rate",
                Verdict.PASS,
                1.0 if sr is None else round(sr, 5),
                gates.min_success_rate,
                f"{target_name} success rate {sr}",
            )
        )
    else:
        ms.append(
            Measurement(
                "success_rate",
                Verdict.INCONCLUSIVE,
                sr,
                gates.min_success_rate,
                f"only {target.requests} {target_name} requests in window (< min_requests {gates.min_requests})",
            )
        )

    p99 = target.p99_ms
    if enough and p99 is not None:
        if gates.max_p99_ms is not None and p99 > gates.max_p99_ms:
            ms.append(
                Measurement(
                    "p99_ms",
                    Verdict.FAIL,
                    round(p99, 2),
                    gates.max_p99_ms,
                    f"{target_name} p99 {p99:.0f} ms > max_p99_ms {gates.max_p99_ms:.0f}",
                )
            )
        if baseline_p99_ms is not None:
            limit = max(baseline_p99_ms * gates.max_p99_ratio, baseline_p99_ms + gates.p99_slack_ms)
            ok = p99 <= limit
            ms.append(
                Measurement(
                    "p99_ratio",
                    Verdict.PASS if ok else Verdict.FAIL,
                    round(p99 / max(baseline_p99_ms, 1e-3), 3),
                    gates.max_p99_ratio,
                    f"{target_name} p99 {p99:.0f} ms vs baseline {baseline_p99_ms:.0f} ms (limit {limit:.0f} ms)",
                )
            )
        else:
            ms.append(Measurement("p99_ratio", Verdict.INCONCLUSIVE, None, gates.max_p99_ratio, "no baseline p99 yet"))
    elif not enough:
        ms.append(
            Measurement("p99_ratio", Verdict.INCONCLUSIVE, None, gates.max_p99_ratio, "too few requests for a p99")
        )

    if probes_expected:
        if probe is None:
            ms.append(Measurement("parity", Verdict.INCONCLUSIVE, None, None, "no parity probe round finished yet"))
        elif probe.passed:
            ms.append(
                Measurement("parity", Verdict.PASS, probe.cases, None, f"parity probes agree ({probe.cases} cases)")
            )
        else:
            why = "; ".join(probe.failures[:3]) or "outputs differ"
            ms.append(Measurement("parity", Verdict.FAIL, probe.max_abs_err, None, f"parity probes disagree: {why}"))

    if streams is not None:
        ms.extend(analyze_streams(*streams, gates, target_name=target_name))

    verdicts = {m.verdict for m in ms}
    if Verdict.FAIL in verdicts:
        return Analysis(Verdict.FAIL, ms)
    if Verdict.INCONCLUSIVE in verdicts:
        return Analysis(Verdict.INCONCLUSIVE, ms)
    return Analysis(Verdict.PASS, ms)


def _already_too_many(target: ClusterWindow, gates: GateSettings) -> bool:
    """Fail before min_requests when the failures alone already break the gate at min_requests.

    E.g. 3 failures out of 5 requests with min_success_rate 0.999 and min_requests 20: even 15 more
    successes give 0.85. Waiting for more data would only let more users see the fault.
    """
    allowed = (1.0 - gates.min_success_rate) * max(gates.min_requests, target.requests)
    return target.failures > allowed


def analyze_streams(
    source: StreamWindow, target: StreamWindow, gates: GateSettings, *, target_name: str = "target"
) -> list[Measurement]:
    """The streamed probes' gates: time to first token and inter-token gaps against the source's, same window."""
    if target.errors:
        why = "; ".join(target.errors[:3])
        return [Measurement("streams", Verdict.FAIL, len(target.errors), 0, f"streamed probes failed: {why}")]
    if not target.streams or not source.streams or source.errors:
        why = "; ".join(source.errors[:2]) or "no streamed probe finished on both sides yet"
        return [Measurement("streams", Verdict.INCONCLUSIVE, None, None, why)]
    ms: list[Measurement] = []
    texts: dict[int, set[str]] = {}  # per request: every text either side streamed for it
    for key, text in (*source.texts, *target.texts):
        if text is not None:
            texts.setdefault(key, set()).add(text)
    if any(len(seen) > 1 for seen in texts.values()):
        ms.append(Measurement("stream_text", Verdict.FAIL, None, None, f"{target_name} streamed other text"))
    for metric, mine, theirs, ratio in (
        ("ttft_ratio", target.ttft_p99_ms, source.ttft_p99_ms, gates.max_ttft_ratio),
        ("inter_token_ratio", target.itl_p99_ms, source.itl_p99_ms, gates.max_inter_token_ratio),
    ):
        what = "time to first token" if metric == "ttft_ratio" else "inter-token gap"
        if mine is None or theirs is None:
            ms.append(Measurement(metric, Verdict.INCONCLUSIVE, None, ratio, f"no p99 {what} on both sides yet"))
            continue
        limit = max(theirs * ratio, theirs + gates.stream_slack_ms)
        ms.append(
            Measurement(
                metric,
                Verdict.PASS if mine <= limit else Verdict.FAIL,
                round(mine / max(theirs, 1e-3), 3),
                ratio,
                f"{target_name} p99 {what} {mine:.1f} ms vs source {theirs:.1f} ms (limit {limit:.1f} ms)",
            )
        )
    if gates.max_inter_token_ms is not None and target.itl_max_ms is not None:
        ok = target.itl_max_ms <= gates.max_inter_token_ms
        ms.append(
            Measurement(
                "inter_token_ms",
                Verdict.PASS if ok else Verdict.FAIL,
                round(target.itl_max_ms, 2),
                gates.max_inter_token_ms,
                f"{target_name} largest inter-token gap {target.itl_max_ms:.0f} ms "
                f"(max_inter_token_ms {gates.max_inter_token_ms:.0f})",
            )
        )
    return ms

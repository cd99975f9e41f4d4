"""The streamed probes' gates, without a server: texts compare per request, timings against the source's."""

from __future__ import annotations

from gpumigrate.traffic.analysis import GateSettings, Verdict, analyze_streams
from gpumigrate.traffic.streamprobe import StreamTiming, summarize


def _side(*answers: tuple[int, str], gap_ms: float = 20.0) -> list[StreamTiming]:
    return [StreamTiming(1.0, 100.0, (gap_ms, gap_ms), text, key=key) for key, text in answers]


def _verdicts(source: list[StreamTiming], target: list[StreamTiming]) -> dict[str, Verdict]:
    return {m.metric: m.verdict for m in analyze_streams(summarize(source), summarize(target), GateSettings())}


def test_each_request_compares_with_itself_not_with_the_other_prompts() -> None:
    """Three golden prompts stream three texts; the two sides agree on each: no stream_text failure."""
    answers = ((0, "alpha"), (1, "beta"), (2, "gamma"))
    verdicts = _verdicts(_side(*answers), _side(*answers))
    assert "stream_text" not in verdicts and verdicts["inter_token_ratio"] == Verdict.PASS


def test_a_target_that_streams_other_text_for_one_request_fails() -> None:
    verdicts = _verdicts(_side((0, "alpha"), (1, "beta")), _side((0, "alpha"), (1, "bet!")))
    assert verdicts["stream_text"] == Verdict.FAIL


def test_slow_tokens_on_the_target_fail_the_inter_token_gate() -> None:
    verdicts = _verdicts(_side((0, "a")), _side((0, "a"), gap_ms=500.0))
    assert verdicts["inter_token_ratio"] == Verdict.FAIL and verdicts["ttft_ratio"] == Verdict.PASS

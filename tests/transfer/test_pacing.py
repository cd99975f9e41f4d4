"""A capture round's pace: the rate limiter every chunk passes, and the controller that steers it from the source's
request latency (transfer/pacing.py). The controller is the real one; its latency signal here is a fake, whose
latency the test raises and lowers (the one place a fake signal is used: the SDK's real one is tested below and in
tests/agent/test_bounds.py)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest

from gpumigrate.snapshot.stepgate import SafePointGate
from gpumigrate.transfer.pacing import PacingController, PacingRules
from gpumigrate.transfer.progress import RateLimiter

MiB = 1 << 20


def wait_until(what: str, ok: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:g}s for {what}")
        time.sleep(0.005)


class FakeLatency:
    """A source whose requests take ``latency`` seconds: one ends every ``every_s`` while ``serving``."""

    def __init__(self, latency: float, every_s: float = 0.004) -> None:
        self.latency = latency
        self.serving = True
        self._ended: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        now = time.monotonic()
        self._ended = [(now - 1.0 + i * 0.05, latency) for i in range(20)]  # the requests before the round
        self._thread = threading.Thread(target=self._serve, args=(every_s,), daemon=True)
        self._thread.start()

    def _serve(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            if self.serving:
                with self._lock:
                    self._ended.append((time.monotonic(), self.latency))

    def latencies(self, since: float) -> list[float]:
        with self._lock:
            return [d for end, d in self._ended if end > since]

    @property
    def in_flight(self) -> int:
        return 1 if self.serving else 0

    def running_for(self, since: float) -> float:
        return self.latency if self.serving else 0.0  # a request under way runs for about as long as they all take

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class Mover:
    """A capture's chunks passing the limiter: 256 KiB at a time, about 100 MB/s at most."""

    def __init__(self, limiter: RateLimiter) -> None:
        self.limiter = limiter
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._move, daemon=True)
        self._thread.start()

    def _move(self) -> None:
        while not self._stop.is_set():
            self.limiter.take(256 << 10)
            time.sleep(0.0025)

    def close(self) -> None:
        self._stop.set()
        self.limiter.set_rate(None)  # a take waiting on a low rate passes at once
        self._thread.join(timeout=30)


def test_the_controller_backs_off_when_the_sources_latency_rises_and_speeds_up_when_it_is_idle() -> None:
    source = FakeLatency(0.010)
    limiter = RateLimiter(None)
    rules = PacingRules(interval_s=0.02, settle_s=0.05, idle_s=0.1, min_samples=3)
    pacer = PacingController(source, limiter, rules=rules)
    mover = Mover(limiter)
    try:
        pacer.start()
        assert pacer.report.base_latency_ms == 10.0  # the median of the requests before the round
        wait_until("verdicts at the base latency", lambda: pacer.report.verdicts >= 5)
        assert limiter.rate is None and pacer.report.cuts == 0  # within tolerance: the round runs uncapped

        source.latency = 0.030  # the round is felt: requests take three times as long
        wait_until("a cut", lambda: pacer.report.cuts >= 1)
        first = limiter.rate
        assert first is not None
        wait_until("more cuts while it stays slow", lambda: pacer.report.cuts >= 3)
        assert limiter.rate is not None and limiter.rate < first  # cut again and again, multiplicatively
        assert limiter.rate >= max(float(MiB), rules.floor_fraction * first)  # never below the floor

        source.serving = False  # the source goes idle: no request ends, none under way
        wait_until("the cap lifted", lambda: limiter.rate is None)
        assert pacer.report.idle_raises >= 1
    finally:
        report = pacer.stop()
        mover.close()
        source.close()
    assert report["cuts"] >= 3 and report["lowest_rate"] > 0 and report["capped_s"] > 0
    assert "base 10.0 ms" in report["changes"][0][2]  # each change says why


def test_a_capped_controller_never_goes_above_the_rate_limit() -> None:
    source = FakeLatency(0.010)
    limiter = RateLimiter(64 * MiB)
    pacer = PacingController(source, limiter, ceiling=64 * MiB, rules=PacingRules(interval_s=0.02, min_samples=3))
    mover = Mover(limiter)
    try:
        pacer.start()
        source.latency = 0.050
        wait_until("a cut below the cap", lambda: pacer.report.cuts >= 1)
        assert limiter.rate is not None and limiter.rate <= 32 * MiB
        source.latency = 0.010
        wait_until("back at the cap", lambda: limiter.rate == 64 * MiB)
        pacer.stop()
        assert limiter.rate == 64 * MiB  # the round ends where the plan put it
    finally:
        pacer.stop()
        mover.close()
        source.close()


def test_the_limiter_holds_the_rate_across_threads() -> None:
    limiter = RateLimiter(8 * MiB)
    t0 = time.monotonic()
    threads = [threading.Thread(target=lambda: [limiter.take(MiB) for _ in range(3)]) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    # 6 MiB at 8 MiB/s: the first MiB passes at once, the other 5 wait their turn (a loaded machine only adds)
    assert time.monotonic() - t0 >= 5 / 8
    assert limiter.admitted == 6 * MiB


def test_a_raised_rate_frees_a_waiting_take_at_once() -> None:
    limiter = RateLimiter(MiB)
    limiter.take(64 * MiB)  # passes, leaving 64 s of debt
    waiting = threading.Thread(target=limiter.take, args=(MiB,))
    waiting.start()
    wait_until("the take to wait", lambda: waiting.is_alive(), timeout_s=5)
    limiter.set_rate(None)
    waiting.join(timeout=30)  # far less than the 64 s the old rate would make it wait
    assert not waiting.is_alive()


def test_the_safe_point_times_the_requests_it_admits() -> None:
    gate = SafePointGate()
    t0 = time.monotonic()
    with gate.safe_point():
        time.sleep(0.02)
    with pytest.raises(RuntimeError), gate.safe_point():
        raise RuntimeError("a failed request is not a served one")
    got = gate.latencies(t0)
    assert len(got) == 1 and got[0] >= 0.02
    assert gate.latencies(time.monotonic()) == [] and gate.in_flight == 0


def test_a_step_still_under_way_past_the_overdue_bound_cuts_the_rate_before_it_ends() -> None:
    """An engine loop's safe point is one decode step: a round that stalls it would end before enough stalled steps
    ended for a verdict. The real safe point says how long the step under way has run, and that alone cuts; a request
    that began before the round says nothing about it."""
    gate = SafePointGate()
    for _ in range(8):  # the steps before the round: about 5 ms each
        with gate.safe_point():
            time.sleep(0.005)
    limiter = RateLimiter(None)
    pacer = PacingController(gate, limiter, rules=PacingRules(interval_s=0.02, settle_s=0.05, min_samples=4))
    mover = Mover(limiter)
    stuck = threading.Event()

    def stalled_step() -> None:
        with gate.safe_point():
            stuck.wait(60)

    step = threading.Thread(target=stalled_step, daemon=True)
    try:
        with gate.safe_point():  # a request from before the round, under way throughout
            round_began = time.monotonic()
            pacer.start()
            assert pacer.report.base_latency_ms is not None and pacer.report.base_latency_ms >= 5.0
            assert gate.running_for(0.0) > 0 and gate.running_for(round_began) == 0.0
            ended = gate.steps
            step.start()
            wait_until("a cut while the step is still under way", lambda: pacer.report.cuts >= 1)
            assert gate.steps == ended and gate.in_flight == 2  # no step ended: the one under way decided
            assert limiter.rate is not None and pacer.report.overdue_cuts >= 1
    finally:
        stuck.set()
        step.join(timeout=30)
        report = pacer.stop()
        mover.close()
    assert report["changes"][0][2].startswith("slow start")  # the round began at the slow start's rate
    assert "under way" in report["changes"][1][2] and gate.in_flight == 0


def test_a_serving_sources_round_starts_slow_and_doubles_until_the_cap_holds_nothing_back() -> None:
    """Slow start: the round's first bytes move at ``start_rate``, not uncapped (a round that began at full speed
    stalled an engine loop before the first verdict); each verdict within tolerance doubles the rate, and once no
    chunk waits for the cap (the round moves slower by itself) it is lifted."""
    source = FakeLatency(0.010)
    limiter = RateLimiter(None)
    rules = PacingRules(interval_s=0.02, min_samples=3, start_rate=4 * MiB)
    pacer = PacingController(source, limiter, rules=rules)
    pacer.start()
    assert limiter.rate == 4 * MiB and pacer.report.start_rate == 4 * MiB  # before any byte moved
    mover = Mover(limiter)  # about 100 MB/s at most: a cap above that holds nothing back
    try:
        wait_until("the cap lifted", lambda: limiter.rate is None)
        assert pacer.report.cuts == 0
    finally:
        report = pacer.stop()
        mover.close()
        source.close()
    rates = [rate for _, rate, _ in report["changes"]]
    assert rates[0] == 4 * MiB and report["changes"][0][2] == "slow start, base 10.0 ms"
    grown = rates[1 : rates.index(None)]
    assert grown and all(b == 2 * a for a, b in zip([rates[0], *grown], grown, strict=False))  # doubled each verdict
    assert report["start_rate"] == 4 * MiB


def test_the_slow_start_ends_at_the_first_cut() -> None:
    """A round the source feels from its first bytes is cut from the slow start's rate; from then on it grows by
    ``growth`` per verdict, not by ``start_growth``."""
    source = FakeLatency(0.010)
    source.latency = 0.030  # felt at once
    limiter = RateLimiter(None)
    rules = PacingRules(interval_s=0.02, settle_s=0.05, min_samples=3, start_rate=16 * MiB)
    pacer = PacingController(source, limiter, rules=rules)
    mover = Mover(limiter)
    try:
        pacer.start()
        wait_until("a cut", lambda: pacer.report.cuts >= 1)
        source.latency = 0.010
        wait_until("a raise after the cut", lambda: any(why.startswith("latency 10.0") for _, _, why in
                                                          pacer.report.changes))  # fmt: skip
    finally:
        report = pacer.stop()
        mover.close()
        source.close()
    changes = report["changes"]
    cut = next(i for i, (_, _, why) in enumerate(changes) if "base 10.0 ms" in why and why.startswith("latency"))
    raised = next(i for i, (_, _, why) in enumerate(changes) if why.startswith("latency 10.0"))
    assert changes[cut][1] < 16 * MiB  # cut from the start's rate
    before, after = changes[raised - 1][1], changes[raised][1]
    assert after == round(before * rules.growth)  # grown by growth, no longer doubled


def test_an_idle_sources_round_starts_uncapped() -> None:
    """Nothing to yield to (no request ended lately, none under way): the round moves at full speed from the start."""
    source = FakeLatency(0.010)
    source.serving = False
    wait_until("no request ended in the last 0.2 s", lambda: not source.latencies(time.monotonic() - 0.2))
    limiter = RateLimiter(None)
    pacer = PacingController(source, limiter, rules=PacingRules(idle_s=0.2))
    try:
        pacer.start()
        assert limiter.rate is None and pacer.report.start_rate is None
    finally:
        report = pacer.stop()
        source.close()
    assert report["start_rate"] is None and report["changes"] == []


class QueueingSource:
    """A source under an open-loop load at half its capacity, which the round does not touch: requests arrive as a
    Poisson stream (``rate`` a second) at one server whose service times are exponential (``service_s`` mean), so its
    latencies queue and swing by themselves (an M/M/1 queue at 50%). The schedule is drawn up front from a seed,
    ``history_s`` of it before the round; it is a function of the clock, whatever the round does."""

    def __init__(self, seed: int = 7, service_s: float = 0.005, history_s: float = 30.0, length_s: float = 120.0):
        rng = random.Random(seed)
        start = time.monotonic() - history_s
        arrival, free = start, start
        self._requests: list[tuple[float, float]] = []  # (admitted, ended)
        while arrival < start + history_s + length_s:
            arrival += rng.expovariate(0.5 / service_s)
            begin = max(arrival, free)
            free = begin + rng.expovariate(1 / service_s)
            self._requests.append((arrival, free))

    def latencies(self, since: float) -> list[float]:
        now = time.monotonic()
        return [end - admitted for admitted, end in self._requests if since < end <= now]

    @property
    def in_flight(self) -> int:
        now = time.monotonic()
        return sum(1 for admitted, end in self._requests if admitted <= now < end)

    def running_for(self, since: float) -> float:
        now = time.monotonic()
        return next((now - a for a, end in self._requests if since < a <= now < end), 0.0)


def test_a_source_whose_latency_swings_by_itself_keeps_the_round_near_full_speed() -> None:
    """A verdict is "felt" only beyond the source's own noise: under an open-loop load a source's median over a few
    requests swings well past 10% with no round beside it, and a bound inside that swing cut a round that nothing felt
    down to the floor (bench/HISTORY.md, sixteenth session: 328 cuts in 339 verdicts). The signal's latencies here
    do not depend on the round at all, so every cut is a false one."""
    source = QueueingSource()
    limiter = RateLimiter(None)
    pacer = PacingController(source, limiter, rules=PacingRules(start_rate=4 * MiB))
    mover = Mover(limiter)
    try:
        pacer.start()
        wait_until("60 verdicts", lambda: pacer.report.verdicts >= 60)
    finally:
        report = pacer.stop()
        mover.close()
    assert report["cuts"] <= report["verdicts"] // 4, report  # a false cut now and then, not one a verdict
    assert report["lowest_rate"] >= 4 * MiB * PacingRules().backoff ** 3, report  # never near the floor


class ChangedLoad:
    """A source whose load changed shortly before the round: 2,000 requests of 60 ms (a closed-loop burst) that
    ended 7 s ago, then 300 of 10 ms (the steady load it serves now), all within 30 s."""

    def __init__(self) -> None:
        now = time.monotonic()
        self._ended = [(now - 17 + i * 0.005, 0.060) for i in range(2000)] + [
            (now - 3 + i * 0.01, 0.010) for i in range(300)
        ]

    def latencies(self, since: float) -> list[float]:
        return [d for end, d in self._ended if end > since]

    @property
    def in_flight(self) -> int:
        return 1

    def running_for(self, since: float) -> float:
        return 0.0


def test_the_base_is_the_sources_latency_now_not_a_load_it_had_before() -> None:
    limiter = RateLimiter(None)
    pacer = PacingController(ChangedLoad(), limiter, rules=PacingRules(interval_s=3600))
    try:
        pacer.start()
    finally:
        report = pacer.stop()
    assert report["base_latency_ms"] == 10.0, report  # the last 5 s, not the 30 s window's median (60 ms)


def test_a_source_with_few_recent_requests_takes_its_base_from_the_longer_window() -> None:
    source = ChangedLoad()
    source._ended = source._ended[:2000] + source._ended[-3:]  # 3 requests in the last 5 s: too few to judge by
    pacer = PacingController(source, RateLimiter(None), rules=PacingRules(interval_s=3600))
    try:
        pacer.start()
    finally:
        report = pacer.stop()
    assert report["base_latency_ms"] == 60.0, report

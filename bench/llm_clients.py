"""The clients of ``bench/llm_streams.py``: streams read and timed as an OpenAI client reads them, and the figures
made of their timestamps (gaps, phases, the hand-over, the re-prefill baseline) and of the engine's step counters."""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import string
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from gpumigrate.transfer.pacing import PacingRules

Window = tuple[float, float]  # (start, end), time.monotonic()
EngineSample = tuple[float, int, float, float]  # (monotonic, steps, step wall seconds, step CPU seconds), summed


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(0, -(-99 * len(ordered) // 100) - 1)], 2)


@dataclass
class Stream:
    """One client's stream: every event's arrival (monotonic) and the text, usage and ending."""

    prompt: str
    index: int = 0  # which prompt (its control text)
    wave: int = 1  # the bench's set of streams it belongs to (a refill starts another)
    times: list[float] = field(default_factory=list)
    text: str = ""
    tokens: int | None = None
    done: bool = False
    error: str | None = None

    def spans(self, t: float) -> bool:
        """Its client read events before ``t`` and after it: it was being generated at ``t``."""
        return bool(self.times) and self.times[0] < t < self.times[-1]


def prompts(n: int, low: int, high: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + "      .,"
    return [f"Request {i}: " + "".join(rng.choices(alphabet, k=rng.randint(low, high) - 12)) for i in range(n)]


def body(model: str, prompt: str, tokens: int, *, stream: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                           "ignore_eos": True, "stream": stream}  # fmt: skip
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


def read_stream(url: str, payload: dict[str, Any], s: Stream) -> None:
    try:
        with httpx.Client(timeout=httpx.Timeout(900.0), trust_env=False) as client:
            with client.stream("POST", url + "/v1/completions", json=payload) as r:
                if r.status_code != 200:
                    s.error = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        s.done = True
                        return
                    event = json.loads(line[6:])
                    if "error" in event:
                        s.error = str(event["error"].get("message"))[:300]
                        return
                    if event.get("usage"):
                        s.tokens = int(event["usage"]["completion_tokens"])
                    if event.get("choices") and event["choices"][0]["text"]:
                        s.times.append(time.monotonic())
                        s.text += event["choices"][0]["text"]
    except httpx.HTTPError as exc:
        s.error = f"{type(exc).__name__}: {exc}"[:300]


def run_streams(
    url: str, model: str, texts: list[str], tokens: int, wave: int = 1
) -> tuple[list[Stream], list[threading.Thread]]:
    streams = [Stream(p, i, wave) for i, p in enumerate(texts)]
    threads = [
        threading.Thread(target=read_stream, args=(url, body(model, s.prompt, tokens), s), daemon=True) for s in streams
    ]
    for t in threads:
        t.start()
    return streams, threads


_local = threading.local()


def _stats_client() -> httpx.Client:
    """This thread's client for the servers' counters, kept: a new ``httpx.get`` loads the CA bundle each time
    (tens of ms, for a plain-http URL that needs none), and the bench samples the engines between the
    migration's steps, once between the target's ready and the hand-over, where every moved stream waits."""
    client: httpx.Client | None = getattr(_local, "client", None)
    if client is None:
        client = _local.client = httpx.Client(timeout=60, trust_env=False, verify=False)
    return client


def engine_stats(url: str) -> dict[str, Any]:
    got: dict[str, Any] = _stats_client().get(url + "/v1/engine").json()
    return got


def engine_sample(url: str) -> EngineSample:
    """The server's engine counters now (``/v1/engine``)."""
    got = engine_stats(url)
    return time.monotonic(), int(got["steps"]), float(got["step_s_total"]), float(got["step_cpu_s_total"])


def engine_between(a: EngineSample, b: EngineSample) -> dict[str, Any]:
    """The engine's steps between two samples: how many, their mean wall time, and the share of it its thread was on
    a CPU (a GIL wait sleeps; a device wait spins, on a host with a core to spare)."""
    steps, wall, cpu = b[1] - a[1], b[2] - a[2], b[3] - a[3]
    return {"steps": steps, "step_ms": round(wall * 1000 / steps, 2) if steps else None,
            "cpu_share": round(cpu / wall, 3) if wall > 0 else None}  # fmt: skip


def gaps_between(streams: list[Stream], start: float, end: float, skip: Sequence[Window] = ()) -> list[float]:
    """Every gap between two events of one stream whose later event arrived in [start, end] and in none of the
    ``skip`` windows, in ms."""
    return [
        (b - a) * 1000
        for s in streams
        for a, b in zip(s.times, s.times[1:], strict=False)
        if start <= b <= end and not any(x <= b <= y for x, y in skip)
    ]


def gap_figures(gaps: list[float]) -> dict[str, Any]:
    """A phase's inter-token gaps (those whose later event arrived in it): how many, their largest and p99, in ms."""
    return {"gaps": len(gaps), "max_ms": round(max(gaps), 1) if gaps else None, "p99_ms": p99(gaps)}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a / max(b, 1e-3), 3)


def hand_over_figures(streams: list[Stream], at_freeze: float, ready: float, end: float) -> dict[str, Any]:
    """Each stream in flight at the freeze: the largest gap its client saw across the move (its later event in
    [freeze, end]) and when that later event, the first from the target, came after the target was ready, in ms."""
    across, after = [], []
    for s in streams:
        if not s.spans(at_freeze):
            continue
        pairs = [(a, b) for a, b in zip(s.times, s.times[1:], strict=False) if at_freeze <= b <= end]
        if pairs:
            a, b = max(pairs, key=lambda ab: ab[1] - ab[0])
            across.append((b - a) * 1000)
            after.append((b - ready) * 1000)

    def figures(ms: list[float]) -> dict[str, Any]:
        ordered = sorted(ms)
        return {"p50_ms": round(ordered[len(ordered) // 2], 1), "max_ms": round(ordered[-1], 1)} if ordered else {}

    return {
        "streams": len(across),
        "gap_across": figures(across),
        "first_target_event_after_ready": figures(after),
        "includes": "gap_across: the largest gap of a stream in flight at the freeze whose later event came from the "
        "freeze to a second after the hand-over (the stop-and-copy, the hand-over, the relay's opening, the "
        "target's first step); first_target_event_after_ready: that later event's arrival after the target was ready",
    }


def reprefill(url: str, model: str, streams: list[Stream], at_freeze: float) -> dict[str, Any]:
    """Every stream replayed on the target as a replay-based system resumes it: one prompt of the original prompt
    plus the tokens it had at the freeze (the same length in bytes: one token each), all at once, timed to the
    first token."""
    replays = [s.prompt + "x" * sum(1 for t in s.times if t < at_freeze) for s in streams]
    firsts: list[float] = []
    lock = threading.Lock()

    def one(prompt: str) -> None:
        s = Stream(prompt)
        t0 = time.monotonic()
        read_stream(url, body(model, prompt, 1), s)
        if s.times:
            with lock:
                firsts.append((s.times[0] - t0) * 1000)

    threads = [threading.Thread(target=one, args=(p,)) for p in replays]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ordered = sorted(firsts)
    return {
        "replayed": len(replays),
        "answered": len(firsts),
        "first_token_p50_ms": round(ordered[len(ordered) // 2], 1) if ordered else None,
        "first_token_max_ms": round(ordered[-1], 1) if ordered else None,
        "includes": "the gap a replayed client would see at the least: the target prefills every request's prompt "
        "and tokens so far (all replayed at once, as after a failover), to its first new token; not the detection "
        "and resubmission before it",
    }


class Clients:
    """The measured run's streams, wave by wave: a refill waits for the streams of the wave before it to end and
    starts the same prompts again (their control texts are known), so that the freeze lands mid-generation."""

    def __init__(self, url: str, model: str, texts: list[str], args: argparse.Namespace) -> None:
        self.url, self.model, self.texts, self.args = url, model, texts, args
        self.streams: list[Stream] = []
        self.threads: list[threading.Thread] = []
        self.wave = 0

    def start_wave(self) -> float:
        """A new wave of streams; returns once every one decodes (monotonic then)."""
        self.wave += 1
        streams, threads = run_streams(self.url, self.model, self.texts, self.args.tokens, self.wave)
        self.streams += streams
        self.threads += threads
        deadline = time.monotonic() + self.args.start_timeout
        while not all(len(s.times) >= 2 or s.error or s.done for s in streams):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the streams of wave {self.wave} did not all start decoding")
            time.sleep(0.01)
        return time.monotonic()

    def refill(self) -> None:
        for t in self.threads:
            t.join()
        self.start_wave()
        # The new wave's steady decoding before the round that ships its prefill, and for as long as the pacing's
        # base window (transfer/pacing.py, ``baseline_s``): a base that still held the wave's prefill steps (many
        # times a decode step) read a noise bound that let the round stall the decode steps unjudged.
        time.sleep(max(self.args.before_s, PacingRules().baseline_s))

    def decoding_left_s(self, step_s: float) -> float:
        """How long the soonest-ending stream under way will still decode at ``step_s`` a step (0: none is)."""
        running = engine_stats(self.url)["running"]
        if not running:
            return 0.0
        return (self.args.tokens - max(int(r["tokens"]) for r in running)) * step_s

    def join(self) -> None:
        for t in self.threads:
            t.join()


class GilProfile:
    """py-spy recording which threads of a process hold the GIL (``record --gil``, raw stacks, every thread), from
    :meth:`start` to :meth:`stop`; nothing where py-spy is not installed (a diagnosis tool, not a dependency)."""

    def __init__(self, pid: int, path: str) -> None:
        self.pid, self.path = pid, path
        self._spy: subprocess.Popen[bytes] | None = None

    def start(self) -> bool:
        exe = shutil.which("py-spy")
        if exe is None:
            log("py-spy is not installed: the round runs unprofiled")
            return False
        cmd = [exe, "record", "--pid", str(self.pid), "--gil", "--threads", "--format", "raw", "--rate", "250"]
        self._spy = subprocess.Popen(
            [*cmd, "--output", self.path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        time.sleep(1.0)  # attached before the round starts
        return True

    def stop(self) -> None:
        if self._spy is not None:
            self._spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            self._spy.wait(timeout=60)
            self._spy = None


def failures(run: dict[str, Any]) -> list[str]:
    """What a run's correctness half says went wrong (empty: nothing)."""
    if "error" in run:
        return [run["error"]]
    checks: list[tuple[bool, str]] = [
        (run["broken"] == 0, f"{run['broken']} streams broken"),
        (run["lost_or_duplicated"] == 0, f"{run['lost_or_duplicated']} streams lost or repeated tokens"),
        (run["freeze_tested"], "no stream was in flight at the freeze: the hand-over was not tested"),
        (run["reprefill"]["answered"] == run["reprefill"]["replayed"], "the re-prefill baseline went unanswered"),
    ]
    return [why for ok, why in checks if not ok]

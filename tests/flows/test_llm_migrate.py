"""An LLM server written with the SDK through a whole `gpumigrate migrate`, with streams in flight all along.

The source is started by the test as a user starts theirs (``python -m gpumigrate.workloads.llm``, the reference
server, built only on the public SDK), behind a real front door (`gpumigrate frontdoor up`: Envoy and its control
plane). Eight clients, each the official ``openai`` client, stream 200-token completions through the front door
one after another for the whole migration, so that streams are in flight at the freeze, at the hand-over and
through the ramp. Every stream must end normally, its text identical to an unmigrated control server's for the
same request (greedy; two clients with a stop sequence). The migration's result says how many streams were handed
over, and its ramp read time to first token and inter-token gaps from streamed probes. A ramp that fails its
inter-token gate rolls back with streams in flight: the target keeps serving the streams on it until they end
(the source relays them), and not one breaks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "llm" / "plan.yaml"
MODEL = "llama-tiny-float32-s0"
TOKENS = 200
CLIENTS = 8
PROMPTS = [f"Client {i} asks the harbour master about ship {i * 7}." for i in range(CLIENTS)]
STOPPED = (6, 7)  # clients whose requests carry a stop sequence taken from the control text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(cond: Callable[[], bool], what: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(0.05)


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    agent: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def _start_server(env: dict[str, str], log: Path, name: str) -> Server:
    port, agent = _free_port(), f"127.0.0.1:{_free_port()}"
    argv = [sys.executable, "-m", "gpumigrate.workloads.llm", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--name", name, "--size", "tiny", "--seed", "0", "--slots", "16"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            argv, env={**env, "GPUMIGRATE_AGENT_ADDR": agent, "OMP_NUM_THREADS": "1"},
            stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    server = Server(proc, f"http://127.0.0.1:{port}", agent, log)

    def ready() -> bool:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        try:
            return httpx.get(server.url + "/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    _wait(ready, f"the {name} LLM server to be ready")
    return server


@dataclass
class Env:
    home: Path
    env: dict[str, str]
    cli: list[str]
    source: Server
    listener: str
    expected: dict[int, str]
    stops: dict[int, str]

    def gm(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.cli, *args], env=self.env, capture_output=True, text=True, timeout=900)


def _params(i: int, stops: dict[int, str]) -> dict[str, Any]:
    extra: dict[str, Any] = {"stop": [stops[i]]} if i in stops else {}
    return {"max_tokens": TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}, **extra}


def _first_stop(text: str) -> str:
    """A stop sequence from the middle of ``text`` (its first occurrence is where the text must end)."""
    for start in range(90, 140):
        candidate = text[start : start + 5]
        if len(candidate) == 5 and text.find(candidate) == start:
            return candidate
    raise AssertionError(f"no stop sequence found in {text!r}")


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory, prefect_api: str) -> Iterator[Env]:
    from gpumigrate.transfer import generate_key
    from tests.conftest import gpumigrate_cmd

    cli_cmd = gpumigrate_cmd()
    tmp = tmp_path_factory.mktemp("llm")
    home = tmp / "gmhome"
    home.mkdir()
    env = {**os.environ, "GPUMIGRATE_HOME": str(home), "PREFECT_API_URL": prefect_api,
           "GPUMIGRATE_LLM_KEY": generate_key()}  # fmt: skip
    env.pop("GPUMIGRATE_AWAIT_RESTORE", None)
    control = _start_server({**env, "GPUMIGRATE_HOME": str(tmp / "control-home")}, tmp / "control.log", "control")
    source = None
    try:
        client = openai.OpenAI(base_url=control.url + "/v1", api_key="not-needed", max_retries=0, timeout=300)

        def ask(i: int, stops: dict[int, str]) -> str:
            return client.completions.create(model=MODEL, prompt=PROMPTS[i], **_params(i, stops)).choices[0].text

        with ThreadPoolExecutor(CLIENTS) as pool:
            plain = dict(zip(range(CLIENTS), pool.map(lambda i: ask(i, {}), range(CLIENTS)), strict=True))
        stops = {i: _first_stop(plain[i]) for i in STOPPED}
        expected = {i: (plain[i][: plain[i].find(stops[i])] if i in stops else plain[i]) for i in range(CLIENTS)}
        assert all(ask(i, stops) == expected[i] for i in STOPPED)  # the control server stops there too
        source = _start_server(env, tmp / "source.log", "source")
        up = subprocess.run(
            [*cli_cmd, "frontdoor", "up", "--source", source.url, "--workload", "llm", "--listen", "127.0.0.1:0"],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert up.returncode == 0, up.stderr
        from gpumigrate.traffic.frontdoor import read

        listener = str(read(home / "traffic" / "llm").listener)
        yield Env(home, env, cli_cmd, source, listener, expected, stops)
    finally:
        subprocess.run([*cli_cmd, "frontdoor", "down", "--workload", "llm"], env=env, capture_output=True, timeout=120)
        from gpumigrate.infra import get_provider

        os.environ["GPUMIGRATE_HOME"], old = str(home), os.environ.get("GPUMIGRATE_HOME")
        try:
            provider = get_provider("local")
            for host in provider.list_hosts():
                provider.terminate(host)
        finally:
            if old is None:
                os.environ.pop("GPUMIGRATE_HOME", None)
            else:
                os.environ["GPUMIGRATE_HOME"] = old
        for srv in (source, control):
            if srv is not None:
                srv.stop()


@dataclass
class Streamer:
    """One client: streams its prompt through the front door again and again until stopped."""

    url: str
    index: int
    params: dict[str, Any]
    done: list[tuple[str, str | None, int]] = field(default_factory=list)  # (text, finish_reason, completion tokens)
    errors: list[str] = field(default_factory=list)
    chunks: int = 0  # of the stream in progress
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> Streamer:
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"streamer-{self.index}")
        self.thread.start()
        return self

    def _run(self) -> None:
        client = openai.OpenAI(base_url=self.url + "/v1", api_key="not-needed", max_retries=0, timeout=300)
        while not self.stop.is_set():
            text, finish, usage = "", None, None
            self.chunks = 0
            try:
                stream = client.completions.create(
                    model=MODEL, prompt=PROMPTS[self.index], stream=True,
                    stream_options={"include_usage": True}, **self.params,
                )  # fmt: skip
                for chunk in stream:
                    if chunk.usage is not None:
                        usage = chunk.usage.completion_tokens
                    if chunk.choices:
                        text += chunk.choices[0].text
                        finish = chunk.choices[0].finish_reason or finish
                        self.chunks += 1
            except Exception as exc:  # reported by the test: a broken stream
                self.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                continue
            self.done.append((text, finish, usage or 0))

    def finish(self) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(300)
        assert not self.thread.is_alive(), f"client {self.index}'s last stream did not end"


def _plan(e: Env, path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["workload"]["endpoint"] = e.source.url
    doc["workload"]["agent"] = e.source.agent
    doc["parity"]["golden_inputs"] = str(EXAMPLE.parent / "golden.jsonl")
    doc["transfer"]["store"] = f"file://{path.parent / 'store'}"
    doc["traffic"]["stages"] = [{"weight": 50, "hold_s": 2}, {"weight": 100, "hold_s": 2}]
    doc["traffic"]["gates"].update(min_requests=3, max_p99_ratio=20.0, max_ttft_ratio=20.0, max_inter_token_ratio=20.0)
    doc["traffic"]["analysis_interval_s"] = 0.5
    edit(doc)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _migrate_with_streams(e: Env, plan: Path, mid: str) -> tuple[int, dict[str, Any], list[Streamer]]:
    streamers = [Streamer(e.listener, i, _params(i, e.stops)).start() for i in range(CLIENTS)]
    try:
        _wait(lambda: all(s.chunks >= 5 or s.done for s in streamers), "every client to stream through the door")
        out = e.gm("migrate", str(plan), "--id", mid, "--json")
    finally:
        for s in streamers:
            s.finish()
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if lines else {}
    assert "Traceback" not in str(result.get("error")), result
    return out.returncode, result, streamers


def _no_stream_broken(e: Env, streamers: list[Streamer]) -> int:
    """Every stream ended normally with the control run's text; returns how many streams ran."""
    for s in streamers:
        assert not s.errors, f"client {s.index}: {s.errors[:3]}"
        assert s.done, f"client {s.index} finished no stream"
        for text, finish, tokens in s.done:
            assert text == e.expected[s.index], f"client {s.index}'s text differs from the control run's"
            assert finish == ("stop" if s.index in e.stops else "length")
            assert s.index in e.stops or tokens == TOKENS
    return sum(len(s.done) for s in streamers)


def _why(result: dict[str, Any]) -> str:
    """What a failed migration's result says about why, before the rest of it (pytest cuts a long dict short)."""
    failed = {n: p for n, p in result.get("phases", {}).items() if p.get("status") != "completed"}
    return json.dumps({"rollback": result.get("rollback"), "error": result.get("error"), "failed": failed})[:3000]


def _audit(e: Env, mid: str) -> list[dict[str, Any]]:
    path = e.home / "migrations" / mid / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_rollback_with_streams_in_flight_breaks_no_stream(llm: Env, tmp_path: Path) -> None:
    """The ramp's inter-token gate fails at its first stage (a limit no stream can meet): traffic goes back to the
    source, the target serves the streams on it (its own, and those handed over) until they end, then goes."""

    def edit(doc: dict[str, Any]) -> None:
        doc["traffic"]["gates"]["max_inter_token_ms"] = 0.001

    code, result, streamers = _migrate_with_streams(llm, _plan(llm, tmp_path / "plan.yaml", edit), "llm-rb")
    assert code == 3 and result["status"] == "rolled_back", result
    assert "inter-token gap" in str(result["rollback"]["reason"])
    assert _no_stream_broken(llm, streamers) >= CLIENTS
    events = {x["event"]: x["data"] for x in _audit(llm, "llm-rb")}
    assert events["work.handed_over"]["figures"]["moved"] >= 1  # streams were handed over before the rollback
    assert events["rollback.target_drained"]["left"] == 0


def test_streams_in_flight_survive_a_whole_migration(llm: Env, tmp_path: Path) -> None:
    from gpumigrate.traffic.state import StateStore

    code, result, streamers = _migrate_with_streams(llm, _plan(llm, tmp_path / "plan.yaml", lambda d: None), "llm-1")
    assert code == 0 and result["status"] == "completed", _why(result)
    ran = _no_stream_broken(llm, streamers)
    assert ran >= 2 * CLIENTS
    assert result["parity"]["passed"] is True and result["parity"]["cases"] == 3
    streams = result["streams"]
    assert streams["handed_over"] >= 1 and streams["handover_ms"] > 0
    assert {"source", "target"} <= set(streams["probes"]) and streams["probes"]["target"]["itl_p99_ms"] is not None
    assert StateStore(llm.home / "traffic" / "llm").read().weights == {"source": 0.0, "target": 100.0}
    assert result["requests"]["failed"] == 0  # the front door's access log: every request, one by one
    stages = [x["data"] for x in _audit(llm, "llm-1") if x["event"] == "traffic.figures"]
    assert stages and stages[-1]["failures"] == 0  # Envoy's counters, sampled through the ramp, agree

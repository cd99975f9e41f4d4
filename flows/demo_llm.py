"""``gpumigrate demo --workload llm``: an LLM server moved with its streams in flight, on this machine.

Two local hosts; the reference LLM server (``python -m gpumigrate.workloads.llm``, tiny config) on the source;
our control plane and a real Envoy in front of it; eight clients streaming greedy completions through Envoy
for the whole run, one after another; then the migrate flow to cutover with the live view, which shows the
clients' streams (in flight, done, broken, differing, the longest gap between two tokens), the hand-over and
the ramp's streamed probes. A client's first stream, finished before the migration starts, is its control:
every later stream of the same request must give the same text. The demo exits 0 only if the migration
completed and no stream broke or differed. The plan is ``examples/llm/plan.yaml``'s, on the demo's hosts.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from gpumigrate.atomic import atomic_write_bytes
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit
from gpumigrate.flows.report import merge_result, write_outputs
from gpumigrate.flows.run import run_migration
from gpumigrate.infra import get_provider
from gpumigrate.infra.launch import service_url, wait_http
from gpumigrate.interfaces import Host, HostSpec, Provider
from gpumigrate.launch import WorkloadLaunch
from gpumigrate.result import MigrationResult
from gpumigrate.settings import migrations_dir
from gpumigrate.state import Migration, new_migration_id
from gpumigrate.traffic.frontdoor import FrontDoor

WORKLOAD = "llm"
REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "llm"
MODEL = "llama-tiny-float32-s0"
ARGV = ["{python}", "-m", "gpumigrate.workloads.llm", "--host", "{host}", "--port", "{service_port}",
        "--name", "{name}", "--size", "tiny", "--seed", "0", "--slots", "16"]  # fmt: skip
CLIENTS = 8
TOKENS = 64
READY_TIMEOUT_S = 120.0
REPORT_EVERY_S = 0.5


@dataclass
class StreamClient:
    """One client streaming its greedy request through the front door again and again."""

    url: str
    index: int
    control: str | None = None  # its first stream's text
    completed: int = 0
    broken: list[str] = field(default_factory=list)
    differ: int = 0
    streaming: bool = False
    max_gap_ms: float = 0.0

    def body(self) -> dict[str, Any]:
        prompt = f"Demo client {self.index} asks the harbour master about ship {self.index * 7}."
        return {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "stream": True,
                "ignore_eos": True}  # fmt: skip

    def run(self, stop: threading.Event) -> None:
        with httpx.Client(timeout=httpx.Timeout(300.0), trust_env=False) as client:
            while not stop.is_set():
                self._one(client)

    def _one(self, client: httpx.Client) -> None:
        text, last, done = "", None, False
        self.streaming = True
        try:
            with client.stream("POST", self.url + "/v1/completions", json=self.body()) as r:
                if r.status_code != 200:
                    self.broken.append(f"HTTP {r.status_code}")
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.broken.append(str(event["error"].get("message"))[:200])
                        return
                    now = time.monotonic()
                    if last is not None:
                        self.max_gap_ms = max(self.max_gap_ms, (now - last) * 1000)
                    last = now
                    text += event["choices"][0]["text"] if event.get("choices") else ""
        except httpx.HTTPError as exc:
            self.broken.append(f"{type(exc).__name__}: {exc}"[:200])
            return
        finally:
            self.streaming = False
        if not done:
            self.broken.append("the stream ended without [DONE]")
            return
        if self.control is None:
            self.control = text
        elif text != self.control:
            self.differ += 1
        self.completed += 1


class StreamClients:
    """The demo's clients, and what they saw, reported as ``demo.streams`` events."""

    def __init__(self, url: str) -> None:
        self.clients = [StreamClient(url, i) for i in range(CLIENTS)]
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=c.run, args=(self._stop,), daemon=True) for c in self.clients]

    def start(self) -> StreamClients:
        for t in self._threads:
            t.start()
        return self

    def figures(self) -> dict[str, Any]:
        cs = self.clients
        return {
            "clients": len(cs),
            "in_flight": sum(c.streaming for c in cs),
            "completed": sum(c.completed for c in cs),
            "broken": sum(len(c.broken) for c in cs),
            "differ": sum(c.differ for c in cs),
            "max_gap_ms": round(max(c.max_gap_ms for c in cs), 1),
            "errors": [e for c in cs for e in c.broken][:5],
        }

    def wait_for_controls(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while any(c.control is None for c in self.clients):
            if time.monotonic() > deadline or self.figures()["broken"]:
                raise RuntimeError(f"the demo's clients could not stream through the front door: {self.figures()}")
            time.sleep(0.1)
        for c in self.clients:  # the gaps that count are the ones the migration causes
            c.max_gap_ms = 0.0

    def stop(self, timeout_s: float = 300.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)


def _report_while(m: Migration, clients: StreamClients, stop: threading.Event) -> None:
    while not stop.wait(REPORT_EVERY_S):
        emit(m, "demo.streams", clients.figures())


def demo_plan(source: Host, target_host: str, store: Path, key_file: Path) -> dict[str, Any]:
    """``examples/llm/plan.yaml`` on the demo's hosts, with a short ramp, no rollback window and the demo's gates."""
    doc: dict[str, Any] = yaml.safe_load((EXAMPLE / "plan.yaml").read_text())
    doc["workload"].update(source_host=source.name, endpoint=service_url(source),
                           agent=f"{source.address}:{source.ports['agent']}")  # fmt: skip
    doc["workload"]["launch"] = {"argv": ARGV, "env": {"OMP_NUM_THREADS": "1"}, "ready_timeout_s": READY_TIMEOUT_S}
    doc["target"]["host"] = target_host
    doc["transfer"].update(store=f"file://{store}", encryption_key={"file": str(key_file)})
    doc["parity"]["golden_inputs"] = str(EXAMPLE / "golden.jsonl")
    doc["traffic"].update(stages=[{"weight": w, "hold_s": 2} for w in (25, 50, 100)], rollback_window_s=0)
    # Both servers share this machine's cores (and whatever else runs on it), so a latency ratio measures CPU
    # contention more than the target: at 4x, a second test run beside the demo rolled it back (the fresh target's
    # p99 time to first token 7.6x the warm source's, over intervals of 2-3 requests). The demo injects no fault
    # here; its ratios stay on at 20x (a stalled or broken target still fails them), two bad intervals in a row.
    # A client's stream lasts seconds, so few requests end in one interval: longer intervals, fewer requests each.
    doc["traffic"]["gates"].update(max_p99_ratio=20.0, max_ttft_ratio=20.0, max_inter_token_ratio=20.0,
                                   failures_to_rollback=2, min_requests=2)  # fmt: skip
    doc["traffic"]["analysis_interval_s"] = 2.0
    return doc


def _start_source(provider: Provider, migration_id: str, name: str) -> Host:
    host = provider.provision(HostSpec(name=name, provider="local", region="local-a"), migration_id=migration_id)
    host = provider.wait_ready(host, timeout_s=60)
    launch = WorkloadLaunch(argv=tuple(ARGV), env={"OMP_NUM_THREADS": "1"}, ready_timeout_s=READY_TIMEOUT_S)
    host = provider.bootstrap(host, launch, timeout_s=launch.ready_timeout_s)
    wait_http(service_url(host), path=launch.ready_path, timeout_s=launch.ready_timeout_s)
    return host


def run_llm_demo(*, watch: Any = None) -> MigrationResult:
    """Run the LLM demo end to end; ``watch(migration_id)`` is entered around the migration (the live view)."""
    from gpumigrate.transfer.format.keys import generate_key

    mid = new_migration_id(WORKLOAD)
    suffix = mid.rsplit("-", 1)[-1]
    mdir = migrations_dir() / mid
    mdir.mkdir(parents=True, exist_ok=True)
    key_file = mdir / "demo.key"
    atomic_write_bytes(key_file, generate_key().encode(), mode=0o600)
    provider = get_provider("local")
    source: Host | None = None
    door: FrontDoor | None = None
    clients: StreamClients | None = None
    try:
        source = _start_source(provider, mid, f"demo-llm-a-{suffix}")
        door = FrontDoor.start(mdir / "traffic", source_host=source.address, source_port=source.ports["service"],
                               node_id=f"demo-llm-envoy-{suffix}")  # fmt: skip
        plan_path = mdir / "demo-plan.yaml"
        plan = demo_plan(source, f"demo-llm-b-{suffix}", mdir / "store", key_file)
        atomic_write_bytes(plan_path, yaml.safe_dump(plan, sort_keys=False).encode())
        ctx = RunContext.create(plan_path, migration_id=mid, resume=False, traffic_state_dir=str(mdir / "traffic"),
                                target_attached=True)  # fmt: skip
        m = ctx.migration
        clients = StreamClients(door.url).start()
        clients.wait_for_controls()
        reporting = threading.Event()
        reporter = threading.Thread(target=_report_while, args=(m, clients, reporting), daemon=True)
        with contextlib.ExitStack() as stack:
            if watch is not None:
                stack.enter_context(watch(mid))
            reporter.start()
            result = run_migration(mid)
            clients.stop()
            reporting.set()
            reporter.join(5)
            figures = clients.figures()
            emit(m, "demo.streams", figures)
        bad = figures["broken"] + figures["differ"]
        merge_result(m, requests={"total": figures["completed"] + figures["broken"], "failed": bad,
                                  "measured_by": "the demo's streaming clients, over the whole migration"})  # fmt: skip
        if result.status == "completed" and bad:
            return write_outputs(m, status="failed", error=f"{bad} of the clients' streams broke or differed")
        return write_outputs(m, status=result.status, error=result.error)
    finally:
        if clients is not None:
            clients.stop(timeout_s=10)
        if door is not None:
            door.stop()
        with contextlib.suppress(Exception):
            target = RunContext.load(mid).runtime.target_host
            if target is not None:
                provider.terminate(target)
        if source is not None:
            with contextlib.suppress(Exception):
                provider.terminate(source)

"""``gpumigrate demo``: the whole path on this machine, on the embedded Prefect default.

Two local hosts; the reference inference server (tiny model) on the source; our control plane and a
real Envoy in front of it; a load generator through Envoy for the whole run; then the migrate flow
to cutover with a live view. ``fault`` breaks the target at the right moment (via its
``/admin/fault``) to show the automatic rollback. Everything started here is stopped in ``finally``.
The demo's encryption key is generated per run into the migration's directory (mode 0600) and
referenced by file: it is never printed, logged or put in the plan.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import yaml

from gpumigrate.atomic import atomic_write_bytes
from gpumigrate.errors import GpumigrateError, InvalidInputError
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit, listening
from gpumigrate.flows.report import write_outputs
from gpumigrate.flows.run import run_migration
from gpumigrate.infra import get_provider
from gpumigrate.infra.launch import service_url, wait_http
from gpumigrate.interfaces import Host, HostSpec, Provider
from gpumigrate.launch import WorkloadLaunch
from gpumigrate.result import MigrationResult
from gpumigrate.settings import migrations_dir
from gpumigrate.state import Migration, new_migration_id
from gpumigrate.traffic.frontdoor import FrontDoor

WORKLOAD = "tiny-lm"
FAULTS: dict[str, tuple[dict[str, Any], str]] = {
    # --fault name: (target fault body, the event after which it is injected)
    "target-errors": ({"kind": "errors", "rate": 1.0}, "ramp25"),
    "target-slow": ({"kind": "slow", "delay_ms": 2000}, "ramp25"),  # far beyond a loaded source's p99
    "target-drift": ({"kind": "drift"}, "ramp25"),
    "target-crash": ({"kind": "crash", "rate": 1.0}, "ramp25"),
}
DEMO_RPS = 50.0
REPO = Path(__file__).resolve().parents[1]
# How the demo's workload starts, on the source and (through the plan) on the target: the same launch.
ARGV = ["{python}", "-m", "gpumigrate.workloads.inference", "--host", "{host}", "--port", "{service_port}",
        "--name", "{name}", "--seed", "0", "--size", "tiny", "--device", "cpu"]  # fmt: skip
READY_TIMEOUT_S = 120.0
Watch = Callable[[str], AbstractContextManager[object]]  # the caller's view of a migration's events


def golden_inputs(dest: Path) -> Path:
    """The demo's golden set: examples/golden/tiny-lm.jsonl when present, else a small built-in one."""
    shipped = REPO / "examples" / "golden" / "tiny-lm.jsonl"
    if shipped.is_file():
        return shipped
    lines = [
        json.dumps({"id": f"g{i:02d}", "prompt": p, "max_new_tokens": 8})
        for i, p in enumerate(["Hello", "The GPU", "Migrate me", "zero downtime", "Envoy says", "abc"])
    ]
    atomic_write_bytes(dest, ("\n".join(lines) + "\n").encode())
    return dest


def demo_plan(
    *, source: Host, target_host: str, store: Path, key_file: Path, golden: Path, faults: bool = False
) -> dict[str, Any]:
    """The demo's plan. ``faults``: the target (and only it) starts with ``--enable-faults``, so the drill can
    break it through ``POST /admin/fault``; the source never serves that path."""
    return {
        "version": 1,
        "workload": {
            "name": WORKLOAD,
            "kind": "inference",
            "source_host": source.name,
            "source_provider": "local",
            "source_region": "local-a",
            "endpoint": service_url(source),
            "agent": f"{source.address}:{source.ports['agent']}",
            "launch": {"argv": [*ARGV, "--enable-faults"] if faults else ARGV, "ready_timeout_s": READY_TIMEOUT_S},
        },
        "target": {"provider": "local", "region": "local-b", "host": target_host},
        "data": {"classification": "internal", "allowed_jurisdictions": ["LOCAL"]},
        "snapshot": {"backend": "agent", "precopy_rounds": 2, "max_downtime_ms": 500},
        "transfer": {
            "store": f"file://{store}",
            "compression": "auto",
            "encryption_key": {"file": str(key_file)},
            "parallelism": 2,
        },
        "parity": {
            "golden_inputs": str(golden),
            "request": {  # as examples/local-demo.yaml asks the reference server
                "method": "POST",
                "path": "/v1/generate",
                "compare": [
                    {"field": "tokens", "kind": "exact"},
                    {"field": "text", "kind": "exact"},
                    {"field": "logprobs", "kind": "numeric"},
                ],
            },
            "atol": 1e-4,
            "rtol": 1e-3,
            "environment": {"torch": "must_match", "weights_digest": "must_match", "driver": "may_differ"},
        },
        "traffic": {
            "stages": [{"weight": w, "hold_s": 2} for w in (5, 25, 50, 100)],
            "gates": {
                "min_success_rate": 0.99,
                "max_p99_ratio": 4.0,
                "min_requests": 5,
                "failures_to_rollback": 2,
            },  # two bad intervals in a row: no false alarm
            "analysis_interval_s": 1.0,
            "rollback_window_s": 0,
        },
    }


class FaultInjector:
    """Listens to the migration's events and breaks the target once, at the planned moment.

    The audit gets ``fault.injected`` only once the target acknowledged the fault (it answers with the
    fault it now runs); any other outcome is recorded as ``fault.failed`` with the reason, and
    :attr:`failure` says it, so the demo fails instead of showing a migration that nothing broke.
    """

    def __init__(self, migration: Migration, fault: str | None) -> None:
        self.migration = migration
        self.fault = fault
        self.done = False
        self.acknowledged = False
        self.failure: str | None = None
        self.endpoint: str | None = None

    def on_event(self, event: str, data: dict[str, Any]) -> None:
        if self.fault is None or self.done:
            return
        if event == "phase.provision.completed":
            self.endpoint = data.get("endpoint")
        body, moment = FAULTS[self.fault]
        due = moment == "ramp25" and event == "traffic.stage" and float(data.get("weight") or 0) >= 25
        if not due:
            return
        self.done = True
        self.failure = self._inject(body) if self.endpoint else "the target's endpoint was never reported"
        if self.failure is None:
            self.acknowledged = True
            emit(self.migration, "fault.injected", {"fault": self.fault, "at": event, **body})
        else:
            emit(self.migration, "fault.failed", {"fault": self.fault, "at": event, "reason": self.failure, **body})

    def _inject(self, body: dict[str, Any]) -> str | None:
        """POST the fault to the target; None once it answered that it runs it, else why not."""
        url = f"{self.endpoint}/admin/fault"
        try:
            reply = httpx.post(url, json=body, timeout=5, trust_env=False)
        except httpx.HTTPError as exc:
            return f"POST {url} failed: {type(exc).__name__}: {exc}"
        if reply.status_code != 200:
            return f"POST {url} answered {reply.status_code}: {reply.text[:200]}"
        try:
            running = reply.json().get("kind")
        except (ValueError, AttributeError):
            running = None
        if running != body["kind"]:
            return f"POST {url} answered 200 but the target runs fault {running!r}, not {body['kind']!r}"
        return None

    def check(self, result: MigrationResult) -> None:
        """Raise when the fault asked for was not injected: a demo of a rollback that nothing caused shows nothing."""
        if self.fault is None or self.acknowledged:
            return
        why = self.failure or "the ramp never reached the moment of the fault (25% of traffic on the target)"
        raise DemoFaultError(
            f"--fault {self.fault} was not injected: {why}; the migration {self.migration.id} ended "
            f"{result.status} without it",
            result,
        )


class DemoFaultError(GpumigrateError):
    """The demo's fault could not be injected into its target (exit 1); ``result`` is the migration's own."""

    def __init__(self, message: str, result: MigrationResult) -> None:
        super().__init__(message)
        self.result = result


def _start_source(provider: Provider, migration_id: str, name: str) -> Host:
    """The source host and its workload, started through the one launcher like any target."""
    host = provider.provision(HostSpec(name=name, provider="local", region="local-a"), migration_id=migration_id)
    host = provider.wait_ready(host, timeout_s=60)
    launch = WorkloadLaunch(argv=tuple(ARGV), ready_timeout_s=READY_TIMEOUT_S)
    host = provider.bootstrap(host, launch, timeout_s=launch.ready_timeout_s)
    wait_http(service_url(host), path=launch.ready_path, timeout_s=launch.ready_timeout_s)
    return host


def run_demo(*, fault: str | None = None, watch: Watch | None = None) -> MigrationResult:
    """Run the demo end to end; returns the result contract (the load generator's own view is the ``demo.load``
    audit event).

    ``watch(migration_id)`` is entered around the migration: the CLI's live view listens there.
    """
    if fault is not None and fault not in FAULTS:
        raise InvalidInputError(f"--fault {fault!r} is not one of {', '.join(FAULTS)}")
    from gpumigrate.traffic.loadgen import LoadProcess
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
    load: LoadProcess | None = None
    target_name = f"demo-b-{suffix}"
    try:
        source = _start_source(provider, mid, f"demo-a-{suffix}")
        door = FrontDoor.start(
            mdir / "traffic",
            source_host=source.address,
            source_port=source.ports["service"],
            node_id=f"demo-envoy-{suffix}",
        )
        plan = demo_plan(
            source=source,
            target_host=target_name,
            store=mdir / "store",
            key_file=key_file,
            golden=golden_inputs(mdir / "golden.jsonl"),
            faults=fault is not None,
        )
        plan_path = mdir / "demo-plan.yaml"
        atomic_write_bytes(plan_path, yaml.safe_dump(plan, sort_keys=False).encode())
        ctx = RunContext.create(
            plan_path,
            migration_id=mid,
            resume=False,
            traffic_state_dir=str(mdir / "traffic"),
            target_attached=True,
        )
        m = ctx.migration
        # Its own process: a load generator sharing this process's GIL with the flow would measure itself.
        load = LoadProcess(
            door.url + "/v1/generate", rps=DEMO_RPS, seconds=600, body={"prompt": "hello", "max_new_tokens": 4}
        )
        injector = FaultInjector(m, fault)
        with listening(mid, injector.on_event), watch(mid) if watch else contextlib.nullcontext():
            result = run_migration(mid)
        _record_load(m, load)
        outcome = write_outputs(m, status=result.status, error=result.error)
        injector.check(outcome)
        return outcome
    finally:
        if load is not None:
            with contextlib.suppress(Exception):
                load.kill()
        _teardown(provider, mid, source, door)


def _record_load(m: Migration, load: Any) -> None:
    """What its clients saw, from their side: beside the result's own figures (the front door's, from the first
    freeze: flows/client_figures.py), never in their place. A load generator that does not finish within 60 s of
    its stop (a machine too loaded) loses that view, said in the event; the migration's outcome stands (a rolled
    back demo exits 3, not 1 for the load generator)."""
    load.stop()
    try:
        report = load.wait(timeout_s=60)
    except RuntimeError as exc:
        emit(m, "demo.load", {"rps": DEMO_RPS, "error": f"{exc} within 60 s of its stop: the clients' view is lost"})
        return
    emit(
        m,
        "demo.load",
        {
            "rps": DEMO_RPS,
            "total": report.total,
            "failed": report.failed,
            "errors": report.errors,
            "longest_extra_wait_ms": report.stall_ms,
            "failed_per_second": {str(b["t"]): b["failed"] for b in report.per_second if b["failed"]},
        },
    )


def _teardown(provider: Provider, migration_id: str, source: Host | None, door: FrontDoor | None) -> None:
    """Stop everything the demo started, even after a failure; never raises.

    Not an undo: the migration's record keeps its outcome; only the processes go away.
    """
    if door is not None:
        door.stop()
    with contextlib.suppress(Exception):
        target = RunContext.load(migration_id).runtime.target_host
        if target is not None:
            provider.terminate(target)
    if source is not None:
        with contextlib.suppress(Exception):
            provider.terminate(source)

"""Fault matrix: SIGKILL one process of a real local migration at one phase, then look at what is left.

    python bench/faults.py [--only VICTIM:PHASE,...] [--out build/faults] [--json] [--freeze-lease-s S]

Each cell runs the product's own path, as ``gpumigrate demo`` does between two local hosts: the
reference inference server (tiny model) on a source host, the front door ``gpumigrate frontdoor up`` starts
(its supervisor with Envoy and the xDS control plane as children, each its own process so that each can be
killed, each started again by the supervisor), and the migrate flow in an orchestrator process of its own
(``RunContext.create`` then ``run_migration``, what ``gpumigrate migrate`` runs), reporting to one Prefect
server started here. Receiver cells move the image through ``stream://target`` (a receiver the flow starts on
the target); the others through the demo's ``file://`` store. The orchestrator carries a tripwire: it listens to its
migration's events (and to two calls that emit none: the target's launch and the source's freeze) and,
at the cell's moment, SIGKILLs the victim (itself, for the orchestrator). Then the driver probes:

* the source: does it answer a request, is its agent frozen, are its weights the ones it started with;
* the front door: does a client request get an answer, where do the weights point;
* the migration: its recorded status, and the image's verification in its store;
* recovery: what the flow did by itself (rollback, completion), how long a frozen source took to
  resume by its lease; when the flow did not end the migration (its orchestrator died, or it failed),
  ``gpumigrate migrate PLAN --id ID --resume`` is run once, then ``gpumigrate rollback ID`` if needed.

Nothing in a cell is filled in by hand: every verdict is computed from those probes. The results go to
``OUT/faults.json`` and ``OUT/faults.md`` (FAULTS.md beside this file says how to read them). A cell whose victim
does not run at its moment (the receiver before the flow started it or after it stopped it) says so.

``--smoke`` (CI, seconds, no process started): the driver's plan and report only. Every victim and phase is either
a cell or named not applicable with its reason, a wrong ``--only`` is refused, and two cells whose probes are given
(a baseline that completed, an Envoy killed mid-ramp) are described and rendered to ``faults.md`` through
``--render``; exits 1 on any difference. The real cells are SIGKILLs of real migrations: ``tests/faults`` runs three
of them in ``make test``, and the whole matrix is this script without ``--smoke``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PHASES = ("preflight", "provision", "snapshot", "freeze", "transfer", "restore", "parity", "ramp", "finalize")
VICTIMS = ("none", "orchestrator", "source", "target", "receiver", "envoy", "control-plane")
# The moment each phase's kill happens at, as the orchestrator's tripwire sees it.
MOMENTS = {
    "preflight": "phase.preflight.started",
    "provision": "target workload launched, not yet ready",
    "snapshot": "first pre-copy round done (source live)",
    "freeze": "source frozen, final round not begun",
    "transfer": "phase.transfer.started (image committed, not yet checked where the target reads it)",
    "restore": "phase.restore.started",
    "parity": "phase.parity.started",
    "ramp": "first ramp stage applied (traffic split)",
    "finalize": "phase.finalize.started",
}
LOAD_RPS = 25.0  # clients through the front door for the whole cell: the ramp's gates need requests to judge
NOT_APPLICABLE = {
    ("target", "preflight"): "no target process exists before provision",
    ("receiver", "preflight"): "the flow starts its receiver in provision, after the target's workload",
}
NO_VICTIM = "not running at that moment"  # the cell's note when the tripwire found no victim process
# One orchestrator run (a hung one is killed and reported as such), and one --resume: on a 2-core machine that other
# work loads a whole migration took over 240 s (preflight alone two minutes), which read as hung.
FLOW_TIMEOUT_S = 900.0
RESUME_TIMEOUT_S = 900.0
FREEZE_LEASE_S = (
    60.0  # the demo plan's freeze lease (snapshot.freeze_lease_s, default 60 s): a frozen source waits that long
)
TRAFFIC_LEASE_WAIT_S = 20.0  # the ramp's traffic lease (lease_min_s 10 s) plus slack


# ---------------------------------------------------------------- environment
def _env_defaults(out: Path) -> None:
    """A private state root, Prefect home, audit key and anchors for the whole matrix."""
    home = out / "run"
    home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("GPUMIGRATE_HOME", str(home / "gmhome"))
    os.environ.setdefault("PREFECT_HOME", str(home / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
    key = home / "audit.key"
    if not key.exists():
        key.write_text(secrets.token_hex(32) + "\n")
        key.chmod(0o600)
    os.environ.setdefault("GPUMIGRATE_AUDIT_KEY_FILE", str(key))
    os.environ.setdefault("GPUMIGRATE_AUDIT_ANCHORS", (home / "anchors").as_uri())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(check: Callable[[], bool], timeout_s: float, every_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(every_s)
    return check()


@contextlib.contextmanager
def prefect_server(log: Path) -> Iterator[str]:
    """One real Prefect server for every orchestrator of the matrix (an ephemeral API per orchestrator
    would be orphaned each time one is SIGKILLed)."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    with open(log, "ab") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def up() -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200
        return False

    try:
        if not wait_until(up, 600, 0.5):  # a fresh home migrates its database first; long on a loaded machine
            raise RuntimeError(f"the prefect server did not answer {url}/health within 600s; see {log}")
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)


@dataclass
class Stage:
    """The source host with its workload, and the front door: shared by cells while they stay healthy."""

    source: Any  # gpumigrate.interfaces.Host
    endpoint: str
    agent: str
    workload_pid: int
    traffic_dir: Path
    listener: str  # where clients call the front door
    admin_url: str  # its Envoy's admin (read by the probes, never by the supervisor)
    digest: str

    def door(self) -> Any:  # gpumigrate.traffic.frontdoor.DoorInfo: the children's pids change on each restart
        from gpumigrate.traffic.frontdoor import read

        return read(self.traffic_dir)

    @property
    def pids(self) -> dict[str, int]:
        procs = self.door().processes
        return {
            "source": self.workload_pid,
            "envoy": procs.get("envoy", 0),
            "control-plane": procs.get("control-plane", 0),
        }


def source_launch() -> Any:  # gpumigrate.launch.WorkloadLaunch: the demo's reference server, as the stage starts it
    from gpumigrate.flows.demo import ARGV, READY_TIMEOUT_S
    from gpumigrate.launch import WorkloadLaunch

    return WorkloadLaunch(argv=tuple(ARGV), ready_timeout_s=READY_TIMEOUT_S)


def start_stage(work: Path, n: int) -> Stage:
    from gpumigrate.infra.launch import service_url, wait_http
    from gpumigrate.infra.local import LocalProvider
    from gpumigrate.interfaces import HostSpec
    from gpumigrate.parity.environment import fetch_info
    from gpumigrate.traffic import detached

    provider = LocalProvider()  # attached: the source host dies with the driver, whatever ends it
    host = provider.provision(HostSpec(name=f"fm-src-{n}", provider="local", region="local-a"))
    host = provider.wait_ready(host, timeout_s=60)
    launch = source_launch()
    host = provider.bootstrap(host, launch, timeout_s=launch.ready_timeout_s)
    endpoint = service_url(host)
    wait_http(endpoint, path=launch.ready_path, timeout_s=launch.ready_timeout_s)
    # The front door as `gpumigrate frontdoor up` starts it: the supervisor, its Envoy and its control plane.
    tdir = work / f"traffic-{n}"
    door, _ = detached.start_detached(tdir, source_host=host.address, source_port=host.ports["service"],
                                       listen="127.0.0.1:0", node_id=f"fm-envoy-{n}")  # fmt: skip
    listener = str(door.listener)
    wait_until(lambda: _post(listener) == 200, 30, 0.3)
    digest = str(fetch_info(endpoint).get("weights_digest") or "")
    agent = f"{host.address}:{host.ports['agent']}"
    pid = int(host.meta["workload"]["pid"])
    return Stage(host, endpoint, agent, pid, tdir.resolve(), listener, door.admin_urls[0], digest)


def stop_stage(stage: Stage) -> None:
    from gpumigrate.infra import get_provider
    from gpumigrate.traffic.detached import stop_detached

    with contextlib.suppress(Exception):
        stop_detached(stage.traffic_dir)
    with contextlib.suppress(Exception):
        get_provider("local").terminate(stage.source)


# ---------------------------------------------------------------- probes
def _post(url: str, timeout_s: float = 5.0) -> int | None:
    import httpx

    try:
        r = httpx.post(
            url + "/v1/generate", json={"prompt": "hello", "max_new_tokens": 2}, timeout=timeout_s, trust_env=False
        )
        return r.status_code
    except httpx.HTTPError:
        return None


def _frozen(agent: str) -> bool | None:
    """The source agent's frozen flag; None when the agent does not answer."""
    from gpumigrate.snapshot.client import AgentClient

    try:
        with AgentClient(agent, timeout_s=5) as client:
            return client.request_info().frozen
    except Exception:
        return None


def _digest(endpoint: str | None) -> str | None:
    from gpumigrate.parity.environment import fetch_info

    if not endpoint:
        return None
    try:
        return str(fetch_info(endpoint, timeout_s=5).get("weights_digest") or "")
    except Exception:
        return None


def _weights(traffic_dir: Path) -> dict[str, float]:
    try:
        state = json.loads((traffic_dir / "desired.json").read_text())
        return {k: float(v) for k, v in (state.get("weights") or {}).items()}
    except (OSError, ValueError):
        return {}


def _live(admin_url: str) -> dict[str, int] | None:
    from gpumigrate.traffic.envoy import EnvoyAdmin

    try:
        return EnvoyAdmin(admin_url, timeout_s=3).live_weights()
    except Exception:
        return None


def _image_ok(mid: str) -> bool | None:
    """Does the committed image verify in the store the target reads (None: no image was committed)?"""
    from gpumigrate.flows.context import RunContext
    from gpumigrate.transfer.format.keys import resolve_key
    from gpumigrate.transfer.push import verify

    try:
        ctx = RunContext.load(mid)
        rt = ctx.runtime
        if rt.image is None:
            return None
        ref = ctx.key_ref()
        key = resolve_key(env=ref.get("env"), file=ref.get("file")) if ref else None
        for store in dict.fromkeys([rt.target_store, ctx.store_url()]):
            if store:
                with contextlib.suppress(Exception):
                    verify(store, rt.image.id, key=key)
                    return True
        return False
    except Exception:
        return None


# ---------------------------------------------------------------- one cell
@dataclass
class Cell:
    victim: str
    phase: str
    moment: str = ""
    skipped: str | None = None
    killed: bool = False  # the tripwire fired and the victim got SIGKILL
    flow_exit: int | None = None  # orchestrator's exit code (-9: killed)
    flow_status: str | None = None  # the migration's recorded status when the orchestrator ended
    source_frozen_after_kill: bool | None = None
    source_serves_again_s: float | None = None  # orchestrator cells: seconds from the kill to a served request
    freeze_lease_s: float = FREEZE_LEASE_S  # the plan's snapshot.freeze_lease_s: how long a frozen source waits
    recovery_steps: list[str] = field(default_factory=list)
    final_status: str | None = None
    source_serves: bool | None = None
    source_frozen: bool | None = None
    source_digest_same: bool | None = None
    door_serves: bool | None = None
    door_weights: dict[str, float] = field(default_factory=dict)  # desired (the control plane's state)
    door_live: dict[str, int] | None = None  # what Envoy runs (its config dump); None: Envoy is down
    door_restarts: dict[str, int] = field(default_factory=dict)  # children the door's supervisor started again
    client_requests: int | None = None  # through the front door, from before the flow started to the probes
    client_failed: int | None = None
    target_digest_same: bool | None = None
    image_verifies: bool | None = None
    bytes_lost: bool | None = None
    source_harmed: bool | None = None
    recovery: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    commit: str = ""  # the code the cell ran (git describe of the working tree)


def plan_for(
    stage: Stage,
    work: Path,
    mid: str,
    key_file: Path,
    *,
    store: str | None = None,
    freeze_lease_s: float = FREEZE_LEASE_S,
) -> Path:
    import yaml

    from gpumigrate.atomic import atomic_write_bytes
    from gpumigrate.flows.demo import demo_plan, golden_inputs

    plan = demo_plan(
        source=stage.source,
        target_host=f"fm-tgt-{mid[-6:]}",
        store=work / mid / "store",
        key_file=key_file,
        golden=golden_inputs(work / "golden.jsonl"),
    )
    # Two short stages: one cell takes seconds. The p99 gate is widened: on a shared 2-core machine it
    # measures CPU contention, which would roll back cells for reasons that are not their fault.
    # Everything else is the demo's plan.
    plan["traffic"]["stages"] = [{"weight": 50, "hold_s": 2}, {"weight": 100, "hold_s": 2}]
    plan["traffic"]["gates"]["max_p99_ratio"] = 20.0
    if store is not None:  # the receiver's cells: the image through a receiver the flow starts on the target
        plan["transfer"]["store"] = store
    plan["snapshot"]["freeze_lease_s"] = freeze_lease_s
    path = work / mid / "plan.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, yaml.safe_dump(plan, sort_keys=False).encode())
    return path


def _cli(args: list[str], timeout_s: float, env: dict[str, str]) -> tuple[int | None, dict[str, Any]]:
    """The real CLI in a subprocess: its exit code and the last JSON object it printed."""
    exe = Path(sys.executable).parent / "gpumigrate"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "gpumigrate"]
    try:
        out = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=env)
    except subprocess.TimeoutExpired:
        return None, {}
    last: dict[str, Any] = {}
    for line in reversed(out.stdout.strip().splitlines()):
        with contextlib.suppress(ValueError):
            parsed = json.loads(line)
            if isinstance(parsed, dict):
                last = parsed
                break
    return out.returncode, last


def _status(mid: str) -> str | None:
    from gpumigrate.state import Migration

    with contextlib.suppress(Exception):
        return str(Migration.open(mid).read().get("status"))
    return None


def _target_endpoint(mid: str) -> str | None:
    from gpumigrate.flows.context import RunContext

    with contextlib.suppress(Exception):
        return RunContext.load(mid).runtime.target_endpoint
    return None


def run_cell(
    stage: Stage, work: Path, victim: str, phase: str, key_file: Path, *, freeze_lease_s: float = FREEZE_LEASE_S
) -> Cell:
    from gpumigrate.state import new_migration_id

    cell = Cell(victim, phase, MOMENTS[phase], freeze_lease_s=freeze_lease_s)
    started = time.monotonic()
    mid = new_migration_id("fm")
    store = "stream://target" if victim == "receiver" else None
    plan = plan_for(stage, work, mid, key_file, store=store, freeze_lease_s=freeze_lease_s)
    restarts_before = dict(stage.door().restarts)
    trip = work / mid / "trip.json"
    result = work / mid / "result.json"
    args = ["orchestrate", "--plan", str(plan), "--id", mid, "--victim", victim, "--phase", phase]
    args += ["--pids", json.dumps(stage.pids), "--trip", str(trip), "--result", str(result)]
    env = {**os.environ, "GPUMIGRATE_TRAFFIC_DIR": str(stage.traffic_dir)}
    from gpumigrate.traffic.loadgen import LoadProcess

    body = {"prompt": "hello", "max_new_tokens": 4}
    load = LoadProcess(stage.listener + "/v1/generate", rps=LOAD_RPS, seconds=900, body=body)
    try:
        _run_flow(cell, stage, plan, mid, args, env, trip)
    finally:
        load.stop()
        with contextlib.suppress(Exception):
            report = load.wait()
            cell.client_requests, cell.client_failed = report.total, report.failed
        load.kill()
    probe(cell, stage, mid)
    if victim == "source" and cell.killed and cell.final_status not in ("completed", "rolled_back", "denied"):
        _operator_starts_the_source_again(cell, stage, mid, env)
    after = stage.door().restarts
    cell.door_restarts = {k: n - restarts_before.get(k, 0) for k, n in after.items() if n > restarts_before.get(k, 0)}
    cell.recovery = describe(cell)
    cell.seconds = round(time.monotonic() - started, 1)
    _terminate_targets(mid)
    return cell


def _run_flow(cell: Cell, stage: Stage, plan: Path, mid: str, args: list[str], env: dict[str, str], trip: Path) -> None:
    """The orchestrator until it ends (or dies), then what recovery the cell needs."""
    victim, phase = cell.victim, cell.phase
    with open(plan.parent / "orchestrator.log", "ab") as sink:
        proc = subprocess.Popen([sys.executable, __file__, *args], stdout=sink, stderr=subprocess.STDOUT, env=env)
        try:
            cell.flow_exit = proc.wait(timeout=FLOW_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            cell.flow_exit = proc.wait()
            cell.notes.append(f"orchestrator hung: killed after {FLOW_TIMEOUT_S:.0f}s")
    tripped = json.loads(trip.read_text()) if trip.exists() else {}
    killed_at = tripped.get("t") if tripped.get("pid") else None
    cell.killed = killed_at is not None
    if tripped and not tripped.get("pid"):
        cell.skipped = f"the {victim} was {NO_VICTIM} ({cell.moment}); the migration ran unharmed"
    cell.flow_status = _status(mid)
    if not tripped and victim != "none":
        cell.notes.append("the moment was never reached")
    if victim == "orchestrator" and killed_at is not None:
        cell.source_frozen_after_kill = _frozen(stage.agent)
        if wait_until(lambda: _post(stage.endpoint, 2) == 200, cell.freeze_lease_s + 15, 0.5):
            cell.source_serves_again_s = round(time.time() - killed_at, 1)
        if phase in ("ramp", "finalize"):  # the control plane's traffic lease returns the split by itself
            wait_until(lambda: _weights(stage.traffic_dir).get("source", 0) == 100, TRAFFIC_LEASE_WAIT_S, 0.5)
            cell.notes.append(f"weights {_weights(stage.traffic_dir)} after the orchestrator died")
    if _status(mid) not in ("completed", "rolled_back", "denied"):
        rc, out = _cli(["migrate", str(plan), "--id", mid, "--resume", "--json"], RESUME_TIMEOUT_S, env)
        cell.recovery_steps.append(f"resume: exit {rc}, status {out.get('status') or _status(mid)}")
        if _status(mid) not in ("completed", "rolled_back", "denied"):
            rc, _ = _cli(["rollback", mid, "--reason", "fault matrix"], 120, env)
            cell.recovery_steps.append(f"rollback: exit {rc}, status {_status(mid)}")


def _operator_starts_the_source_again(cell: Cell, stage: Stage, mid: str, env: dict[str, str]) -> None:
    """What the rollback's error tells an operator to do when the source died: start it again as it was
    launched, then `gpumigrate rollback ID` once more. After the probes: the restarted reference server serves the
    weights its seed gives again, which would hide what the kill lost."""
    from gpumigrate.infra.local import LocalProvider

    launch = source_launch()
    try:
        host = LocalProvider().bootstrap(stage.source, launch, timeout_s=launch.ready_timeout_s)
    except Exception as exc:
        cell.recovery_steps.append(f"the source could not be started again: {type(exc).__name__}: {exc}"[:200])
        return
    stage.workload_pid = int(host.meta["workload"]["pid"])  # the next source cell kills this one
    cell.recovery_steps.append("the source started again (as the error says)")
    rc, _ = _cli(["rollback", mid, "--reason", "fault matrix: the source started again"], 120, env)
    cell.recovery_steps.append(f"rollback: exit {rc}, status {_status(mid)}")
    cell.final_status = _status(mid)


def probe(cell: Cell, stage: Stage, mid: str) -> None:
    """Look at what is left, and judge it (every verdict comes from these probes)."""
    cell.final_status = _status(mid)
    cell.source_serves = _post(stage.endpoint) == 200
    cell.source_frozen = _frozen(stage.agent)
    digest = _digest(stage.endpoint)
    cell.source_digest_same = None if digest is None else digest == stage.digest
    door = _post(stage.listener)
    cell.door_serves = door == 200
    cell.door_weights = _weights(stage.traffic_dir)
    cell.door_live = _live(stage.admin_url)
    tgt = _digest(_target_endpoint(mid))
    cell.target_digest_same = None if tgt is None else tgt == stage.digest
    cell.image_verifies = _image_ok(mid)
    live_copy = bool(cell.source_digest_same and cell.source_serves) or bool(cell.target_digest_same)
    cell.bytes_lost = not live_copy and not cell.image_verifies
    cut_over = cell.final_status == "completed" and bool(cell.target_digest_same)
    if cell.victim == "source" and cell.killed:
        cell.source_harmed = None  # the fault itself killed it: the question is whether anything else broke
    else:
        cell.source_harmed = not cut_over and not (cell.source_serves and cell.source_digest_same)
    cell.recovery = describe(cell)


def describe(cell: Cell) -> str:
    """The recovery column: how the episode ended, from the cell's recorded probes."""
    how = []
    if cell.flow_status in ("rolled_back", "completed", "denied", "failed"):
        how.append(f"flow ended {cell.flow_status}")
    if cell.source_serves_again_s is not None:
        how.append(f"source served again {cell.source_serves_again_s}s after the kill")
    how += cell.recovery_steps
    if cell.door_restarts:
        again = ", ".join(f"{name} x{n}" for name, n in sorted(cell.door_restarts.items()))
        how.append(f"the door's supervisor started again: {again}")
    if cell.door_live is None:
        how.append("Envoy down: clients get no answer")
    elif not cell.door_serves:
        how.append("the side Envoy sends clients to does not answer: clients fail")
    return "; ".join(how)


def _terminate_targets(mid: str) -> None:
    from gpumigrate.infra.local import LocalProvider

    provider = LocalProvider()
    with contextlib.suppress(Exception):
        for host in provider.list_hosts():
            if host.name.startswith(f"fm-tgt-{mid[-6:]}"):
                provider.terminate(host)


def stage_healthy(stage: Stage) -> bool:
    from gpumigrate.traffic.detached import door_status

    procs = door_status(stage.traffic_dir).get("processes") or {}
    return (
        len(procs) == 3
        and all(p["running"] for p in procs.values())
        and _frozen(stage.agent) is False
        and _post(stage.endpoint) == 200
        and _digest(stage.endpoint) == stage.digest
        and {k: v for k, v in _weights(stage.traffic_dir).items() if v} == {"source": 100.0}
        and _post(stage.listener) == 200
    )


# ---------------------------------------------------------------- the orchestrator side
def orchestrate(a: argparse.Namespace) -> int:
    """A migrate run (as ``gpumigrate migrate`` does it) with a tripwire that SIGKILLs the victim."""
    from gpumigrate.flows import prefect_env

    prefect_env.configure(quiet_console=True)
    from gpumigrate.atomic import atomic_write_json
    from gpumigrate.flows.context import RunContext
    from gpumigrate.flows.events import listening
    from gpumigrate.flows.run import run_migration
    from gpumigrate.infra.local import LocalProvider
    from gpumigrate.snapshot.backends.embedded import EmbeddedAgentBackend as AgentBackend
    from gpumigrate.traffic import frontdoor

    pids: dict[str, int] = json.loads(a.pids)
    fired = [False]

    def trip(target_pid: int | None = None) -> None:
        if fired[0] or a.victim == "none":
            return
        fired[0] = True
        pid: int | None
        if a.victim == "orchestrator":
            pid = os.getpid()
        elif a.victim == "target":
            pid = target_pid or _target_pid(a.id)
        elif a.victim == "receiver":
            pid = target_pid or _receiver_pid(a.id)
        elif a.victim in ("envoy", "control-plane"):  # the door's children now (the supervisor may have renewed them)
            pid = frontdoor.read(Path(os.environ["GPUMIGRATE_TRAFFIC_DIR"])).processes.get(a.victim)
        else:
            pid = pids[a.victim]
        atomic_write_json(Path(a.trip), {"t": time.time(), "victim": a.victim, "pid": pid, "phase": a.phase})
        if pid:
            os.kill(pid, signal.SIGKILL)  # the process alone, as a crash would: the supervisor sees its child die

    def on_event(event: str, data: dict[str, Any]) -> None:
        due = {
            "preflight": event == "phase.preflight.started",
            "snapshot": event == "snapshot.precopy",
            # The agent writes the image where the target reads it (its disk, or the receiver): nothing is pushed.
            "transfer": event == "phase.transfer.started",
            "restore": event == "phase.restore.started",
            "parity": event == "phase.parity.started",
            "ramp": event == "traffic.stage" and float(data.get("weight") or 0) > 0,
            "finalize": event == "phase.finalize.started",
        }.get(a.phase, False)
        if due:
            trip()

    freeze, spawn = AgentBackend.freeze, LocalProvider.spawn

    def freeze_then_trip(self: AgentBackend, lease_s: float | None = None) -> int:
        step = freeze(self, lease_s)
        if a.phase == "freeze":
            trip()
        return step

    def spawn_then_trip(self: LocalProvider, *args: Any, **kw: Any) -> dict[str, Any]:
        reply = spawn(self, *args, **kw)
        # The receiver's provision cell: the receiver the flow starts after the target's workload, once launched.
        which = "receiver" if a.victim == "receiver" else "workload"
        if a.phase == "provision" and kw.get("name") == which:
            trip(int(reply["pid"]))
        return reply

    # Hooks that only observe when to fire; the real calls run unchanged.
    AgentBackend.freeze = freeze_then_trip  # type: ignore[method-assign]
    LocalProvider.spawn = spawn_then_trip  # type: ignore[method-assign]
    mid = RunContext.create(Path(a.plan), migration_id=a.id, resume=False).migration.id
    with listening(mid, on_event):
        result = run_migration(mid)
    atomic_write_json(Path(a.result), result.model_dump(mode="json"))
    return result.exit_code


def _receiver_pid(mid: str) -> int | None:
    """The receiver the flow started on the target, while it runs (None before it started or once it stopped)."""
    from gpumigrate.flows.context import RunContext
    from gpumigrate.transfer.receiver.host import read_receiver_info

    rt = RunContext.load(mid).runtime
    if not rt.receiver_dir or rt.receiver_stopped:
        return None
    with contextlib.suppress(Exception):
        info = read_receiver_info(rt.receiver_dir)
        return info.pid if info.state == "running" else None
    return None


def _target_pid(mid: str) -> int | None:
    from gpumigrate.flows.context import RunContext

    host = RunContext.load(mid).runtime.target_host
    workload = host.meta.get("workload") if host is not None else None
    return int(workload["pid"]) if isinstance(workload, dict) and workload.get("pid") else None


# ---------------------------------------------------------------- the matrix
def cells(only: str | None) -> list[tuple[str, str]]:
    if only:
        picked: list[tuple[str, str]] = []
        for c in (c.strip() for c in only.split(",") if c.strip()):
            v, _, p = c.partition(":")
            if v not in VICTIMS or p not in PHASES:
                raise SystemExit(f"--only {c}: VICTIM:PHASE, victims {', '.join(VICTIMS)}; phases {', '.join(PHASES)}")
            picked.append((v, p))
        return picked
    return [("none", "finalize"), *((v, p) for v in VICTIMS[1:] for p in PHASES)]


def code_version() -> str:
    """The commit the matrix runs, ``+dirty`` when the working tree differs from it."""
    git = ["git", "-C", str(REPO)]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _yn(v: bool | None) -> str:
    return "?" if v is None else ("yes" if v else "no")


def markdown(results: list[Cell], seconds: float) -> str:
    lines = [
        "# Fault matrix (SIGKILL of one process at one phase of a real local migration)",
        "",
        f"Generated by `python bench/faults.py` in {seconds:.0f} s; every cell is one real run.",
        "Columns: bytes lost (no live copy with the original weights and no verifying image);",
        "source harmed (neither serving its original weights nor replaced by a completed cut-over);",
        "recovery (what ended the episode).",
        "",
        "| victim | phase (moment) | killed | bytes lost | source harmed | source after | front door after "
        "| client requests failed | recovery | commit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in results:
        where = f"{c.phase} ({c.moment})"
        if c.skipped:
            lines.append(f"| {c.victim} | {where} | n/a | | | | | | {c.skipped} | {c.commit} |")
            continue
        src = "serves" if c.source_serves else ("frozen" if c.source_frozen else "down")
        harmed = "killed (the fault)" if c.source_harmed is None and c.victim == "source" else _yn(c.source_harmed)
        live = "envoy down" if c.door_live is None else ", ".join(f"{k} {v / 100:g}%" for k, v in c.door_live.items())
        door = f"{'serves' if c.door_serves else 'FAILS'} ({live})"
        rec = c.recovery + ("; " + "; ".join(c.notes) if c.notes else "")
        clients = f"{c.client_failed}/{c.client_requests}" if c.client_requests is not None else "?"
        if c.victim == "none":
            where = "(no fault: baseline)"
        row = [
            c.victim,
            where,
            _yn(c.killed),
            _yn(c.bytes_lost),
            harmed,
            src,
            door,
            clients,
            f"{c.final_status}: {rec}",
            c.commit,
        ]
        lines.append("| " + " | ".join(s.replace("|", "/") for s in row) + " |")
    return "\n".join(lines) + "\n"


def smoke(out: Path) -> int:
    """The driver's plan and report, checked without starting a process (see the module's docstring)."""
    wrong = []
    planned = set(cells(None))
    unplanned = [f"{v}:{p}" for v in VICTIMS[1:] for p in PHASES if (v, p) not in planned]
    wrong += [f"{c} is not in the matrix" for c in unplanned]
    wrong += [f"{v}:{p} has no moment" for v, p in planned if p not in MOMENTS]
    for bad in ("nobody:ramp", "envoy", "envoy:ramp:x"):
        try:
            cells(bad)
            wrong.append(f"--only {bad} was accepted")
        except SystemExit:
            pass
    if cells("envoy:ramp, receiver:transfer") != [("envoy", "ramp"), ("receiver", "transfer")]:
        wrong.append("--only did not pick exactly the cells it named")
    unharmed: dict[str, Any] = {"source_harmed": False, "bytes_lost": False, "client_requests": 40}
    baseline = Cell("none", "finalize", MOMENTS["finalize"], flow_exit=0, flow_status="completed",
                    final_status="completed", door_serves=True, door_live={"target": 10000}, client_failed=0,
                    **unharmed)  # fmt: skip
    envoy = Cell("envoy", "ramp", MOMENTS["ramp"], killed=True, flow_exit=3, flow_status="rolled_back",
                 final_status="rolled_back", source_serves=True, door_serves=True, door_live={"source": 10000},
                 door_restarts={"envoy": 1}, client_failed=12, **unharmed)  # fmt: skip
    skipped = Cell("receiver", "preflight", MOMENTS["preflight"], skipped=NOT_APPLICABLE[("receiver", "preflight")])
    from gpumigrate.atomic import atomic_write_json

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        out / "faults.json",
        {"seconds": 1.0, "moments": MOMENTS, "cells": [asdict(c) for c in (baseline, envoy, skipped)]},
    )
    main(["--render", "--out", str(out)])
    table = (out / "faults.md").read_text()
    expected = {
        "| none | (no fault: baseline) |": "completed: flow ended completed",
        "| envoy | ramp (": "the door's supervisor started again: envoy x1",
        "| receiver | preflight (": NOT_APPLICABLE[("receiver", "preflight")],
    }
    for row, text in expected.items():
        line = next((x for x in table.splitlines() if x.startswith(row)), "")
        if text not in line:
            wrong.append(f"faults.md row {row!r} lacks {text!r}: {line!r}")
    if "| 12/40 |" not in table:
        wrong.append("faults.md does not count the clients' failed requests")
    print(
        json.dumps({"bench": "faults", "smoke": "plan and report only", "cells_planned": len(planned), "wrong": wrong})
    )
    return 1 if wrong else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    o = sub.add_parser("orchestrate", help="(internal) one migrate run with a tripwire")
    for name in ("--plan", "--id", "--victim", "--phase", "--pids", "--trip", "--result"):
        o.add_argument(name, required=True)
    ap.add_argument("--only", help="VICTIM:PHASE[,VICTIM:PHASE...] (default: every cell)")
    ap.add_argument("--out", default=str(REPO / "build" / "faults"))
    ap.add_argument("--json", action="store_true", help="print the results JSON as the last stdout line")
    ap.add_argument("--render", action="store_true", help="only write OUT/faults.md again from OUT/faults.json")
    ap.add_argument(
        "--also",
        action="append",
        default=[],
        help="with --render: the faults.json of a later run (--only) whose cells replace the same cells of OUT's",
    )
    ap.add_argument("--smoke", action="store_true", help="CI: the plan and the report, no process started")
    ap.add_argument(
        "--freeze-lease-s",
        type=float,
        default=FREEZE_LEASE_S,
        help="the plans' snapshot.freeze_lease_s (default: the demo plan's): how long a source frozen by a killed "
        "orchestrator waits before it serves again",
    )
    a = ap.parse_args(argv)
    if a.cmd == "orchestrate":
        return orchestrate(a)
    out = Path(a.out).resolve()
    if a.smoke:
        return smoke(out / "smoke")
    if a.render:
        from gpumigrate.atomic import atomic_write_bytes as write

        doc = json.loads((out / "faults.json").read_text())
        done = [Cell(**c) for c in doc["cells"]]
        seconds = float(doc["seconds"])
        for later in a.also:
            again = json.loads((Path(later) / "faults.json").read_text())
            redone = {(c["victim"], c["phase"]): Cell(**c) for c in again["cells"]}
            done = [redone.pop((c.victim, c.phase), c) for c in done] + list(redone.values())
            seconds += float(again["seconds"])
        for c in done:
            c.recovery = describe(c) if not c.skipped else c.recovery
        write(out / "faults.md", markdown(done, seconds).encode())
        return 0
    _env_defaults(out)
    work = out / "run" / "cells"
    work.mkdir(parents=True, exist_ok=True)
    from gpumigrate.atomic import atomic_write_bytes, atomic_write_json
    from gpumigrate.transfer.format.keys import generate_key

    key_file = out / "run" / "transfer.key"
    if not key_file.exists():
        atomic_write_bytes(key_file, generate_key().encode(), mode=0o600)
    todo = cells(a.only)
    version = code_version()
    results: list[Cell] = []
    t0 = time.monotonic()
    stage: Stage | None = None
    with prefect_server(out / "run" / "prefect-server.log") as api:
        os.environ["PREFECT_API_URL"] = api
        try:
            for n, (victim, phase) in enumerate(todo):
                if (victim, phase) in NOT_APPLICABLE:
                    why = NOT_APPLICABLE[(victim, phase)]
                    results.append(Cell(victim, phase, MOMENTS[phase], skipped=why, commit=version))
                    continue
                if stage is not None and not stage_healthy(stage):
                    stop_stage(stage)
                    stage = None
                if stage is None:
                    stage = start_stage(work, n)
                cell = run_cell(stage, work, victim, phase, key_file, freeze_lease_s=a.freeze_lease_s)
                cell.commit = version
                results.append(cell)
                print(f"{victim:>13} @ {phase:<9} {cell.final_status}: {cell.recovery}", file=sys.stderr, flush=True)
                partial = {"seconds": round(time.monotonic() - t0, 1), "moments": MOMENTS, "partial": True}
                atomic_write_json(out / "faults.json", {**partial, "cells": [asdict(c) for c in results]})
        finally:
            if stage is not None:
                stop_stage(stage)
            _terminate_targets("")
    seconds = time.monotonic() - t0
    doc = {"seconds": round(seconds, 1), "moments": MOMENTS, "cells": [asdict(c) for c in results]}
    atomic_write_json(out / "faults.json", doc)
    atomic_write_bytes(out / "faults.md", markdown(results, seconds).encode())
    if a.json:
        print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())

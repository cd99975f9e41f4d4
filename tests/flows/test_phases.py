"""The phases as plain functions, with fakes of the siblings' Protocols (Provider, SnapshotBackend, HostActions).

No Prefect, no Envoy, no model: each test drives one phase (or the undo) against a fake provider and
a fake backend that record what they were asked, a real state record, and, where a phase asks a
workload over HTTP, a small real HTTP server standing in for the workload. The real flow runs end to
end in test_migrate.py and test_demo.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpumigrate.atomic import atomic_write_json
from gpumigrate.control import AuthError
from gpumigrate.environment import collect_facts
from gpumigrate.errors import (
    InvalidInputError,
    ParityError,
    PolicyDeniedError,
    ResidencyError,
    RolledBackError,
    SnapshotError,
)
from gpumigrate.flows.context import RunContext, Siblings
from gpumigrate.flows.phases import finalize, preflight, provision, restore, snapshot, transfer
from gpumigrate.flows.rollback import roll_back_here
from gpumigrate.flows.undo import rolled_back_or_not, undo_all, undo_source
from gpumigrate.interfaces import Host, HostSpec, ImageRef, Jurisdiction, Restored, Round, RoundStats, Side, StepLosses
from gpumigrate.launch import AWAIT_RESTORE_ENV, WorkloadLaunch
from gpumigrate.snapshot.backends import Setup, snapshot_backend
from gpumigrate.traffic.frontdoor import FRONTDOOR
from gpumigrate.traffic.state import DesiredState, StateStore, Upstream

FACTS = collect_facts(with_torch=False)


# ----------------------------------------------------------------------------- a workload over HTTP
class Workload:
    """A real HTTP server answering what the phases ask a workload: /healthz, /readyz, /v1/info, POST /v1/generate;
    and /ready as an Envoy admin does (the front door the source's plan names points its admin URL here)."""

    def __init__(self, info: dict[str, Any], *, ready: bool = True) -> None:
        info_body = json.dumps(info).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                body = {"/v1/info": info_body, "/ready": b"LIVE"}.get(self.path, b"{}")
                if self.path == "/readyz" and not ready:  # started, awaiting its restore
                    self.send_response(503)
                else:
                    self.send_response(200 if self.path in ("/healthz", "/readyz", "/v1/info", "/ready") else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.dumps({"tokens": [1, 2, 3]}).encode()  # the golden request preflight asks
                self.send_response(200 if self.path == "/v1/generate" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def source() -> Iterator[Workload]:
    w = Workload({**FACTS, "pid": 4242, "seed": 7, "size": "tiny", "dtype": "float32", "device": "cpu"})
    yield w
    w.stop()


@pytest.fixture
def target() -> Iterator[Workload]:
    w = Workload(FACTS)
    yield w
    w.stop()


# ----------------------------------------------------------------------------- fakes of the siblings
@dataclass
class FakeProvider:
    """A Provider whose target host is the ``target`` workload's address and port."""

    target_port: int
    calls: list[str] = field(default_factory=list)
    launches: list[WorkloadLaunch] = field(default_factory=list)

    name = "local"

    def check_capacity(self, spec: HostSpec) -> dict[str, Any] | None:
        self.calls.append("check_capacity")
        return None

    def provision(self, spec: HostSpec, *, migration_id: str) -> Host:
        self.calls.append("provision")
        ports = {"service": self.target_port, "agent": 1}
        return Host(spec.name, "local", spec.region, "127.0.0.1", ports=ports, workdir="/nonexistent/host")

    def wait_ready(self, host: Host, *, timeout_s: float = 600) -> Host:
        return host

    def bootstrap(self, host: Host, launch: WorkloadLaunch, *, timeout_s: float) -> Host:
        self.calls.append("bootstrap")
        self.launches.append(launch)
        return host

    def terminate(self, host: Host) -> None:
        self.calls.append(f"terminate {host.name}")

    def jurisdiction(self, region: str) -> Jurisdiction:
        return Jurisdiction("LOCAL", (), "test")

    def price(self, spec: HostSpec) -> float:
        return 0.0


@dataclass
class FakeBackend:
    """A SnapshotBackend with scripted rounds; records every step."""

    setup: Setup
    dirty: list[int] = field(default_factory=lambda: [1000, 0])
    fail_final: bool = False
    needs_launch: bool = True
    steps: list[str] = field(default_factory=list)

    name = "fake"
    live_rounds = True
    preloads = False  # the pre-loaded target is tested through the real agent (tests/flows/test_preload.py)
    leases = False  # the freeze lease is tested through the real agent (tests/flows/test_own_training_rollback.py)

    def check(self) -> dict[str, Any]:
        self.steps.append("check")
        return {"start": 99, "nested": {"dropped": True}}

    def facts(self, side: Side) -> dict[str, Any]:
        raise SnapshotError(f"the {side}'s agent does not answer (a fake backend: its service's /v1/info does)")

    def renew(self, lease_s: float) -> bool:
        raise AssertionError("renew is called only on a backend that leases")

    def advance(self, steps: int, *, timeout_s: float) -> StepLosses:
        raise AssertionError("advance is called only for a training plan")

    def wait_for_steps(self, side: Side, *, since: int, count: int, timeout_s: float) -> StepLosses:
        raise AssertionError("steps are waited for only for a training plan")

    def precopy(self) -> Round:
        n = len([s for s in self.steps if s == "precopy"]) + 1
        self.steps.append("precopy")
        stats = RoundStats(n, 10, 10 if n == 1 else 0, self.dirty[min(n, len(self.dirty)) - 1], 0.01)
        return Round(stats, ImageRef(f"round-{n}", self.setup.store))

    def freeze(self, lease_s: float | None = None) -> None:
        self.steps.append("freeze")

    def final(self) -> ImageRef:
        self.steps.append("final")
        if self.fail_final:
            raise SnapshotError("the final round failed")
        return ImageRef("final-image", self.setup.store, parent="round-2", bytes_image=4096, bytes_stored=100)

    def resume(self) -> None:
        self.steps.append("resume")

    def retire(self) -> dict[str, Any]:
        self.steps.append("retire")
        return {"zeroized_bytes": 4096, "verified": True}

    def preload(self, image: ImageRef) -> Restored:
        raise AssertionError("preload is called only on a backend that preloads")

    def restore(self, image: ImageRef | None) -> Restored:
        self.steps.append(f"restore {image.id if image else None}")
        return Restored(image_id=image.id if image else "", seconds=0.1, pid=555, pid_start=777)

    def discard(self) -> None:
        self.steps.append("discard")

    def hand_over(self, target: str) -> dict[str, Any]:
        return {}  # a workload without work in flight hands nothing over

    def take_back(self) -> dict[str, Any]:
        return {}

    def work(self, side: Side) -> dict[str, Any]:
        return {}


@dataclass
class World:
    ctx: RunContext
    provider: FakeProvider
    backend: FakeBackend
    setups: list[Setup]

    def events(self) -> list[str]:
        return [r["event"] for r in self.ctx.migration.audit.records()]

    def data(self, event: str) -> dict[str, Any]:
        return next(r["data"] for r in reversed(self.ctx.migration.audit.records()) if r["event"] == event)


LAUNCH = {"argv": ["{python}", "-m", "svc", "--port", "{service_port}"]}


def plan_doc(source: Workload, **workload: Any) -> dict[str, Any]:
    return {
        "version": 1,
        "workload": {
            "name": "svc",
            "kind": "inference",
            "source_host": "src-host",
            "endpoint": source.url,
            "agent": "127.0.0.1:7070",
            "launch": LAUNCH,
            **workload,
        },
        "target": {"provider": "local", "region": "local-b", "host": "tgt"},
        "data": {"classification": "internal", "allowed_jurisdictions": ["LOCAL"]},
        "snapshot": {"precopy_rounds": 5, "max_downtime_ms": 500},
        "transfer": {"store": "file://store"},
        "parity": {"environment": {"torch": "may_differ", "gpu_model": "may_differ"}},
        "traffic": {"stages": [{"weight": 100, "hold_s": 0}], "rollback_window_s": 0},
    }


def make_world(tmp_path: Path, doc: dict[str, Any], target: Workload, **backend: Any) -> World:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(doc))
    # A real source's SDK creates the state root's control key as it attaches; this fake source does not.
    from gpumigrate import control

    control.load_key(create=True)
    provider = FakeProvider(target.port)
    setups: list[Setup] = []
    fake = FakeBackend(Setup(store="file://x"), **backend)

    def make_backend(name: str, setup: Setup) -> Any:
        setups.append(setup)
        fake.setup = setup
        return fake

    def host_actions(host: str, action: str, params: Any) -> dict[str, Any]:
        raise AssertionError("the fake backend never dispatches host actions")

    siblings = Siblings(provider=lambda plan, attached: provider, backend=make_backend, host_actions=host_actions)
    door = tmp_path / "traffic"  # the source's front door, its Envoy admin stood in by the source itself
    atomic_write_json(
        door / FRONTDOOR, {"admin_urls": [doc["workload"]["endpoint"]], "source": doc["workload"]["endpoint"]}
    )
    ctx = RunContext.create(path, migration_id="m-unit", resume=False, traffic_state_dir=str(door))
    return World(replace(ctx, siblings=siblings), provider, fake, setups)


WorldMaker = Callable[..., World]


@pytest.fixture
def world(gm_home: Path, tmp_path: Path, source: Workload, target: Workload) -> WorldMaker:
    """``world(plan_doc=None, **backend)``: a migration of ``source`` to ``target`` with fake siblings."""

    def make(doc: dict[str, Any] | None = None, **backend: Any) -> World:
        return make_world(tmp_path, doc or plan_doc(source), target, **backend)

    return make


# ----------------------------------------------------------------------------- preflight
def test_preflight_records_the_source_and_what_the_backend_found(world: WorldMaker) -> None:
    w = world()
    out = preflight.run(w.ctx)
    assert out["residency"] == "allow" and out["environment"] == "match"
    assert w.provider.calls == ["check_capacity"] and w.backend.steps == ["check"]
    rt = w.ctx.runtime
    assert rt.source_facts["pid"] == 4242 and rt.backend_facts == {"start": 99}  # scalars only
    assert {"residency.allow", "infra.capacity.ok", "parity.environment.preflight", "snapshot.checked"} <= set(
        w.events()
    )


def test_preflight_denied_by_residency_touches_nothing(world: WorldMaker, source: Workload) -> None:
    doc = plan_doc(source)
    doc["data"]["allowed_jurisdictions"] = ["EU"]
    w = world(doc)
    with pytest.raises(ResidencyError):
        preflight.run(w.ctx)
    assert w.provider.calls == [] and w.backend.steps == []


def test_preflight_without_a_front_door_says_how_to_start_it_and_touches_nothing(
    world: WorldMaker, source: Workload, tmp_path: Path
) -> None:
    w = world()
    (tmp_path / "traffic" / FRONTDOOR).unlink()
    with pytest.raises(PolicyDeniedError) as info:
        preflight.run(w.ctx)
    assert info.value.exit_code == 2
    assert str(info.value).endswith(
        f"no front door fronts {source.url}: start it with `gpumigrate frontdoor up --source {source.url}`"
    )
    assert w.provider.calls == [] and w.backend.steps == []


def test_preflight_refuses_golden_inputs_that_do_not_load_before_anything_is_provisioned(
    world: WorldMaker, source: Workload, tmp_path: Path
) -> None:
    """The parity phase would find a missing golden file only after the source froze; preflight finds it first."""
    doc = plan_doc(source)
    doc.setdefault("parity", {}).update(
        {
            "golden_inputs": str(tmp_path / "missing.jsonl"),
            "request": {"method": "POST", "path": "/v1/generate", "compare": [{"field": "tokens", "kind": "exact"}]},
        }
    )
    w = world(doc)
    with pytest.raises(InvalidInputError, match="missing.jsonl: no such file") as info:
        preflight.run(w.ctx)
    assert info.value.exit_code == 2
    assert w.provider.calls == [] and w.backend.steps == []
    (tmp_path / "missing.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    assert preflight.run(w.ctx)["golden_cases"] == 1


def test_preflight_refuses_a_front_door_of_another_service(world: WorldMaker, tmp_path: Path) -> None:
    w = world()
    door = json.loads((tmp_path / "traffic" / FRONTDOOR).read_text())
    atomic_write_json(tmp_path / "traffic" / FRONTDOOR, {**door, "source": "http://127.0.0.1:1"})
    with pytest.raises(PolicyDeniedError, match="fronts http://127.0.0.1:1, not this plan's endpoint"):
        preflight.run(w.ctx)
    assert w.provider.calls == []


def test_preflight_refuses_the_cuda_driver_backend_before_anything_moves(world: WorldMaker, source: Workload) -> None:
    """cuda-driver resumes the source in place: parity and the ramp would compare the source with itself."""
    doc = plan_doc(source)
    doc["snapshot"]["backend"] = "cuda-driver"
    w = world(doc)
    asked: list[str] = []
    real = replace(
        w.ctx.siblings, backend=snapshot_backend, host_actions=lambda host, action, params: asked.append(action) or {}
    )
    with pytest.raises(InvalidInputError, match="no second endpoint") as info:
        preflight.run(replace(w.ctx, siblings=real))
    assert info.value.exit_code == 2 and asked == []  # nothing suspended, nothing asked of the source host


def test_preflight_with_the_source_not_answering_is_bad_input_naming_it_not_a_rollback(
    world: WorldMaker, source: Workload, tmp_path: Path
) -> None:
    """Nothing moved: exit 2 (never 3, "rolled back"), naming the source's URL and agent and what to check."""
    dead = "http://127.0.0.1:9"
    doc = plan_doc(source, endpoint=dead, agent="127.0.0.1:9")
    w = world(doc)
    atomic_write_json(tmp_path / "traffic" / FRONTDOOR, {"admin_urls": [source.url], "source": dead})
    with pytest.raises(InvalidInputError) as info:
        preflight.run(w.ctx)
    msg = str(info.value)
    assert info.value.exit_code == 2 and not isinstance(info.value, ParityError)
    assert msg.startswith(f"the source workload svc at {dead} did not answer (its agent at 127.0.0.1:9:")
    assert "nothing was moved" in msg and "check that the source is running" in msg and "control key" in msg
    assert w.backend.steps == []


def test_preflight_with_a_source_agent_refusing_the_control_key_is_bad_input(
    world: WorldMaker, source: Workload
) -> None:
    """The service answers its /v1/info, its agent refuses this control key: exit 2, the key named."""
    w = world()

    def refuse() -> dict[str, Any]:
        raise AuthError("the snapshot agent at 127.0.0.1:7070 refused 'ping': bad signature")

    w.backend.check = refuse  # type: ignore[method-assign]
    with pytest.raises(InvalidInputError, match="refused 'ping'") as info:
        preflight.run(w.ctx)
    assert info.value.exit_code == 2 and "GPUMIGRATE_CONTROL_KEY_FILE" in str(info.value)


# ----------------------------------------------------------------------------- provision
def test_provision_starts_the_plans_launch_awaiting_the_restore(
    world: WorldMaker, source: Workload, target: Workload, tmp_path: Path, gm_home: Path
) -> None:
    launch = {"argv": ["{python}", "serve.py", "--port", "{service_port}"], "cwd": "app"}
    w = world(plan_doc(source, launch=launch))
    out = provision.run(w.ctx)
    assert w.provider.calls == ["check_capacity", "provision", "bootstrap"]
    (started,) = w.provider.launches
    assert started.argv == ("{python}", "serve.py", "--port", "{service_port}")
    assert started.contract_env[AWAIT_RESTORE_ENV] == "1" and started.contract_env["GPUMIGRATE_HOME"] == str(gm_home)
    assert started.plan_dir == str(tmp_path)
    rt = w.ctx.runtime
    assert rt.target_endpoint == target.url == out["endpoint"] and rt.target_agent == "127.0.0.1:1"
    assert rt.target_host is not None and rt.target_host.name == "tgt"
    assert rt.target_store == "file:///nonexistent/host/store"  # the target's own disk


def test_provision_refuses_a_target_that_is_the_source_itself(world: WorldMaker, source: Workload) -> None:
    # Restore brings the process up at the source's port, on the target's address: here the same one.
    w = world(needs_launch=False)
    with pytest.raises(InvalidInputError, match="source's own: parity and the ramp need two endpoints"):
        provision.run(w.ctx)
    assert "bootstrap" not in w.provider.calls


# ----------------------------------------------------------------------------- snapshot
def test_snapshot_converges_freezes_commits_and_resumes_an_inference_source(world: WorldMaker) -> None:
    w = world()
    out = snapshot.run(w.ctx)
    assert w.backend.steps == ["precopy", "precopy", "freeze", "final", "resume"]  # round 2 dirtied nothing
    assert out["image_id"] == "final-image" and out["precopy_rounds"] == 2
    rt = w.ctx.runtime
    assert rt.image is not None and rt.image.id == "final-image" and rt.source_frozen is False
    assert w.data("image.committed")["converged"].startswith("dirty set fits")
    assert w.ctx.migration.read()["result"]["bytes"] == {"image": 4096, "stored": 100}


def test_a_failed_final_round_resumes_the_source_before_the_error_goes_on(world: WorldMaker) -> None:
    w = world(fail_final=True)
    with pytest.raises(SnapshotError, match="final round failed"):
        snapshot.run(w.ctx)
    assert w.backend.steps[-3:] == ["freeze", "final", "resume"]
    assert w.ctx.runtime.source_frozen is False and "rollback.source_resumed" in w.events()


# ----------------------------------------------------------------------------- transfer, restore, finalize
def test_transfer_moves_nothing_when_the_state_stayed_in_the_process(world: WorldMaker) -> None:
    w = world()
    assert "in place" in transfer.run(w.ctx)["skipped"]


def test_restore_keeps_the_restored_process_and_waits_for_ready(world: WorldMaker) -> None:
    w = world()
    provision.run(w.ctx)
    w.ctx.update(image=ImageRef("final-image", "file://x"))
    assert restore.run(w.ctx) == {"image_id": "final-image", "ready": True}
    rt = w.ctx.runtime
    assert (rt.target_pid, rt.target_pid_start) == (555, 777)
    assert w.data("image.restored")["pid"] == 555
    assert w.setups[-1].target_store == "file:///nonexistent/host/store"  # the backend reads where it was pushed


@pytest.mark.parametrize(("window", "retired"), [(0, True), (60, False)])
def test_finalize_retires_the_source_only_without_a_rollback_window(
    world: WorldMaker, source: Workload, window: int, retired: bool
) -> None:
    doc = plan_doc(source)
    doc["traffic"]["rollback_window_s"] = window
    w = world(doc)
    finalize.run(w.ctx)
    assert ("retire" in w.backend.steps) is retired and w.ctx.runtime.source_retired is retired
    assert ("source.zeroized" in w.events()) is retired and ("source.kept_warm" in w.events()) is not retired


def test_finalize_rolls_back_instead_of_retiring_when_the_target_died_after_the_cut_over(
    world: WorldMaker, source: Workload, tmp_path: Path
) -> None:
    doc = plan_doc(source)
    doc["traffic"]["rollback_window_s"] = 0  # would retire the source at once
    w = world(doc)
    doors = tmp_path / "traffic"
    StateStore(doors).init(
        DesiredState(
            upstreams={"source": Upstream("source", "127.0.0.1", 1), "target": Upstream("target", "127.0.0.1", 2)},
            weights={"source": 0.0, "target": 100.0},
        )
    )
    provision.run(w.ctx)
    w.ctx.migration.set_phase("provision", "completed")
    w.ctx.update(traffic_state_dir=str(doors), target_endpoint="http://127.0.0.1:9")  # nothing answers there
    with pytest.raises(RolledBackError, match="stopped answering after the cut-over"):
        finalize.run(w.ctx)
    assert "retire" not in w.backend.steps and not w.ctx.runtime.source_retired  # the source stays whole
    assert StateStore(doors).read().weights == {"source": 100.0, "target": 0.0}
    assert "finalize.target_lost" in w.events() and "source.zeroized" not in w.events()


# ----------------------------------------------------------------------------- undo
def test_undo_all_puts_traffic_back_then_tears_the_target_down_then_resumes_the_source(
    world: WorldMaker, source: Workload, tmp_path: Path
) -> None:
    w = world()
    doors = tmp_path / "traffic"
    StateStore(doors).init(
        DesiredState(
            upstreams={"source": Upstream("source", "127.0.0.1", 1), "target": Upstream("target", "127.0.0.1", 2)},
            weights={"source": 75.0, "target": 25.0},
        )
    )
    provision.run(w.ctx)
    w.ctx.migration.set_phase("provision", "completed")
    w.ctx.update(traffic_state_dir=str(doors), source_frozen=True)
    undo_all(w.ctx, reason="gate failed")
    assert StateStore(doors).read().weights == {"source": 100.0, "target": 0.0}
    assert w.backend.steps == ["discard", "resume"] and w.provider.calls[-1] == "terminate tgt"
    events = w.events()
    order = [events.index(e) for e in ("traffic.rolled_back", "rollback.target_torn_down", "rollback.source_resumed")]
    assert order == sorted(order)
    rt = w.ctx.runtime
    assert rt.target_torn_down and not rt.source_frozen
    assert w.ctx.migration.phase("provision")["status"] == "rolled_back"
    undo_all(w.ctx, reason="again")  # idempotent: the target is not terminated twice
    assert w.provider.calls.count("terminate tgt") == 1


def test_undo_keeps_the_target_and_its_traffic_when_the_source_is_gone(
    world: WorldMaker, source: Workload, tmp_path: Path
) -> None:
    doc = plan_doc(source)
    doc["workload"]["endpoint"] = "http://127.0.0.1:9"  # the source died: nothing answers there
    w = world(doc)
    doors = tmp_path / "traffic"
    split = {"source": 75.0, "target": 25.0}
    StateStore(doors).init(
        DesiredState(
            upstreams={"source": Upstream("source", "127.0.0.1", 1), "target": Upstream("target", "127.0.0.1", 2)},
            weights=split,
        )
    )
    provision.run(w.ctx)
    w.ctx.update(traffic_state_dir=str(doors), target_endpoint=source.url)  # the target serves
    undo_all(w.ctx, reason="parity probe failed: source HTTP 503")
    assert StateStore(doors).read().weights == split  # no client is sent to the dead source
    assert "terminate tgt" not in w.provider.calls and not w.ctx.runtime.target_torn_down
    assert "rollback.refused_source_lost" in w.events()
    # Whatever asked for the rollback, the run does not read "rolled back": the source does not serve again.
    assert w.ctx.runtime.rollback_refused
    status, error = rolled_back_or_not(w.ctx, "rolled_back", "ramp gate failed")
    assert status == "failed" and error.startswith("ramp gate failed; not rolled back: the source no longer answers")
    result = roll_back_here(w.ctx, reason="operator asked", actor="sre", trigger="manual", after="ramp")
    assert result.status == "failed" and "not rolled back" in (result.error or "")
    assert w.ctx.migration.read()["status"] == "failed" and "rollback.completed" not in w.events()


def test_a_rollback_refused_while_the_source_was_gone_goes_ahead_once_it_answers_again(world: WorldMaker) -> None:
    """The fault matrix's source cells: the operator starts the dead source again, as the refusal says, and the next
    rollback then sends the traffic back, tears the target down and ends the migration rolled back."""
    w = world()  # its plan's source answers (started again)
    provision.run(w.ctx)
    w.ctx.update(rollback_refused=True)  # what the undo that found the source gone left
    result = roll_back_here(w.ctx, reason="the source started again", actor="sre", trigger="manual", after="failed")
    assert result.status == "rolled_back", result.error
    assert not w.ctx.runtime.rollback_refused and w.ctx.runtime.target_torn_down


def test_undo_tears_down_a_target_that_never_served_when_the_source_is_gone(
    world: WorldMaker, source: Workload
) -> None:
    """A target that lives but was never restored (its ready path answers 503) serves nobody: with the source gone
    it is torn down, not kept as if it were the only process serving."""
    doc = plan_doc(source)
    doc["workload"]["endpoint"] = "http://127.0.0.1:9"  # the source stopped
    w = world(doc)
    waiting = Workload(FACTS, ready=False)
    try:
        provision.run(w.ctx)
        w.ctx.update(target_endpoint=waiting.url)
        undo_all(w.ctx, reason="snapshot failed: the source's agent does not answer")
    finally:
        waiting.stop()
    assert "terminate tgt" in w.provider.calls and w.ctx.runtime.target_torn_down
    assert "rollback.refused_source_lost" not in w.events() and not w.ctx.runtime.rollback_refused


def test_undo_never_raises_when_a_step_fails(world: WorldMaker, source: Workload) -> None:
    w = world()

    def broken() -> None:
        raise SnapshotError("the source agent is unreachable")

    w.backend.resume = broken  # type: ignore[method-assign]
    undo_source(w.ctx)  # logged, not raised
    assert "rollback.source_resumed" not in w.events()


# ----------------------------------------------------------------------------- the runtime record
def test_runtime_facts_survive_a_new_process_and_unknown_names_are_bugs(world: WorldMaker) -> None:
    w = world()
    w.ctx.update(image=ImageRef("abc", "file://x", bytes_image=3), target_pid=5)
    again = RunContext.load("m-unit", siblings=w.ctx.siblings)  # what a resume or the rollback flow reads
    assert again.runtime.image == ImageRef("abc", "file://x", bytes_image=3) and again.runtime.target_pid == 5
    with pytest.raises(TypeError, match="not runtime facts: image_id"):
        w.ctx.update(image_id="abc")
    with pytest.raises(InvalidInputError, match="the target endpoint is not known yet"):
        w.ctx.target_endpoint()


def test_resume_runs_with_the_plan_it_was_started_with(world: WorldMaker, tmp_path: Path) -> None:
    w = world()
    again = RunContext.create(tmp_path / "plan.yaml", migration_id="m-unit", resume=True)
    assert again.migration.id == "m-unit" and again.runtime.plan_dir == str(tmp_path.resolve())
    assert RunContext.create(tmp_path / "plan.yaml", migration_id="m-unit", resume=None).migration.id == "m-unit"
    assert "migration.created" in w.events()


def test_a_resume_checks_the_preflight_again_until_a_target_was_provisioned(world: WorldMaker) -> None:
    """Resumed later, a migration that never launched its target runs its preflight again (the source's facts, the
    capacity, the store); once the target exists, its own capacity would deny it, so the preflight stands."""
    from gpumigrate.flows.migrate import still_valid

    w = world()
    m = w.ctx.migration
    m.set_phase("preflight", "completed", result={"residency": "allow"})
    assert still_valid(w.ctx, "preflight") is False and "phase.preflight.recheck" in w.events()
    m.set_phase("provision", "completed", result={})
    assert still_valid(w.ctx, "preflight") is True


def test_resume_with_another_plan_file_is_refused_naming_both(
    world: WorldMaker, source: Workload, tmp_path: Path
) -> None:
    """The stored plan would run with the other file's folder as its plan_dir: refused, exit 2, nothing changed."""
    import hashlib

    w = world()
    before = w.ctx.migration.read()
    doc = plan_doc(source)
    doc["snapshot"]["precopy_rounds"] = 2
    other = tmp_path / "other" / "plan.yaml"
    other.parent.mkdir()
    other.write_text(yaml.safe_dump(doc))
    given = hashlib.sha256(other.read_bytes()).hexdigest()[:16]
    recorded = hashlib.sha256((tmp_path / "plan.yaml").read_bytes()).hexdigest()[:16]
    for resume in (True, None):  # --resume, and the deployment's resume of an existing id
        with pytest.raises(InvalidInputError) as info:
            RunContext.create(other, migration_id="m-unit", resume=resume)
        msg = str(info.value)
        assert info.value.exit_code == 2 and "migration m-unit was started with another plan" in msg
        assert f"{other} has sha256 {given}" in msg and f"{w.ctx.migration.plan_path} has sha256 {recorded}" in msg
    assert w.ctx.migration.read() == before


def test_the_ramps_figures_go_to_the_audit_and_never_replace_the_migrations_one_figure(world: WorldMaker) -> None:
    """Issue 35, finding 6: the result counted only the ramp's window (228 of 4,800 requests) and read its
    "no good answer" stretch as downtime (0 ms for a freeze that held every client)."""
    from gpumigrate.flows.phases.ramp import record_figures
    from gpumigrate.flows.report import build_result

    w = world()
    record_figures(w.ctx, {"requests": 40, "failures": 0, "p50_ms": 3.2, "p99_ms": 9.9, "downtime_ms": 0.0})
    result = build_result(w.ctx.migration)
    assert result.requests.total is None and result.downtime_ms is None
    assert w.data("traffic.figures") == {"requests": 40, "failures": 0, "p50_ms": 3.2, "p99_ms": 9.9,
                                         "downtime_ms": 0.0, "window": "the ramp"}  # fmt: skip


def test_two_undos_of_one_failure_record_the_source_resumed_once(world: WorldMaker) -> None:
    """Issue 35, finding 9: the snapshot's undo and the provision's both resumed the source, and both said so."""
    w = world()
    w.ctx.update(source_frozen=True)
    undo_source(w.ctx)
    undo_source(w.ctx)  # the next hook of the same transaction: the source runs already
    assert w.backend.steps == ["resume", "resume"] and w.events().count("rollback.source_resumed") == 1


def test_a_failure_after_the_freeze_that_the_undo_put_back_reads_rolled_back(world: WorldMaker) -> None:
    """Issue 35, finding 2: the undo had resumed the source and torn the target down, and the run said "failed"
    (exit 1); it rolled back (exit 3), saying why. Before any freeze, or while the source is still frozen, it failed."""
    from gpumigrate.flows.migrate import _failed

    w = world()
    boom = SnapshotError("the target's training process ended before it reported 1 step(s) after step 40")
    assert _failed(w.ctx, boom) == ("failed", str(boom))  # nothing had frozen
    w.ctx.update(froze_at=1.0, source_frozen=True, target_torn_down=True)
    assert _failed(w.ctx, boom)[0] == "failed"  # the source did not run again
    w.ctx.update(source_frozen=False)
    status, error = _failed(w.ctx, boom)
    assert (status, error) == ("rolled_back", f"rolled back: {boom}")
    rollback = w.ctx.migration.read()["result"]["rollback"]
    assert rollback["triggered"] is True and rollback["trigger"] == "error"


def test_a_resumed_world_without_http_stands_while_every_ranks_agent_answers(
    world: WorldMaker, source: Workload
) -> None:
    """A training world has no endpoint: a resume keeps its provision and restore while the target's agents answer,
    rank 0's at its port and rank r's at port + r, and provisions again once one of them is gone."""
    import socket

    from gpumigrate.flows.migrate import still_valid

    doc = plan_doc(source)
    doc["workload"]["ranks"] = 2
    w = world(doc)
    listeners = []
    for _ in range(20):  # two consecutive free ports
        first = socket.create_server(("127.0.0.1", 0))
        port = first.getsockname()[1]
        try:
            listeners = [first, socket.create_server(("127.0.0.1", port + 1))]
            break
        except OSError:
            first.close()
    assert listeners, "no two consecutive free ports"
    try:
        w.ctx.update(target_endpoint=None, target_agent=f"127.0.0.1:{port}")
        w.ctx.migration.set_phase("provision", "completed", result={})
        assert still_valid(w.ctx, "provision") is True
        listeners.pop().close()  # rank 1's agent is gone
        assert still_valid(w.ctx, "provision") is False
        assert w.ctx.migration.phase("provision").get("status") == "pending"
    finally:
        for s in listeners:
            s.close()

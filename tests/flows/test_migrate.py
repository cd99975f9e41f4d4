"""The migrate flow end to end on local hosts, a real Envoy and the tiny model, on the test harness.

One module-scoped source (inference server on a local host, front door = control plane + Envoy)
serves every test; each test migrates to its own target host. Load runs through Envoy during ramps
(a ramp with no traffic is inconclusive by design).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support.plans import inference_plan

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = "tiny-lm"
MODEL = ("--seed", "0", "--size", "tiny", "--device", "cpu")  # the source's model; the target allocates the same
SHARED: dict[str, Any] = {}  # the cut-over migration of the resume test, rolled back by the next test


@dataclass
class Source:
    home: Path
    host: Any
    door: Any
    key_file: Path

    @property
    def endpoint(self) -> str:
        return f"http://{self.host.address}:{self.host.ports['service']}"

    @property
    def agent(self) -> str:
        return f"{self.host.address}:{self.host.ports['agent']}"


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("flows-home")
    old = os.environ.get("GPUMIGRATE_HOME")
    os.environ["GPUMIGRATE_HOME"] = str(path)
    yield path
    if old is None:
        os.environ.pop("GPUMIGRATE_HOME", None)
    else:
        os.environ["GPUMIGRATE_HOME"] = old


@pytest.fixture(scope="module")
def source(home: Path, prefect_api: str, workload_launch: Callable[..., Any]) -> Iterator[Source]:
    from gpumigrate.atomic import atomic_write_bytes
    from gpumigrate.infra import get_provider
    from gpumigrate.infra.launch import service_url, wait_http
    from gpumigrate.interfaces import HostSpec
    from gpumigrate.traffic.frontdoor import FrontDoor, default_dir
    from gpumigrate.transfer import generate_key

    provider = get_provider("local")
    key_file = home / "image.key"
    atomic_write_bytes(key_file, generate_key().encode(), mode=0o600)
    host = door = None
    try:
        host = provider.wait_ready(provider.provision(HostSpec("flows-src", "local", "local-a"), migration_id="tests"))
        host = provider.bootstrap(host, workload_launch("inference", *MODEL), timeout_s=120)
        wait_http(service_url(host), path="/readyz", timeout_s=120)
        door = FrontDoor.start(
            default_dir(WORKLOAD), source_host=host.address, source_port=host.ports["service"], node_id="flows-envoy"
        )
        yield Source(home, host, door, key_file)
    finally:
        if door is not None:
            door.stop()
        for h in provider.list_hosts():
            provider.terminate(h)


def write_plan(src: Source, path: Path, *, target: str, manual_gate: bool = False, window_s: float = 300) -> Path:
    return inference_plan(
        path,
        name=WORKLOAD,
        source_host="flows-src",
        endpoint=src.endpoint,
        agent=src.agent,
        key_file=src.key_file,
        model=MODEL,
        target=target,
        traffic={"stages": [{"weight": 25, "hold_s": 1}, {"weight": 100, "hold_s": 1}], "rollback_window_s": window_s,
                 "manual_gate": manual_gate},
    )  # fmt: skip


def cli_env(prefect_api: str, home: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PREFECT_API_URL": prefect_api, "GPUMIGRATE_HOME": str(home), **extra}


def load(src: Source, seconds: float = 120) -> Any:
    from gpumigrate.traffic.loadgen import LoadProcess

    return LoadProcess(src.door.url + "/v1/generate", rps=30, seconds=seconds)


def state(home: Path, mid: str) -> dict[str, Any]:
    try:
        return json.loads((home / "migrations" / mid / "state.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def events(home: Path, mid: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (home / "migrations" / mid / "audit.jsonl").read_text().splitlines()]


def artifact_types(flow_run_id: str) -> set[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {a.type for a in found}


def wait_paused(flow_run_id: str, timeout_s: float = 60) -> None:
    """The state record says paused just before Prefect does: wait for the API to agree."""
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            if client.read_flow_run(flow_run_id).state.is_paused():
                return
            time.sleep(0.1)
    raise AssertionError("the flow run never paused")


def final(state: Any) -> dict[str, Any]:
    """The result contract a migrate run ended with, and its final state as (type, name)."""
    return {**state.result(raise_on_failure=False), "state": (state.type.value, state.name)}


def serves(url: str) -> bool:
    try:
        return (
            httpx.post(url + "/v1/generate", json={"prompt": "hi", "max_new_tokens": 2}, timeout=10).status_code == 200
        )
    except httpx.HTTPError:
        return False


def test_migration_cuts_over_with_the_image_written_where_the_target_reads_it(
    source: Source, prefect_api: str, cli_cmd: list[str], tmp_path: Path
) -> None:
    """The source's agent writes straight to the target's store; the transfer phase checks the image there
    from its signed manifest and forwards nothing (an interrupted write resumes over a receiver's link:
    tests/flows/test_net_transport.py)."""
    plan = write_plan(source, tmp_path / "plan.yaml", target="flows-tgt-resume")
    mid = "flows-resume"
    lp = load(source)
    try:
        out = subprocess.run(
            [*cli_cmd, "migrate", str(plan), "--id", mid, "--json"],
            env=cli_env(prefect_api, source.home),
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        lp.stop()
        report = lp.wait(timeout_s=60)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["status"] == "completed" and result["migration_id"] == mid, (result["error"], out.stderr[-2000:])
    assert all(p["status"] == "completed" for p in result["phases"].values())
    found = {e["event"]: e["data"] for e in events(source.home, mid)}
    verified = found["image.verified"]
    assert "image.transferred" not in found and verified["read_back"] is False and verified["bytes_sent"] == 0
    assert verified["chunks_total"] == verified["chunks_skipped"] > 0  # every chunk was where the target reads
    assert report.failed == 0  # the clients never noticed
    from gpumigrate.traffic.state import StateStore

    assert StateStore(source.door.state_dir).read().weights == {"source": 0.0, "target": 100.0}
    assert Path(result["report"]).is_file() and Path(result["chart"]).is_file()
    # The run's Prefect artifacts: summary (markdown), phases (table), chart (image), transfer/ramp progress.
    assert {"markdown", "table", "image", "progress"} <= artifact_types(state(source.home, mid)["flow_run_id"])
    SHARED["cut_over"] = mid


def test_rollback_through_the_rollback_deployment(
    source: Source, prefect_api: str, cli_cmd: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Prefect UI's button: a run of the `rollback` deployment, executed by a runner process."""
    mid = SHARED.get("cut_over")
    if mid is None:
        pytest.skip("needs the cut-over migration of the previous test")
    import asyncio

    from prefect.deployments import run_deployment
    from prefect.runner import Runner

    from gpumigrate.flows.rollback import rollback_flow

    target = state(source.home, mid)["runtime"]["target_endpoint"]
    assert serves(target)
    monkeypatch.setenv("PREFECT_API_URL", prefect_api)  # the runner's flow-run process reports here

    async def run() -> str:
        runner = Runner(name="rollback-test")
        await runner.add_flow(rollback_flow, name="rollback")
        flow_run = await run_deployment(
            name="rollback/rollback", timeout=0, parameters={"migration_id": mid, "reason": "SRE pressed the button"}
        )
        await runner.execute_flow_run(flow_run.id)
        from prefect.client.orchestration import get_client

        async with get_client() as client:
            return (await client.read_flow_run(flow_run.id)).state.type.value

    assert asyncio.run(run()) == "COMPLETED"
    st = state(source.home, mid)
    assert st["status"] == "rolled_back"
    from gpumigrate.traffic.state import StateStore

    assert StateStore(source.door.state_dir).read().weights["source"] == 100.0
    assert not serves(target)  # torn down
    assert serves(source.door.url) and serves(source.endpoint)  # the source never stopped
    names = [e["event"] for e in events(source.home, mid)]
    assert "rollback.requested" in names and "rollback.target_torn_down" in names and "rollback.completed" in names
    # `gpumigrate rollback` reaches the same path; a second rollback is a no-op, not an error.
    again = subprocess.run(
        [*cli_cmd, "rollback", mid, "--json"],
        env=cli_env(prefect_api, source.home),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout.strip().splitlines()[-1])["how"] == "already rolled back"


def test_manual_gate_resumed_with_roll_back(source: Source, prefect_api: str, tmp_path: Path) -> None:
    """The flow pauses before any traffic moves; the operator answers "roll back" through Prefect."""
    from prefect.flow_runs import resume_flow_run

    from gpumigrate.flows.context import RunContext
    from gpumigrate.flows.migrate import migrate_flow

    plan = write_plan(source, tmp_path / "plan.yaml", target="flows-tgt-gate", manual_gate=True)
    mid = RunContext.create(plan, migration_id="flows-gate", resume=False).migration.id
    out: dict[str, Any] = {}
    runner = threading.Thread(
        target=lambda: out.update(final(migrate_flow(migration_id=mid, gate_timeout_s=120, return_state=True)))
    )
    runner.start()
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and state(source.home, mid).get("status") not in (
        "paused",
        "failed",
        "rolled_back",
        "denied",
    ):
        time.sleep(0.1)
    st = state(source.home, mid)
    assert st.get("status") == "paused", (st.get("phases"), out)
    target = st["runtime"]["target_endpoint"]
    assert serves(target)  # restored and verified, waiting for the operator
    wait_paused(st["flow_run_id"])
    resume_flow_run(
        st["flow_run_id"], run_input={"action": "roll back", "acting_as": "sre-ana", "reason": "change freeze"}
    )
    runner.join(timeout=120)
    assert not runner.is_alive()
    assert out["status"] == "rolled_back" and "change freeze" in out["error"], out
    assert out["state"] == ("FAILED", "RolledBack") and out["rollback"]["actor"] == "sre-ana"
    assert not serves(target) and serves(source.door.url)
    names = [e["event"] for e in events(source.home, mid)]
    assert "traffic.gate.waiting" in names and "traffic.gate.decided" in names
    assert "rollback.target_torn_down" in names and "traffic.stage" not in names  # no traffic ever moved


def test_rollback_during_the_ramp_acts_within_an_interval(source: Source, prefect_api: str, tmp_path: Path) -> None:
    """`gpumigrate rollback` while the flow ramps: a request the ramp controller sees at its next interval;
    the flow's undo puts traffic back on the source and tears the target down."""
    from gpumigrate.flows.context import RunContext
    from gpumigrate.flows.migrate import migrate_flow
    from gpumigrate.flows.rollback import rollback_flow

    plan_path = write_plan(source, tmp_path / "plan.yaml", target="flows-tgt-ramp")
    data = yaml.safe_load(plan_path.read_text())
    data["traffic"]["stages"] = [{"weight": 25, "hold_s": 30}, {"weight": 100, "hold_s": 1}]
    plan_path.write_text(yaml.safe_dump(data))
    mid = RunContext.create(plan_path, migration_id="flows-ramp-rb", resume=False).migration.id
    out: dict[str, Any] = {}
    lp = load(source)
    runner = threading.Thread(target=lambda: out.update(final(migrate_flow(migration_id=mid, return_state=True))))
    runner.start()
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and not any(e["event"] == "traffic.stage" for e in events(source.home, mid)):
            assert runner.is_alive(), out
            time.sleep(0.1)
        outcome = rollback_flow(migration_id=mid, reason="pager says stop")
        runner.join(timeout=60)
    finally:
        lp.stop()
        report = lp.wait(timeout_s=60)
    assert outcome["status"] == "rolled_back" and outcome["how"].startswith("requested"), outcome
    assert out["status"] == "rolled_back" and "pager says stop" in out["rollback"]["reason"]
    assert out["state"] == ("FAILED", "RolledBack")
    names = [e["event"] for e in events(source.home, mid)]
    assert "rollback.manual" in names and "rollback.target_torn_down" in names
    from gpumigrate.traffic.state import StateStore

    assert StateStore(source.door.state_dir).read().weights["source"] == 100.0
    assert report.failed == 0 and serves(source.door.url)

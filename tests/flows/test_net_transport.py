"""Migrations through the flow over the receivers: ``stream://`` (pinned TLS) and ``nixl://`` between two
network-namespace hosts joined by shaped veth links, and a plan pinning the wrong certificate refused.

The source serves in its own namespace behind a real front door; each migration's target is a host in
another namespace, brought up beforehand (as `gpumigrate hosts up --netns` does) and adopted by the
flow. The flow starts the receiver on the target, the source's agent writes there over the link, the
transfer phase checks the image from its manifest without reading a payload back, the target restores
from the receiver's store, and the receiver is stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpumigrate.infra import netns as netns_lib
from tests.support.plans import inference_plan

_ok, _why = netns_lib.available()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not _ok, reason=f"network namespaces unavailable: {_why}")]

WORKLOAD = "tiny-lm"
MODEL = ("--seed", "0", "--size", "tiny", "--device", "cpu")
RATE = "100mbit"


@dataclass
class Source:
    home: Path
    provider: Any
    host: Any
    door: Any
    key_file: Path

    @property
    def endpoint(self) -> str:
        return f"http://{self.host.address}:{self.host.ports['service']}"

    @property
    def agent(self) -> str:
        return f"{self.host.address}:{self.host.ports['agent']}"


@pytest.fixture
def source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefect_api: str, workload_launch: Callable[..., Any]
) -> Iterator[Source]:
    """A source of its own per test (a completed migration retires its source), in its own namespace."""
    from gpumigrate.atomic import atomic_write_bytes
    from gpumigrate.infra.launch import service_url, wait_http
    from gpumigrate.infra.local import LocalProvider
    from gpumigrate.interfaces import HostSpec
    from gpumigrate.traffic.frontdoor import FrontDoor, default_dir
    from gpumigrate.transfer import generate_key

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("GPUMIGRATE_HOME", str(home))
    provider = LocalProvider(netns=True, rate=RATE, attached=False)
    key_file = home / "image.key"
    atomic_write_bytes(key_file, generate_key().encode(), mode=0o600)
    door = None
    try:
        host = provider.wait_ready(provider.provision(HostSpec("net-src", "local", "local-a")))
        host = provider.bootstrap(host, workload_launch("inference", *MODEL), timeout_s=120)
        wait_http(service_url(host), path="/readyz", timeout_s=120)
        door = FrontDoor.start(
            default_dir(WORKLOAD), source_host=host.address, source_port=host.ports["service"], node_id="net-envoy"
        )
        yield Source(home, provider, host, door, key_file)
    finally:
        if door is not None:
            door.stop()
        for h in provider.list_hosts():
            provider.terminate(h)


def target_host(src: Source, name: str) -> Any:
    """A host in its own namespace, up before the migration (the flow adopts it by name)."""
    from gpumigrate.interfaces import HostSpec

    return src.provider.wait_ready(src.provider.provision(HostSpec(name, "local", "local-b")))


def write_plan(src: Source, path: Path, *, target: str, store: str) -> Path:
    return inference_plan(
        path,
        name=WORKLOAD,
        source_host="net-src",
        endpoint=src.endpoint,
        agent=src.agent,
        key_file=src.key_file,
        model=MODEL,
        target=target,
        transfer={"store": store},
    )
    return path


def events(home: Path, mid: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (home / "migrations" / mid / "audit.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("scheme", ["stream", "nixl"])
def test_migration_over_a_receiver_the_flow_starts_on_the_target(
    source: Source, migrate_under_load: Any, tmp_path: Path, scheme: str
) -> None:
    if scheme == "nixl":
        from gpumigrate.transfer.stores.nixl_agent import load_nixl

        load_nixl()  # the nixl extra is part of `make setup`: missing, this fails with the package's name
    target = target_host(source, f"net-tgt-{scheme}")
    store = f"{scheme}://target?connections=2" + ("&transports=tcp" if scheme == "nixl" else "")
    plan = write_plan(source, tmp_path / "plan.yaml", target=target.name, store=store)
    mid = f"net-{scheme}"
    out, report = migrate_under_load(source, plan, mid)
    assert report.failed == 0, report.errors  # the clients never noticed
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["status"] == "completed", (result["error"], out.stderr[-2000:])
    assert all(p["status"] == "completed" for p in result["phases"].values())

    found = {e["event"]: e["data"] for e in events(source.home, mid)}
    started = found["transfer.receiver.started"]
    assert started["host"] == target.name and started["nixl"] is (scheme == "nixl")
    assert started["url"].startswith(f"{scheme}://{target.address}:") and "fingerprint=sha256" in started["url"]
    assert Path(started["store"].removeprefix("file://")).is_relative_to(Path(target.workdir))
    # The source's agent wrote over the link, pinned to the receiver's certificate; nothing was forwarded.
    committed = found["image.committed"]
    assert committed["store"].startswith(f"{scheme}://{target.address}:")
    verified = found["image.verified"]
    assert verified["read_back"] is False and verified["bytes_sent"] == 0 and "image.transferred" not in found
    assert verified["chunks_total"] == verified["chunks_skipped"] > 0  # every chunk landed verified
    assert result["bytes"]["sent"] == verified["bytes_landed"] > 0  # what crossed the link is what landed
    assert found["transfer.receiver.stopped"]["state"] == "stopped"
    # The target restored from the receiver's store on its own host.
    runtime = json.loads((source.home / "migrations" / mid / "state.json").read_text())["runtime"]
    assert runtime["target_store"] == started["store"] and runtime["receiver_stopped"] is True
    from gpumigrate.transfer.receiver.host import read_receiver_info

    assert read_receiver_info(runtime["receiver_dir"]).state == "stopped"


def test_a_plan_pinning_the_wrong_certificate_is_refused_before_anything_moves(
    source: Source, prefect_api: str, cli_cmd: list[str], tmp_path: Path
) -> None:
    """A receiver the operator runs, pinned in the plan by a fingerprint that is not its certificate's."""
    from gpumigrate import control
    from gpumigrate.transfer.receiver.host import ReceiverOptions, start_receiver, stop_receiver

    state = tmp_path / "receiver"  # a receiver the operator runs on this machine
    info = start_receiver(state, ReceiverOptions(listen="127.0.0.1:0"), key_ref={"file": str(source.key_file)})
    try:
        wrong = "sha256:" + ("1" * 64 if info.fingerprint == "sha256:" + "0" * 64 else "0" * 64)
        store = f"stream://127.0.0.1:{info.port}?fingerprint={wrong}"
        plan = write_plan(source, tmp_path / "plan.yaml", target="net-tgt-pinned", store=store)
        env = {**os.environ, "PREFECT_API_URL": prefect_api, "GPUMIGRATE_HOME": str(source.home)}
        out = subprocess.run(
            [*cli_cmd, "migrate", str(plan), "--id", "net-pinned", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 2, out.stderr[-3000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["status"] == "denied"
        assert "certificate" in result["error"] and wrong.removeprefix("sha256:")[:16] in result["error"]
        assert "Traceback" not in out.stderr
        names = [e["event"] for e in events(source.home, "net-pinned")]
        assert "infra.provisioned" not in names and "image.committed" not in names  # nothing launched or sent
        assert all(h.name != "net-tgt-pinned" for h in source.provider.list_hosts())
        assert read_chunks(state) == 0  # the receiver got no byte
    finally:
        stop_receiver(state, control_key=control.load_key(control.key_reference()))


def read_chunks(state: Path) -> int:
    return sum(1 for p in state.rglob("*") if p.is_file() and "chunks" in p.parts)


def link_tx_bytes(host: Any) -> int:
    """Bytes sent into ``host``'s namespace over its veth link (the root side's transmit counter)."""
    return int(Path(f"/sys/class/net/gmh{host.meta['netns'][3:]}/statistics/tx_bytes").read_text())


def test_a_migration_killed_while_the_agent_writes_resumes_without_sending_it_again(
    source: Source, prefect_api: str, cli_cmd: list[str], tmp_path: Path
) -> None:
    """SIGKILL the orchestrator while the source's agent writes over a slow link to the receiver on the
    target; `--resume` finishes with the receiver still running there, and the chunks it holds do not
    cross the link again: all the bytes that entered the target's namespace stay well under two images."""
    import signal
    import time

    from gpumigrate.infra.local import LocalProvider
    from gpumigrate.interfaces import HostSpec

    slow = LocalProvider(netns=True, rate="2mbit", attached=False)
    target = slow.wait_ready(slow.provision(HostSpec("net-tgt-slow", "local", "local-b")))
    plan = write_plan(source, tmp_path / "plan.yaml", target=target.name, store="stream://target?connections=2")
    mid = "net-resume"
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "GPUMIGRATE_HOME": str(source.home)}
    before = link_tx_bytes(target)
    proc = subprocess.Popen(
        [*cli_cmd, "migrate", str(plan), "--id", mid],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    state_file = source.home / "migrations" / mid / "state.json"
    arrived = 0
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                st = json.loads(state_file.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                st = {}
            store = (st.get("runtime", {}).get("target_store") or "").removeprefix("file://")
            if st.get("phases", {}).get("snapshot", {}).get("status") == "running" and store:
                arrived = sum(1 for p in Path(store).rglob("*") if p.is_file() and "chunks" in p.parts)
                if arrived >= 3:
                    break
            time.sleep(0.05)
        assert proc.poll() is None and arrived >= 3, f"not interrupted mid-write: {proc.stderr.read()[-2000:]!r}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    from gpumigrate.traffic.loadgen import LoadProcess

    lp = LoadProcess(source.door.url + "/v1/generate", rps=20, seconds=300)
    try:
        out = subprocess.run(
            [*cli_cmd, "migrate", str(plan), "--id", mid, "--resume", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
    finally:
        lp.stop()
        report = lp.wait(timeout_s=60)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["status"] == "completed", (result["error"], out.stderr[-2000:])
    assert report.failed == 0, report.errors
    found = events(source.home, mid)
    assert [e["event"] for e in found].count("transfer.receiver.started") == 1  # the same receiver, resumed to
    verified = next(e["data"] for e in found if e["event"] == "image.verified")
    crossed = link_tx_bytes(target) - before
    assert verified["bytes_landed"] < crossed < 1.6 * verified["bytes_landed"], (crossed, verified)
    slow.terminate(target)


def test_a_receiver_on_a_cloud_target_is_refused_with_what_to_use_instead(
    prefect_api: str, cli_cmd: list[str], tmp_path: Path, gm_home: Path
) -> None:
    """stream://target asks the flow to start a receiver on the target, which it does on local hosts only."""
    plan = {
        "version": 1,
        "workload": {
            "name": WORKLOAD,
            "kind": "inference",
            "source_host": "src",
            "endpoint": "http://127.0.0.1:9",
            "agent": "127.0.0.1:9",
            "launch": {"argv": ["{python}", "-m", "svc", "--port", "{service_port}"]},
        },
        "target": {"provider": "aws", "region": "eu-central-1", "zone": "eu-central-1a", "instance_type": "g5.xlarge"},
        "data": {"classification": "internal", "allowed_jurisdictions": ["EU"]},
        "transfer": {"store": "stream://target"},
        "parity": {
            "golden_inputs": "golden.jsonl",
            "request": {"path": "/v1/generate", "compare": [{"field": "tokens", "kind": "exact"}]},
        },
    }
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "GPUMIGRATE_HOME": str(gm_home)}
    out = subprocess.run(
        [*cli_cmd, "migrate", str(path), "--id", "net-cloud-receiver", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr[-3000:]  # refused with the plan, before a migration exists
    said = " ".join((out.stdout + out.stderr).split())
    assert "local hosts only" in said and "s3://" in said and "fingerprint=sha256:HEX" in said, said
    assert "Traceback" not in out.stderr and not (gm_home / "migrations" / "net-cloud-receiver").exists()

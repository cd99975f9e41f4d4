"""Host-level snapshot actions: the embedded default runs them in-process, on this machine only."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpumigrate.errors import GpumigrateError, InvalidInputError, PolicyDeniedError


def test_unknown_action_and_backend_are_refused_before_any_host_is_asked() -> None:
    from gpumigrate.flows.host_actions import dispatch

    with pytest.raises(InvalidInputError, match="not one of"):
        dispatch("somewhere-else", "teleport", {"backend": "criu"})
    with pytest.raises(InvalidInputError, match="cuda-driver and criu"):
        dispatch("somewhere-else", "check", {"backend": "agent"})


@pytest.mark.parametrize("backend", ["criu", "cuda-driver"])
def test_check_runs_in_process_and_says_why_it_cannot(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No server, no host workers, the host is this machine: the action runs here; on this machine (no GPU,
    CRIU < 4) it refuses with a GpumigrateError naming the reason, or reports what it found where it can run."""
    from gpumigrate.flows.host_actions import dispatch

    monkeypatch.delenv("GPUMIGRATE_HOST_WORKERS", raising=False)
    try:
        out = dispatch(socket.gethostname(), "check", {"backend": backend})
    except GpumigrateError as exc:
        assert str(exc) and "Traceback" not in str(exc)
    else:
        assert out  # a GPU machine with the driver API / a host with CRIU 4+ and its CUDA plugin


def test_the_embedded_default_refuses_a_host_that_is_not_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpumigrate.flows.host_actions import dispatch

    monkeypatch.delenv("GPUMIGRATE_HOST_WORKERS", raising=False)
    with pytest.raises(PolicyDeniedError, match="not this machine .* no host workers") as info:
        dispatch("gpu-node-7", "checkpoint", {"backend": "criu", "pid": os.getpid(), "images_dir": "/tmp/x"})
    assert info.value.exit_code == 2


def test_the_embedded_default_refuses_a_pid_of_another_host(gm_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local host is up here, but the pid is not one of its processes: refused before anything acts on it."""
    from gpumigrate.flows.host_actions import dispatch
    from gpumigrate.infra.local import LocalProvider
    from gpumigrate.interfaces import HostSpec

    monkeypatch.delenv("GPUMIGRATE_HOST_WORKERS", raising=False)
    provider = LocalProvider()
    host = provider.provision(HostSpec("ha-a", "local", "local-a"), migration_id="ha")
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine = provider.spawn(host, [sys.executable, "-c", "import time; time.sleep(60)"], name="sleeper")
        with pytest.raises(PolicyDeniedError, match=f"pid {stranger.pid} is not a process of local host ha-a"):
            dispatch("ha-a", "resume", {"backend": "criu", "pid": stranger.pid})
        assert stranger.poll() is None
        # Its own process passes the check and reaches the backend (CRIU's resume: it runs, nothing to do).
        assert dispatch("ha-a", "resume", {"backend": "criu", "pid": mine["pid"]}) == {"source": "running"}
    finally:
        stranger.kill()
        provider.terminate(host)


def test_deployment_names_follow_the_per_host_queues() -> None:
    from gpumigrate.flows.host_actions import deployment_name

    assert deployment_name("gpu-7") == "host-action/gpu-7"


def test_dispatch_goes_through_the_hosts_deployment(prefect_api: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With host workers on, the action is a run of `host-action/<host>` executed by that host's runner
    (here a Runner in this test standing in for the worker), and its outcome comes back to the caller."""
    import asyncio
    import threading

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName, FlowRunFilter
    from prefect.runner import Runner

    from gpumigrate.flows.host_actions import dispatch, host_action_flow

    monkeypatch.setenv("PREFECT_API_URL", prefect_api)
    monkeypatch.setenv("GPUMIGRATE_HOST_WORKERS", "1")
    runner = Runner(name="host-local-a")
    outcome: dict[str, object] = {}
    deployed = threading.Event()

    def call() -> None:
        try:
            outcome["result"] = dispatch("local-a", "check", {"backend": "criu"}, timeout_s=120)
        except GpumigrateError as exc:
            outcome["error"] = str(exc)

    caller = threading.Thread(target=lambda: deployed.wait(60) and call())

    async def serve_one() -> None:
        await runner.add_flow(host_action_flow, name="local-a")
        deployed.set()
        caller.start()
        async with get_client() as client:
            for _ in range(600):
                runs = await client.read_flow_runs(
                    deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["local-a"])),
                    flow_run_filter=FlowRunFilter(),
                )
                if runs:
                    await runner.execute_flow_run(runs[0].id)
                    return
                await asyncio.sleep(0.1)
        raise AssertionError("dispatch never created a flow run of host-action/local-a")

    asyncio.run(serve_one())
    caller.join(timeout=120)
    assert not caller.is_alive()
    # CRIU 4 with its CUDA plugin is not on this machine: the refusal travels back through Prefect.
    assert "result" in outcome or "host action check on local-a ended" in str(outcome.get("error")), outcome

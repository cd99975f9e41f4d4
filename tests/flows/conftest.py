"""Fixtures for the flow tests: ONE Prefect test harness for the session, local hosts, a front door, and
the plans of an inference migration (``inference_source``, ``inference_plan``).

Prefect reads its settings when it is first imported, so the temporary PREFECT_HOME and an explicitly
empty PREFECT_API_URL are set here, before any test module imports the flows.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import plans
from tests.support.own_service import own_service_source  # noqa: F401 (the fixture `source`: a user's own service)

_HOME = tempfile.mkdtemp(prefix="gm-prefect-home-")
atexit.register(shutil.rmtree, _HOME, True)
os.environ["PREFECT_HOME"] = _HOME
os.environ["PREFECT_API_URL"] = ""  # nothing leaks in from the developer's shell
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """The harness's API URL; CLI subprocesses get it as PREFECT_API_URL (the "with a server" path)."""
    from prefect.settings import PREFECT_API_URL

    from tests.support.prefect import harness

    with harness():
        yield str(PREFECT_API_URL.value())


# ----------------------------------------------------------------------------- a source and its plans
TINY_MODEL = ("--seed", "0", "--size", "tiny", "--device", "cpu")  # the source's model; a target allocates the same


@dataclass
class InferenceSource:
    """The reference inference server on a local host, behind a real front door (Envoy + control plane)."""

    name: str  # the workload's name (the front door's)
    home: Path  # GPUMIGRATE_HOME of the module
    provider: Any
    host: Any
    door: Any
    key_file: Path  # the image key, by file reference
    args: tuple[str, ...]  # the server's model arguments; the plan's launch gives the target the same

    @property
    def endpoint(self) -> str:
        return f"http://{self.host.address}:{self.host.ports['service']}"

    @property
    def agent(self) -> str:
        return f"{self.host.address}:{self.host.ports['agent']}"


@pytest.fixture(scope="module")
def inference_source(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    prefect_api: str,
    workload_launch: Callable[..., Any],
) -> Iterator[InferenceSource]:
    """One source for a module's tests (its ``WORKLOAD`` names it; ``SOURCE_ARGS`` are model arguments added to
    the tiny model's), in a GPUMIGRATE_HOME of the module's own; every local host of that home is terminated
    after the module."""
    from gpumigrate.atomic import atomic_write_bytes
    from gpumigrate.infra import get_provider
    from gpumigrate.infra.launch import service_url, wait_http
    from gpumigrate.interfaces import HostSpec
    from gpumigrate.traffic.frontdoor import FrontDoor, default_dir
    from gpumigrate.transfer import generate_key

    name = str(getattr(request.module, "WORKLOAD", "tiny-lm"))
    args = (*TINY_MODEL, *getattr(request.module, "SOURCE_ARGS", ()))
    home = tmp_path_factory.mktemp(f"{name}-home")
    old = os.environ.get("GPUMIGRATE_HOME")
    os.environ["GPUMIGRATE_HOME"] = str(home)
    provider = get_provider("local")
    key_file = home / "image.key"
    atomic_write_bytes(key_file, generate_key().encode(), mode=0o600)
    door = None
    try:
        spec = HostSpec(f"{name}-src", "local", "local-a")
        host = provider.wait_ready(provider.provision(spec, migration_id="tests"))
        host = provider.bootstrap(host, workload_launch("inference", *args), timeout_s=120)
        wait_http(service_url(host), path="/readyz", timeout_s=120)
        door = FrontDoor.start(
            default_dir(name), source_host=host.address, source_port=host.ports["service"], node_id=f"{name}-envoy"
        )
        yield InferenceSource(name, home, provider, host, door, key_file, args)
    finally:
        if door is not None:
            door.stop()
        for h in provider.list_hosts():
            provider.terminate(h)
        if old is None:
            os.environ.pop("GPUMIGRATE_HOME", None)
        else:
            os.environ["GPUMIGRATE_HOME"] = old


PlanBuilder = Callable[..., Path]


@pytest.fixture(scope="session")
def inference_plan() -> PlanBuilder:
    """``inference_plan(src, path, target=HOST, **sections) -> path``: the plan of a migration of ``src`` to the
    local host ``target``, written to ``path`` (golden inputs beside it); each keyword replaces the keys it
    names in that top-level section (``snapshot={"precopy_rounds": 2}``, ``transfer={"store": ...}``)."""

    def build(src: InferenceSource, path: Path, *, target: str, **sections: dict[str, Any]) -> Path:
        return plans.inference_plan(
            path,
            name=src.name,
            source_host=src.host.name,
            endpoint=src.endpoint,
            agent=src.agent,
            key_file=src.key_file,
            model=src.args,
            target=target,
            **sections,
        )

    return build


@pytest.fixture
def migrate_under_load(cli_cmd: list[str], prefect_api: str) -> Callable[..., tuple[Any, Any]]:
    """``migrate_under_load(src, plan, mid) -> (completed CLI process, load report)``: ``gpumigrate migrate plan
    --id mid --json`` in ``src``'s GPUMIGRATE_HOME while 20 rps of generate requests go through its front door."""
    from gpumigrate.traffic.loadgen import LoadProcess

    def run(src: Any, plan: Path, mid: str) -> tuple[Any, Any]:
        env = {**os.environ, "PREFECT_API_URL": prefect_api, "GPUMIGRATE_HOME": str(src.home)}
        lp = LoadProcess(src.door.url + "/v1/generate", rps=20, seconds=240)
        try:
            out = subprocess.run(
                [*cli_cmd, "migrate", str(plan), "--id", mid, "--json"],
                env=env,
                capture_output=True,
                text=True,
                timeout=400,
            )
        finally:
            lp.stop()
            report = lp.wait()
        return out, report

    return run

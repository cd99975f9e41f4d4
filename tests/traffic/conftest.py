"""Fixtures for the traffic tests: upstream processes, a control plane, a supervised Envoy.

Upstreams are the reference inference server (``gpumigrate.workloads.inference``) when it is
installed, else the stdlib stand-in ``fake_upstream.py`` with the same endpoints. Set
``GPUMIGRATE_TRAFFIC_UPSTREAM=fake|real`` to force one. Every process started here is started in
its own session and killed as a group by the fixture's finalizer.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from gpumigrate.traffic.envoy import Envoy, free_port
from gpumigrate.traffic.state import DesiredState, StateStore, Upstream, split
from gpumigrate.traffic.xds import ControlPlane

from gpumigrate.interfaces import ParityReport

HERE = Path(__file__).resolve().parent


def _use_real() -> bool:
    choice = os.environ.get("GPUMIGRATE_TRAFFIC_UPSTREAM", "auto")
    if choice in ("fake", "real"):
        return choice == "real"
    try:
        return importlib.util.find_spec("gpumigrate.workloads.inference") is not None
    except ModuleNotFoundError:
        return False


@dataclass
class UpstreamProc:
    name: str
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fault(self, kind: str, rate: float = 1.0, delay_ms: int = 0) -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(self.url + "/admin/fault", json={"kind": kind, "rate": rate, "delay_ms": delay_ms}, timeout=5)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def start_upstream(name: str, *, real: bool | None = None) -> UpstreamProc:
    port = free_port()
    real = _use_real() if real is None else real
    if real:
        cmd = [sys.executable, "-m", "gpumigrate.workloads.inference", "--host", "127.0.0.1", "--port", str(port),
               "--seed", "0", "--size", "tiny", "--device", "cpu", "--name", name]
    else:
        cmd = [sys.executable, str(HERE / "fake_upstream.py"), "--port", str(port), "--name", name]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    up = UpstreamProc(name, port, proc)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"upstream {name} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(up.url + "/readyz", timeout=1).status_code == 200:
                return up
        time.sleep(0.1)
    up.kill()
    raise RuntimeError(f"upstream {name} not ready")


@dataclass
class TrafficEnv:
    state_dir: Path
    store: StateStore
    plane: ControlPlane
    envoy: Envoy
    upstreams: dict[str, UpstreamProc]
    extra: list[Any] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.envoy.url + "/v1/generate"


@pytest.fixture
def traffic_env(tmp_path: Path) -> Iterator[TrafficEnv]:
    ups: dict[str, UpstreamProc] = {}
    plane = envoy = None
    try:
        for n in ("source", "target"):
            ups[n] = start_upstream(n)
        state_dir = tmp_path / "xds"
        store = StateStore(state_dir)
        store.init(DesiredState(upstreams={n: Upstream(n, "127.0.0.1", u.port) for n, u in ups.items()},
                                weights=split("source", "target", 0)))
        plane = ControlPlane(state_dir).start()
        envoy = Envoy(tmp_path / "envoy", xds_port=plane.port, node_id="test-envoy").start()
        yield TrafficEnv(state_dir, store, plane, envoy, ups)
    finally:
        if envoy is not None:
            envoy.stop()
        if plane is not None:
            plane.stop()
        for u in ups.values():
            u.kill()


class TokensComparator:
    """Test double of the parity side: outputs agree when their tokens are equal."""

    def compare(self, source: Sequence[Mapping[str, Any]], target: Sequence[Mapping[str, Any]]) -> ParityReport:
        failures = tuple(f"case {i}: tokens differ" for i, (s, t) in enumerate(zip(source, target, strict=True))
                         if s.get("tokens") != t.get("tokens"))
        return ParityReport(passed=not failures, cases=len(source), max_abs_err=None, failures=failures)


@pytest.fixture
def comparator() -> TokensComparator:
    return TokensComparator()


GOLDEN = [{"prompt": f"golden input {i}", "max_new_tokens": 4} for i in range(3)]


@pytest.fixture
def golden() -> list[dict[str, Any]]:
    return list(GOLDEN)

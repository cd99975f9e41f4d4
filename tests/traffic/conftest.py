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

from gpumigrate.interfaces import ParityReport
from gpumigrate.traffic.envoy import Envoy, free_port
from gpumigrate.traffic.state import DesiredState, StateStore, Upstream, split
from gpumigrate.traffic.xds import ControlPlane

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
        """Break (or mend) this upstream; a fault it does not acknowledge fails the test that asked for it."""
        body = {"kind": kind, "rate": rate, "delay_ms": delay_ms}
        reply = httpx.post(self.url + "/admin/fault", json=body, timeout=10, trust_env=False)
        reply.raise_for_status()
        assert reply.json().get("kind") == kind, f"upstream {self.name} did not take fault {kind}: {reply.text}"

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


UPSTREAM_READY_S = 180.0  # a tiny model's server imports torch: tens of seconds each on a loaded 2-core machine


def start_upstream(name: str, *, real: bool | None = None) -> UpstreamProc:
    """One upstream, started and answering ``/readyz``."""
    return wait_upstream(spawn_upstream(name, real=real))


def spawn_upstream(name: str, *, real: bool | None = None) -> UpstreamProc:
    """One upstream's process, started (several start side by side: see :func:`wait_upstream`)."""
    port = free_port()
    real = _use_real() if real is None else real
    if real:
        cmd = [
            sys.executable,
            "-m",
            "gpumigrate.workloads.inference",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--seed",
            "0",
            "--size",
            "tiny",
            "--device",
            "cpu",
            "--name",
            name,
            "--enable-faults",  # the ramp and figures tests break these upstreams through POST /admin/fault
        ]
    else:
        cmd = [sys.executable, str(HERE / "fake_upstream.py"), "--port", str(port), "--name", name]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return UpstreamProc(name, port, proc)


def wait_upstream(up: UpstreamProc, timeout_s: float = UPSTREAM_READY_S) -> UpstreamProc:
    """``up`` once it answers ``GET /readyz`` with 200; killed, and the reason raised, when it does not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if up.proc.poll() is not None:
            raise RuntimeError(f"upstream {up.name} exited with {up.proc.returncode} before it answered /readyz")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(up.url + "/readyz", timeout=1).status_code == 200:
                return up
        time.sleep(0.1)
    up.kill()
    raise RuntimeError(f"upstream {up.name} did not answer GET {up.url}/readyz with 200 within {timeout_s:.0f}s")


@dataclass
class TrafficEnv:
    state_dir: Path
    store: StateStore
    plane: ControlPlane | None  # in-process control plane, or None when it runs as its own process
    envoy: Envoy
    upstreams: dict[str, UpstreamProc]
    plane_proc: subprocess.Popen[bytes] | None = None
    plane_port: int = 0
    extra: list[Any] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.envoy.url + "/v1/generate"

    def kill_plane(self) -> None:
        """SIGKILL the control plane process (no goodbye to Envoy)."""
        if self.plane_proc is not None:
            kill_group(self.plane_proc)

    def start_plane(self) -> None:
        """A new control plane process on the same socket (and port, if any), reading the same state directory."""
        self.plane_proc, _ = start_control_plane_process(
            self.state_dir, self.plane_port, log=self.state_dir.parent / "xds.log"
        )


def _env(tmp_path: Path, *, external_plane: bool, real: bool | None = None) -> Iterator[TrafficEnv]:
    """Upstreams, a control plane and an Envoy. An external plane logs to ``<tmp_path>/xds.log``."""
    ups: dict[str, UpstreamProc] = {}
    plane = envoy = None
    env: TrafficEnv | None = None
    try:
        for n in ("source", "target"):  # both start side by side: each loads its model while the other does
            ups[n] = spawn_upstream(n, real=real)
        for u in ups.values():
            wait_upstream(u)
        state_dir = tmp_path / "xds"
        store = StateStore(state_dir)
        store.init(
            DesiredState(
                upstreams={n: Upstream(n, "127.0.0.1", u.port) for n, u in ups.items()},
                weights=split("source", "target", 0),
            )
        )
        proc = None
        if external_plane:
            proc, port = start_control_plane_process(state_dir, log=tmp_path / "xds.log")
        else:
            plane = ControlPlane(state_dir).start()  # its private socket: Envoy finds it from the state directory
            port = 0
        env = TrafficEnv(state_dir, store, plane, None, ups, plane_proc=proc, plane_port=port)  # type: ignore[arg-type]
        envoy = Envoy(tmp_path / "envoy", state_dir=state_dir, node_id="test-envoy").start()
        env.envoy = envoy
        yield env
    finally:
        if envoy is not None:
            envoy.stop()
        if plane is not None:
            plane.stop()
        if env is not None and env.plane_proc is not None:
            kill_group(env.plane_proc)
        for u in ups.values():
            u.kill()


@pytest.fixture
def traffic_env(tmp_path: Path) -> Iterator[TrafficEnv]:
    """Two upstreams, an in-process control plane, one Envoy; weights 100% source."""
    yield from _env(tmp_path, external_plane=False)


@pytest.fixture
def light_env(tmp_path: Path) -> Iterator[TrafficEnv]:
    """Like ``traffic_env`` with the stdlib stand-in upstreams (fast to start) for mechanism tests."""
    yield from _env(tmp_path, external_plane=False, real=False)


@pytest.fixture
def light_env_external(tmp_path: Path) -> Iterator[TrafficEnv]:
    """Stand-in upstreams and the control plane as its own process (its log: ``tmp_path/xds.log``)."""
    yield from _env(tmp_path, external_plane=True, real=False)


@pytest.fixture
def traffic_env_external(tmp_path: Path) -> Iterator[TrafficEnv]:
    """Like ``traffic_env`` with the control plane as its own process (killable, restartable)."""
    yield from _env(tmp_path, external_plane=True)


class TokensComparator:
    """Test double of the parity side: same tokens and logprobs within 1e-4."""

    def compare(self, source: Sequence[Mapping[str, Any]], target: Sequence[Mapping[str, Any]]) -> ParityReport:
        failures = []
        worst = 0.0
        for i, (s, t) in enumerate(zip(source, target, strict=True)):
            if s.get("tokens") != t.get("tokens"):
                failures.append(f"case {i}: tokens differ")
                continue
            errs = [abs(a - b) for a, b in zip(s.get("logprobs") or [], t.get("logprobs") or [], strict=False)]
            worst = max([worst, *errs])
            if errs and max(errs) > 1e-4:
                failures.append(f"case {i}: logprobs differ by {max(errs):.3g}")
        return ParityReport(passed=not failures, cases=len(source), max_abs_err=worst, failures=tuple(failures))


def start_control_plane_process(
    state_dir: Path, port: int = 0, *, log: Path | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    """``python -m gpumigrate.traffic.xds`` as its own process, on its private socket (and on ``port`` where one
    is given); returns (process, port or 0). ``log``: its stderr."""
    extra = ["--port", str(port)] if port else []
    with open(log, "ab") if log else contextlib.nullcontext(subprocess.DEVNULL) as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpumigrate.traffic.xds", "--state-dir", str(state_dir), *extra],
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
        )
    line = proc.stdout.readline().decode() if proc.stdout else ""
    if not line.startswith("listening "):
        kill_group(proc)
        raise RuntimeError(f"control plane did not start: {line!r}")
    return proc, port


def kill_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


@pytest.fixture
def comparator() -> TokensComparator:
    return TokensComparator()


GOLDEN = [{"prompt": f"golden input {i}", "max_new_tokens": 4} for i in range(3)]


@pytest.fixture
def golden() -> list[dict[str, Any]]:
    return list(GOLDEN)

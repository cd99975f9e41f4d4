"""Fixtures for the reference workloads: real server processes on loopback, always cleaned up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # llm_support, shared by the LLM server's tests


@dataclass
class ServerProc:
    proc: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=10)


def start_server(
    *extra: str, wait_ready: bool = True, timeout_s: float = 60.0, env: dict[str, str] | None = None
) -> ServerProc:
    argv = [sys.executable, "-m", "gpumigrate.workloads.inference", "--port", "0", "--name", "test", *extra]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        line = proc.stdout.readline()  # the "listening" line, printed once the socket is bound
        if not line:
            raise RuntimeError(f"server exited: {proc.wait(5)} {proc.stderr.read()}")
        port = json.loads(line)["port"]
        deadline = time.monotonic() + timeout_s
        path = "/readyz" if wait_ready else "/healthz"
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2).status_code == 200:
                    return ServerProc(proc, port)
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError("server did not become ready")
    except BaseException:
        _kill_group(proc)
        raise


@pytest.fixture
def server_factory() -> Iterator[Callable[..., ServerProc]]:
    started: list[ServerProc] = []

    def factory(*extra: str, wait_ready: bool = True, env: dict[str, str] | None = None) -> ServerProc:
        srv = start_server(*extra, wait_ready=wait_ready, env=env)
        started.append(srv)
        return srv

    yield factory
    for srv in started:
        _kill_group(srv.proc)


@pytest.fixture(scope="module")
def shared_server() -> Iterator[ServerProc]:
    """One tiny server for read-only contract tests (no faults set on it)."""
    srv = start_server("--seed", "0", "--enable-faults")
    yield srv
    _kill_group(srv.proc)

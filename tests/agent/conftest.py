"""Fixtures for the SDK tests: real processes (each a user's program embedding gpumigrate.agent),
a private state root (the control key they and the test share), and a file store with a key."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpumigrate.snapshot.client import AgentClient

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    """A user's program started as its own process group, stdout+stderr to a log file."""

    popen: subprocess.Popen[bytes]
    log: Path
    agent: str
    url: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        out = []
        for line in self.text().splitlines():
            if line.startswith("{"):
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if kind is None or event.get("event") == kind:
                    out.append(event)
        return out

    def client(self) -> AgentClient:
        return AgentClient(self.agent, timeout_s=300)

    def wait_agent(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.popen.poll() is None, f"process exited early:\n{self.text()[-3000:]}"
            try:
                with self.client() as c:
                    c.call("ping")
                return
            except Exception:
                time.sleep(0.1)
        raise AssertionError(f"agent at {self.agent} did not come up:\n{self.text()[-3000:]}")

    def wait_http(self, path: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.popen.poll() is None, f"process exited early:\n{self.text()[-3000:]}"
            try:
                if httpx.get(f"{self.url}{path}", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{self.url}{path} did not answer 200:\n{self.text()[-3000:]}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(timeout=30)


@pytest.fixture
def spawn(tmp_path: Path, gm_home: Path) -> Iterator[Callable[..., Proc]]:
    """Start a Python program with the environment contract gpumigrate gives a workload."""
    started: list[Proc] = []

    def start(
        argv: list[str],
        *,
        name: str,
        await_restore: bool = False,
        http: bool = False,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> Proc:
        agent = f"127.0.0.1:{free_port()}"
        extra = {"GPUMIGRATE_AGENT_ADDR": agent, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        url = None
        if http:
            port = free_port()
            extra.update(HOST="127.0.0.1", PORT=str(port))
            url = f"http://127.0.0.1:{port}"
        if await_restore:
            extra["GPUMIGRATE_AWAIT_RESTORE"] = "1"
        inherited = {k: v for k, v in os.environ.items() if k != "GPUMIGRATE_AWAIT_RESTORE"}
        full_env = {**inherited, **extra, **(env or {})}
        log = tmp_path / f"{name}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                [sys.executable, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=cwd,
                start_new_session=True,
            )
        proc = Proc(popen, log, agent, url, extra)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, str]]:
    """A real file store and the image key's reference (the key lives only in the environment)."""
    from gpumigrate import transfer

    monkeypatch.setenv("GM_AGENT_TEST_KEY", transfer.generate_key())
    return f"file://{tmp_path / 'store'}", {"env": "GM_AGENT_TEST_KEY"}


@pytest.fixture(autouse=True)
def _in_process_contract(gm_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """In-process attaches listen on a free loopback port; none outlives its test."""
    monkeypatch.setenv("GPUMIGRATE_AGENT_ADDR", "127.0.0.1:0")
    monkeypatch.delenv("GPUMIGRATE_AWAIT_RESTORE", raising=False)
    yield
    from gpumigrate.agent import current

    handle = current()
    if handle is not None:
        handle.close()

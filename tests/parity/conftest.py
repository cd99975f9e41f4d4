"""Parity fixtures: real inference-server processes (the workloads' reference server) and a damaging proxy.

Servers are session-scoped (each costs seconds to import torch) and started in their own process
group, killed as a group at the end, so no process outlives the tests.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).resolve().parent
GOLDEN_SMALL = HERE / "data" / "golden-small.jsonl"
START_TIMEOUT_S = 90.0


@dataclass
class Proc:
    url: str
    popen: subprocess.Popen


def _read_json_line(popen: subprocess.Popen, timeout_s: float) -> dict:
    """The first JSON line a child prints (its bound port), within ``timeout_s``."""
    assert popen.stdout is not None
    deadline = time.monotonic() + timeout_s
    buf = b""
    fd = popen.stdout.fileno()
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
            for line in buf.splitlines():
                if line.strip().startswith(b"{"):
                    return json.loads(line)
        elif popen.poll() is not None:
            break
    err = popen.stderr.read().decode(errors="replace")[-2000:] if popen.stderr and popen.poll() is not None else ""
    raise RuntimeError(f"child did not report its port within {timeout_s} s (exit {popen.poll()}): {err}")


def _stop(popen: subprocess.Popen) -> None:
    if popen.poll() is None:
        try:
            os.killpg(popen.pid, signal.SIGTERM)
            popen.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            popen.wait(timeout=10)
    for stream in (popen.stdout, popen.stderr):
        if stream:
            stream.close()


def _spawn(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, env=env)


def _wait_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready within {timeout_s} s")


def _inference(seed: int, threads: int, name: str, *extra: str) -> Iterator[Proc]:
    popen = _spawn([sys.executable, "-m", "gpumigrate.workloads.inference", "--host", "127.0.0.1", "--port", "0",
                    "--seed", str(seed), "--size", "tiny", "--device", "cpu", "--threads", str(threads),
                    "--name", name, *extra])  # fmt: skip
    try:
        port = _read_json_line(popen, START_TIMEOUT_S)["port"]
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, START_TIMEOUT_S)
        yield Proc(url, popen)
    finally:
        _stop(popen)


@pytest.fixture(scope="session")
def source_server() -> Iterator[Proc]:
    """The source: seed 0, one thread."""
    yield from _inference(seed=0, threads=1, name="parity-src")


@pytest.fixture(scope="session")
def twin_server() -> Iterator[Proc]:
    """The same weights (seed 0) served with a different thread count; faults enabled (``drifted_twin``)."""
    yield from _inference(0, 2, "parity-twin", "--enable-faults")


@pytest.fixture(scope="session")
def other_seed_server() -> Iterator[Proc]:
    """Different weights: seed 1."""
    yield from _inference(seed=1, threads=1, name="parity-other")


@pytest.fixture(scope="session")
def damaging_proxy(twin_server: Proc) -> Iterator[Proc]:
    """A proxy in front of the twin that damages answers on request (see mutating_proxy.py)."""
    popen = _spawn([sys.executable, str(HERE / "mutating_proxy.py"), "--upstream", twin_server.url])
    try:
        port = _read_json_line(popen, 30)["port"]
        yield Proc(f"http://127.0.0.1:{port}", popen)
    finally:
        _stop(popen)


@pytest.fixture
def damaged_target(damaging_proxy: Proc) -> Iterator[Callable[[str, str], str]]:
    """``damaged_target(mode, match="")`` sets the proxy's damage and returns its URL; reset afterwards."""

    def set_mode(mode: str, match: str = "") -> str:
        resp = httpx.post(damaging_proxy.url + "/proxy/mode", json={"mode": mode, "match": match}, timeout=5,
                          trust_env=False)  # fmt: skip
        resp.raise_for_status()
        return damaging_proxy.url

    yield set_mode
    set_mode("none")


@pytest.fixture
def drifted_twin(twin_server: Proc) -> Iterator[str]:
    """The twin with the server's own drift fault on (perturbed logits), switched off afterwards."""
    httpx.post(twin_server.url + "/admin/fault", json={"kind": "drift"}, timeout=5, trust_env=False).raise_for_status()
    try:
        yield twin_server.url
    finally:
        httpx.post(twin_server.url + "/admin/fault", json={"kind": "none"}, timeout=5, trust_env=False)


@pytest.fixture
def golden_small() -> Path:
    return GOLDEN_SMALL

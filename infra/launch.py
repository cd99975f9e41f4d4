"""The one launcher: start a workload on a host from a :class:`~gpumigrate.launch.WorkloadLaunch`, wait until it lives.

A provider's ``bootstrap`` (local: spawn under the host's supervisor; cloud: the boot script started
at launch) renders the launch for its host with :func:`render_for` and waits with
:func:`wait_until_up`. The readiness rule, :func:`is_up`, is this module's alone (the cloud boot
agent on the machine and the orchestrator's boot wait call it too): the launch's health path answers
200 on the host's service port or, for a workload that is given no service port (a training job
serves no HTTP), its agent address accepts connections. A process that exits first fails at once,
with its last output lines. The flows, the demo, the tests and the benchmarks all start workloads this way.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from gpumigrate.errors import ProviderError
from gpumigrate.interfaces import Host
from gpumigrate.launch import RenderedLaunch, WorkloadLaunch

POLL_S = 0.1
TAIL_LINES = 20


def render_for(host: Host, launch: WorkloadLaunch) -> RenderedLaunch:
    """The launch with this host's address, ports and name filled in."""
    agent_port = host.ports.get("agent")
    if agent_port is None:
        raise ProviderError(f"host {host.name} reports no 'agent' port: cannot place the workload's agent")
    return launch.render(
        host=host.address,
        agent_port=agent_port,
        service_port=host.ports.get("service"),
        python=sys.executable,
        name=host.name,
    )


def serves_http(launch: WorkloadLaunch) -> bool:
    """A workload serves HTTP when its launch is told a service port (``{service_port}`` in argv or env)."""
    return any("{service_port}" in part for part in (*launch.argv, *launch.env.values()))


def netloc(address: str, port: int) -> str:
    """``address:port``, with an IPv6 address in brackets."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def service_url(host: Host) -> str:
    port = host.ports.get("service")
    if port is None:
        raise ProviderError(f"host {host.name} reports no 'service' port")
    return f"http://{netloc(host.address, port)}"


def answers(url: str, *, path: str = "/healthz", timeout_s: float = 2.0, tries: int = 1) -> bool:
    """Whether ``url + path`` answers 200 now, asked up to ``tries`` times (one slow answer on a loaded
    host is not a dead process)."""
    for _ in range(tries):
        try:
            with httpx.Client(timeout=timeout_s, trust_env=False) as client:
                if client.get(url.rstrip("/") + path).status_code == 200:
                    return True
        except httpx.HTTPError:
            pass
    return False


def accepts(host: str, port: int, *, timeout_s: float = 1.0) -> bool:
    """Whether ``host:port`` accepts a TCP connection now."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def is_up(host: Host, launch: WorkloadLaunch, *, with_agent: bool = False) -> bool:
    """The workload on ``host`` lives: its health path answers, or (no HTTP) its agent accepts connections.

    ``with_agent``: its agent port must accept connections as well (what the orchestrator needs of a
    cloud target, checked from where it stands)."""
    agent = host.ports.get("agent") or 0
    if serves_http(launch):
        if not answers(service_url(host), path=launch.health_path):
            return False
        return not with_agent or accepts(host.address, agent)
    return accepts(host.address, agent)


def wait_until_up(
    host: Host, launch: WorkloadLaunch, *, timeout_s: float, exited: Callable[[], str | None] | None = None
) -> None:
    """Poll :func:`is_up`; ``exited()`` returns why the process is gone (its exit and last lines), or None."""
    deadline = time.monotonic() + timeout_s
    while True:
        if is_up(host, launch):
            return
        why = exited() if exited is not None else None
        if why is not None:
            raise ProviderError(f"the workload on {host.name} exited before it answered: {why}")
        if time.monotonic() > deadline:
            what = f"{launch.health_path} on its service port" if serves_http(launch) else "its agent address"
            raise ProviderError(f"the workload on {host.name} did not answer {what} within {timeout_s:.0f}s")
        time.sleep(POLL_S)


def wait_http(url: str, *, timeout_s: float, path: str = "/healthz") -> None:
    """Poll ``url + path`` until it answers 200 (a restored workload's ready path, say)."""
    deadline = time.monotonic() + timeout_s
    while not answers(url, path=path):
        if time.monotonic() > deadline:
            raise ProviderError(f"{url}{path} did not answer within {timeout_s:.0f}s")
        time.sleep(POLL_S)


def last_lines(log: str | Path, n: int = TAIL_LINES) -> str:
    """The last ``n`` lines of a log file ('' when it cannot be read)."""
    try:
        lines = Path(log).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])

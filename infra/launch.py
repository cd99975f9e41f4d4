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

from gpumigrate.errors import InvalidInputError, ProviderError
from gpumigrate.interfaces import Host
from gpumigrate.launch import RenderedLaunch, WorkloadLaunch

POLL_S = 0.1
# A health path refused this long by a workload whose agent is up breaks the launch contract (wait_until_up).
REFUSING_HEALTH_S = 10.0
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


def status_of(url: str, *, path: str = "/healthz", timeout_s: float = 2.0) -> int | None:
    """The HTTP status ``GET url + path`` answers now, or None when nothing answers."""
    try:  # plain http needs no CA bundle, whose loading alone takes a second on a busy host
        with httpx.Client(timeout=timeout_s, trust_env=False, verify=url.startswith("https:")) as client:
            return client.get(url.rstrip("/") + path).status_code
    except httpx.HTTPError:
        return None


def answers(url: str, *, path: str = "/healthz", timeout_s: float = 2.0, tries: int = 1) -> bool:
    """Whether ``url + path`` answers 200 now, asked up to ``tries`` times (one slow answer on a loaded
    host is not a dead process)."""
    return any(status_of(url, path=path, timeout_s=timeout_s) == 200 for _ in range(tries))


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
    """Poll :func:`is_up`; ``exited()`` returns why the process is gone (its exit and last lines), or None.

    A workload whose agent is up while its health path answers anything but 200 for
    :data:`REFUSING_HEALTH_S` breaks the launch contract (the health path answers 200 while the process
    lives, unready targets included): that fails at once, naming the rule, instead of after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    refusing_since: float | None = None
    while True:
        if is_up(host, launch):
            return
        why = exited() if exited is not None else None
        if why is not None:
            raise ProviderError(f"the workload on {host.name} exited before it answered: {why}")
        code = status_of(service_url(host), path=launch.health_path) if serves_http(launch) else None
        if code is None or code == 200 or not accepts(host.address, host.ports.get("agent") or 0):
            refusing_since = None
        elif refusing_since is None:
            refusing_since = time.monotonic()
        elif time.monotonic() - refusing_since > REFUSING_HEALTH_S:
            raise health_contract_error(host.name, launch.health_path, code, REFUSING_HEALTH_S)
        if time.monotonic() > deadline:
            what = f"{launch.health_path} on its service port" if serves_http(launch) else "its agent address"
            raise ProviderError(f"the workload on {host.name} did not answer {what} within {timeout_s:.0f}s")
        time.sleep(POLL_S)


def health_contract_error(where: str, path: str, code: int, seconds: float) -> InvalidInputError:
    """The launch contract's rule for the health path, broken by the workload ``where`` (exit 2 before a
    migration moved anything; the provision phase's own failure after it started a target)."""
    return InvalidInputError(
        f"the workload on {where} answers GET {path} (workload.health_path) with HTTP {code} for {seconds:.0f}s "
        "while its agent is up and it awaits its restore",
        hint="the health path must answer 200 while the process lives, also before the restore (gpumigrate waits "
        "on it to start the target, then restores the state, then waits on workload.ready_path): point "
        "workload.health_path at such a path (gpumigrate.agent.ReadinessMiddleware serves /healthz) and keep the "
        "path that answers 503 until the restore as workload.ready_path",
    )


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

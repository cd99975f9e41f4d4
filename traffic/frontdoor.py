"""The front door: Envoy plus our xDS control plane in front of a workload, and what a migration does to it.

:class:`FrontDoor` starts (and stops) the pair for a source, and writes ``frontdoor.json`` beside the
control plane's state so that a migration finds it (format below). :func:`add_target` puts the
target beside the source at weight 0 before a ramp; :func:`traffic_to_source` sends everything back
to the source in one state update (the first undo step of a rollback).

A front door a user starts (``gpumigrate frontdoor up``) is detached, a process of its own:
:mod:`gpumigrate.traffic.detached` starts, finds and stops it.

``<state dir>/frontdoor.json`` (format 1, mode 0600): ``{"admin_urls": [Envoy admin URLs: ``unix:PATH``, a
socket only this user reaches], "listener": "http://host:port", "probe_listener": "http://127.0.0.1:port",
"nodes": [Envoy node ids], "xds_port": int or null (null: the control plane's private socket only),
"xds_socket": path, "source": "http://host:port", "processes": {"frontdoor": pid, "envoy": pid, "control-plane":
pid}, "restarts": {"envoy": n, "control-plane": n}, "access_logs": [paths]}`` (``probe_listener``: parity probes
only, each request naming its side; ``processes``: the detached door's supervisor and its two children, each
recognised by its command line naming this state directory, so a reused pid is never signalled; ``restarts``: how
often the supervisor started each child again). ``GPUMIGRATE_ENVOY_ADMIN`` (comma-separated) overrides ``admin_urls``;
``GPUMIGRATE_TRAFFIC_DIR`` overrides the directory (default ``<state root>/traffic/<workload>``).
The process's own log is ``<state dir>/frontdoor.log``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gpumigrate.atomic import atomic_write_json
from gpumigrate.errors import InvalidInputError, TrafficError
from gpumigrate.settings import state_root
from gpumigrate.traffic import access_control
from gpumigrate.traffic.state import DesiredState, StateStore, Upstream, rollback_to_source

log = logging.getLogger("gpumigrate.traffic.frontdoor")

if TYPE_CHECKING:  # Envoy's and the control plane's modules pull in gRPC: imported when a door starts
    from gpumigrate.traffic.envoy import Envoy


class ControlPlaneHandle(Protocol):
    """What a door needs of its control plane, which runs in this process (``xds.ControlPlane``) or as the
    supervisor's child (``supervisor.PlaneProcess``): where it listens, and how to stop it."""

    port: int | None
    socket_path: Path

    def stop(self) -> None: ...


FRONTDOOR = "frontdoor.json"
LOG = "frontdoor.log"
SOURCE, TARGET = "source", "target"  # the upstream names a migration uses
ANY_WORKLOAD = "default"  # the door `frontdoor up` starts without --workload: any plan whose endpoint it fronts
DEFAULT_LISTEN = "127.0.0.1:10000"
# The detached door health-checks the source's readiness path (workload.ready_path). The SDK's answers 200
# while a migration freezes the source (it holds requests and serves them on resume: agent/asgi.py); were it
# 503 then, Envoy (the source its one upstream, no panic routing) would refuse the clients the safe point holds.
DEFAULT_HEALTH_PATH = "/readyz"


def default_dir(workload: str) -> Path:
    return Path(os.environ.get("GPUMIGRATE_TRAFFIC_DIR") or state_root() / "traffic" / workload)


def find_dir(workload: str, source_url: str | None) -> Path:
    """The workload's front door directory; when it holds no door, the one started without ``--workload``
    if that one fronts ``source_url`` (host and port alike)."""
    own = default_dir(workload)
    if (own / FRONTDOOR).exists() or not source_url:
        return own
    shared = default_dir(ANY_WORKLOAD)
    with contextlib.suppress(OSError, ValueError):
        if same_hostport(json.loads((shared / FRONTDOOR).read_text()).get("source"), source_url):
            return shared
    return own


def _hostport(url: object) -> tuple[str, int] | None:
    from urllib.parse import urlsplit

    if not isinstance(url, str):
        return None
    parts = urlsplit(url)
    return (parts.hostname or "", parts.port or 80) if parts.hostname else None


def same_hostport(a: object, b: object) -> bool:
    return _hostport(a) is not None and _hostport(a) == _hostport(b)


def up_command(source_url: str, health_path: str = DEFAULT_HEALTH_PATH) -> str:
    """The command that starts the front door a migration needs, or sets a running one's health path (preflight
    says it). Without ``--workload``: any plan whose endpoint the door fronts finds it (:func:`find_dir`)."""
    extra = f" --health-path {health_path}" if health_path != DEFAULT_HEALTH_PATH else ""
    return f"gpumigrate frontdoor up --source {source_url}{extra}"


def health_path(state_dir: Path) -> str | None:
    """The path Envoy health-checks the source on (the control plane's desired state), or None without one."""
    store = StateStore(state_dir)
    if not store.exists():
        return None
    source = store.read().upstreams.get(SOURCE)
    return source.health_path if source is not None else None


def set_health_path(state_dir: Path, path: str, *, timeout_s: float = 30.0) -> str | None:
    """Envoy health-checks the source on ``path`` from now on: a cluster update over xDS (connections and weights
    stay), waited for until every Envoy runs it. Returns the path checked before, or None if it already was ``path``."""
    store = StateStore(state_dir)
    before = health_path(state_dir)
    if before is None or before == path:
        return None

    def change(s: DesiredState) -> None:
        s.upstreams[SOURCE] = replace(s.upstreams[SOURCE], health_path=path)

    state = store.update(change)
    nodes = read(state_dir).nodes
    if nodes:
        store.wait_applied(state.version, nodes, timeout_s=timeout_s)
    return before


@dataclass(frozen=True)
class DoorInfo:
    """What a ramp needs to know about the front door (``frontdoor.json``)."""

    admin_urls: list[str]
    listener: str | None = None  # where clients go
    probe_listener: str | None = None  # loopback only: parity probes, each request naming its side
    nodes: list[str] = field(default_factory=list)
    xds_port: int | None = None
    source: str | None = None  # the source it fronts (http://host:port)
    processes: dict[str, int] = field(default_factory=dict)  # a detached door's: frontdoor, envoy, control-plane
    restarts: dict[str, int] = field(default_factory=dict)  # a detached door's: how often each child was restarted
    access_logs: list[str] = field(default_factory=list)  # each Envoy's client requests (traffic/access_log.py)


def read(state_dir: Path) -> DoorInfo:
    """The front door of ``state_dir``; ``GPUMIGRATE_ENVOY_ADMIN`` overrides its admin URLs."""
    info: dict[str, object] = {}
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        info = json.loads((state_dir / FRONTDOOR).read_text())
    admin_env = os.environ.get("GPUMIGRATE_ENVOY_ADMIN")
    admin = [u.strip() for u in admin_env.split(",") if u.strip()] if admin_env else info.get("admin_urls")
    if not isinstance(admin, list) or not admin:
        raise TrafficError(
            f"no front door in {state_dir}: start one with `gpumigrate frontdoor up --source URL` "
            f"(or set GPUMIGRATE_ENVOY_ADMIN and GPUMIGRATE_TRAFFIC_DIR to an Envoy of your own)"
        )
    nodes, procs, logs = info.get("nodes"), info.get("processes"), info.get("access_logs")
    restarts = info.get("restarts")
    listener, xds_port, probe = info.get("listener"), info.get("xds_port"), info.get("probe_listener")
    return DoorInfo(
        admin_urls=[str(u) for u in admin],
        listener=str(listener) if listener else None,
        probe_listener=str(probe) if probe else None,
        nodes=[str(n) for n in nodes] if isinstance(nodes, list) else [],
        xds_port=int(xds_port) if isinstance(xds_port, int) else None,
        source=str(info["source"]) if info.get("source") else None,
        processes={str(k): v for k, v in procs.items() if isinstance(v, int)} if isinstance(procs, dict) else {},
        access_logs=[str(p) for p in logs] if isinstance(logs, list) and not admin_env else [],
        restarts={str(k): v for k, v in restarts.items() if isinstance(v, int)} if isinstance(restarts, dict) else {},
    )


def check(state_dir: Path) -> DoorInfo:
    """The front door of ``state_dir``, answering: its ``frontdoor.json`` and every Envoy's admin LIVE."""
    from gpumigrate.traffic.envoy import EnvoyAdmin

    door = read(state_dir)
    for url in door.admin_urls:
        admin = EnvoyAdmin(url, timeout_s=2.0)
        try:
            if not admin.live():
                raise TrafficError(f"the front door in {state_dir} is not answering (Envoy admin {url} is not LIVE)")
        finally:
            admin.close()
    return door


@dataclass
class FrontDoor:
    state_dir: Path
    plane: ControlPlaneHandle  # in this process, or the supervisor's child
    envoy: Envoy
    detached: bool = False

    @property
    def url(self) -> str:
        return self.envoy.url

    @property
    def admin_url(self) -> str:
        return self.envoy.admin_url

    @classmethod
    def start(
        cls,
        state_dir: Path,
        *,
        source_host: str,
        source_port: int,
        node_id: str = "gpumigrate-envoy",
        workdir: Path | None = None,
        health_path: str = "/readyz",
        listen_host: str = "127.0.0.1",
        listen_port: int | None = None,
        detached: bool = False,
    ) -> FrontDoor:
        """Control plane (in this process) and Envoy for a source. ``detached``: this process is the
        door's own (:func:`serve`), and ``frontdoor.json`` names it and its Envoy for ``frontdoor down``."""
        from gpumigrate.traffic.envoy import Envoy
        from gpumigrate.traffic.xds import ControlPlane

        access_control.private_dir(state_dir)
        source = Upstream(SOURCE, source_host, source_port, health_path=health_path)
        StateStore(state_dir).init(DesiredState(upstreams={SOURCE: source}, weights={SOURCE: 100.0}))
        plane = ControlPlane(state_dir).start()  # on its private socket only (access_control.py)
        try:
            envoy = Envoy(
                workdir or state_dir / "envoy",
                state_dir=state_dir,
                node_id=node_id,
                listen_host=listen_host,
                listen_port=listen_port,
            ).start()
        except BaseException:
            plane.stop()
            raise
        door = cls(state_dir, plane, envoy, detached=detached)
        door.write_info()
        return door

    def write_info(
        self, *, processes: dict[str, int | None] | None = None, restarts: dict[str, int] | None = None
    ) -> None:
        """``frontdoor.json`` (again after a child was restarted: its pid changed). ``processes``: a detached door's
        other children beside its own process and its Envoy; ``restarts``: how often each was started again."""
        source = StateStore(self.state_dir).read().upstreams[SOURCE]
        host = f"[{source.host}]" if ":" in source.host else source.host
        info: dict[str, Any] = {
            "admin_urls": [self.envoy.admin_url],
            "listener": self.envoy.url,
            "probe_listener": self.envoy.probe_url,
            "nodes": [self.envoy.node_id],
            "xds_port": self.plane.port,
            "xds_socket": str(self.plane.socket_path),
            "source": f"http://{host}:{source.port}",
            "access_logs": [str(self.envoy.access_log_path)],
        }
        if self.detached and self.envoy.proc is not None:
            others = {name: pid for name, pid in (processes or {}).items() if pid}
            info["processes"] = {"frontdoor": os.getpid(), "envoy": self.envoy.proc.pid, **others}
        if restarts is not None:
            info["restarts"] = restarts
        atomic_write_json(self.state_dir / FRONTDOOR, info, mode=access_control.PRIVATE_FILE)

    def rotate_access_log(self) -> None:
        """Keep the access log bounded (traffic/access_log.py): rotated once it is large, and Envoy reopens it."""
        from gpumigrate.traffic import access_log

        try:
            if access_log.rotate(self.envoy.access_log_path):
                admin = self.envoy.admin
                try:
                    admin.reopen_logs()
                finally:
                    admin.close()
        except Exception as exc:  # a log that cannot rotate never stops the door; the next tick tries again
            log.warning("the access log could not be rotated: %s", exc)

    def stop(self) -> None:
        for part in (self.envoy, self.plane):
            with contextlib.suppress(Exception):
                part.stop()
        (self.state_dir / FRONTDOOR).unlink(missing_ok=True)


def add_target(state_dir: Path, host: str, port: int, *, nodes: list[str], timeout_s: float = 30) -> DesiredState:
    """The target beside the source at weight 0 (a new ramp: an earlier rollback mark no longer applies);
    waits until every Envoy node applied it."""

    def change(s: DesiredState) -> None:
        s.upstreams[TARGET] = Upstream(TARGET, host, port)
        s.primary = SOURCE
        s.weights = {name: (100.0 if name == SOURCE else 0.0) for name in s.upstreams}
        s.rolled_back = None

    state = StateStore(state_dir).update(change)
    if nodes:
        StateStore(state_dir).wait_applied(state.version, nodes, timeout_s=timeout_s)
    return state


def traffic_to_source(state_dir: Path, reason: str) -> dict[str, float] | None:
    """100% source in one update, if a front door exists there and ever sent traffic elsewhere.

    Returns the new weights, or None when there was nothing to do (no front door, never ramped, or
    the ramp controller already rolled back by itself).
    """
    store = StateStore(state_dir)
    if not store.exists():
        return None
    before = store.read()
    if all(w == 0 for name, w in before.weights.items() if name != before.primary):
        return None
    return dict(rollback_to_source(state_dir, reason).weights)


# ----------------------------------------------------------------------------- the detached front door
def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) where Envoy's client listener binds; port 0 picks a free one."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidInputError(f"--listen must be HOST:PORT such as {DEFAULT_LISTEN}, got {text!r}")
    return host, int(port)


def source_healthy(state_dir: Path) -> bool:
    """Whether every Envoy of the door has passed a health check of the source (it routes clients to it)."""
    from gpumigrate.traffic.envoy import EnvoyAdmin

    for url in read(state_dir).admin_urls:
        admin = EnvoyAdmin(url, timeout_s=2.0)
        try:
            statuses = admin.clusters().get("cluster_statuses", [])
        except (TrafficError, OSError, ValueError):
            return False
        finally:
            admin.close()
        hosts = [h for c in statuses if c.get("name") == SOURCE for h in c.get("host_statuses", [])]
        if not hosts or any(h.get("health_status", {}).get("failed_active_health_check") for h in hosts):
            return False
    return True


def wait_source_healthy(state_dir: Path, timeout_s: float, *, hopeless: Callable[[], bool] = lambda: False) -> bool:
    """Wait until :func:`source_healthy` (False after ``timeout_s``, or as soon as ``hopeless()`` says no wait can
    mend it): until then Envoy answers clients 503."""
    deadline = time.monotonic() + timeout_s
    while not source_healthy(state_dir):
        if time.monotonic() > deadline or hopeless():
            return False
        time.sleep(0.1)
    return True

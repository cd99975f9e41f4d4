"""The front door: Envoy plus our xDS control plane in front of a workload, and what a migration does to it.

:class:`FrontDoor` starts (and stops) the pair for a source, and writes ``frontdoor.json`` beside the
control plane's state so that a migration finds it (format below). :func:`add_target` puts the
target beside the source at weight 0 before a ramp; :func:`traffic_to_source` sends everything back
to the source in one state update (the first undo step of a rollback).

``<state dir>/frontdoor.json`` (format 1): ``{"admin_urls": [Envoy admin URLs], "listener":
"http://host:port", "probe_listener": "http://127.0.0.1:port", "nodes": [Envoy node ids], "xds_port": int}``
(``probe_listener``: parity probes only, each request naming its side). ``GPUMIGRATE_ENVOY_ADMIN``
(comma-separated) overrides ``admin_urls``; ``GPUMIGRATE_TRAFFIC_DIR`` overrides the directory
(default ``<state root>/traffic/<workload>``).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gpumigrate.atomic import atomic_write_json
from gpumigrate.errors import TrafficError
from gpumigrate.settings import state_root
from gpumigrate.traffic.state import DesiredState, StateStore, Upstream, rollback_to_source

if TYPE_CHECKING:  # Envoy's and the control plane's modules pull in gRPC: imported when a door starts
    from gpumigrate.traffic.envoy import Envoy
    from gpumigrate.traffic.xds import ControlPlane

FRONTDOOR = "frontdoor.json"
SOURCE, TARGET = "source", "target"  # the upstream names a migration uses


def default_dir(workload: str) -> Path:
    return Path(os.environ.get("GPUMIGRATE_TRAFFIC_DIR") or state_root() / "traffic" / workload)


@dataclass(frozen=True)
class DoorInfo:
    """What a ramp needs to know about the front door (``frontdoor.json``)."""

    admin_urls: list[str]
    listener: str | None = None  # where clients go
    probe_listener: str | None = None  # loopback only: parity probes, each request naming its side
    nodes: list[str] = field(default_factory=list)
    xds_port: int | None = None


def read(state_dir: Path) -> DoorInfo:
    """The front door of ``state_dir``; ``GPUMIGRATE_ENVOY_ADMIN`` overrides its admin URLs."""
    info: dict[str, object] = {}
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        info = json.loads((state_dir / FRONTDOOR).read_text())
    admin_env = os.environ.get("GPUMIGRATE_ENVOY_ADMIN")
    admin = [u.strip() for u in admin_env.split(",") if u.strip()] if admin_env else info.get("admin_urls")
    if not isinstance(admin, list) or not admin:
        raise TrafficError(
            f"no front door for this workload in {state_dir}: start Envoy and the control plane there "
            f"(`gpumigrate demo` shows how) or set GPUMIGRATE_ENVOY_ADMIN and GPUMIGRATE_TRAFFIC_DIR"
        )
    nodes = info.get("nodes")
    listener, xds_port, probe = info.get("listener"), info.get("xds_port"), info.get("probe_listener")
    return DoorInfo(
        admin_urls=[str(u) for u in admin],
        listener=str(listener) if listener else None,
        probe_listener=str(probe) if probe else None,
        nodes=[str(n) for n in nodes] if isinstance(nodes, list) else [],
        xds_port=int(xds_port) if isinstance(xds_port, int) else None,
    )


@dataclass
class FrontDoor:
    state_dir: Path
    plane: ControlPlane
    envoy: Envoy

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
    ) -> FrontDoor:
        from gpumigrate.traffic.envoy import Envoy
        from gpumigrate.traffic.xds import ControlPlane

        state_dir.mkdir(parents=True, exist_ok=True)
        StateStore(state_dir).init(
            DesiredState(upstreams={SOURCE: Upstream(SOURCE, source_host, source_port)}, weights={SOURCE: 100.0})
        )
        plane = ControlPlane(state_dir).start()
        try:
            envoy = Envoy(workdir or state_dir / "envoy", xds_port=plane.port, node_id=node_id).start()
        except BaseException:
            plane.stop()
            raise
        atomic_write_json(
            state_dir / FRONTDOOR,
            {
                "admin_urls": [envoy.admin_url],
                "listener": envoy.url,
                "probe_listener": envoy.probe_url,
                "nodes": [node_id],
                "xds_port": plane.port,
            },
        )
        return cls(state_dir, plane, envoy)

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

"""The front door of a workload: our ADS control plane and one Envoy, with the source as its upstream.

The demo and the tests start one per workload; ``gpumigrate migrate`` finds it by convention in
``<state root>/traffic/<workload>/`` (the control plane's state directory), where ``frontdoor.json``
names Envoy's admin URL, listener and node id so the ramp can read Envoy's stats. A front door
started elsewhere (``gpumigrate traffic serve`` + your own Envoy) works the same once that file
exists, or with ``GPUMIGRATE_TRAFFIC_DIR`` / ``GPUMIGRATE_ENVOY_ADMIN`` set.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumigrate.atomic import atomic_write_json
from gpumigrate.errors import TrafficError
from gpumigrate.settings import state_root

FRONTDOOR = "frontdoor.json"


def default_dir(workload: str) -> Path:
    return Path(os.environ.get("GPUMIGRATE_TRAFFIC_DIR") or state_root() / "traffic" / workload)


def read(state_dir: Path) -> dict[str, Any]:
    """What the ramp needs to know about the front door; env vars override the file."""
    info: dict[str, Any] = {}
    try:
        info = json.loads((state_dir / FRONTDOOR).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        pass
    if os.environ.get("GPUMIGRATE_ENVOY_ADMIN"):
        info["admin_urls"] = [u.strip() for u in os.environ["GPUMIGRATE_ENVOY_ADMIN"].split(",") if u.strip()]
    if not info.get("admin_urls"):
        raise TrafficError(
            f"no front door for this workload in {state_dir}: start Envoy and the control plane there "
            f"(`gpumigrate demo` shows how) or set GPUMIGRATE_ENVOY_ADMIN and GPUMIGRATE_TRAFFIC_DIR"
        )
    return info


@dataclass
class FrontDoor:
    state_dir: Path
    plane: Any
    envoy: Any

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
        from gpumigrate.traffic.state import DesiredState, StateStore, Upstream
        from gpumigrate.traffic.xds import ControlPlane

        state_dir.mkdir(parents=True, exist_ok=True)
        StateStore(state_dir).init(
            DesiredState(upstreams={"source": Upstream("source", source_host, source_port)}, weights={"source": 100.0})
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
            try:
                part.stop()
            except Exception:
                pass
        (self.state_dir / FRONTDOOR).unlink(missing_ok=True)

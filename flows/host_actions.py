"""Host-level snapshot actions (CUDA driver checkpoint, CRIU) run on the host that holds the process.

The agent backend needs none of this: the orchestrator drives agents over their control addresses.
A driver checkpoint or a CRIU dump acts on a process by pid, so it must run on that process's host.
Across hosts that is Prefect's own distribution: one work-pool queue per host (``host-<name>``), one
worker per host, and a ``host-action/<name>`` deployment of :func:`host_action_flow` on that queue
(flows/MULTIHOST.md); :func:`dispatch` starts it with ``run_deployment`` and waits. Without host
workers (the embedded default) the action runs in this process, and so only for a host that is this
machine: its own name, or a local host up here whose process it is. Anything else is refused.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any

from prefect import flow
from prefect.client.schemas.objects import FlowRun

from gpumigrate.errors import NotFoundError, PolicyDeniedError, SnapshotError
from gpumigrate.flows import prefect_env
from gpumigrate.interfaces import ImageRef
from gpumigrate.snapshot import process
from gpumigrate.snapshot.backends import ImageFiles, host_side, run_on_host


def deployment_name(host: str) -> str:
    return f"host-action/{host}"


def _transfer_files() -> ImageFiles:
    """The transfer engine as the host-level backends' packer (content-defined chunks, sealed with the key)."""
    from gpumigrate.transfer.format.keys import resolve_key
    from gpumigrate.transfer.pack import pack_paths, unpack

    def key(ref: Mapping[str, str]) -> bytes | None:
        return resolve_key(env=ref.get("env"), file=ref.get("file")) if ref else None

    def pack(paths: list[str], store: str, key_ref: Mapping[str, str]) -> ImageRef:
        return pack_paths(paths, store, key=key(key_ref))

    def unpack_into(store: str, image_id: str, into: str, key_ref: Mapping[str, str]) -> None:
        unpack(store, image_id, into, key=key(key_ref))

    return ImageFiles(pack=pack, unpack=unpack_into)


def run_action(action: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """Do one host action here, on this host's process (what a host's worker runs)."""
    return run_on_host(str(params.get("backend")), action, params, _transfer_files())


def this_machine() -> set[str]:
    name = socket.gethostname()
    return {name, name.split(".")[0], os.uname().nodename, "localhost"}


def check_here(host: str, params: Mapping[str, Any]) -> None:
    """The embedded default acts only where it runs: on this machine, or on a local host up here and then
    only on that host's own processes (its supervisor's marker, or the process its own restore started)."""
    if host in this_machine():
        return
    from gpumigrate.infra.local import LocalProvider

    local = LocalProvider()
    try:
        local.get(host)
    except NotFoundError:
        raise PolicyDeniedError(
            "host-action",
            f"host {host!r} is not this machine ({socket.gethostname()}) and no host workers are set up: "
            "refusing to act on its processes from here (set GPUMIGRATE_HOST_WORKERS=1 with a Prefect server "
            "and a worker on that host: flows/MULTIHOST.md)",
        ) from None
    pid, started = params.get("pid"), params.get("start")
    if pid is None or local.owns(host, int(pid)):
        return
    if started is not None and process.start_ticks(int(pid)) == started:
        return  # the process a restore on that host started (it carries its source host's marker)
    raise PolicyDeniedError("host-action", f"pid {pid} is not a process of local host {host}: refusing to act on it")


def dispatch(host: str, action: str, params: Mapping[str, Any], *, timeout_s: float = 3600) -> dict[str, Any]:
    """Run ``action`` on ``host``: through its worker when host workers are set up, else here if ``host`` is here."""
    host_side(str(params.get("backend")), action)  # a wrong action or backend fails here, before any host is asked
    if os.environ.get("GPUMIGRATE_HOST_WORKERS") and os.environ.get("PREFECT_API_URL"):
        from prefect.deployments import run_deployment

        run = run_deployment(
            name=deployment_name(host), parameters={"action": action, "params": dict(params)}, timeout=timeout_s
        )
        if not isinstance(run, FlowRun):  # called outside an event loop: the run itself, never a coroutine
            raise SnapshotError(f"host action {action} on {host}: Prefect returned no flow run")
        state = run.state
        if state is None or not state.is_completed():
            why = (state.message or "")[:300] if state else ""
            raise SnapshotError(
                f"host action {action} on {host} ended {state.name if state else 'unknown'}"
                f"{': ' + why if why else ''} (flow run {run.id})"
            )
        result: dict[str, Any] = state.result()
        return result
    check_here(host, params)
    return run_action(action, params)


@flow(name="host-action", flow_run_name="{action}", persist_result=True)
def host_action_flow(action: str, params: dict[str, Any]) -> dict[str, Any]:
    """One host-level snapshot action, run by the worker on the host that holds the process."""
    prefect_env.configure()
    return run_action(action, params)

"""Host-level actions (CUDA driver checkpoint, CRIU) run where the process lives.

The agent path needs none of this: the orchestrator drives agents over their control addresses.
A driver checkpoint or a CRIU dump, though, must run on the host that holds the process. Across
hosts that is Prefect's own distribution: one work pool queue per host (``host-<name>``), one
worker per host, and a ``host-action/<name>`` deployment of :func:`host_action_flow` on that queue
(see flows/MULTIHOST.md). The migrate flow dispatches with ``run_deployment`` and waits. The
embedded default (no server, or ``GPUMIGRATE_HOST_WORKERS`` unset) runs the action in-process.
"""

from __future__ import annotations

from gpumigrate.flows import prefect_env

prefect_env.configure()

import os  # noqa: E402
from typing import Any  # noqa: E402

from prefect import flow  # noqa: E402

from gpumigrate.errors import InvalidInputError, SnapshotError  # noqa: E402

ACTIONS = ("checkpoint", "restore", "resume", "check")


def run_action(action: str, params: dict[str, Any]) -> dict[str, Any]:
    """Do one host-level action here, through the snapshot backends (and the transfer engine for CRIU).

    cuda-driver (same host): ``checkpoint`` suspends ``pid`` (its GPU memory moves to host RAM, the GPU
    is free), ``restore`` resumes it, optionally onto other GPUs (``gpu_pairs``). criu (across hosts):
    ``checkpoint`` dumps ``pid`` into ``images_dir`` and packs it into ``store``; ``restore`` unpacks
    ``image_id`` and restores the tree, returning the new pid. ``check`` says whether the backend works.
    """
    if action not in ACTIONS:
        raise InvalidInputError(f"host action {action!r} is not one of {', '.join(ACTIONS)}")
    backend = params.get("backend")
    if backend == "cuda-driver":
        return _cuda_driver(action, params)
    if backend == "criu":
        return _criu(action, params)
    raise InvalidInputError(f"host actions are for the cuda-driver and criu backends, not {backend!r}")


def _cuda_driver(action: str, params: dict[str, Any]) -> dict[str, Any]:
    from gpumigrate.snapshot import cuda_driver

    if action == "check":
        return {"driver_version": list(cuda_driver.driver_version()), "gpus": cuda_driver.gpu_uuids()}
    proc = cuda_driver.CudaProcess(int(params["pid"]))
    if action == "checkpoint":
        proc.suspend(int(params.get("timeout_ms", 10_000)))
    else:  # restore / resume
        proc.resume(params.get("gpu_pairs"))
    return {"pid": int(params["pid"]), "state": proc.state()}


def _criu(action: str, params: dict[str, Any]) -> dict[str, Any]:
    from gpumigrate import transfer
    from gpumigrate.snapshot import criu

    if action == "check":
        info = criu.detect()
        criu.check_kernel(info.binary)
        return {"binary": info.binary, "plugin": info.plugin}
    key_ref = params.get("key_ref") or {}
    key = transfer.resolve_key(env=key_ref.get("env"), file=key_ref.get("file")) if key_ref else None
    if action == "checkpoint":
        ref = criu.dump_and_pack(
            int(params["pid"]), params["images_dir"], lambda paths: transfer.pack_paths(paths, params["store"], key=key)
        )
        return {"image_id": ref.id, "bytes_image": ref.bytes_image, "bytes_sent": ref.bytes_sent}
    if action == "restore":
        transfer.unpack(params["store"], params["image_id"], params["images_dir"], key=key)
        return {"pid": criu.restore(params["images_dir"])}
    raise InvalidInputError("criu has no separate resume: a dump without --leave-running stops the source")


def deployment_name(host: str) -> str:
    return f"host-action/{host}"


def dispatch(host: str, action: str, params: dict[str, Any], *, timeout_s: float = 3600) -> dict[str, Any]:
    """Run ``action`` on ``host``: through its worker when host workers are set up, else in-process."""
    if os.environ.get("GPUMIGRATE_HOST_WORKERS") and os.environ.get("PREFECT_API_URL"):
        from prefect.deployments import run_deployment

        run = run_deployment(
            name=deployment_name(host), parameters={"action": action, "params": params}, timeout=timeout_s
        )
        state = run.state
        if state is None or not state.is_completed():
            why = (state.message or "")[:300] if state else ""
            raise SnapshotError(
                f"host action {action} on {host} ended {state.name if state else 'unknown'}"
                f"{': ' + why if why else ''} (flow run {run.id})"
            )
        return state.result()
    return run_action(action, params)


@flow(name="host-action", flow_run_name="{action}", persist_result=True)
def host_action_flow(action: str, params: dict[str, Any]) -> dict[str, Any]:
    """One host-level snapshot action, run by the worker on the host that holds the process."""
    return run_action(action, params)

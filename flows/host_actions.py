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
    """Do one host-level action here, through the snapshot backends."""
    if action not in ACTIONS:
        raise InvalidInputError(f"host action {action!r} is not one of {', '.join(ACTIONS)}")
    backend = params.get("backend", "cuda-driver")
    if backend == "cuda-driver":
        from gpumigrate.snapshot import cuda_driver as mod
    elif backend == "criu":
        from gpumigrate.snapshot import criu as mod
    else:
        raise InvalidInputError(f"host actions are for the cuda-driver and criu backends, not {backend!r}")
    fn = getattr(mod, f"{action}_action", None) or getattr(mod, action, None)
    if fn is None:
        raise SnapshotError(f"the {backend} backend offers no {action!r} action on this version")
    out = fn(**{k: v for k, v in params.items() if k not in ("backend", "migration_id")})
    return out if isinstance(out, dict) else {"result": str(out)}


def deployment_name(host: str) -> str:
    return f"host-action/{host}"


def dispatch(host: str, action: str, params: dict[str, Any], *, timeout_s: float = 3600) -> dict[str, Any]:
    """Run ``action`` on ``host``: through its worker when host workers are set up, else in-process."""
    if os.environ.get("GPUMIGRATE_HOST_WORKERS") and os.environ.get("PREFECT_API_URL"):
        from prefect.deployments import run_deployment

        run = run_deployment(name=deployment_name(host), parameters={"action": action, "params": params},
                             timeout=timeout_s)
        state = run.state
        if state is None or not state.is_completed():
            raise SnapshotError(f"host action {action} on {host} ended {state.name if state else 'unknown'}: "
                                f"see flow run {run.id}")
        return state.result()
    return run_action(action, params)


@flow(name="host-action", flow_run_name="{action}", persist_result=True)
def host_action_flow(action: str, params: dict[str, Any]) -> dict[str, Any]:
    """One host-level snapshot action, run by the worker on the host that holds the process."""
    return run_action(action, params)

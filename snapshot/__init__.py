"""GPU state capture and restore: the in-process engine, the agent's wire, the CUDA driver checkpoint and CRIU.

Entry points, by side: :class:`SnapshotEngine` (``engine/``: in the workload's process), ``serve``
(``server.py``: the workload's side of the control address), :class:`AgentClient` and :class:`World`
(``client.py``, ``world.py``: the orchestrator's side, see PROTOCOL.md), :func:`converge` (the one rule
for when pre-copy stops), ``cuda_driver`` and ``criu`` (the host-level mechanics), and ``backends``:
each way of capturing and restoring behind the ``SnapshotBackend`` Protocol, chosen by one factory.
Names load on first use, so the CLI and the client never import torch.
"""

from __future__ import annotations

from gpumigrate.lazy import lazy_exports

_EXPORTS = {
    "SnapshotEngine": "engine",
    "AgentClient": "client",
    "World": "world",
    "converge": "precopy",
    "Convergence": "precopy",
    "ImageMismatchError": "errors",
    "EnvironmentMismatchError": "errors",
    "serve": "server",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)

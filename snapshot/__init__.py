"""GPU state capture and restore: the in-process agent, the CUDA driver checkpoint and CRIU backends.

Entry points: :class:`Agent` (embed in a workload), :class:`AgentClient` (drive an agent over its
control address, see PROTOCOL.md, replies decoded into typed results), :func:`converge` (the one rule
for when pre-copy stops), ``cuda_driver`` and ``criu`` (the host-level mechanics), and ``backends``:
each way of capturing and restoring behind the ``SnapshotBackend`` Protocol, chosen by one factory.
Names load on first use, so the CLI and the client never import torch.
"""

from __future__ import annotations

from gpumigrate.lazy import lazy_exports

_EXPORTS = {
    "Agent": "agent",
    "AgentClient": "client",
    "converge": "precopy",
    "Convergence": "precopy",
    "ImageMismatchError": "errors",
    "EnvironmentMismatchError": "errors",
    "serve": "server",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)

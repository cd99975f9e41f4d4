"""GPU state capture and restore: the in-process agent, the CUDA driver checkpoint and CRIU backends.

Entry points: :class:`Agent` (embed in a workload), :class:`AgentClient` (drive an agent over its
control address, see PROTOCOL.md), :func:`converge` (pre-copy until dirty bytes fit the downtime),
``cuda_driver`` and ``criu`` backends. Names load on first use, so the CLI and the client never
import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value

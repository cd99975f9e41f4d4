"""The one factory of snapshot backends: ``plan.snapshot.backend`` → a :class:`~gpumigrate.interfaces.SnapshotBackend`.

One module per backend, like a router factory choosing a mesh router: ``embedded.py`` (``agent``) drives
the agents embedded in the workload's ranks over their control addresses (a world of ``Setup.ranks``
agents, one for a single process: ``world.py``); ``cuda_driver.py`` and ``criu.py`` act on an unmodified
process through host actions run on the host that holds it (``hostlevel.py``: what they share). The flow
builds a :class:`Setup` from the plan and its runtime facts, for every workload kind, and never branches
on a backend's name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any

from gpumigrate.errors import InvalidInputError
from gpumigrate.interfaces import HostActions, ImageRef, SnapshotBackend

HOST_ACTIONS = ("check", "checkpoint", "restore", "resume", "discard", "retire")

# name -> "module:Class", imported on first use (the agent client needs no torch, CRIU no CUDA)
BACKENDS: dict[str, str] = {
    "agent": "gpumigrate.snapshot.backends.embedded:EmbeddedAgentBackend",
    "cuda-driver": "gpumigrate.snapshot.backends.cuda_driver:CudaDriverBackend",
    "criu": "gpumigrate.snapshot.backends.criu:CriuBackend",
}


@dataclass(frozen=True)
class Setup:
    """What a backend may need from the migration; each backend reads its own part.

    Target fields are None until the target exists (provision). Nothing here is a secret: the key
    travels as a reference (``{"env": NAME}`` or ``{"file": PATH}``), resolved where it is used.
    """

    store: str  # where the source writes images (the plan's store)
    key_ref: Mapping[str, str] = field(default_factory=dict)  # the image key's reference; {} = unencrypted
    writer_options: Mapping[str, Any] = field(default_factory=dict)  # compression, parallelism (plan.transfer)
    policy: Mapping[str, str] = field(default_factory=dict)  # the environment policy a restore enforces
    source_host: str = ""  # the host that holds the source process
    source_agent: str | None = None  # host:port of the source's agent (rank 0's, for a world of ranks)
    ranks: int = 1  # the workload's ranks: rank r's agent listens at the agent address's port + r
    source_pid: int | None = None  # the source process (host-level backends)
    checked: Mapping[str, Any] = field(default_factory=dict)  # what this backend's check() found at preflight
    source_dir: str | None = None  # where a host-level backend keeps the source's dump (on the source host)
    parent: str | None = None  # the image last shipped: a resumed migration ships only what changed since
    target_host: str | None = None
    target_agent: str | None = None  # host:port of the target workload's agent (rank 0's)
    target_agent_id: str | None = None  # the id the flow gave the target's agent: no other is accepted there
    target_store: str | None = None  # where the target reads the image (default: the plan's store)
    fill_from_source: bool = False  # the target copies the source's tensors out of its memory (one host; agent)
    target_dir: str | None = None  # where a host-level backend unpacks the image (on the target host)
    target_pid: int | None = None  # the process a restore started there (CRIU)
    target_pid_start: int | None = None  # its start time (clock ticks): the same process, not a recycled pid
    host_actions: HostActions | None = None  # how host-level actions reach the host that holds the process
    # retire(): a training source parked at its safe point ends its process once its freeze lease runs out
    end_parked_source: bool = False


@dataclass(frozen=True)
class ImageFiles:
    """How a host-level backend turns a dump directory into an image and back: the transfer engine's
    content-defined packer, handed in by the flows (``snapshot/`` never moves bytes itself)."""

    pack: Callable[[list[str], str, Mapping[str, str]], ImageRef]  # (files, store, key_ref) -> image
    unpack: Callable[[str, str, str, Mapping[str, str]], None]  # (store, image_id, into_dir, key_ref)


def _load(name: str) -> tuple[Any, str]:
    target = BACKENDS.get(name)
    if target is None:
        raise InvalidInputError(f"unknown snapshot backend {name!r}: allowed are {', '.join(sorted(BACKENDS))}")
    module_name, _, class_name = target.partition(":")
    return import_module(module_name), class_name


def snapshot_backend(name: str, setup: Setup) -> SnapshotBackend:
    """The orchestrator's side of the backend called ``name``, built on ``setup``."""
    module, class_name = _load(name)
    backend: SnapshotBackend = getattr(module, class_name)(setup)
    return backend


OnHost = Callable[[str, Mapping[str, Any], ImageFiles], dict[str, Any]]


def host_side(name: str, action: str) -> OnHost:
    """The host's side of backend ``name`` for ``action``; a refusal naming what is allowed otherwise."""
    if action not in HOST_ACTIONS:
        raise InvalidInputError(f"host action {action!r} is not one of {', '.join(HOST_ACTIONS)}")
    module, _ = _load(name)
    on_host: OnHost | None = getattr(module, "on_host", None)
    if on_host is None:
        raise InvalidInputError(f"host actions are for the cuda-driver and criu backends, not {name!r}")
    return on_host


def run_on_host(name: str, action: str, params: Mapping[str, Any], files: ImageFiles) -> dict[str, Any]:
    """Do ``action`` of host-level backend ``name`` here, on a process of this host."""
    return host_side(name, action)(action, params, files)


__all__ = ["BACKENDS", "HOST_ACTIONS", "ImageFiles", "Setup", "host_side", "run_on_host", "snapshot_backend"]

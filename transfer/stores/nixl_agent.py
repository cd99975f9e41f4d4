"""A NIXL agent, started the way every user of NIXL here needs it: nixl:// senders (``nixl.py``), the receiver's
landing pool (``receiver/landing.py``) and the device landing and sender (``device/``).

NIXL is optional (extra ``nixl``, PyPI ``nixl-cu13``): :func:`load_nixl` raises a clear error when it is missing or
fails to load, and ``stream://`` works without it. Its Python package ships no types: :class:`NixlAgent` names the
part of its agent that gpumigrate uses.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
from collections.abc import Container, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Protocol

import numpy as np
import numpy.typing as npt

from gpumigrate.errors import EXIT_INVALID, TransferError


class XferHandle(Protocol):
    """A prepared NIXL transfer (a WRITE or a READ)."""

    def release(self) -> None: ...


class NixlAgent(Protocol):
    """What gpumigrate calls on a ``nixl_cu13.nixl_agent`` (descriptor lists and registrations stay opaque)."""

    @property
    def name(self) -> str: ...

    @property
    def backends(self) -> Container[str]: ...

    def get_plugin_list(self) -> list[str]: ...

    def get_agent_metadata(self) -> bytes: ...

    def register_memory(self, regions: Sequence[object], mem_type: str | None = None) -> object: ...

    def deregister_memory(self, registered: object) -> None: ...

    def add_remote_agent(self, metadata: bytes) -> bytes | str: ...

    def remove_remote_agent(self, name: str) -> None: ...

    def get_xfer_descs(self, descs: Sequence[tuple[int, int, int]], mem_type: str) -> object: ...

    def prep_xfer_dlist(self, agent: str, descs: Sequence[tuple[int, int, int]], mem_type: str) -> object: ...

    def initialize_xfer(self, op: str, local: object, remote: object, remote_agent: str | None) -> XferHandle: ...

    def make_prepped_xfer(
        self, op: str, local: object, local_indices: Sequence[int], remote: object, remote_indices: Sequence[int]
    ) -> XferHandle: ...

    def transfer(self, handle: XferHandle) -> str: ...

    def check_xfer_state(self, handle: XferHandle) -> str: ...


PACKAGE = "nixl-cu13"  # PyPI name; the import name is nixl_cu13


class NixlUnavailableError(TransferError):
    """NIXL is not installed or does not load here. Nothing moved (exit 2); stream:// does not need it."""

    exit_code = EXIT_INVALID


_MODULE: ModuleType | None = None


def load_nixl() -> ModuleType:
    """Import ``nixl_cu13`` once, quietly (its logger prints to stdout at INFO), or say what is missing."""
    global _MODULE
    if _MODULE is not None:
        return _MODULE
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # read by its C++ core and its Python logger
    try:
        import nixl_cu13
    except Exception as exc:  # ImportError, or an OSError from a bundled library that fails to load
        raise NixlUnavailableError(
            f"the nixl:// transport needs the Python package {PACKAGE} (import nixl_cu13), "
            f"which {'is not installed' if isinstance(exc, ModuleNotFoundError) else 'failed to load'} here: {exc}",
            hint=f"install gpumigrate with its 'nixl' extra ({PACKAGE}==1.5.1, after torch), or use stream://",
        ) from None
    quiet = logging.getLogger("nixl")  # stdout belongs to the CLI's JSON: send NIXL's own lines to stderr
    quiet.handlers.clear()
    quiet.propagate = True
    quiet.setLevel(logging.WARNING)
    _MODULE = nixl_cu13
    return nixl_cu13


# UCX transports that register no memory with the NIC or the driver (UCT's tcp copies through
# sockets): an agent restricted to these needs none of UCX's memory-event hooks (UCM), which exist
# to keep registration caches coherent when the process unmaps memory.
_UNREGISTERED_TRANSPORTS = frozenset({"tcp", "self"})


@contextlib.contextmanager
def _ucx_environment(transports: str | None, settings: Mapping[str, str] | None = None) -> Iterator[None]:
    """UCX reads its environment when a backend starts: set it for this agent only.

    ``UCX_TLS`` restricts the transports (``tcp``, ``rc,tcp``, …). With ``tcp`` alone, UCX's memory
    hooks are turned off too (``UCX_MEM_EVENTS=no``, unless the caller's environment sets it): UCX
    installs them by patching mmap, munmap, mremap, shmat, shmdt, brk, sbrk and madvise in place,
    and waits a grace period after each patch while every thread that calls one of them (a thread
    starting, a large allocation) spins on it: most of a short push's start-up (TRANSPORTS.md), for hooks a TCP
    transport never uses. UCX reads this once per process, when its first backend starts. ``settings``: more UCX
    variables this agent needs, each unless the caller's environment sets it.
    """
    wanted: dict[str, str] = {k: v for k, v in (settings or {}).items() if k not in os.environ}
    if transports:
        wanted["UCX_TLS"] = transports
        if {
            t.strip() for t in transports.split(",")
        } <= _UNREGISTERED_TRANSPORTS and "UCX_MEM_EVENTS" not in os.environ:
            wanted["UCX_MEM_EVENTS"] = "no"
    before = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# NIXL's progress thread waits in poll() on its workers' event fds with this timeout (rounded up to
# whole milliseconds). Its Python API sets it to 0, which turns the wait into a spin: a core per
# agent, idle or not.
PROGRESS_DELAY_US = 1000
_AGENT_LOCK = threading.Lock()


@contextlib.contextmanager
def _paced_progress_thread() -> Iterator[None]:
    """While an agent is made, NIXL's config class keeps a progress delay of at least PROGRESS_DELAY_US.

    The Python API builds its config and forces ``pthrDelay = 0`` inside ``nixl_agent.__init__``;
    a subclass of the config whose setter keeps the floor is swapped in for that call only.
    """
    from nixl_cu13 import _api

    base = _api.nixlBind.nixlAgentConfig

    class PacedConfig(base):  # type: ignore[misc, valid-type]
        pthrDelay = property(  # noqa: N815 - the binding's field name
            lambda self: base.pthrDelay.__get__(self),
            lambda self, us: base.pthrDelay.__set__(self, max(int(us), PROGRESS_DELAY_US)),
        )

    with _AGENT_LOCK:
        _api.nixlBind.nixlAgentConfig = PacedConfig
        try:
            yield
        finally:
            _api.nixlBind.nixlAgentConfig = base


def make_agent(
    role: str,
    *,
    transports: str | None = None,
    backends: tuple[str, ...] = ("UCX",),
    ucx_settings: Mapping[str, str] | None = None,
) -> NixlAgent:
    """A NIXL agent with a unique name, usable from several threads at once (``ucx_settings``: see
    :func:`_ucx_environment`)."""
    nixl = load_nixl()
    name = f"gm-{role}-{os.getpid()}-{secrets.token_hex(4)}"
    config = nixl.nixl_agent_config(backends=list(backends), sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    try:
        with _ucx_environment(transports, ucx_settings), _paced_progress_thread():
            agent = nixl.nixl_agent(name, config)
    except Exception as exc:
        raise NixlUnavailableError(
            f"NIXL ({PACKAGE}) could not start an agent with backends {list(backends)}"
            f"{f' on UCX transports {transports!r}' if transports else ''}: {exc}",
            hint=_AGENT_HINT,
        ) from None
    missing = [b for b in backends if b not in agent.backends]
    if missing:  # NIXL logs an unavailable backend and starts without it
        raise NixlUnavailableError(
            f"NIXL ({PACKAGE}) here has no {', '.join(missing)} backend"
            f"{f' on UCX transports {transports!r}' if transports else ''} (plugins: {agent.get_plugin_list()})",
            hint=_AGENT_HINT,
        )
    started: NixlAgent = agent
    return started


_AGENT_HINT = (
    "transports= in a nixl:// URL and a receiver's --nixl-transports take UCX transport names (tcp; rc,tcp; "
    "cuda_ipc); UCX's log above names those available here. stream:// does not need NIXL"
)


def host_buffer(nbytes: int) -> tuple[object, npt.NDArray[np.uint8]]:
    """Host memory to register: pinned (page-locked) where CUDA is present, plain pages otherwise.

    Returns (owner, uint8 view). Pinned memory lets a GPU's copy engine and an RDMA NIC reach it
    without a bounce; on a CPU-only host UCX's TCP transport reads and writes ordinary pages.
    """
    try:
        import torch

        if torch.cuda.is_available():
            owner = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            return owner, owner.numpy()
    except ImportError:
        pass
    arr = np.empty(nbytes, dtype=np.uint8)
    return arr, arr


def register_host(agent: NixlAgent, arr: npt.NDArray[np.uint8]) -> object:
    """Register host memory ``arr`` with ``agent`` (DRAM); the result is what ``deregister_memory`` takes."""
    return agent.register_memory([(arr.ctypes.data, arr.nbytes, 0, "")], "DRAM")

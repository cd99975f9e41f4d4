"""``nixl://host:port``: chunk objects WRITTEN by NIXL straight into the receiver's registered memory.

The receiver (``receiver.py``, started with ``nixl=True``) registers a pool of landing slots with
NIXL. The sender (:class:`NixlStore`) speaks the stream protocol on the same authenticated TLS
connections for everything but chunk bytes: after HELLO it asks for slots (NIXL_OPEN, a request
signed with the control key; the signed reply carries the receiver's NIXL agent metadata and the
slots' addresses), then for each chunk copies the sealed object into its own registered staging
slot, WRITEs it into the receiver's slot, waits for the transfer to be DONE (NIXL's UCX backend
completes a WRITE only after flushing it to the remote side) and sends NIXL_LANDED (slot, length)
on the connection. The receiver copies the slot out, verifies the object (AES-GCM tag, decode,
BLAKE3) and stores it, then acknowledges; the acknowledgement frees the slot. What the wire carries
is the image's sealed objects, so the data link needs no trust (TRANSPORTS.md, nixl://). NIXL's
agent starts in the background while the connections open (20-40 ms over TCP; about 0.4 s where
UCX's memory hooks are needed); until it is up, chunks go inline on the connections as stream://
sends them.

NIXL is optional (extra ``nixl``, PyPI ``nixl-cu13``): :func:`load_nixl` raises a clear error when
it is missing or fails to load, and ``stream://`` works without it.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import functools
import json
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from gpumigrate import control
from gpumigrate.errors import EXIT_INVALID, InvalidInputError, TransferError
from gpumigrate.transfer.stores import split_url
from gpumigrate.transfer.stream import CHANNEL, NIXL_LANDED, NIXL_OPEN, NO_ID, PUT_CHUNK, StreamStore, _Conn, _Pending

PACKAGE = "nixl-cu13"  # PyPI name; the import name is nixl_cu13
SLOT = struct.Struct(">IQ")  # NIXL_LANDED payload: slot index, object length
DEFAULT_SLOTS = 32  # landing slots in a receiver's pool
DEFAULT_SLOT_BYTES = 8 << 20  # a 4 MiB chunk's sealed object with room to spare; larger ones go inline
SLOTS_PER_CONNECTION = 4  # objects in flight per connection: enough to keep a link busy past one RTT


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
    starting, a large allocation) spins on it: 0.4 s of a push here, for hooks a TCP transport never
    uses. UCX reads this once per process, when its first backend starts. ``settings``: more UCX
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
) -> Any:
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
    return agent


_AGENT_HINT = (
    "transports= in a nixl:// URL and a receiver's --nixl-transports take UCX transport names (tcp; rc,tcp; "
    "cuda_ipc); UCX's log above names those available here. stream:// does not need NIXL"
)


def _buffer(nbytes: int) -> tuple[Any, np.ndarray]:
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


def _register(agent: Any, arr: np.ndarray) -> Any:
    return agent.register_memory([(arr.ctypes.data, arr.nbytes, 0, "")], "DRAM")


# ----------------------------------------------------------------------------- receiver side
class HostLanding:
    """The receiver's pool of registered landing slots, leased to authenticated connections."""

    def __init__(
        self, *, slots: int = DEFAULT_SLOTS, slot_bytes: int = DEFAULT_SLOT_BYTES, transports: str | None = None
    ) -> None:
        if slots < 1 or slot_bytes < 4096:
            raise InvalidInputError("a NIXL landing pool needs at least 1 slot of at least 4096 bytes")
        self.agent = make_agent("recv", transports=transports)
        self.slot_bytes = slot_bytes
        self._owner, self.pool = _buffer(slots * slot_bytes)
        self._reg = _register(self.agent, self.pool)
        self._free = list(range(slots))
        self._lock = threading.Lock()

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def lease(self, wanted: int) -> list[int]:
        with self._lock:
            n = max(0, min(wanted, len(self._free)))
            taken, self._free = self._free[:n], self._free[n:]
        return taken

    def release(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    def offer(self, slots: list[int]) -> dict[str, Any]:
        """What a sender needs to WRITE into ``slots``: agent metadata and each slot's address."""
        base = self.pool.ctypes.data
        return {
            "agent": self.agent.name,
            "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "mem": "DRAM",
            "slot_bytes": self.slot_bytes,
            "slots": [[s, base + s * self.slot_bytes, self.slot_bytes, 0] for s in slots],
        }

    def view(self, slot: int, length: int) -> memoryview:
        if length > self.slot_bytes:
            raise InvalidInputError(f"an object of {length} bytes does not fit a {self.slot_bytes}-byte slot")
        start = slot * self.slot_bytes
        return self.pool[start : start + length].data

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.agent.deregister_memory(self._reg)


# ----------------------------------------------------------------------------- sender side


@dataclass
class _Slots:
    """One connection's leased remote slots, each paired with a local staging slot."""

    remote_index: list[int]  # the receiver's slot numbers, in local slot order
    remote: list[tuple[int, int]]  # each remote slot's (address, device)
    mem: str  # the remote slots' memory type
    staging: np.ndarray
    slot_bytes: int
    free: list[int] = field(default_factory=list)
    writing: collections.deque[_Write] = field(default_factory=collections.deque)  # posted, in order


@dataclass
class _Write:
    """A WRITE posted into slot ``slot``; announced (NIXL_LANDED) once DONE, in posting order."""

    slot: int
    chunk_id: str
    nbytes: int
    handle: Any
    state: str


class NixlStore(StreamStore):
    """Sender side of ``nixl://host:port[?fingerprint=sha256:HEX][&connections=N][&transports=tcp][&slots=N][&inline=0]``.

    ``transports`` sets the UCX transports this side may use (UCX_TLS: ``tcp`` between hosts
    without a fabric, ``rc,tcp`` for InfiniBand/RoCE, default: UCX's own choice); ``slots`` the
    objects in flight per connection. Objects larger than a slot travel inline on the connection,
    like stream://, and so do the first ones while NIXL starts, unless ``inline=0``.
    """

    scheme = "nixl"

    def __init__(self, url: str, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        query = split_url(url)[3]
        transports, slots = query.get("transports"), query.get("slots")
        self.transports = transports[0] if transports else None
        self.slots_per_connection = max(1, int(slots[0]) if slots else SLOTS_PER_CONNECTION)
        # inline=0: every chunk through NIXL (the first ones wait for the agent to start), never inline
        self.inline_start = (query.get("inline") or ["1"])[0] != "0"
        load_nixl()  # fail here, before any connection, when NIXL is missing
        self._agent: Any = None
        self._agent_error: BaseException | None = None
        self._agent_ready = threading.Event()
        self._remote_name: str | None = None
        self._agent_lock = threading.Lock()
        self._registered: list[Any] = []
        self.chunks_written = 0  # objects that went through NIXL
        self.chunks_inline = 0  # objects sent on the connection: before NIXL was up, or larger than a slot
        # Starting NIXL's UCX backend takes 20-40 ms over TCP, ~0.4 s with UCX's memory hooks; meanwhile
        # the connections carry chunks inline (as stream:// does), so a short push does not wait for it.
        threading.Thread(target=self._start_agent, name="gm-nixl-start", daemon=True).start()

    def _start_agent(self) -> None:
        try:
            self._agent = make_agent("send", transports=self.transports)
        except BaseException as exc:
            self._agent_error = exc
        finally:
            self._agent_ready.set()

    def _nixl(self, *, wait: bool) -> Any:
        """The agent; None while it is still starting (unless ``wait``)."""
        if wait:
            self._agent_ready.wait()
        if not self._agent_ready.is_set():
            return None
        if self._agent_error is not None:
            raise self._agent_error
        return self._agent

    def _on_connected(self, conn: _Conn) -> None:
        if not self.receiver_info.get("nixl"):
            raise TransferError(
                f"receiver {self.host}:{self.port} has no NIXL landing pool: start it with nixl on, or use stream://"
            )
        conn.extra = None  # landing slots are leased once the agent is up (_open_slots)

    def _open_slots(self, conn: _Conn) -> _Slots:
        """Lease landing slots for this connection (NIXL_OPEN, signed both ways). Caller holds its lock."""
        agent = self._nixl(wait=True)
        request = control.sign_request(
            self.control_key, CHANNEL, {"op": "nixl-open", "slots": self.slots_per_connection, "agent": agent.name}
        )
        payload = json.dumps(request).encode()
        p = _Pending("nixl-open", len(payload), conn)
        self._send(conn, NIXL_OPEN, NO_ID, payload, p)
        while p.status is None:  # earlier requests on this connection answer first
            self._read_reply(conn)
        status, body = p.status, p.body
        self._check(status, body, "nixl-open")
        offer = control.verify_reply(self.control_key, CHANNEL, request["auth"]["nonce"], json.loads(body))
        slots = offer["slots"]
        if not slots:
            raise TransferError(f"receiver {self.host}:{self.port} has no free NIXL landing slot")
        slot_bytes = int(offer["slot_bytes"])
        try:
            with self._agent_lock:
                if self._remote_name is None:
                    name = agent.add_remote_agent(base64.b64decode(offer["metadata"]))
                    self._remote_name = name.decode() if isinstance(name, bytes) else str(name)
                staging = np.empty(len(slots) * slot_bytes, dtype=np.uint8)
                self._registered.append((_register(agent, staging), staging))
        except Exception as exc:  # NIXL raises its own error types (nixlBackendError, …)
            raise TransferError(
                f"NIXL cannot reach receiver {self.host}:{self.port} ({type(exc).__name__}: {exc})",
                hint="the two sides share no UCX transport (transports= here, --nixl-transports there), or this "
                "process started before the route to the receiver existed: UCX reads the routing table once per process",
            ) from None
        return _Slots(
            remote_index=[int(s[0]) for s in slots],
            remote=[(int(addr), int(dev)) for _, addr, _, dev in slots],
            mem=str(offer.get("mem", "DRAM")),
            staging=staging,
            slot_bytes=slot_bytes,
            free=list(range(len(slots))),
        )

    def _post(self, slots: _Slots, i: int, chunk_id: str, blob: bytes | bytearray | memoryview) -> None:
        """Copy ``blob`` into local slot ``i`` and post its WRITE into the paired remote slot (no wait)."""
        n = len(blob)
        start = i * slots.slot_bytes
        slots.staging[start : start + n] = np.frombuffer(blob, dtype=np.uint8)
        agent = self._agent
        addr, dev = slots.remote[i]
        try:
            # descriptors of exactly this object's length: a slot is larger than most objects
            local = agent.get_xfer_descs([(slots.staging.ctypes.data + start, n, 0)], "DRAM")
            remote = agent.get_xfer_descs([(addr, n, dev)], slots.mem)
            handle = agent.initialize_xfer("WRITE", local, remote, self._remote_name)
            slots.writing.append(_Write(i, chunk_id, n, handle, agent.transfer(handle)))
        except Exception as exc:  # NIXL's own error types: the connection's slots are in an unknown state
            raise ConnectionError(f"NIXL WRITE into slot {slots.remote_index[i]} failed: {exc}") from None

    def _announce(self, conn: _Conn, slots: _Slots, *, wait: bool) -> None:
        """Send NIXL_LANDED for each WRITE at the head of the queue that is DONE (all of them with ``wait``).

        A WRITE is DONE once NIXL flushed it to the remote memory, so the receiver reads whole bytes."""
        agent = self._agent
        pause = 0.0001
        while slots.writing:
            w = slots.writing[0]
            if w.state == "PROC":
                try:
                    w.state = agent.check_xfer_state(w.handle)
                except Exception as exc:
                    raise ConnectionError(f"NIXL WRITE into slot {slots.remote_index[w.slot]} failed: {exc}") from None
            if w.state == "PROC":
                if not wait:
                    return
                time.sleep(pause)
                pause = min(pause * 2, 0.002)
                continue
            slots.writing.popleft()
            w.handle.release()
            if w.state != "DONE":
                raise ConnectionError(f"NIXL WRITE of {w.nbytes} bytes into slot {slots.remote_index[w.slot]} failed")
            p = _Pending(f"chunk {w.chunk_id[:16]}", w.nbytes, conn, done=functools.partial(slots.free.append, w.slot))
            self._send(conn, NIXL_LANDED, bytes.fromhex(w.chunk_id), SLOT.pack(slots.remote_index[w.slot], w.nbytes), p)
            pause = 0.0001

    def put_chunk(self, chunk_id: str, blob: bytes | bytearray | memoryview) -> None:
        """Post a WRITE of one sealed object into a landing slot and return; the receiver is told once
        it is DONE (by this or a later call on the connection, or flush) and acknowledges it later."""
        self._raise_errors(rejected=False)
        conn = self._locked_conn()
        try:
            if conn.broken is not None:
                raise TransferError(f"nixl to receiver {self.host}:{self.port} failed: {conn.broken}")
            try:
                slots: _Slots | None = conn.extra
                if slots is None and self._nixl(wait=not self.inline_start) is not None:
                    slots = conn.extra = self._open_slots(conn)
                if slots is None or len(blob) > slots.slot_bytes:  # inline, as stream:// sends it
                    if slots is not None:
                        self._announce(conn, slots, wait=True)  # keep the connection's requests in order
                    p = _Pending(f"chunk {chunk_id[:16]}", len(blob), conn)
                    self._send(conn, PUT_CHUNK, bytes.fromhex(chunk_id), blob, p)
                    self._drain_ready(conn)
                    with self._lock:
                        self.chunks_inline += 1
                    return
                self._announce(conn, slots, wait=False)
                while not slots.free:
                    if slots.writing:
                        self._announce(conn, slots, wait=True)
                    else:
                        self._read_reply(conn)  # the oldest acknowledgement frees its slot
                self._post(slots, slots.free.pop(), chunk_id, blob)
                self._announce(conn, slots, wait=False)
                self._drain_ready(conn)
            except (OSError, ConnectionError, ValueError) as exc:
                self._drop(conn, exc)
                raise TransferError(f"nixl to receiver {self.host}:{self.port} failed: {exc}") from None
            with self._lock:
                self.chunks_written += 1
        finally:
            conn.lock.release()

    def flush(self) -> None:
        """As stream://, and raise NIXL's failure to start even when every chunk so far went inline: a push
        over nixl:// never completes without a working NIXL (its manifest follows a flush)."""
        self._nixl(wait=True)
        super().flush()

    def _finish_sends(self, conn: _Conn) -> None:
        """Announce every WRITE posted on this connection, once it is DONE (before its acknowledgements are read)."""
        if conn.extra is not None:
            self._announce(conn, conn.extra, wait=True)

    def _close_conn(self, conn: _Conn) -> None:
        slots: _Slots | None = conn.extra
        while slots is not None and slots.writing:
            with contextlib.suppress(Exception):
                slots.writing.popleft().handle.release()
        super()._close_conn(conn)

    def close(self) -> None:
        super().close()
        # An agent still starting (a push that ended inline) registered nothing and reached no one, but
        # its start is waited for: a process that exits while NIXL is still starting aborts in its C++
        # destructors ("pure virtual method called"), after the push succeeded.
        self._agent_ready.wait()
        with self._agent_lock:
            if self._agent is not None:
                if self._remote_name is not None:
                    with contextlib.suppress(Exception):  # disconnects its endpoints
                        self._agent.remove_remote_agent(self._remote_name)
                    self._remote_name = None
                for reg, _staging in self._registered:
                    with contextlib.suppress(Exception):
                        self._agent.deregister_memory(reg)
                self._registered.clear()

"""``nixl://host:port``: chunk objects WRITTEN by NIXL straight into the receiver's registered memory.

The receiver (``receiver/server.py``, started with ``nixl=True``) registers a pool of landing slots with NIXL
(``receiver/landing.py``). The sender (:class:`NixlStore`) speaks the stream protocol on the same authenticated TLS
connections for everything but chunk bytes: after HELLO it asks for slots (NIXL_OPEN, a request signed with the
control key; the signed reply carries the receiver's NIXL agent metadata and the slots' addresses), then for each
chunk copies the sealed object into its own registered staging slot, WRITEs it into the receiver's slot, waits for
the transfer to be DONE (NIXL's UCX backend completes a WRITE only after flushing it to the remote side) and sends
NIXL_LANDED (slot, length) on the connection. The receiver copies the slot out, verifies the object (AES-GCM tag,
decode, BLAKE3) and stores it, then acknowledges; the acknowledgement frees the slot. What the wire carries is the
image's sealed objects, so the data link needs no trust (TRANSPORTS.md, nixl://). NIXL's agent starts in the
background while the connections open; until it is up, chunks go inline on the connections as stream:// sends them.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import functools
import json
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from gpumigrate import control
from gpumigrate.errors import TransferError
from gpumigrate.transfer.stores.base import check_chunk_id, split_url
from gpumigrate.transfer.stores.connections import WINDOW_BYTES, Conn, Pending
from gpumigrate.transfer.stores.nixl_agent import NixlAgent, XferHandle, load_nixl, make_agent, register_host
from gpumigrate.transfer.stores.stream import StreamStore
from gpumigrate.transfer.stores.wire import CHANNEL, NIXL_LANDED, NIXL_OPEN, NO_ID, PUT_CHUNK, SLOT

SLOTS_PER_CONNECTION = 4  # objects in flight per connection: enough to keep a link busy past one RTT


@dataclass
class _Slots:
    """One connection's leased remote slots, each paired with a local staging slot."""

    remote_index: list[int]  # the receiver's slot numbers, in local slot order
    remote: list[tuple[int, int]]  # each remote slot's (address, device)
    mem: str  # the remote slots' memory type
    staging: npt.NDArray[np.uint8]
    slot_bytes: int
    free: list[int] = field(default_factory=list)
    writing: collections.deque[_Write] = field(default_factory=collections.deque)  # posted, in order


@dataclass
class _Write:
    """A WRITE posted into slot ``slot``; announced (NIXL_LANDED) once DONE, in posting order."""

    slot: int
    chunk_id: str
    nbytes: int
    handle: XferHandle
    state: str


def _slots_of(conn: Conn) -> _Slots | None:
    """The landing slots a connection leased, or None before it leased any."""
    return conn.extra if isinstance(conn.extra, _Slots) else None


class NixlStore(StreamStore):
    """Sender side of ``nixl://host:port[?fingerprint=sha256:HEX][&connections=N][&transports=tcp][&slots=N][&inline=0]``.

    ``transports`` sets the UCX transports this side may use (UCX_TLS: ``tcp`` between hosts
    without a fabric, ``rc,tcp`` for InfiniBand/RoCE, default: UCX's own choice); ``slots`` the
    objects in flight per connection. Objects larger than a slot travel inline on the connection,
    like stream://, and so do the first ones while NIXL starts, unless ``inline=0``.
    """

    scheme = "nixl"

    def __init__(
        self, url: str, *, connections: int = 4, window_bytes: int = WINDOW_BYTES, control_key: bytes | None = None
    ) -> None:
        super().__init__(url, connections=connections, window_bytes=window_bytes, control_key=control_key)
        query = split_url(url)[3]
        transports, slots = query.get("transports"), query.get("slots")
        self.transports = transports[0] if transports else None
        self.slots_per_connection = max(1, int(slots[0]) if slots else SLOTS_PER_CONNECTION)
        # inline=0: every chunk through NIXL (the first ones wait for the agent to start), never inline
        self.inline_start = (query.get("inline") or ["1"])[0] != "0"
        load_nixl()  # fail here, before any connection, when NIXL is missing
        self._agent: NixlAgent | None = None
        self._agent_error: BaseException | None = None
        self._agent_ready = threading.Event()
        self._remote_name: str | None = None
        self._agent_lock = threading.Lock()
        self._registered: list[tuple[object, npt.NDArray[np.uint8]]] = []  # (registration, its memory)
        self.chunks_written = 0  # objects that went through NIXL
        self.chunks_inline = 0  # objects sent on the connection: before NIXL was up, or larger than a slot
        # Starting NIXL's UCX backend takes a while (TRANSPORTS.md); meanwhile the connections carry chunks
        # inline (as stream:// does), so a short push does not wait for it.
        threading.Thread(target=self._start_agent, name="gm-nixl-start", daemon=True).start()

    def _start_agent(self) -> None:
        try:
            self._agent = make_agent("send", transports=self.transports)
        except BaseException as exc:
            self._agent_error = exc
        finally:
            self._agent_ready.set()

    def _nixl(self, *, wait: bool) -> NixlAgent | None:
        """The agent; None while it is still starting (unless ``wait``)."""
        if wait:
            self._agent_ready.wait()
        if not self._agent_ready.is_set():
            return None
        if self._agent_error is not None:
            raise self._agent_error
        return self._agent

    def _started(self) -> NixlAgent:
        """The agent, once started (raising why it could not start)."""
        agent = self._nixl(wait=True)
        assert agent is not None  # set before _agent_ready, unless _agent_error is
        return agent

    def _on_connected(self, conn: Conn) -> None:
        if not self.receiver_info.get("nixl"):
            raise TransferError(
                f"receiver {self.host}:{self.port} has no NIXL landing pool: start it with nixl on, or use stream://"
            )
        conn.extra = None  # landing slots are leased once the agent is up (_open_slots)

    def _open_slots(self, conn: Conn) -> _Slots:
        """Lease landing slots for this connection (NIXL_OPEN, signed both ways). Caller holds its lock."""
        agent = self._started()
        request = control.sign_request(
            self.control_key, CHANNEL, {"op": "nixl-open", "slots": self.slots_per_connection, "agent": agent.name}
        )
        payload = json.dumps(request).encode()
        p = Pending("nixl-open", len(payload), conn)
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
                self._registered.append((register_host(agent, staging), staging))
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
        agent = self._started()
        addr, dev = slots.remote[i]
        try:
            # descriptors of exactly this object's length: a slot is larger than most objects
            local = agent.get_xfer_descs([(slots.staging.ctypes.data + start, n, 0)], "DRAM")
            remote = agent.get_xfer_descs([(addr, n, dev)], slots.mem)
            handle = agent.initialize_xfer("WRITE", local, remote, self._remote_name)
            slots.writing.append(_Write(i, chunk_id, n, handle, agent.transfer(handle)))
        except Exception as exc:  # NIXL's own error types: the connection's slots are in an unknown state
            raise ConnectionError(f"NIXL WRITE into slot {slots.remote_index[i]} failed: {exc}") from None

    def _announce(self, conn: Conn, slots: _Slots, *, wait: bool) -> None:
        """Send NIXL_LANDED for each WRITE at the head of the queue that is DONE (all of them with ``wait``).

        A WRITE is DONE once NIXL flushed it to the remote memory, so the receiver reads whole bytes."""
        agent = self._started()
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
            p = Pending(f"chunk {w.chunk_id[:16]}", w.nbytes, conn, done=functools.partial(slots.free.append, w.slot))
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
                slots = _slots_of(conn)
                if slots is None and self._nixl(wait=not self.inline_start) is not None:
                    slots = conn.extra = self._open_slots(conn)
                if slots is None or len(blob) > slots.slot_bytes:  # inline, as stream:// sends it
                    if slots is not None:
                        self._announce(conn, slots, wait=True)  # keep the connection's requests in order
                    p = Pending(f"chunk {chunk_id[:16]}", len(blob), conn)
                    self._send(conn, PUT_CHUNK, bytes.fromhex(check_chunk_id(chunk_id)), blob, p)
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

    def _finish_sends(self, conn: Conn) -> None:
        """Announce every WRITE posted on this connection, once it is DONE (before its acknowledgements are read)."""
        slots = _slots_of(conn)
        if slots is not None:
            self._announce(conn, slots, wait=True)

    def _close_conn(self, conn: Conn) -> None:
        slots = _slots_of(conn)
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

"""The receiver behind ``stream://`` and ``nixl://`` (TRANSPORTS.md, Receiver): its connections and requests.

It serves nothing to a client that has not authenticated (HELLO signed with the control key, ``stores/wire.py``),
gives it a deadline for the whole handshake and keeps few such clients (``admission.py``), and it stores only what it
verified, under a disk quota (``verified.py``). With ``nixl`` it also lands NIXL WRITEs
in a pool of registered slots (``landing.py``). Images land in a ``file://`` store that the target reads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

from gpumigrate import control
from gpumigrate.errors import GpumigrateError, IntegrityError, InvalidInputError, NotFoundError
from gpumigrate.transfer.format.chunkobj import Sealer
from gpumigrate.transfer.receiver.admission import Admission, ReceiverLimits
from gpumigrate.transfer.receiver.landing import HostLanding
from gpumigrate.transfer.receiver.tls import tls_context
from gpumigrate.transfer.receiver.verified import VerifiedStore
from gpumigrate.transfer.stores import open_store
from gpumigrate.transfer.stores.file import FileStore
from gpumigrate.transfer.stores.wire import (
    CHANNEL,
    DENIED,
    ERROR,
    FLUSH,
    GET_MANIFEST,
    HAS_CHUNK,
    HELLO,
    LIST_CHUNKS,
    LIST_MANIFESTS,
    MAGIC,
    MAX_FRAME,
    NIXL_LANDED,
    NIXL_OPEN,
    NOT_FOUND,
    OK,
    PROTOCOL_VERSION,
    PUT_CHUNK,
    PUT_MANIFEST,
    REJECTED,
    REPLY,
    REQUEST,
    SHUTDOWN,
    SLOT,
    parse_listen,
    read_frame,
)

log = logging.getLogger(__name__)

MAX_UNAUTHENTICATED_FRAME = 64 << 10  # HELLO is small: a client proves itself before we read more
AUTHENTICATED_READ_TIMEOUT_S = 300.0  # a sender holding the key, between two requests


class _Refused(Exception):
    """A request from a client that has not authenticated: answered DENIED, then the connection closes. ``tell``:
    the reply says why (a full receiver); otherwise it only says to authenticate (nothing for a prober to learn)."""

    def __init__(self, why: str, *, tell: bool = False) -> None:
        super().__init__(why)
        self.tell = tell


@dataclass
class _Session:
    """One client connection: authenticated yet, and the NIXL slots it holds."""

    peer: str
    raw: socket.socket
    authenticated: bool = False
    slots: list[int] = field(default_factory=list)
    copy: bytearray | None = None  # where a landed object is copied before it is verified


class Receiver:
    """A running receiver. ``port`` is the bound port, ``fingerprint`` the SHA-256 of its certificate.

    ``key`` is the image key (None: only unencrypted chunks can be verified, so encrypted ones are
    refused); ``control_key`` authenticates clients; ``quota_bytes`` caps what the store may hold;
    ``landing`` is a :class:`~gpumigrate.transfer.receiver.landing.HostLanding` for nixl:// senders;
    ``limits`` bound the handshake and the connections (:class:`~gpumigrate.transfer.receiver.admission.ReceiverLimits`).
    """

    def __init__(
        self,
        listen: str,
        store: FileStore,
        *,
        key: bytes | None,
        control_key: bytes,
        quota_bytes: int | None = None,
        landing: HostLanding | None = None,
        advertise: str | None = None,
        limits: ReceiverLimits | None = None,
    ) -> None:
        host, port = parse_listen(listen)
        self.limits = limits or ReceiverLimits()
        self.advertise = advertise
        self.store = store
        self.sealer = Sealer(key)
        self.control_key = control_key
        self.quota_bytes = quota_bytes
        self.landing = landing
        self.chunks_rejected = 0
        self.refusals = 0
        self.clients = 0  # connections that authenticated
        self.chunks_via_nixl = 0  # of chunks_received, those a NIXL WRITE landed (the rest came inline)
        self.manifests: list[str] = []
        self.manifest_event = threading.Event()
        self.stop_requested = threading.Event()
        self._guard = control.ReplayGuard()
        self._lock = threading.Lock()
        self._ctx, self.fingerprint = tls_context(host)
        self._sock = socket.create_server((host, port), reuse_port=False, backlog=64)
        self.admission = Admission(self.limits)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self.kept = VerifiedStore(store, self.sealer, quota_bytes)  # checks what an earlier run left, on a thread
        self._acceptor = threading.Thread(target=self._accept_loop, name="gm-recv-accept", daemon=True)
        self._acceptor.start()

    @property
    def public_host(self) -> str:
        """The host name senders use: the advertised one, else the bound address (loopback for a wildcard)."""
        return self.advertise or ("127.0.0.1" if self.host in ("0.0.0.0", "") else self.host)

    @property
    def url(self) -> str:
        scheme = "nixl" if self.landing is not None else "stream"
        return f"{scheme}://{self.public_host}:{self.port}?fingerprint=sha256:{self.fingerprint}"

    # ------------------------------------------------------------------ connections
    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                raw, addr = self._sock.accept()
            except OSError:
                return
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = f"{addr[0]}:{addr[1]}"
            try:
                self.admission.admit(raw, peer)  # its handshake deadline starts now; the oldest unproven one may go
            except OSError:  # no descriptor left for its handle: refused, the receiver serves on
                raw.close()
                continue
            t = threading.Thread(target=self._serve, args=(raw, peer), name="gm-recv-conn", daemon=True)
            with self._lock:
                self._threads = [x for x in self._threads if x.is_alive()]
                self._threads.append(t)
            t.start()

    def _serve(self, raw: socket.socket, peer: str) -> None:
        # No single read may outlast the handshake's deadline either; admission sheds the connection at the deadline
        # however the bytes trickle in.
        raw.settimeout(self.limits.handshake_timeout_s)
        try:
            sock = self._ctx.wrap_socket(raw, server_side=True)
        except (OSError, ssl.SSLError):
            self._forget(raw)
            return
        session = _Session(peer, raw)
        buf = bytearray(1 << 20)
        scratch = bytearray(8 << 20)
        try:
            while not self._closed.is_set():
                try:
                    head = read_frame(sock, REQUEST.size)
                except (ConnectionError, OSError):
                    return
                magic, kind, ident, length = REQUEST.unpack(head)
                if magic != MAGIC or length > MAX_FRAME:
                    return  # not our protocol: drop the connection
                if not session.authenticated and (kind != HELLO or length > MAX_UNAUTHENTICATED_FRAME):
                    self._refuse(sock, session, f"request {kind} before authentication")
                    return
                if len(buf) < length:
                    buf = bytearray(length)
                payload = read_frame(sock, length, buf)
                try:
                    status, body = self._handle(session, kind, ident.hex(), payload, scratch)
                except _Refused as exc:
                    self._refuse(sock, session, str(exc), tell=exc.tell)
                    return
                sock.sendall(REPLY.pack(status, len(body)) + body)
                if kind == HELLO:
                    sock.settimeout(AUTHENTICATED_READ_TIMEOUT_S)
                if kind == SHUTDOWN:
                    threading.Thread(target=self.close, name="gm-recv-stop", daemon=True).start()
        except (ConnectionError, OSError):
            return
        finally:
            if session.slots and self.landing is not None:
                self.landing.release(session.slots)
            with contextlib.suppress(OSError):
                sock.close()
            self._forget(raw)

    def _refuse(self, sock: ssl.SSLSocket, session: _Session, why: str, *, tell: bool = False) -> None:
        """Answer DENIED and count it; the log (rate-limited) names the peer and the reason, never the request's
        content."""
        with self._lock:
            self.refusals += 1
        self.admission.log.warning("receiver refused client %s: %s", session.peer, why)
        if tell or session.authenticated:
            message = f"refused: {why}".encode()
        else:
            message = b"unauthenticated: send HELLO signed with the control key first"
        with contextlib.suppress(OSError):
            sock.sendall(REPLY.pack(DENIED, len(message)) + message)

    def _forget(self, raw: socket.socket) -> None:
        self.admission.forget(raw)

    def _signed(self, payload: memoryview, op: str) -> tuple[dict[str, Any], str]:
        """A request signed with the control key for this channel (HELLO, NIXL_OPEN); else _Refused."""
        try:
            message = json.loads(bytes(payload))
            if not isinstance(message, dict):
                raise ValueError("not an object")
            body, nonce = control.verify_request(self.control_key, CHANNEL, message, self._guard)
        except control.AuthError as exc:
            raise _Refused(exc.message) from None
        except ValueError:
            raise _Refused("malformed signed request") from None
        if body.get("op") != op:
            raise _Refused(f"expected {op}, got {str(body.get('op'))[:20]!r}")
        return body, nonce

    # ------------------------------------------------------------------ requests
    def _handle(
        self, session: _Session, kind: int, ident: str, payload: memoryview, scratch: bytearray
    ) -> tuple[int, bytes]:
        if kind == HELLO:
            hello, nonce = self._signed(payload, "hello")
            if hello.get("server") != f"sha256:{self.fingerprint}":
                raise _Refused("HELLO names another certificate (a relayed handshake)")
            crowded = self.admission.authenticate(session.raw)
            if crowded is not None:
                raise _Refused(crowded, tell=True)
            session.authenticated = True
            with self._lock:
                self.clients += 1
            reply = {
                "version": PROTOCOL_VERSION,
                "verifies": True,
                "encrypted": self.sealer.encrypted,
                "nixl": self.landing is not None,
                "server": f"sha256:{self.fingerprint}",
                # where the images land on this host: what the target verifies and restores from
                "store": self.store.url,
            }
            return OK, json.dumps(control.sign_reply(self.control_key, CHANNEL, nonce, reply)).encode()
        try:
            if kind in (PUT_CHUNK, NIXL_LANDED):
                blob = self._landed(session, payload) if kind == NIXL_LANDED else payload
                status, body = self.kept.land(ident, blob, scratch)
                if kind == NIXL_LANDED and status == OK:
                    with self._lock:
                        self.chunks_via_nixl += 1
                return status, body
            if kind == HAS_CHUNK:
                found = self.kept.header(ident)
                if found is None:
                    return NOT_FOUND, b""
                return OK, struct.pack(">Q", found[0]) + found[1]
            if kind == LIST_CHUNKS:
                return OK, json.dumps(self.kept.verified_chunks()).encode()
            if kind == FLUSH:
                self.store.flush()
                return OK, b""
            if kind == PUT_MANIFEST:
                return self._accept_manifest(ident, bytes(payload))
            if kind == GET_MANIFEST:
                try:
                    return OK, self.store.get_manifest(ident)
                except NotFoundError:
                    return NOT_FOUND, b""
            if kind == LIST_MANIFESTS:
                return OK, json.dumps(self.store.list_manifests()).encode()
            if kind == NIXL_OPEN:
                return self._nixl_open(session, payload)
            if kind == SHUTDOWN:
                self.store.flush()
                self.stop_requested.set()
                return OK, b""
            return ERROR, f"unknown request {kind}".encode()
        except _Refused:
            raise
        except GpumigrateError as exc:
            if kind in (PUT_CHUNK, NIXL_LANDED):
                with self._lock:
                    self.chunks_rejected += 1
                log.warning("rejected chunk %s: %s", ident[:16], exc.message)
            return REJECTED, exc.message.encode()
        except Exception as exc:  # the receiver keeps serving other connections
            return ERROR, f"{type(exc).__name__}: {exc}".encode()

    def _nixl_open(self, session: _Session, payload: memoryview) -> tuple[int, bytes]:
        body, nonce = self._signed(payload, "nixl-open")
        if self.landing is None:
            return ERROR, b"this receiver has no NIXL landing pool (start it with nixl on)"
        wanted = max(1, min(int(body.get("slots") or 1), 64))
        self.landing.release(session.slots)
        session.slots = self.landing.lease(wanted)
        offer = self.landing.offer(session.slots)
        return OK, json.dumps(control.sign_reply(self.control_key, CHANNEL, nonce, offer)).encode()

    def _accept_manifest(self, image_id: str, data: bytes) -> tuple[int, bytes]:
        status, body = self.kept.accept_manifest(image_id, data)
        if status == OK:
            with self._lock:
                self.manifests.append(image_id)
            self.manifest_event.set()
        return status, body

    def _landed(self, session: _Session, payload: memoryview) -> memoryview:
        if self.landing is None or len(payload) != SLOT.size:
            raise IntegrityError("a NIXL landing notice without a landing pool, or malformed")
        slot, length = SLOT.unpack(payload)
        if slot not in session.slots:
            raise IntegrityError(f"slot {slot} is not leased to this connection")
        # A landing slot is memory that any holder of its descriptor can write: verify and store a
        # private copy, so that the bytes stored are the bytes verified.
        if session.copy is None or len(session.copy) < length:
            session.copy = bytearray(max(length, self.landing.slot_bytes))
        private = memoryview(session.copy)[:length]
        private[:] = self.landing.view(slot, length)
        return private

    # ------------------------------------------------------------------ life cycle
    @property
    def chunks_received(self) -> int:
        """Chunks verified and stored since the start (a re-sent chunk already here counts once)."""
        return self.kept.chunks_received

    def stats(self) -> dict[str, Any]:
        kept = self.kept
        with self._lock:
            return {
                "images": list(self.manifests),
                "chunks_received": kept.chunks_received,
                "chunks_rejected": self.chunks_rejected,
                "chunks_present": kept.chunks_present,
                "chunks_discarded": kept.chunks_discarded,
                "bytes_received": kept.bytes_received,
                "bytes_stored": kept.bytes_stored,
                "refusals": self.refusals,
                "connections_shed": dict(self.admission.shed),
                "clients": self.clients,
                "chunks_via_nixl": self.chunks_via_nixl,
            }

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.stop_requested.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone does not on Linux
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._lock:
            threads = list(self._threads)
        self._acceptor.join(timeout=5)
        self.admission.close()  # shuts every connection down: their threads finish
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        with contextlib.suppress(GpumigrateError):
            self.store.flush()
        self.store.close()
        if self.landing is not None:
            self.landing.close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_stream(
    listen: str,
    store_url: str,
    *,
    key: bytes | None = None,
    control_key: bytes | None = None,
    quota_bytes: int | None = None,
    nixl: bool = False,
    nixl_transports: str | None = None,
    advertise: str | None = None,
    limits: ReceiverLimits | None = None,
) -> Receiver:
    """Start a receiver on ``listen`` (host:port, port 0 = any) that writes into the ``file://`` store ``store_url``.

    ``control_key`` defaults to the deployment's (``gpumigrate.control.load_key``, created under the
    state root on first use). ``nixl=True`` adds a NIXL landing pool (nixl:// senders). ``advertise``
    is the host name senders use when the listen address is a wildcard; ``limits`` bound the handshake and the
    connections (defaults: :class:`~gpumigrate.transfer.receiver.admission.ReceiverLimits`).
    """
    store = open_store(store_url, sync="deferred")
    if not isinstance(store, FileStore):
        raise InvalidInputError(
            f"a receiver writes into a local directory (file://), not {store_url!r}",
            hint="the target reads the image from there: verify and restore use that file:// store",
        )
    landing = HostLanding(transports=nixl_transports) if nixl else None
    try:
        return Receiver(
            listen,
            store,
            key=key,
            control_key=control_key if control_key is not None else control.load_key(create=True),
            quota_bytes=quota_bytes,
            landing=landing,
            advertise=advertise,
            limits=limits,
        )
    except BaseException:
        if landing is not None:
            landing.close()
        raise

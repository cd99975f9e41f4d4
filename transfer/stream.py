"""``stream://host:port``: host-to-host transfer over N parallel TLS connections (TRANSPORTS.md, Stream).

This module holds the wire protocol and the sender, a write-only :class:`Store` (so the writer and
push use it unchanged); the receiver is in ``receiver.py``. Every connection starts with HELLO, a
request signed with the control key (``gpumigrate.control``, channel ``receiver``) and bound to the
receiver's certificate; the receiver answers with a signed reply, so each side knows the other
holds the key before a chunk moves. A pinned certificate (``?fingerprint=sha256:HEX``) is checked
before HELLO is sent.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import re
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpumigrate import control
from gpumigrate.errors import (
    EXIT_INVALID,
    GpumigrateError,
    IntegrityError,
    InvalidInputError,
    NotFoundError,
    TransferError,
)
from gpumigrate.transfer.stores import Store, query_param, split_url

MAGIC = b"GMS2"
REQUEST = struct.Struct(">4sB32sQ")
REPLY = struct.Struct(">BQ")
PUT_CHUNK, PUT_MANIFEST, LIST_CHUNKS, HAS_CHUNK, FLUSH, GET_MANIFEST, LIST_MANIFESTS, HELLO = 1, 2, 3, 4, 5, 6, 7, 8
NIXL_OPEN, NIXL_LANDED, SHUTDOWN = 9, 10, 11
PROTOCOL_VERSION = 2
OK, NOT_FOUND, REJECTED, ERROR, DENIED, FULL = 0, 1, 2, 3, 4, 5
MAX_FRAME = 256 << 20  # larger than any chunk or manifest: a bigger frame is a protocol error, never an allocation
NO_ID = bytes(32)
CHANNEL = "receiver"  # gpumigrate.control channel of every receiver connection
_FINGERPRINT = re.compile(r"^(?:sha256:)?([0-9a-fA-F]{64})$")


class PinnedCertificateError(TransferError):
    """The receiver's certificate is not the one the URL pins: refused before any request was sent (exit 2)."""

    exit_code = EXIT_INVALID


def _recv_exact(sock: ssl.SSLSocket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]


def _read(sock: ssl.SSLSocket, n: int, buf: bytearray | None = None) -> memoryview:
    if buf is None or len(buf) < n:
        buf = bytearray(n)
    view = memoryview(buf)[:n]
    _recv_exact(sock, view)
    return view


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise InvalidInputError(f"listen address {listen!r} must be host:port (port 0 picks a free one)")
    return host.strip("[]") or "0.0.0.0", int(port)


def parse_fingerprint(value: str) -> str:
    """``sha256:HEX`` (or bare HEX, 64 digits) → lower-case hex."""
    m = _FINGERPRINT.match(value.strip())
    if not m:
        raise InvalidInputError(
            f"certificate fingerprint {value!r} is not sha256:<64 hex digits>",
            hint="the receiver prints it, and writes it to receiver.json in its state directory",
        )
    return m.group(1).lower()


def certificate_fingerprint(sock: ssl.SSLSocket) -> str:
    return hashlib.sha256(sock.getpeercert(binary_form=True) or b"").hexdigest()


def hello_request(control_key: bytes, fingerprint: str) -> dict[str, Any]:
    """The signed first request of every connection, bound to the certificate the client saw."""
    return control.sign_request(
        control_key, CHANNEL, {"op": "hello", "version": PROTOCOL_VERSION, "server": f"sha256:{fingerprint}"}
    )


# ----------------------------------------------------------------------------- sender


# Unacknowledged request bytes allowed per connection. Replies come back in order, so a sender
# keeps sending while earlier chunks are still being verified: the link never idles for a round
# trip plus the receiver's verification per chunk (stop-and-wait did, once per chunk).
WINDOW_BYTES = 32 << 20


@dataclass
class _Pending:
    """One request awaiting its reply; ``what`` names it in errors; ``done`` runs when its reply is read."""

    what: str
    nbytes: int
    conn: _Conn | None = None
    status: int | None = None
    body: bytes = b""
    done: Callable[[], None] | None = None
    chunk: str | None = None  # the chunk a PUT_CHUNK / NIXL_LANDED carries


@dataclass
class _Conn:
    sock: ssl.SSLSocket
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: collections.deque[_Pending] = field(default_factory=collections.deque)
    inflight: int = 0
    broken: BaseException | None = None
    extra: Any = None  # a subclass's per-connection state (nixl://: this connection's landing slots)


class StreamStore(Store):
    """Sender side of ``stream://host:port[?fingerprint=sha256:HEX][&connections=N]``. Write-only.

    Requests are pipelined: ``put_chunk`` returns once the chunk is sent, and its acknowledgement
    is collected later by whichever thread next uses that connection. A chunk the receiver
    rejected is raised by the next :meth:`flush` (which precedes every manifest), so a push never
    writes a manifest over a chunk that did not arrive verified. All reads and writes of one TLS
    connection happen under its lock, one thread at a time (OpenSSL objects are not thread-safe).
    """

    readable = False
    prefers_listing = True
    # A receiver authenticates, decodes and BLAKE3-checks every chunk before it stores it, and its
    # listing holds only chunks it verified (TRANSPORTS.md): push leaves both checks to it.
    verifies_on_arrival = True
    scheme = "stream"

    def __init__(
        self,
        url: str,
        *,
        connections: int = 4,
        window_bytes: int = WINDOW_BYTES,
        control_key: bytes | None = None,
    ) -> None:
        scheme, netloc, _, query = split_url(url)
        if scheme != self.scheme:
            raise InvalidInputError(f"{url!r} is not a {self.scheme}:// URL")
        self.url = url
        self.host, self.port = parse_listen(netloc)
        if self.host == "0.0.0.0" or not self.port:
            raise InvalidInputError(f"receiver URL {url!r} names no host or port")
        pinned = query_param(query, "fingerprint")
        self.fingerprint = parse_fingerprint(pinned) if pinned else None
        self.max_connections = max(1, int(query_param(query, "connections") or connections))
        self.window_bytes = max(1, window_bytes)
        self.control_key = control_key if control_key is not None else control.load_key()
        self.receiver_info: dict[str, Any] = {}
        self._conns: list[_Conn] = []
        self._opening = 0
        self._next = 0
        self._lock = threading.Lock()
        self._errors: list[tuple[str | None, GpumigrateError]] = []  # (rejected chunk id or None, error)
        self._closed = False
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        self._ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        # The receiver's certificate is self-signed and fresh per start: it is pinned by fingerprint
        # when the URL gives one, and HELLO binds the certificate seen to the control key either way.
        self._ctx.check_hostname = False
        self._ctx.verify_mode = ssl.CERT_NONE

    # ------------------------------------------------------------------ connections
    def _connect(self) -> _Conn:
        try:
            raw = socket.create_connection((self.host, self.port), timeout=30)
        except OSError as exc:
            raise TransferError(f"cannot connect to receiver {self.host}:{self.port}: {exc}") from None
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock = self._ctx.wrap_socket(raw)
        except OSError as exc:
            raw.close()
            raise TransferError(f"TLS handshake with receiver {self.host}:{self.port} failed: {exc}") from None
        seen = certificate_fingerprint(sock)
        if self.fingerprint and seen != self.fingerprint:
            sock.close()
            raise PinnedCertificateError(
                f"receiver {self.host}:{self.port} presented certificate sha256:{seen[:16]}…, not the pinned "
                f"sha256:{self.fingerprint[:16]}…: refused before any request was sent",
                hint="a receiver restarted since the plan was written has a new certificate: read receiver.json again",
            )
        sock.settimeout(300)
        conn = _Conn(sock)
        try:
            self._hello(conn, seen)
            self._on_connected(conn)
        except BaseException:
            with contextlib.suppress(OSError):
                sock.close()
            raise
        return conn

    def _hello(self, conn: _Conn, seen: str) -> None:
        """Authenticate this connection (both ways) with the control key."""
        request = hello_request(self.control_key, seen)
        status, body = self._exchange(conn, HELLO, json.dumps(request).encode(), "hello")
        if status == DENIED:
            raise control.AuthError(
                f"receiver {self.host}:{self.port} refused this client: {body.decode(errors='replace')}",
                hint="sender and receiver must share the control key (GPUMIGRATE_CONTROL_KEY_FILE)",
            )
        self._check(status, body, "hello")
        try:
            reply = control.verify_reply(self.control_key, CHANNEL, request["auth"]["nonce"], json.loads(body))
        except (ValueError, TypeError, KeyError):
            raise control.AuthError(f"receiver {self.host}:{self.port} sent an unsigned hello reply") from None
        if reply.get("version") != PROTOCOL_VERSION:
            raise TransferError(
                f"receiver speaks stream protocol {reply.get('version')}, this sender {PROTOCOL_VERSION}"
            )
        if reply.get("server") != f"sha256:{seen}":
            raise control.AuthError(f"receiver {self.host}:{self.port} answered for another certificate")
        self.receiver_info = reply

    def _exchange(self, conn: _Conn, kind: int, payload: bytes, what: str) -> tuple[int, bytes]:
        """One synchronous request on a connection nobody else uses yet (set-up)."""
        p = _Pending(what, len(payload), conn)
        try:
            self._send(conn, kind, NO_ID, payload, p)
            while p.status is None:
                self._read_reply(conn)
        except (OSError, ConnectionError, ValueError) as exc:
            raise TransferError(f"stream to receiver {self.host}:{self.port} failed during {what}: {exc}") from None
        return p.status, p.body

    def _on_connected(self, conn: _Conn) -> None:
        """Per-connection set-up after HELLO (nixl:// leases landing slots here)."""

    def _locked_conn(self) -> _Conn:
        """A connection whose lock the caller now holds: a free one, a new one while fewer than N, or the next in turn."""
        with self._lock:
            conns = list(self._conns)
            start = self._next
            self._next += 1
        for i in range(len(conns)):
            conn = conns[(start + i) % len(conns)]
            if conn.lock.acquire(blocking=False):
                return conn
        with self._lock:
            grow = len(self._conns) + self._opening < self.max_connections
            if grow:
                self._opening += 1  # reserve the slot; connect outside the lock (handshakes overlap)
        if grow:
            try:
                conn = self._connect()
            finally:
                with self._lock:
                    self._opening -= 1
            conn.lock.acquire()
            with self._lock:
                first = not self._conns and not self._closed
                self._conns.append(conn)
            if first:
                self._open_spares()
            return conn
        if not conns:  # another thread is still opening the only connection: wait for it
            time.sleep(0.01)
            return self._locked_conn()
        conn = conns[start % len(conns)]
        conn.lock.acquire()
        return conn

    def _open_spares(self) -> None:
        """Open the other N-1 connections in the background, so their TCP and TLS handshakes
        overlap the first requests instead of delaying the first chunks by two round trips."""
        with self._lock:
            count = self.max_connections - len(self._conns) - self._opening
            self._opening += max(0, count)

        def open_one() -> None:
            conn = None
            try:
                conn = self._connect()
            except GpumigrateError:
                pass  # the foreground retries (and reports) when it needs another connection
            finally:
                with self._lock:
                    self._opening -= 1
                    keep = conn is not None and not self._closed
                    if keep:
                        self._conns.append(conn)  # type: ignore[arg-type]
                if conn is not None and not keep:
                    self._close_conn(conn)

        for _ in range(max(0, count)):
            threading.Thread(target=open_one, name="gm-stream-open", daemon=True).start()

    def _close_conn(self, conn: _Conn) -> None:
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _drop(self, conn: _Conn, exc: BaseException) -> None:
        """Forget a connection in an unknown protocol state (never reused). Caller holds its lock."""
        conn.broken = exc
        with self._lock:
            if conn in self._conns:
                self._conns.remove(conn)
        self._close_conn(conn)
        for p in conn.pending:  # their fate is unknown: the next push re-sends what did not arrive
            if p.status is None:
                p.status, p.body = ERROR, f"connection lost: {exc}".encode()
                self._note(p)
        conn.pending.clear()

    # ------------------------------------------------------------------ requests and replies
    def _note(self, p: _Pending) -> None:
        """Record a failed fire-and-forget request (a chunk) for the next flush to raise."""
        if p.status != OK and p.chunk is not None:
            rejected = p.chunk if p.status == REJECTED else None
            with self._lock:
                self._errors.append((rejected, self._error(p.status or ERROR, p.body, p.what)))

    def _read_reply(self, conn: _Conn) -> None:
        status, length = REPLY.unpack(_read(conn.sock, REPLY.size))
        if length > MAX_FRAME:
            raise ConnectionError("reply frame too large")
        p = conn.pending.popleft()
        p.status, p.body = status, bytes(_read(conn.sock, length)) if length else b""
        conn.inflight -= p.nbytes
        if p.done is not None:
            p.done()
        self._note(p)

    def _drain_ready(self, conn: _Conn) -> None:
        """Read the replies that have already arrived, without waiting for more."""
        while conn.pending and (conn.sock.pending() or select.select([conn.sock], [], [], 0)[0]):
            self._read_reply(conn)

    def _send(self, conn: _Conn, kind: int, ident: bytes, payload: bytes | bytearray | memoryview, p: _Pending) -> None:
        """Send one request (waiting first while the window is full). Caller holds the connection's lock."""
        while conn.pending and conn.inflight + p.nbytes > self.window_bytes:
            self._read_reply(conn)  # window full: wait for the oldest acknowledgement
        if kind in (PUT_CHUNK, NIXL_LANDED):
            p.chunk = ident.hex()
        conn.sock.sendall(REQUEST.pack(MAGIC, kind, ident, len(payload)))
        if payload:
            conn.sock.sendall(payload)
        conn.pending.append(p)
        conn.inflight += p.nbytes

    def _request(
        self, kind: int, ident: bytes, payload: bytes | bytearray | memoryview, what: str, wait: bool
    ) -> _Pending:
        conn = self._locked_conn()
        try:
            p = _Pending(what, len(payload), conn)
            if conn.broken is not None:  # dropped by another thread while this one waited for it
                raise TransferError(f"stream to receiver {self.host}:{self.port} failed: {conn.broken}")
            try:
                self._send(conn, kind, ident, payload, p)
                if wait:
                    while p.status is None:
                        self._read_reply(conn)
                else:
                    self._drain_ready(conn)
            except (OSError, ConnectionError, ValueError) as exc:
                self._drop(conn, exc)
                raise TransferError(f"stream to receiver {self.host}:{self.port} failed: {exc}") from None
            return p
        finally:
            conn.lock.release()

    def _call(
        self, kind: int, ident: bytes, payload: bytes | bytearray | memoryview = b"", what: str = "a request"
    ) -> tuple[int, bytes]:
        p = self._request(kind, ident, payload, what, wait=True)
        assert p.status is not None
        return p.status, p.body

    def _error(self, status: int, body: bytes, what: str) -> GpumigrateError:
        text = body.decode(errors="replace")
        if status == REJECTED:
            return IntegrityError(f"receiver rejected {what}: {text}")
        if status == DENIED:
            return control.AuthError(f"receiver refused {what}: {text}")
        if status == FULL:
            return TransferError(f"receiver refused {what}: {text}", hint="raise the receiver's --quota or free disk")
        return TransferError(f"receiver failed on {what}: {text}")

    def _check(self, status: int, body: bytes, what: str) -> None:
        if status != OK:
            raise self._error(status, body, what)

    def _raise_errors(self, *, rejected: bool = True) -> None:
        """Raise the first failure recorded; ``rejected=False`` leaves refused chunks for flush (push resends them)."""
        with self._lock:
            errors = [err for cid, err in self._errors if rejected or cid is None]
        if errors:
            raise errors[0]

    def take_rejected(self) -> list[str]:
        """The chunks the receiver rejected since the last call (its check failed: damaged on the way),
        forgotten here so that they can be sent again; other failures stay to be raised."""
        self._collect()
        with self._lock:
            rejected = [cid for cid, _ in self._errors if cid is not None]
            self._errors = [(cid, err) for cid, err in self._errors if cid is None]
        return rejected

    def _finish_sends(self, conn: _Conn) -> None:
        """Send whatever this connection still holds back (nixl://: announcements of WRITEs). Caller holds its lock."""

    def _collect(self) -> None:
        """Wait for every outstanding acknowledgement on every connection."""
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with conn.lock:
                try:
                    self._finish_sends(conn)
                    while conn.pending:
                        self._read_reply(conn)
                except (OSError, ConnectionError, ValueError) as exc:
                    self._drop(conn, exc)

    # ------------------------------------------------------------------ Store
    def put_chunk(self, chunk_id: str, blob: bytes | bytearray | memoryview) -> None:
        """Send one chunk; returns once sent (the caller's buffer is free).

        A rejection is raised by flush(), which always precedes a manifest; a lost connection sooner.
        """
        self._raise_errors(rejected=False)
        self._request(PUT_CHUNK, bytes.fromhex(chunk_id), blob, f"chunk {chunk_id[:16]}", wait=False)

    def get_chunk(self, chunk_id: str) -> bytes:
        raise InvalidInputError(f"{self.url} is write-only: read from the receiver's store")

    def _has(self, chunk_id: str) -> tuple[int, bytes] | None:
        status, body = self._call(HAS_CHUNK, bytes.fromhex(chunk_id))
        if status == NOT_FOUND:
            return None
        self._check(status, body, "a chunk query")
        return int(struct.unpack_from(">Q", body)[0]), body[8:]

    def chunk_size(self, chunk_id: str) -> int | None:
        found = self._has(chunk_id)
        return None if found is None else found[0]

    def chunk_header(self, chunk_id: str) -> bytes:
        found = self._has(chunk_id)
        if found is None:
            raise TransferError(f"chunk {chunk_id[:16]} is missing at receiver {self.host}:{self.port}")
        return found[1]

    def list_chunks(self) -> dict[str, int]:
        """The chunks the receiver holds and has verified (never one it could not check)."""
        status, body = self._call(LIST_CHUNKS, NO_ID)
        self._check(status, body, "the chunk listing")
        return {k: int(v) for k, v in json.loads(body).items()}

    def put_manifest(self, image_id: str, data: bytes) -> None:
        status, body = self._call(PUT_MANIFEST, bytes.fromhex(image_id), data)
        self._check(status, body, f"manifest {image_id[:16]}")

    def get_manifest(self, image_id: str) -> bytes:
        """The receiver's copy of a manifest (a parent for the next pre-copy round); the caller verifies it."""
        status, body = self._call(GET_MANIFEST, bytes.fromhex(image_id))
        if status == NOT_FOUND:
            raise NotFoundError(f"no image {image_id} at receiver {self.host}:{self.port}")
        self._check(status, body, f"manifest {image_id[:16]}")
        return body

    def list_manifests(self) -> list[str]:
        status, body = self._call(LIST_MANIFESTS, NO_ID)
        self._check(status, body, "the image listing")
        return list(json.loads(body))

    def flush(self) -> None:
        """Wait for every chunk's acknowledgement, raise the first rejection, then flush the receiver's store."""
        self._collect()
        self._raise_errors()
        status, body = self._call(FLUSH, NO_ID)
        self._check(status, body, "flush")

    def hello(self) -> dict[str, Any]:
        """Connect and authenticate now (a pinned certificate is checked before anything is sent); returns
        what the receiver answered to HELLO (its version, key, NIXL, and the store images land in)."""
        if not self.receiver_info:
            self._locked_conn().lock.release()
        return dict(self.receiver_info)

    def shutdown_receiver(self) -> None:
        """Ask the receiver to stop (after it flushed its store); an authenticated request like any other."""
        status, body = self._call(SHUTDOWN, NO_ID, what="shutdown")
        self._check(status, body, "shutdown")

    def close(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
            self._closed = True
        for conn in conns:
            self._close_conn(conn)

"""N authenticated, pipelined TLS connections to one receiver: the link under ``stream://`` and ``nixl://``.

Requests are pipelined: a request returns once it is sent, and its reply is collected later by whichever thread
next uses that connection (a window of unacknowledged bytes bounds each connection). A failed request that nobody
waits for (a chunk) is recorded, for the store's next flush to raise. All reads and writes of one TLS connection
happen under its lock, one thread at a time (OpenSSL objects are not thread-safe). The frames are ``wire.py``'s.
"""

from __future__ import annotations

import collections
import contextlib
import json
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpumigrate import control
from gpumigrate.errors import EXIT_INVALID, GpumigrateError, IntegrityError, TransferError
from gpumigrate.transfer.stores.wire import (
    CHANNEL,
    DENIED,
    ERROR,
    FULL,
    HELLO,
    MAGIC,
    MAX_FRAME,
    NIXL_LANDED,
    NO_ID,
    OK,
    PROTOCOL_VERSION,
    PUT_CHUNK,
    REJECTED,
    REPLY,
    REQUEST,
    certificate_fingerprint,
    hello_request,
    read_frame,
)


class PinnedCertificateError(TransferError):
    """The receiver's certificate is not the one the URL pins: refused before any request was sent (exit 2)."""

    exit_code = EXIT_INVALID


# Unacknowledged request bytes allowed per connection. Replies come back in order, so a sender
# keeps sending while earlier chunks are still being verified: the link never idles for a round
# trip plus the receiver's verification per chunk (stop-and-wait did, once per chunk).
WINDOW_BYTES = 32 << 20


@dataclass
class Pending:
    """One request awaiting its reply; ``what`` names it in errors; ``done`` runs when its reply is read."""

    what: str
    nbytes: int
    conn: Conn | None = None
    status: int | None = None
    body: bytes = b""
    done: Callable[[], None] | None = None
    chunk: str | None = None  # the chunk a PUT_CHUNK / NIXL_LANDED carries


@dataclass
class Conn:
    sock: ssl.SSLSocket
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: collections.deque[Pending] = field(default_factory=collections.deque)
    inflight: int = 0
    broken: BaseException | None = None
    extra: object = None  # a subclass's per-connection state (nixl://: this connection's landing slots)
    # poll, not select: select() refuses a descriptor numbered 1024 or more, and the process this runs in (a
    # serving workload's agent, a long test session) may well hold that many files.
    readable: select.poll = field(init=False)

    def __post_init__(self) -> None:
        self.readable = select.poll()
        self.readable.register(self.sock, select.POLLIN)


class ReceiverConnections:
    """Up to ``max_connections`` TLS connections to the receiver at ``host:port``, opened as needed, each
    authenticated with HELLO (``control_key``) and, when ``fingerprint`` is given, pinned to that certificate.
    Subclasses hook in per-connection set-up (:meth:`_on_connected`), held-back sends (:meth:`_finish_sends`)
    and clean-up (:meth:`_close_conn`)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        fingerprint: str | None,
        max_connections: int,
        window_bytes: int,
        control_key: bytes,
    ) -> None:
        self.host, self.port = host, port
        self.fingerprint = fingerprint
        self.max_connections = max(1, max_connections)
        self.window_bytes = max(1, window_bytes)
        self.control_key = control_key
        self.receiver_info: dict[str, Any] = {}
        self._conns: list[Conn] = []
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
    def _connect(self) -> Conn:
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
        conn = Conn(sock)
        try:
            self._hello(conn, seen)
            self._on_connected(conn)
        except BaseException:
            with contextlib.suppress(OSError):
                sock.close()
            raise
        return conn

    def _hello(self, conn: Conn, seen: str) -> None:
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

    def _exchange(self, conn: Conn, kind: int, payload: bytes, what: str) -> tuple[int, bytes]:
        """One synchronous request on a connection nobody else uses yet (set-up)."""
        p = Pending(what, len(payload), conn)
        try:
            self._send(conn, kind, NO_ID, payload, p)
            while p.status is None:
                self._read_reply(conn)
        except (OSError, ConnectionError, ValueError) as exc:
            raise TransferError(f"stream to receiver {self.host}:{self.port} failed during {what}: {exc}") from None
        return p.status, p.body

    def _on_connected(self, conn: Conn) -> None:
        """Per-connection set-up after HELLO (nixl:// leases landing slots here)."""

    def _locked_conn(self) -> Conn:
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
                keep = False
                with self._lock:
                    self._opening -= 1
                    if conn is not None and not self._closed:
                        self._conns.append(conn)
                        keep = True
                if conn is not None and not keep:
                    self._close_conn(conn)

        for _ in range(max(0, count)):
            threading.Thread(target=open_one, name="gm-stream-open", daemon=True).start()

    def _close_conn(self, conn: Conn) -> None:
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _drop(self, conn: Conn, exc: BaseException) -> None:
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
    def _note(self, p: Pending) -> None:
        """Record a failed fire-and-forget request (a chunk) for the next flush to raise."""
        if p.status != OK and p.chunk is not None:
            rejected = p.chunk if p.status == REJECTED else None
            with self._lock:
                self._errors.append((rejected, self._error(p.status or ERROR, p.body, p.what)))

    def _read_reply(self, conn: Conn) -> None:
        status, length = REPLY.unpack(read_frame(conn.sock, REPLY.size))
        if length > MAX_FRAME:
            raise ConnectionError("reply frame too large")
        p = conn.pending.popleft()
        p.status, p.body = status, bytes(read_frame(conn.sock, length)) if length else b""
        conn.inflight -= p.nbytes
        if p.done is not None:
            p.done()
        self._note(p)

    def _drain_ready(self, conn: Conn) -> None:
        """Read the replies that have already arrived, without waiting for more."""
        while conn.pending and (conn.sock.pending() or conn.readable.poll(0)):
            self._read_reply(conn)

    def _send(self, conn: Conn, kind: int, ident: bytes, payload: bytes | bytearray | memoryview, p: Pending) -> None:
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
    ) -> Pending:
        conn = self._locked_conn()
        try:
            p = Pending(what, len(payload), conn)
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

    def _finish_sends(self, conn: Conn) -> None:
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

    def hello(self) -> dict[str, Any]:
        """Connect and authenticate now (a pinned certificate is checked before anything is sent); returns
        what the receiver answered to HELLO (its version, key, NIXL, and the store images land in)."""
        if not self.receiver_info:
            self._locked_conn().lock.release()
        return dict(self.receiver_info)

    def close_connections(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
            self._closed = True
        for conn in conns:
            self._close_conn(conn)

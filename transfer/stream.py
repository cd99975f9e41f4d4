"""``stream://host:port``: host-to-host transfer over N parallel TLS connections (TRANSPORTS.md, Stream).

This module holds the wire protocol and the sender, a write-only :class:`Store` (so the writer and
push use it unchanged); the receiver is in ``receiver.py`` (:func:`serve_stream`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import queue
import socket
import ssl
import struct
import threading
from typing import Any

from gpumigrate.transfer.stores import Store, split_url

from gpumigrate.errors import IntegrityError, InvalidInputError, NotFoundError, TransferError

MAGIC = b"GMS1"
REQUEST = struct.Struct(">4sB32sQ")
REPLY = struct.Struct(">BQ")
PUT_CHUNK, PUT_MANIFEST, LIST_CHUNKS, HAS_CHUNK, FLUSH, GET_MANIFEST, LIST_MANIFESTS, HELLO = 1, 2, 3, 4, 5, 6, 7, 8
PROTOCOL_VERSION = 1
OK, NOT_FOUND, REJECTED, ERROR = 0, 1, 2, 3
MAX_FRAME = 256 << 20  # larger than any chunk or manifest: a bigger frame is a protocol error, never an allocation
NO_ID = bytes(32)


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
    if not sep or not port.isdigit():
        raise InvalidInputError(f"listen address {listen!r} must be host:port (port 0 picks a free one)")
    return host.strip("[]") or "0.0.0.0", int(port)


# ----------------------------------------------------------------------------- sender


class StreamStore(Store):
    """Sender side of ``stream://host:port[?fingerprint=SHA256HEX]``. Write-only."""

    readable = False
    prefers_listing = True

    def __init__(self, url: str, *, connections: int = 4) -> None:
        _, netloc, _, query = split_url(url)
        self.url = url
        self.host, self.port = parse_listen(netloc)
        if self.host == "0.0.0.0":
            raise InvalidInputError(f"stream URL {url!r} names no host")
        self.fingerprint = (query.get("fingerprint") or [None])[0]
        self.max_connections = max(1, int((query.get("connections") or [connections])[0]))
        self._hello: dict[str, Any] | None = None
        self._count = 0  # connections open or being opened
        self._idle: queue.LifoQueue[ssl.SSLSocket] = queue.LifoQueue()
        self._all: list[ssl.SSLSocket] = []
        self._lock = threading.Lock()
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        self._ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        # The receiver's certificate is self-signed: it is pinned by fingerprint when the URL gives
        # one. Chunks and manifests are end-to-end authenticated by the image key either way.
        self._ctx.check_hostname = False
        self._ctx.verify_mode = ssl.CERT_NONE

    def _connect(self) -> ssl.SSLSocket:
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
        if self.fingerprint:
            cert = sock.getpeercert(binary_form=True) or b""
            if hashlib.sha256(cert).hexdigest() != self.fingerprint.lower():
                sock.close()
                raise TransferError(f"receiver {self.host}:{self.port} presented a certificate that does not match the pinned fingerprint")
        sock.settimeout(300)
        return sock

    def _acquire(self) -> ssl.SSLSocket:
        """An idle connection, a new one while fewer than N exist, or the next one returned."""
        while True:
            try:
                return self._idle.get_nowait()
            except queue.Empty:
                pass
            with self._lock:
                grow = self._count < self.max_connections
                if grow:
                    self._count += 1  # reserve the slot; connect outside the lock (handshakes overlap)
            if grow:
                try:
                    sock = self._connect()
                except BaseException:
                    with self._lock:
                        self._count -= 1
                    raise
                with self._lock:
                    self._all.append(sock)
                return sock
            try:  # all N busy: wait, but look again if one of them failed and freed its slot
                return self._idle.get(timeout=0.2)
            except queue.Empty:
                continue

    @contextlib.contextmanager
    def _conn(self) -> Any:
        sock = self._acquire()
        ok = False
        try:
            yield sock
            ok = True
        finally:
            if ok:
                self._idle.put(sock)
            else:  # a connection in an unknown protocol state is dropped, never reused
                with self._lock:
                    if sock in self._all:
                        self._all.remove(sock)
                    self._count -= 1
                sock.close()

    def _call(self, kind: int, ident: bytes, payload: bytes | bytearray | memoryview = b"") -> tuple[int, bytes]:
        try:
            with self._conn() as sock:
                sock.sendall(REQUEST.pack(MAGIC, kind, ident, len(payload)))
                if payload:
                    sock.sendall(payload)
                status, length = REPLY.unpack(_read(sock, REPLY.size))
                if length > MAX_FRAME:
                    raise ConnectionError("reply frame too large")
                return status, bytes(_read(sock, length)) if length else b""
        except (OSError, ConnectionError) as exc:
            raise TransferError(f"stream to {self.host}:{self.port} failed: {exc}") from None

    def _check(self, status: int, body: bytes, what: str) -> None:
        if status == REJECTED:
            raise IntegrityError(f"receiver rejected {what}: {body.decode(errors='replace')}")
        if status != OK:
            raise TransferError(f"receiver failed on {what}: {body.decode(errors='replace')}")

    def put_chunk(self, chunk_id: str, blob: bytes | bytearray | memoryview) -> None:
        status, body = self._call(PUT_CHUNK, bytes.fromhex(chunk_id), blob)
        self._check(status, body, f"chunk {chunk_id[:16]}")

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

    @property
    def verifies_on_arrival(self) -> bool:
        """True when the receiver holds the key and checks AES-GCM and BLAKE3 before acknowledging."""
        if self._hello is None:
            status, body = self._call(HELLO, NO_ID)
            self._check(status, body, "hello")
            self._hello = json.loads(body)
            if self._hello.get("version") != PROTOCOL_VERSION:
                raise TransferError(f"receiver speaks stream protocol {self._hello.get('version')}, this sender {PROTOCOL_VERSION}")
        return bool(self._hello.get("verifies"))

    def flush(self) -> None:
        status, body = self._call(FLUSH, NO_ID)
        self._check(status, body, "flush")

    def close(self) -> None:
        with self._lock:
            socks, self._all = self._all, []
            self._count = 0
            self._idle = queue.LifoQueue()
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()

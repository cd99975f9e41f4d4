"""``stream://host:port``: host-to-host transfer over N parallel TLS connections (TRANSPORTS.md, Stream).

The sender side is a write-only :class:`Store` (so the writer and push use it unchanged); the
receiver (:func:`serve_stream`) verifies each chunk (AES-GCM tag and BLAKE3 of the plaintext when it
has the key, the object header otherwise) before it stores it and acknowledges, and accepts a
manifest only when every object the manifest names is already stored.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import queue
import socket
import ssl
import struct
import tempfile
import threading
from typing import Any

from gpumigrate.transfer.chunkobj import Sealer, parse_header
from gpumigrate.transfer.manifest import open_manifest
from gpumigrate.transfer.stores import Store, open_store, split_url

from gpumigrate.errors import GpumigrateError, IntegrityError, InvalidInputError, NotFoundError, TransferError

MAGIC = b"GMS1"
REQUEST = struct.Struct(">4sB32sQ")
REPLY = struct.Struct(">BQ")
PUT_CHUNK, PUT_MANIFEST, LIST_CHUNKS, HAS_CHUNK, FLUSH, GET_MANIFEST, LIST_MANIFESTS = 1, 2, 3, 4, 5, 6, 7
OK, NOT_FOUND, REJECTED, ERROR = 0, 1, 2, 3
MAX_FRAME = 1 << 30  # a frame larger than any chunk or manifest is a protocol error, not an allocation
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

    def __init__(self, url: str, *, connections: int = 4) -> None:
        _, netloc, _, query = split_url(url)
        self.url = url
        self.host, self.port = parse_listen(netloc)
        if self.host == "0.0.0.0":
            raise InvalidInputError(f"stream URL {url!r} names no host")
        self.fingerprint = (query.get("fingerprint") or [None])[0]
        self.max_connections = max(1, int((query.get("connections") or [connections])[0]))
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
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock = self._ctx.wrap_socket(raw)
        if self.fingerprint:
            cert = sock.getpeercert(binary_form=True) or b""
            if hashlib.sha256(cert).hexdigest() != self.fingerprint.lower():
                sock.close()
                raise TransferError(f"receiver {self.host}:{self.port} presented a certificate that does not match the pinned fingerprint")
        sock.settimeout(300)
        return sock

    @contextlib.contextmanager
    def _conn(self) -> Any:
        try:
            sock = self._idle.get_nowait()
        except queue.Empty:
            with self._lock:
                grow = len(self._all) < self.max_connections
                if grow:
                    sock = self._connect()
                    self._all.append(sock)
            if not grow:
                sock = self._idle.get()
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

    def chunk_size(self, chunk_id: str) -> int | None:
        status, body = self._call(HAS_CHUNK, bytes.fromhex(chunk_id))
        if status == NOT_FOUND:
            return None
        self._check(status, body, "a chunk query")
        return int(struct.unpack(">Q", body)[0])

    def chunk_header(self, chunk_id: str) -> bytes:
        raise InvalidInputError(f"{self.url} is write-only")

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

    def flush(self) -> None:
        status, body = self._call(FLUSH, NO_ID)
        self._check(status, body, "flush")

    def close(self) -> None:
        with self._lock:
            socks, self._all = self._all, []
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()


# ----------------------------------------------------------------------------- receiver


def _self_signed(host: str) -> tuple[bytes, bytes, str]:
    """A fresh ECDSA P-256 certificate: (cert PEM, key PEM, SHA-256 fingerprint of the DER cert)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"gpumigrate-receiver {host}")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=2))
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fingerprint = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()
    return cert.public_bytes(serialization.Encoding.PEM), pem_key, fingerprint


class StreamServer:
    """A running receiver. ``port`` is the bound port, ``fingerprint`` the SHA-256 of its certificate."""

    def __init__(self, listen: str, store: Store, *, key: bytes | None = None) -> None:
        host, port = parse_listen(listen)
        self.store = store
        self.sealer = Sealer(key) if key is not None else None
        self.chunks_received = 0
        self.chunks_rejected = 0
        self.bytes_received = 0
        self.manifests: list[str] = []
        self.manifest_event = threading.Event()
        self._lock = threading.Lock()
        cert_pem, key_pem, self.fingerprint = _self_signed(host)
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        with tempfile.TemporaryDirectory() as tmp:  # ssl loads certs from files only; the key never outlives this block
            cpath, kpath = os.path.join(tmp, "c.pem"), os.path.join(tmp, "k.pem")
            fd = os.open(kpath, os.O_WRONLY | os.O_CREAT, 0o600)
            os.write(fd, key_pem)
            os.close(fd)
            with open(cpath, "wb") as fh:
                fh.write(cert_pem)
            self._ctx.load_cert_chain(cpath, kpath)
        self._sock = socket.create_server((host, port), reuse_port=False, backlog=64)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept_loop, name="gm-stream-accept", daemon=True)
        self._acceptor.start()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"stream://{host}:{self.port}?fingerprint={self.fingerprint}"

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                raw, _ = self._sock.accept()
            except OSError:
                return
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = threading.Thread(target=self._serve, args=(raw,), name="gm-stream-conn", daemon=True)
            with self._lock:
                self._conns.add(raw)
                self._threads.append(t)
            t.start()

    def _serve(self, raw: socket.socket) -> None:
        buf = bytearray(8 << 20)
        scratch = bytearray(8 << 20)
        try:
            sock = self._ctx.wrap_socket(raw, server_side=True)
        except (OSError, ssl.SSLError):
            self._forget(raw)
            return
        try:
            while not self._closed.is_set():
                try:
                    head = _read(sock, REQUEST.size)
                except (ConnectionError, OSError):
                    return
                magic, kind, ident, length = REQUEST.unpack(head)
                if magic != MAGIC or length > MAX_FRAME:
                    return  # not our protocol: drop the connection
                if len(buf) < length:
                    buf = bytearray(length)
                payload = _read(sock, length, buf)
                status, body = self._handle(kind, ident.hex(), payload, scratch)
                sock.sendall(REPLY.pack(status, len(body)) + body)
        except (ConnectionError, OSError):
            return
        finally:
            with contextlib.suppress(OSError):
                sock.close()
            self._forget(raw)

    def _forget(self, raw: socket.socket) -> None:
        with self._lock:
            self._conns.discard(raw)

    def _open_base(self, base_id: str) -> bytes:
        assert self.sealer is not None
        blob = self.store.get_chunk(base_id)
        out = bytearray(parse_header(blob, base_id).raw_len)
        self.sealer.open_into(base_id, blob, memoryview(out), self._open_base)
        return bytes(out)

    def _handle(self, kind: int, ident: str, payload: memoryview, scratch: bytearray) -> tuple[int, bytes]:
        try:
            if kind == PUT_CHUNK:
                header = parse_header(payload, ident)
                if self.sealer is not None:
                    out = scratch if len(scratch) >= header.raw_len else bytearray(header.raw_len)
                    self.sealer.open_into(ident, payload, memoryview(out)[: header.raw_len], self._open_base)
                self.store.put_chunk(ident, payload)
                with self._lock:
                    self.chunks_received += 1
                    self.bytes_received += len(payload)
                return OK, b""
            if kind == HAS_CHUNK:
                size = self.store.chunk_size(ident)
                return (NOT_FOUND, b"") if size is None else (OK, struct.pack(">Q", size))
            if kind == LIST_CHUNKS:
                return OK, json.dumps(self.store.list_chunks()).encode()
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
            return ERROR, f"unknown request {kind}".encode()
        except GpumigrateError as exc:
            if kind == PUT_CHUNK:
                with self._lock:
                    self.chunks_rejected += 1
            return REJECTED, exc.message.encode()
        except Exception as exc:  # the receiver keeps serving other connections
            return ERROR, f"{type(exc).__name__}: {exc}".encode()

    def _accept_manifest(self, image_id: str, data: bytes) -> tuple[int, bytes]:
        if self.sealer is not None:
            body = open_manifest(data, image_id, self.sealer)
        else:
            import blake3

            if blake3.blake3(data).hexdigest() != image_id:
                return REJECTED, b"manifest does not match its image id"
            body = json.loads(data)["body"]
        have = self.store.list_chunks()
        missing = [cid for cid, entry in body["objects"].items() if have.get(cid) != int(entry[0])]
        if missing:
            return REJECTED, f"{len(missing)} chunks named by the manifest have not arrived (first {missing[0][:16]})".encode()
        self.store.flush()
        self.store.put_manifest(image_id, data)
        with self._lock:
            self.manifests.append(image_id)
        self.manifest_event.set()
        return OK, b""

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone does not on Linux
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._lock:
            conns = list(self._conns)
            threads = list(self._threads)
        for raw in conns:
            with contextlib.suppress(OSError):
                raw.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(timeout=5)
        for t in threads:
            t.join(timeout=5)
        self.store.close()

    def __enter__(self) -> StreamServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_stream(listen: str, store_url: str, *, key: bytes | None = None, endpoint_url: str | None = None) -> StreamServer:
    """Start a receiver on ``listen`` (host:port, port 0 = any) that writes into ``store_url``."""
    store = open_store(store_url, endpoint_url=endpoint_url)
    if not store.readable:
        raise InvalidInputError("a stream receiver must write into a readable store (file://, s3://, gs://)")
    return StreamServer(listen, store, key=key)

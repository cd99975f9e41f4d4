"""The ``stream://`` receiver: verifies each chunk before storing and acknowledging it (TRANSPORTS.md).

With the image key it authenticates (AES-GCM), decodes and recomputes BLAKE3 against the chunk id;
it accepts a manifest only when every object the manifest names is already stored.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import socket
import ssl
import struct
import tempfile
import threading

from gpumigrate.errors import GpumigrateError, InvalidInputError, NotFoundError
from gpumigrate.transfer.chunkobj import Sealer, parse_header
from gpumigrate.transfer.manifest import open_manifest
from gpumigrate.transfer.stores import Store, open_store
from gpumigrate.transfer.stream import (
    ERROR,
    FLUSH,
    GET_MANIFEST,
    HAS_CHUNK,
    HELLO,
    LIST_CHUNKS,
    LIST_MANIFESTS,
    MAGIC,
    MAX_FRAME,
    NOT_FOUND,
    OK,
    PROTOCOL_VERSION,
    PUT_CHUNK,
    PUT_MANIFEST,
    REJECTED,
    REPLY,
    REQUEST,
    _read,
    parse_listen,
)


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
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
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
                if size is None:
                    return NOT_FOUND, b""
                return OK, struct.pack(">Q", size) + self.store.chunk_header(ident)
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
            if kind == HELLO:
                return OK, json.dumps({"version": PROTOCOL_VERSION, "verifies": self.sealer is not None}).encode()
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
            return (
                REJECTED,
                f"{len(missing)} chunks named by the manifest have not arrived (first {missing[0][:16]})".encode(),
            )
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


def serve_stream(
    listen: str, store_url: str, *, key: bytes | None = None, endpoint_url: str | None = None
) -> StreamServer:
    """Start a receiver on ``listen`` (host:port, port 0 = any) that writes into ``store_url``."""
    store = open_store(store_url, endpoint_url=endpoint_url, sync="deferred")
    if not store.readable:
        raise InvalidInputError("a stream receiver must write into a readable store (file://, s3://, gs://)")
    return StreamServer(listen, store, key=key)

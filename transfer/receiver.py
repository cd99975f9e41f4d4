"""The receiver behind ``stream://`` and ``nixl://`` (TRANSPORTS.md, Receiver).

It serves nothing to a client that has not authenticated (HELLO signed with the control key), it
verifies every chunk (AES-GCM, decode, BLAKE3 against the id) before storing it — a chunk it cannot
verify is never stored — and it keeps its store under a disk quota. Chunks left by an earlier run
(a receiver killed mid-transfer) are verified again before they are listed, so a resumed push
moves only what is missing and trusts nothing unchecked. With ``nixl`` it also lands NIXL WRITEs in
a pool of registered slots (``nixl.py``). Images land in a ``file://`` store that the target reads.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import logging
import os
import socket
import ssl
import struct
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from gpumigrate import control
from gpumigrate.errors import GpumigrateError, IntegrityError, InvalidInputError, NotFoundError
from gpumigrate.transfer.chunkobj import Sealer, parse_header
from gpumigrate.transfer.manifest import open_manifest
from gpumigrate.transfer.stores import FileStore, open_store
from gpumigrate.transfer.stream import (
    CHANNEL,
    DENIED,
    ERROR,
    FLUSH,
    FULL,
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
    _read,
    parse_listen,
)

log = logging.getLogger(__name__)

MAX_UNAUTHENTICATED_FRAME = 64 << 10  # HELLO is small: a client proves itself before we read more
AUTH_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64
DISK_RESERVE_BYTES = 64 << 20  # never fill the disk to the last block, whatever the quota
AUDIT_THREADS = 4


class _Refused(Exception):
    """A request from a client that has not authenticated: answered DENIED, then the connection closes."""


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


def _tls_context(host: str) -> tuple[ssl.SSLContext, str]:
    cert_pem, key_pem, fingerprint = _self_signed(host)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    with tempfile.TemporaryDirectory() as tmp:  # ssl loads certs from files only; the key never outlives this block
        cpath, kpath = os.path.join(tmp, "c.pem"), os.path.join(tmp, "k.pem")
        fd = os.open(kpath, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, key_pem)
        os.close(fd)
        with open(cpath, "wb") as fh:
            fh.write(cert_pem)
        ctx.load_cert_chain(cpath, kpath)
    return ctx, fingerprint


@dataclass
class _Session:
    """One client connection: authenticated yet, and the NIXL slots it holds."""

    peer: str
    authenticated: bool = False
    slots: list[int] = field(default_factory=list)
    copy: bytearray | None = None  # where a landed object is copied before it is verified


class Receiver:
    """A running receiver. ``port`` is the bound port, ``fingerprint`` the SHA-256 of its certificate.

    ``key`` is the image key (None: only unencrypted chunks can be verified, so encrypted ones are
    refused); ``control_key`` authenticates clients; ``quota_bytes`` caps what the store may hold;
    ``landing`` is a :class:`~gpumigrate.transfer.nixl.HostLanding` for nixl:// senders.
    """

    def __init__(
        self,
        listen: str,
        store: FileStore,
        *,
        key: bytes | None,
        control_key: bytes,
        quota_bytes: int | None = None,
        landing: Any = None,
        advertise: str | None = None,
    ) -> None:
        host, port = parse_listen(listen)
        self.advertise = advertise
        self.store = store
        self.sealer = Sealer(key)
        self.control_key = control_key
        self.quota_bytes = quota_bytes
        self.landing = landing
        self.chunks_received = 0
        self.chunks_rejected = 0
        self.bytes_received = 0
        self.refusals = 0
        self.clients = 0  # connections that authenticated
        self.chunks_via_nixl = 0  # of chunks_received, those a NIXL WRITE landed (the rest came inline)
        self.manifests: list[str] = []
        self.manifest_event = threading.Event()
        self.stop_requested = threading.Event()
        self._guard = control.ReplayGuard()
        self._lock = threading.Lock()
        self._verified: dict[str, int] = {}
        self._used = 0
        self._audited = threading.Event()
        self.chunks_present = 0  # verified chunks found at start (left by an earlier run)
        self.chunks_discarded = 0  # chunks found at start that failed verification, removed
        self._ctx, self.fingerprint = _tls_context(host)
        self._sock = socket.create_server((host, port), reuse_port=False, backlog=64)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        threading.Thread(target=self._audit, name="gm-recv-audit", daemon=True).start()
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

    # ------------------------------------------------------------------ chunks already on disk
    def _audit(self) -> None:
        """Verify what an earlier run left before listing any of it (a kill -9 leaves whole files whose
        data may not have reached the disk, and hidden temp files); remove what fails."""
        try:
            root = self.store.root / "chunks"
            if root.is_dir():
                for sub in os.scandir(root):
                    if sub.is_dir():
                        for entry in os.scandir(sub.path):
                            if entry.name.startswith("."):
                                with contextlib.suppress(OSError):
                                    os.unlink(entry.path)
            found = self.store.list_chunks()
            is_delta = {c: self._is_delta(c) for c in found}
            bases = [c for c, delta in is_delta.items() if not delta]
            deltas = [c for c, delta in is_delta.items() if delta]
            with ThreadPoolExecutor(AUDIT_THREADS, thread_name_prefix="gm-recv-audit") as pool:
                for phase in (bases, deltas):  # a delta's base must be verified first
                    list(pool.map(self._audit_one, phase))
            manifests = self.store.root / "manifests"
            extra = sum(e.stat().st_size for e in os.scandir(manifests)) if manifests.is_dir() else 0
            with self._lock:
                self._used = sum(self._verified.values()) + extra
                self.chunks_present = len(self._verified)
        except Exception:  # a receiver that cannot read its own store serves an empty listing, never a wrong one
            log.exception("checking the chunks already in %s failed", self.store.url)
        finally:
            self._audited.set()

    def _is_delta(self, chunk_id: str) -> bool:
        header = self.store.chunk_header(chunk_id)
        return len(header) > 4 and bool(header[4] & 0x80)  # byte 4: codec, 0x80 = XOR delta (FORMAT.md)

    def _audit_one(self, chunk_id: str) -> None:
        try:
            blob = self.store.get_chunk(chunk_id)
            header = parse_header(blob, chunk_id)
            if header.encrypted and not self.sealer.encrypted:
                return  # checkable only with the image key: neither listed nor removed
            out = bytearray(header.raw_len)
            self.sealer.open_into(chunk_id, blob, memoryview(out), self._open_base)
        except GpumigrateError as exc:
            log.warning("removing chunk %s left by an earlier run: %s", chunk_id[:16], exc.message)
            self.store.remove_chunk(chunk_id)
            with self._lock:
                self.chunks_discarded += 1
            return
        with self._lock:
            self._verified[chunk_id] = len(blob)

    def _open_base(self, base_id: str) -> bytes:
        blob = self.store.get_chunk(base_id)
        out = bytearray(parse_header(blob, base_id).raw_len)
        self.sealer.open_into(base_id, blob, memoryview(out), self._open_base)
        return bytes(out)

    def verified_chunks(self) -> dict[str, int]:
        self._audited.wait()
        with self._lock:
            return dict(self._verified)

    # ------------------------------------------------------------------ connections
    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                raw, addr = self._sock.accept()
            except OSError:
                return
            with self._lock:
                crowded = len(self._conns) >= MAX_CONNECTIONS
            if crowded:
                raw.close()
                continue
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = threading.Thread(target=self._serve, args=(raw, f"{addr[0]}:{addr[1]}"), name="gm-recv-conn")
            t.daemon = True
            with self._lock:
                self._conns.add(raw)
                self._threads.append(t)
            t.start()

    def _serve(self, raw: socket.socket, peer: str) -> None:
        raw.settimeout(AUTH_TIMEOUT_S)  # the handshake and HELLO must come promptly
        try:
            sock = self._ctx.wrap_socket(raw, server_side=True)
        except (OSError, ssl.SSLError):
            self._forget(raw)
            return
        session = _Session(peer)
        buf = bytearray(1 << 20)
        scratch = bytearray(8 << 20)
        try:
            while not self._closed.is_set():
                try:
                    head = _read(sock, REQUEST.size)
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
                payload = _read(sock, length, buf)
                try:
                    status, body = self._handle(session, kind, ident.hex(), payload, scratch)
                except _Refused as exc:
                    self._refuse(sock, session, str(exc))
                    return
                sock.sendall(REPLY.pack(status, len(body)) + body)
                if kind == HELLO:
                    sock.settimeout(300)
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

    def _refuse(self, sock: ssl.SSLSocket, session: _Session, why: str) -> None:
        """Answer DENIED and count it; the log names the peer and the reason, never the request's content."""
        with self._lock:
            self.refusals += 1
        log.warning("receiver refused client %s: %s", session.peer, why)
        message = b"unauthenticated: send HELLO signed with the control key first"
        with contextlib.suppress(OSError):
            sock.sendall(REPLY.pack(DENIED, len(message)) + message)

    def _forget(self, raw: socket.socket) -> None:
        with self._lock:
            self._conns.discard(raw)

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
                status, body = self._land(ident, blob, scratch)
                if kind == NIXL_LANDED and status == OK:
                    with self._lock:
                        self.chunks_via_nixl += 1
                return status, body
            if kind == HAS_CHUNK:
                size = self.verified_chunks().get(ident)
                if size is None:
                    return NOT_FOUND, b""
                return OK, struct.pack(">Q", size) + self.store.chunk_header(ident)
            if kind == LIST_CHUNKS:
                return OK, json.dumps(self.verified_chunks()).encode()
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

    def _landed(self, session: _Session, payload: memoryview) -> memoryview:
        from gpumigrate.transfer.nixl import SLOT

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

    def _reserve(self, nbytes: int) -> bool:
        """Count ``nbytes`` against the quota and the disk's free space; False when either would overflow."""
        st = os.statvfs(self.store.root if self.store.root.exists() else self.store.root.parent)
        if st.f_bavail * st.f_frsize < nbytes + DISK_RESERVE_BYTES:
            return False
        with self._lock:
            if self.quota_bytes is not None and self._used + nbytes > self.quota_bytes:
                return False
            self._used += nbytes
        return True

    def _unreserve(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes

    def _land(self, ident: str, blob: memoryview, scratch: bytearray) -> tuple[int, bytes]:
        """Verify one object, then store it; nothing unverified is ever stored."""
        self._audited.wait()
        n = len(blob)
        with self._lock:
            have = self._verified.get(ident)
        if have == n:
            return OK, b""  # already here and verified (a re-sent chunk)
        if not self._reserve(n):
            with self._lock:
                used = self._used
            return FULL, f"quota: {n} more bytes would exceed {self.quota_bytes} (holding {used})".encode()
        try:
            header = parse_header(blob, ident)
            out = scratch if len(scratch) >= header.raw_len else bytearray(header.raw_len)
            self.sealer.open_into(ident, blob, memoryview(out)[: header.raw_len], self._open_base)
            self.store.put_chunk(ident, blob)
        except BaseException:
            self._unreserve(n)
            raise
        with self._lock:
            if have is not None:
                self._used -= have
            self._verified[ident] = n
            self.chunks_received += 1
            self.bytes_received += n
        return OK, b""

    def _accept_manifest(self, image_id: str, data: bytes) -> tuple[int, bytes]:
        body = open_manifest(data, image_id, self.sealer)  # signature, key id; alg none only where allowed
        have = self.verified_chunks()
        missing = [cid for cid, entry in body["objects"].items() if have.get(cid) != int(entry[0])]
        if missing:
            return (
                REJECTED,
                f"{len(missing)} chunks named by the manifest have not arrived (first {missing[0][:16]})".encode(),
            )
        if not self._reserve(len(data)):
            return FULL, b"quota: no room for the manifest"
        self.store.flush()
        self.store.put_manifest(image_id, data)
        with self._lock:
            self.manifests.append(image_id)
        self.manifest_event.set()
        return OK, b""

    # ------------------------------------------------------------------ life cycle
    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "images": list(self.manifests),
                "chunks_received": self.chunks_received,
                "chunks_rejected": self.chunks_rejected,
                "chunks_present": self.chunks_present,
                "chunks_discarded": self.chunks_discarded,
                "bytes_received": self.bytes_received,
                "bytes_stored": self._used,
                "refusals": self.refusals,
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
            conns = list(self._conns)
            threads = list(self._threads)
        for raw in conns:
            with contextlib.suppress(OSError):
                raw.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(timeout=5)
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
) -> Receiver:
    """Start a receiver on ``listen`` (host:port, port 0 = any) that writes into the ``file://`` store ``store_url``.

    ``control_key`` defaults to the deployment's (``gpumigrate.control.load_key``, created under the
    state root on first use). ``nixl=True`` adds a NIXL landing pool (nixl:// senders). ``advertise``
    is the host name senders use when the listen address is a wildcard.
    """
    store = open_store(store_url, sync="deferred")
    if not isinstance(store, FileStore):
        raise InvalidInputError(
            f"a receiver writes into a local directory (file://), not {store_url!r}",
            hint="the target reads the image from there: verify and restore use that file:// store",
        )
    landing = None
    if nixl:
        from gpumigrate.transfer.nixl import HostLanding

        landing = HostLanding(transports=nixl_transports)
    try:
        return Receiver(
            listen,
            store,
            key=key,
            control_key=control_key if control_key is not None else control.load_key(create=True),
            quota_bytes=quota_bytes,
            landing=landing,
            advertise=advertise,
        )
    except BaseException:
        if landing is not None:
            landing.close()
        raise

"""``stream://host:port``: the sender of host-to-host transfer over N parallel TLS connections (TRANSPORTS.md, Stream).

A write-only :class:`Store`, so the writer and push use it unchanged. Its connections (authenticated, pipelined)
are ``connections.py``'s, its frames ``wire.py``'s; the receiver is ``receiver/server.py``. A chunk the receiver
rejected is raised by the next :meth:`StreamStore.flush` (which precedes every manifest), so a push never writes a
manifest over a chunk that did not arrive verified.
"""

from __future__ import annotations

import json
import struct
from typing import Self

from gpumigrate import control
from gpumigrate.errors import InvalidInputError, NotFoundError, TransferError
from gpumigrate.transfer.stores.base import (
    ID_PATTERN,
    Store,
    StoreOptions,
    check_chunk_id,
    check_image_id,
    query_param,
    split_url,
)
from gpumigrate.transfer.stores.connections import WINDOW_BYTES, ReceiverConnections
from gpumigrate.transfer.stores.wire import (
    FLUSH,
    GET_MANIFEST,
    HAS_CHUNK,
    LIST_CHUNKS,
    LIST_MANIFESTS,
    NO_ID,
    NOT_FOUND,
    PUT_CHUNK,
    PUT_MANIFEST,
    SHUTDOWN,
    parse_fingerprint,
    parse_listen,
)


class StreamStore(ReceiverConnections, Store):
    """Sender side of ``stream://host:port[?fingerprint=sha256:HEX][&connections=N]``. Write-only: ``put_chunk``
    returns once the chunk is sent, and its acknowledgement is collected later (``connections.py``)."""

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
        host, port = parse_listen(netloc)
        if host == "0.0.0.0" or not port:
            raise InvalidInputError(f"receiver URL {url!r} names no host or port")
        pinned = query_param(query, "fingerprint")
        super().__init__(
            host,
            port,
            fingerprint=parse_fingerprint(pinned) if pinned else None,
            max_connections=int(query_param(query, "connections") or connections),
            window_bytes=window_bytes,
            control_key=control_key if control_key is not None else control.load_key(),
        )

    @classmethod
    def from_url(cls, url: str, options: StoreOptions) -> Self:
        return cls(url, connections=options.parallelism)

    # ------------------------------------------------------------------ Store
    def put_chunk(self, chunk_id: str, blob: bytes | bytearray | memoryview) -> None:
        """Send one chunk; returns once sent (the caller's buffer is free).

        A rejection is raised by flush(), which always precedes a manifest; a lost connection sooner.
        """
        self._raise_errors(rejected=False)
        self._request(PUT_CHUNK, bytes.fromhex(check_chunk_id(chunk_id)), blob, f"chunk {chunk_id[:16]}", wait=False)

    def get_chunk(self, chunk_id: str) -> bytes:
        raise InvalidInputError(f"{self.url} is write-only: read from the receiver's store")

    def _has(self, chunk_id: str) -> tuple[int, bytes] | None:
        status, body = self._call(HAS_CHUNK, bytes.fromhex(check_chunk_id(chunk_id)))
        if status == NOT_FOUND:
            return None
        self._check(status, body, "a chunk query")
        return int(struct.unpack_from(">Q", body)[0]), body[8:]

    def chunk_size(self, chunk_id: str) -> int | None:
        found = self._has(chunk_id)
        return None if found is None else found[0]

    def chunk_header(self, chunk_id: str, nbytes: int) -> bytes:
        found = self._has(chunk_id)  # the receiver answers with the object's header
        if found is None:
            raise TransferError(f"chunk {chunk_id[:16]} is missing at receiver {self.host}:{self.port}")
        return found[1][:nbytes]

    def list_chunks(self) -> dict[str, int]:
        """The chunks the receiver holds and has verified (never one it could not check)."""
        status, body = self._call(LIST_CHUNKS, NO_ID)
        self._check(status, body, "the chunk listing")
        return {k: int(v) for k, v in json.loads(body).items()}

    def put_manifest(self, image_id: str, data: bytes) -> None:
        status, body = self._call(PUT_MANIFEST, bytes.fromhex(check_image_id(image_id)), data)
        self._check(status, body, f"manifest {image_id[:16]}")

    def get_manifest(self, image_id: str) -> bytes:
        """The receiver's copy of a manifest (a parent for the next pre-copy round); the caller verifies it."""
        status, body = self._call(GET_MANIFEST, bytes.fromhex(check_image_id(image_id)))
        if status == NOT_FOUND:
            raise NotFoundError(f"no image {image_id} at receiver {self.host}:{self.port}")
        self._check(status, body, f"manifest {image_id[:16]}")
        return body

    def list_manifests(self) -> list[str]:
        status, body = self._call(LIST_MANIFESTS, NO_ID)
        self._check(status, body, "the image listing")
        return [name for name in json.loads(body) if isinstance(name, str) and ID_PATTERN.fullmatch(name)]

    def flush(self) -> None:
        """Wait for every chunk's acknowledgement, raise the first rejection, then flush the receiver's store."""
        self._collect()
        self._raise_errors()
        status, body = self._call(FLUSH, NO_ID)
        self._check(status, body, "flush")

    def shutdown_receiver(self) -> None:
        """Ask the receiver to stop (after it flushed its store); an authenticated request like any other."""
        status, body = self._call(SHUTDOWN, NO_ID, what="shutdown")
        self._check(status, body, "shutdown")

    def close(self) -> None:
        self.close_connections()

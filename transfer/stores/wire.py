"""The stream protocol's frames (TRANSPORTS.md, Stream): what a sender (``stream.py``, ``nixl.py``) and the
receiver (``receiver/server.py``) both speak.

Every request is a ``REQUEST`` frame (magic, kind, a 32-byte id, payload length) and its payload; every reply a
``REPLY`` frame (status, length) and its body. Every connection starts with HELLO, a request signed with the
control key (``gpumigrate.control``, channel ``receiver``) and bound to the certificate the client saw.
"""

from __future__ import annotations

import hashlib
import re
import ssl
import struct
from typing import Any

from gpumigrate import control
from gpumigrate.errors import InvalidInputError

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
SLOT = struct.Struct(">IQ")  # NIXL_LANDED payload: landing slot index, object length
_FINGERPRINT = re.compile(r"^(?:sha256:)?([0-9a-fA-F]{64})$")


def _recv_exact(sock: ssl.SSLSocket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]


def read_frame(sock: ssl.SSLSocket, n: int, buf: bytearray | None = None) -> memoryview:
    """The next ``n`` bytes of ``sock``, in ``buf`` when it is large enough (else a fresh buffer)."""
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

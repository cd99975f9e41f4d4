"""Plane codec 2 (FORMAT.md, "Plane codec 2: huff"): the byte-plane Huffman coder, from Python.

The coder itself is C (``_huffplane.c`` says why: a bf16 exponent plane codes much faster than
through libzstd, at the same ratio; ``bench/planecoder.py``) and is built when gpumigrate is installed. Where the extension is
missing, :data:`AVAILABLE` is False: writers fall back to zstd planes, and a reader that meets a huff
plane says what to install instead of failing on a malformed-looking payload.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt
from typing_extensions import Buffer

from gpumigrate.errors import IntegrityError, TransferError

Bytes = Buffer | npt.NDArray[np.uint8]  # numpy's arrays are buffers, which its stubs do not say before Python 3.12


class _Coder(Protocol):
    """What this module calls of the compiled coder (``_huffplane.pyi``)."""

    HEADER_BYTES: int

    def merge(self, planes: Sequence[Bytes], out: Bytes, /) -> None: ...
    def split(self, data: Bytes, k: int, out: Bytes, /) -> None: ...
    def encode(self, plane: Bytes, out: Bytes, /) -> int: ...
    def decode(self, payload: Bytes, out: Bytes, /) -> None: ...


def _load() -> _Coder | None:
    try:
        from gpumigrate.transfer.format import _huffplane
    except ImportError:  # pragma: no cover - only on an install that could not compile the extension
        return None
    return _huffplane


_huffplane = _load()
AVAILABLE = _huffplane is not None
HEADER_BYTES = _huffplane.HEADER_BYTES if _huffplane else 1 + 128 + 12  # FORMAT.md's plane header
_local = threading.local()


def _coder() -> _Coder:
    """The compiled coder; callers ask :data:`AVAILABLE` first."""
    if _huffplane is None:
        raise _missing()
    return _huffplane


def encode_into(plane: npt.NDArray[np.uint8], out: memoryview | bytearray | npt.NDArray[np.uint8]) -> int:
    """Code ``plane`` (contiguous bytes) into ``out``; the payload length, or -1 when it needs more than len(out).

    ``out`` may be the very memory ``plane`` lives in: the coder reads all of the plane before it writes.
    """
    return _coder().encode(plane, out)


def split(data: memoryview, k: int, out: npt.NDArray[np.uint8]) -> None:
    """Byte j of every k-byte element of ``data`` into ``out[j*n:(j+1)*n]``, all planes in one pass."""
    _coder().split(data, k, out)


def compress(sample: npt.NDArray[np.uint8]) -> memoryview:
    """The payload for ``sample`` (a fresh buffer): what the 5% rule weighs against the sample's size."""
    out = bytearray(len(sample) + HEADER_BYTES + 64)
    n = _coder().encode(sample, out)
    return memoryview(out)[:n] if n >= 0 else memoryview(out)  # -1: longer than the sample itself


def _missing() -> TransferError:
    return TransferError(
        "this chunk's planes use the huff coder (plane codec 2), which needs gpumigrate's compiled "
        "extension gpumigrate.transfer.format._huffplane; reinstall gpumigrate where a C compiler is available"
    )


def decode_into(payload: memoryview | bytes, plane: npt.NDArray[np.uint8]) -> None:
    """Decode a huff payload into ``plane`` (its length is the plane's byte count)."""
    coder = _coder()
    try:
        coder.decode(payload, plane)
    except ValueError as exc:
        raise IntegrityError(f"byte-plane payload does not decode: {exc}") from None


def decode(payload: memoryview | bytes, n: int) -> npt.NDArray[np.uint8]:
    """The ``n`` bytes of a plane from its huff payload, in a fresh array."""
    plane = np.empty(n, dtype=np.uint8)
    decode_into(payload, plane)
    return plane


def merge(planes: Sequence[npt.NDArray[np.uint8]], out: memoryview) -> None:
    """The inverse of :func:`split`: interleave k equally long planes into ``out``."""
    _coder().merge(planes, out)


def scratch(nbytes: int) -> npt.NDArray[np.uint8]:
    """This thread's reusable decode buffer, at least ``nbytes`` long.

    A fresh multi-MiB array per chunk costs its page faults every time (buffers.py says how much),
    and on this machine class a freed page can come back only after the host faults it in again.
    """
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _local.buf = np.empty(nbytes, dtype=np.uint8)
    return buf[:nbytes]

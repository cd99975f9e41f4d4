"""zstd as a pure entropy coder for byte planes, through libzstd's own parameter API.

Float byte planes (bf16/fp16/fp32 sign-and-exponent bytes) have almost no repeats worth a match,
so the useful part of zstd on them is the Huffman coding of literals. The match finder still scans
every position, though, and zstd's only knob that makes it skip ahead (``targetLength`` in the
``fast`` strategy) also switches literal compression off by default. libzstd lets a caller switch
it back on (``ZSTD_c_literalCompressionMode``, an experimental parameter that python-zstandard's
C API does not expose, but its cffi backend's ``ZSTD_CCtx_setParameter`` reaches). On bf16 exponent
planes that keeps the ratio of the tuned ``fast`` parameters alone for less CPU (``bench/planecoder.py``).

The output is an ordinary zstd frame (content size recorded), so readers need nothing new and
FORMAT.md is unchanged. When the cffi backend is missing, or libzstd is not a 1.5.x whose
parameter numbers this module knows, or the parameters are refused, :func:`compress_plane`
falls back to python-zstandard's C backend with the tuned ``fast`` parameters.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import zstandard

_local = threading.local()

# ZSTD_c_literalCompressionMode = ZSTD_c_experimentalParam5 in every libzstd 1.5.x; ZSTD_ps_enable = 1.
_LITERAL_COMPRESSION_MODE = 1002
_PS_ENABLE = 1
# In the fast strategy targetLength is the match finder's stride growth; this large a value makes it
# sample a handful of positions per block (a small one gives the same ratio for more CPU: bench/planecoder.py).
_SKIP_AHEAD = 1 << 17
CCtx = Any  # a libzstd ZSTD_CCtx* through zstandard's cffi backend (cffi's objects carry no types); None: none

try:  # python-zstandard ships the cffi backend beside the C one; cffi comes with cryptography
    from zstandard.backend_cffi import ffi as _ffi
    from zstandard.backend_cffi import lib as _lib
except ImportError:  # pragma: no cover - depends on the installed wheel
    _ffi = _lib = None


def _fallback() -> zstandard.ZstdCompressor:
    """The tuned ``fast`` parameters alone: tiny tables, matches of 7+ bytes only."""
    comp = getattr(_local, "fallback", None)
    if comp is None:
        params = zstandard.ZstdCompressionParameters(
            window_log=17,
            hash_log=6,
            chain_log=6,
            search_log=1,
            min_match=7,
            target_length=0,
            strategy=zstandard.STRATEGY_FAST,
            write_content_size=True,
        )
        comp = _local.fallback = zstandard.ZstdCompressor(compression_params=params)
    return comp


def _new_cctx() -> CCtx:
    """A libzstd context set up as a literal coder, or None when this libzstd cannot be trusted to."""
    if _lib is None or _lib.ZSTD_versionNumber() // 100 != 105:
        return None
    cctx = _ffi.gc(_lib.ZSTD_createCCtx(), _lib.ZSTD_freeCCtx)
    settings = (
        (_lib.ZSTD_c_strategy, _lib.ZSTD_fast),
        (_lib.ZSTD_c_windowLog, 17),
        (_lib.ZSTD_c_hashLog, 6),
        (_lib.ZSTD_c_minMatch, 7),
        (_lib.ZSTD_c_targetLength, _SKIP_AHEAD),
        (_lib.ZSTD_c_contentSizeFlag, 1),
        (_LITERAL_COMPRESSION_MODE, _PS_ENABLE),
    )
    for param, value in settings:
        if _lib.ZSTD_isError(_lib.ZSTD_CCtx_setParameter(cctx, param, value)):
            return None
    return cctx


def _self_test() -> bool:
    """Literal coding really is on: a skewed random plane must shrink and decode to itself."""
    cctx = _new_cctx()
    if cctx is None:
        return False
    rng = np.random.default_rng(0)
    plane = rng.choice(np.array([60, 59, 61, 188, 187, 189], dtype=np.uint8), size=1 << 16)
    out = bytearray(_lib.ZSTD_compressBound(len(plane)))
    n = _lib.ZSTD_compress2(cctx, _ffi.from_buffer(out), len(out), _ffi.from_buffer(plane), len(plane))
    if _lib.ZSTD_isError(n) or n > len(plane) // 2:
        return False
    try:
        return zstandard.ZstdDecompressor().decompress(bytes(out[:n])) == plane.tobytes()
    except zstandard.ZstdError:
        return False


USES_LITERAL_MODE = _self_test()


def compress_plane(plane: np.ndarray) -> bytes | memoryview:
    """One zstd frame holding ``plane`` (a contiguous uint8 array); valid until this thread's next call."""
    if not USES_LITERAL_MODE:
        return _fallback().compress(plane.data)
    cctx = getattr(_local, "cctx", None)
    if cctx is None:
        cctx = _local.cctx = _new_cctx()
    bound = _lib.ZSTD_compressBound(len(plane))
    out = getattr(_local, "out", None)
    if out is None or len(out) < bound:
        out = _local.out = bytearray(bound)  # kept per thread: a fresh buffer per plane faults its pages in
    # cffi releases the GIL around the call, so planes of several chunks compress in parallel
    n = _lib.ZSTD_compress2(
        cctx, _ffi.from_buffer(out, require_writable=True), len(out), _ffi.from_buffer(plane), len(plane)
    )
    if _lib.ZSTD_isError(n):
        raise zstandard.ZstdError(_ffi.string(_lib.ZSTD_getErrorName(n)).decode())
    return memoryview(out)[:n]

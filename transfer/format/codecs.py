"""Per-chunk codecs: none, zstd, the float-aware byte-plane codec, and XOR delta (FORMAT.md, Codecs).

Every codec is exact for every bit pattern: the byte-plane codec only moves bytes, so NaN payloads,
infinities, denormals and -0.0 come back identical. zstd and numpy release the GIL, so chunks
encode in parallel in the caller's threads.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Sized
from typing import Any

import numpy as np
import zstandard

from gpumigrate.errors import IntegrityError, InvalidInputError
from gpumigrate.transfer.device import gpucodec
from gpumigrate.transfer.format import planehuff
from gpumigrate.transfer.format.planezstd import compress_plane

NONE = 0
ZSTD = 1
BYTEPLANE = 2
DELTA_FLAG = 0x80
CODEC_NAMES = {NONE: "none", ZSTD: "zstd", BYTEPLANE: "byteplane"}
PLANE_HUFF = 2  # plane codec inside a byte-plane payload (0 none and 1 zstd as above); FORMAT.md
PLANE_GPU = gpucodec.PLANE_NVCOMP_ANS  # plane codec 3: coded on a GPU with nvCOMP (gpucodec.py)
COMPRESSION_MODES = ("auto", "none", "zstd", "byteplane")

SAMPLE_BYTES = 64 * 1024
MIN_GAIN = 0.05  # below this, a sample says compression is not worth its CPU
ZSTD_LEVEL = 1

# Element sizes of the dtypes the byte-plane codec understands (torch and numpy spellings).
FLOAT_ITEMSIZE = {
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float32": 4,
    "float": 4,
    "float64": 8,
    "double": 8,
}

_local = threading.local()
_PLANE_HEADER = struct.Struct(">BQ")


def _compressor() -> zstandard.ZstdCompressor:
    # zstandard compressor objects are not safe to share between threads; one per thread is cheap.
    comp = getattr(_local, "comp", None)
    if comp is None:
        comp = _local.comp = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return comp


def _decompressor() -> zstandard.ZstdDecompressor:
    dec = getattr(_local, "dec", None)
    if dec is None:
        dec = _local.dec = zstandard.ZstdDecompressor()
    return dec


def float_itemsize(dtype: str | None) -> int | None:
    if not dtype:
        return None
    return FLOAT_ITEMSIZE.get(dtype.removeprefix("torch.").lower())


def check_mode(mode: str) -> str:
    if mode not in COMPRESSION_MODES:
        raise InvalidInputError(f"unknown compression {mode!r}", hint=f"allowed: {', '.join(COMPRESSION_MODES)}")
    return mode


def _sample(data: memoryview | np.ndarray) -> np.ndarray:
    """Up to SAMPLE_BYTES of ``data``: all of it when small, else four slices spread over it."""
    view = data if isinstance(data, memoryview) else data.data.cast("B")
    n = len(view)
    if n <= SAMPLE_BYTES * 2:
        return np.frombuffer(view, dtype=np.uint8)
    # Four slices spread over the chunk: one slice from the middle misjudges mixed chunks.
    part = SAMPLE_BYTES // 4
    step = (n - part) // 3
    return np.frombuffer(b"".join(view[i * step : i * step + part] for i in range(4)), dtype=np.uint8)


def _worth_compressing(data: memoryview | np.ndarray, compress: Callable[[Any], Sized] | None = None) -> bool:
    """Compress a sample spread over ``data`` (with ``compress``, default zstd -1); no when it gains under MIN_GAIN."""
    sample = _sample(data)
    if len(sample) == 0:
        return False
    packed = compress(sample) if compress is not None else _compressor().compress(sample.data)
    return len(packed) <= len(sample) * (1.0 - MIN_GAIN)


# Where a Huffman code nears its floor of one bit per byte (long runs, a near-constant plane such as
# the zero low bytes of fp32 values widened from bf16), zstd's matches do far better: ask it too.
HUFF_FLOOR = 0.2


def _zstd_plane(plane: np.ndarray) -> bytes | memoryview:
    """zstd for one plane: with the huff coder about, zstd is only picked for runs, so with its match
    finder (level 1); without it, as the pure literal coder (planezstd.py says why)."""
    return _compressor().compress(plane.data) if planehuff.AVAILABLE else compress_plane(plane)


def _plane_verdict(plane: np.ndarray) -> int:
    """The plane codec a sample of ``plane`` asks for: NONE under MIN_GAIN, else huff or zstd, the smaller."""
    sample = _sample(plane)
    if not planehuff.AVAILABLE:
        return ZSTD if _worth_compressing(sample, compress_plane) else NONE
    size, codec = len(planehuff.compress(sample)), PLANE_HUFF
    if size <= len(sample) * HUFF_FLOOR:
        zsize = len(_zstd_plane(sample))
        if zsize < size:
            size, codec = zsize, ZSTD
    return codec if size <= len(sample) * (1.0 - MIN_GAIN) else NONE


def _split_plane(u: np.ndarray, k: int, j: int, dest: np.ndarray) -> None:
    """Byte j (little-endian) of every k-byte element of ``u`` into ``dest``."""
    if k in (2, 4) and j == 0:
        np.copyto(dest, u, casting="unsafe")  # the low byte is a plain narrowing cast: one pass, no shift
    elif k in (2, 4):
        # a shift with a uint8 output narrows in registers: no chunk-sized temporary, no fresh
        # allocation (fresh 2 MiB arrays per chunk cost more than the split: their pages fault in)
        np.right_shift(u, 8 * j, out=dest, casting="unsafe")
    else:
        np.copyto(dest, u.reshape(-1, k)[:, j])


class PlanePlan:
    """What the sample said about each byte plane of one region, so most chunks skip the sample.

    The planes of one tensor or weights file behave alike from chunk to chunk (bf16 mantissa bytes
    are noise everywhere, exponent bytes compress everywhere), so sampling every plane of every
    chunk repeats one answer. A verdict (the plane codec to use, or NONE) is reused for
    ``RECHECK - 1`` chunks and then sampled again, and a plane coded on a reused verdict that gains
    under MIN_GAIN in full sends the next chunk back to sampling: the 5% rule still decides, it is
    just asked less often. Shared by the threads encoding one region; a lost update between them
    only costs one extra sample.
    """

    RECHECK = 16

    def __init__(self) -> None:
        self._verdicts: dict[int, tuple[int, int]] = {}

    def reuse(self, plane: int) -> int | None:
        """The remembered plane codec for ``plane`` (and count one use of it), or None: sample it."""
        found = self._verdicts.get(plane)
        if found is None or found[1] <= 0:
            return None
        self._verdicts[plane] = (found[0], found[1] - 1)
        return found[0]

    def remember(self, plane: int, codec: int) -> None:
        self._verdicts[plane] = (codec, self.RECHECK - 1)

    def forget(self, plane: int) -> None:
        self._verdicts.pop(plane, None)


def _byteplane_into(data: memoryview, k: int, dest: memoryview, plan: PlanePlan | None = None) -> memoryview:
    """Write the byte-plane payload for ``data`` into ``dest``; return the used view.

    Planes are split straight into the payload (with the compiled coder, all k in one pass, plane
    j at ``base + j*n``: where every plane before it stays raw, as bf16 mantissas do, that is its
    final place); a plane that compresses is then overwritten by its (shorter) coding, so a raw
    plane is copied again only after an earlier plane shrank.
    """
    n = len(data) // k
    out = np.frombuffer(dest, dtype=np.uint8)
    out[0] = k
    base = off = 1 + k * _PLANE_HEADER.size
    presplit = planehuff.AVAILABLE
    if presplit:
        planehuff.split(data, k, out[base : base + k * n])
    else:
        u = np.frombuffer(data, dtype={2: "<u2", 4: "<u4"}.get(k, np.uint8))
    for j in range(k):
        plane = out[off : off + n]
        if not presplit:
            _split_plane(u, k, j, plane)
        elif off != base + j * n:
            plane[:] = out[base + j * n : base + (j + 1) * n]  # numpy copies overlapping ranges safely
        codec, length = NONE, n
        choice = plan.reuse(j) if plan is not None else None
        if choice is None:
            choice = _plane_verdict(plane)
            if plan is not None:
                plan.remember(j, choice)
        if choice == PLANE_HUFF and planehuff.AVAILABLE:
            # coded over the plane's own bytes: the coder reads them all before it writes, and
            # writes nothing when the result would not be shorter
            packed_len = planehuff.encode_into(plane, dest[off : off + n - 1])
            if packed_len > 0:
                codec, length = PLANE_HUFF, packed_len
            if plan is not None and not 0 < packed_len <= n * (1.0 - MIN_GAIN):
                plan.forget(j)  # the full plane no longer pays: sample the next chunk's
        elif choice != NONE:
            packed = _zstd_plane(plane)
            if plan is not None and len(packed) > n * (1.0 - MIN_GAIN):
                plan.forget(j)
            if len(packed) < n:
                dest[off : off + len(packed)] = packed
                codec, length = ZSTD, len(packed)
        _PLANE_HEADER.pack_into(dest, 1 + j * _PLANE_HEADER.size, codec, length)
        off += length
    return dest[:off]


def scratch_size(raw_len: int) -> int:
    """Bytes of scratch :func:`encode_into` may need for a chunk of ``raw_len`` bytes."""
    return raw_len + 1 + 8 * _PLANE_HEADER.size


def encode_into(
    data: memoryview,
    scratch: bytearray | memoryview,
    *,
    mode: str = "auto",
    dtype: str | None = None,
    plan: PlanePlan | None = None,
) -> tuple[int, bytes | memoryview]:
    """Pick a codec for one chunk and encode it, using ``scratch`` (≥ scratch_size bytes) as workspace.

    Returns (codec, payload); the payload may alias ``data`` or ``scratch``, so use it before
    either is reused. ``plan`` (one per region) lets byte-plane chunks reuse earlier chunks'
    sample verdicts (see PlanePlan); without it every plane is sampled.
    """
    if mode == "none" or len(data) == 0:
        return NONE, data
    k = float_itemsize(dtype)
    if mode in ("auto", "byteplane") and k and len(data) % k == 0 and len(data) >= 2 * k:
        if len(scratch) < scratch_size(len(data)):
            raise ValueError(f"encode_into: scratch of {len(scratch)} bytes is too small for {len(data)}")
        return BYTEPLANE, _byteplane_into(data, k, memoryview(scratch), plan)
    if mode == "auto" and not _worth_compressing(data):
        return NONE, data
    packed = _compressor().compress(data)
    if len(packed) >= len(data):
        return NONE, data
    return ZSTD, packed


def _decode_byteplane(payload: memoryview, raw_len: int, out: memoryview) -> None:
    k = payload[0]
    if k < 1 or raw_len % k:
        raise IntegrityError(f"byte-plane header names element size {k} for {raw_len} bytes")
    n = raw_len // k
    offset = 1 + k * _PLANE_HEADER.size
    planes = []
    for j in range(k):
        codec, length = _PLANE_HEADER.unpack_from(payload, 1 + j * _PLANE_HEADER.size)
        body = payload[offset : offset + length]
        offset += length
        plane: np.ndarray
        if codec == PLANE_HUFF:
            plane = planehuff.scratch(k * n)[j * n : (j + 1) * n]
            planehuff.decode_into(body, plane)
        elif codec == PLANE_GPU:
            plane = gpucodec.decode_plane_to_host(body, n)
        elif codec == ZSTD:
            plane = np.frombuffer(_decompressor().decompress(body, max_output_size=n), dtype=np.uint8)
        elif codec == NONE:
            plane = np.frombuffer(body, dtype=np.uint8)
        else:
            raise IntegrityError(f"byte-plane payload names plane codec {codec}, which this reader does not know")
        if len(plane) != n:
            raise IntegrityError("byte-plane payload is malformed (a plane's decoded length)")
        planes.append(plane)
    if planehuff.AVAILABLE:
        planehuff.merge(planes, out)  # one pass, all planes
    elif k == 2:
        o = np.frombuffer(out, dtype="<u2", count=n)
        np.left_shift(planes[1], 8, out=o, dtype=np.uint16)
        o |= planes[0]
    elif k == 4:
        o4 = np.frombuffer(out, dtype="<u4", count=n)
        np.left_shift(planes[3], 24, out=o4, dtype=np.uint32)
        for j in (2, 1, 0):
            o4 |= planes[j].astype(np.uint32) << (8 * j)
    else:
        grid = np.frombuffer(out, dtype=np.uint8, count=raw_len).reshape(-1, k)
        for j in range(k):
            grid[:, j] = planes[j]


def encode(data: memoryview, *, mode: str = "auto", dtype: str | None = None) -> tuple[int, bytes | memoryview]:
    """Pick a codec for one chunk and encode it. Returns (codec, payload); payload may alias ``data``."""
    return encode_into(data, bytearray(scratch_size(len(data))), mode=mode, dtype=dtype)


def decode_into(codec: int, payload: memoryview, raw_len: int, out: memoryview) -> None:
    """Decode ``payload`` into ``out[:raw_len]`` (without the delta step; see xor_into)."""
    base_codec = codec & 0x0F
    if base_codec == NONE:
        if len(payload) != raw_len:
            raise IntegrityError(f"stored length {len(payload)} differs from the recorded {raw_len}")
        out[:raw_len] = payload
    elif base_codec == ZSTD:
        try:
            plain = _decompressor().decompress(payload, max_output_size=raw_len)
        except zstandard.ZstdError as exc:
            raise IntegrityError(f"zstd payload does not decode: {exc}") from None
        if len(plain) != raw_len:
            raise IntegrityError(f"decoded length {len(plain)} differs from the recorded {raw_len}")
        out[:raw_len] = plain
    elif base_codec == BYTEPLANE:
        try:
            _decode_byteplane(payload, raw_len, out)
        except (zstandard.ZstdError, struct.error, ValueError) as exc:
            raise IntegrityError(f"byte-plane payload does not decode: {exc}") from None
    else:
        raise IntegrityError(f"unknown codec {codec:#x} (this reader knows {sorted(CODEC_NAMES.values())})")


def xor_with_base(data: memoryview, base: memoryview | bytes) -> np.ndarray:
    """``data XOR base``, base zero-extended or truncated to len(data)."""
    a = np.frombuffer(data, dtype=np.uint8)
    b = np.frombuffer(base, dtype=np.uint8)
    out = a.copy()
    m = min(len(a), len(b))
    np.bitwise_xor(out[:m], b[:m], out=out[:m])
    return out


def xor_into(out: memoryview, raw_len: int, base: memoryview | bytes) -> None:
    """Undo the delta in place: out[:raw_len] ^= base."""
    o = np.frombuffer(out, dtype=np.uint8, count=raw_len)
    b = np.frombuffer(base, dtype=np.uint8)
    m = min(raw_len, len(b))
    np.bitwise_xor(o[:m], b[:m], out=o[:m])

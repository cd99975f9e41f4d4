"""Per-chunk codecs: none, zstd, the float-aware byte-plane codec, and XOR delta (FORMAT.md, Codecs).

Every codec is exact for every bit pattern: the byte-plane codec only moves bytes, so NaN payloads,
infinities, denormals and -0.0 come back identical. zstd and numpy release the GIL, so chunks
encode in parallel in the caller's threads.
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import zstandard

from gpumigrate.errors import IntegrityError, InvalidInputError

NONE = 0
ZSTD = 1
BYTEPLANE = 2
DELTA_FLAG = 0x80
CODEC_NAMES = {NONE: "none", ZSTD: "zstd", BYTEPLANE: "byteplane"}
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


def _plane_compressor() -> zstandard.ZstdCompressor:
    """zstd tuned as an entropy coder for byte planes: tiny hash table, matches of 7+ bytes only.

    Float planes have almost no long repeats, so match finding is wasted work; these parameters
    leave zstd Huffman-coding literals. Measured here on bf16 normal(0, 0.02) high planes: ratio
    0.34 at 0.43 CPU-s/GB, against 0.37 at 1.25 CPU-s/GB for level 1. Output is a standard frame.
    """
    comp = getattr(_local, "plane_comp", None)
    if comp is None:
        params = zstandard.ZstdCompressionParameters(
            window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7, target_length=0,
            strategy=zstandard.STRATEGY_FAST, write_content_size=True,
        )
        comp = _local.plane_comp = zstandard.ZstdCompressor(compression_params=params)
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


def _worth_compressing(data: memoryview | np.ndarray, comp: zstandard.ZstdCompressor | None = None) -> bool:
    """Compress a sample from the middle; say no when it gains under MIN_GAIN."""
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data
    n = len(view)
    if n == 0:
        return False
    if n <= SAMPLE_BYTES * 2:
        sample: bytes | memoryview = view
    else:
        # Four slices spread over the chunk: one slice from the middle misjudges mixed chunks.
        part = SAMPLE_BYTES // 4
        step = (n - part) // 3
        sample = b"".join(view[i * step : i * step + part] for i in range(4))
    packed = (comp or _compressor()).compress(sample)
    return len(packed) <= len(sample) * (1.0 - MIN_GAIN)


def _split_planes(data: memoryview, k: int) -> list[np.ndarray]:
    if k == 2:
        u = np.frombuffer(data, dtype="<u2")
        return [u.astype(np.uint8), (u >> 8).astype(np.uint8)]
    if k == 4:
        u = np.frombuffer(data, dtype="<u4")
        return [(u >> (8 * j)).astype(np.uint8) for j in range(4)]
    grid = np.frombuffer(data, dtype=np.uint8).reshape(-1, k)
    return [np.ascontiguousarray(grid[:, j]) for j in range(k)]


def _encode_byteplane(data: memoryview, k: int) -> bytes:
    parts: list[bytes | memoryview] = [bytes([k])]
    bodies: list[bytes | memoryview] = []
    for plane in _split_planes(data, k):
        if _worth_compressing(plane, _plane_compressor()):
            body: bytes | memoryview = _plane_compressor().compress(plane)
            parts.append(_PLANE_HEADER.pack(ZSTD, len(body)))
        else:
            body = memoryview(plane)
            parts.append(_PLANE_HEADER.pack(NONE, len(body)))
        bodies.append(body)
    return b"".join(parts + bodies)


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
        plane = _decompressor().decompress(body, max_output_size=n) if codec == ZSTD else body
        if codec not in (NONE, ZSTD) or len(plane) != n:
            raise IntegrityError("byte-plane payload is malformed (plane codec or length)")
        planes.append(np.frombuffer(plane, dtype=np.uint8))
    if k == 2:
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
    if mode == "none" or len(data) == 0:
        return NONE, data
    k = float_itemsize(dtype)
    if mode in ("auto", "byteplane") and k and len(data) % k == 0 and len(data) >= 2 * k:
        return BYTEPLANE, _encode_byteplane(data, k)
    if mode == "auto" and not _worth_compressing(data):
        return NONE, data
    packed = _compressor().compress(data)
    if len(packed) >= len(data):
        return NONE, data
    return ZSTD, packed


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

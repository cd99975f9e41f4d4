"""The two byte-plane payloads a GPU writes (FORMAT.md, "Plane codec 3: nvcomp-ans"), and their decode on a device.

* ``k = 2`` for a bf16/fp16 chunk: plane 0 (mantissa bytes) raw, plane 1 (sign and exponent) ANS-coded.
* ``k = 1`` for a chunk of any other dtype (uint8, int8, fp8, integer and bool tensors: a KV cache's pages, a
  quantized model's weights, a step counter): its one plane is the chunk itself, ANS-coded. Zero-filled or
  constant pages shrink to a few percent, int8 weights a little, random bytes not at all (then the chunk is
  stored raw). Coding it on the device keeps it off the CPU, whose zstd of a frozen source's changed state ran
  inside the downtime; the GPU codes such a batch far faster (bench/README.md).

Both are ordinary byte-plane payloads (codec 2), so a CPU reader decodes them through ``format/codecs.py`` (the
ANS plane on a GPU). The direct reader decodes them on the destination device: :func:`decode_on_device`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpumigrate.errors import IntegrityError
from gpumigrate.transfer.device import gpucodec, plane_kernels

if TYPE_CHECKING:
    import torch

# to_device(dest, start): queue the copy of dest.numel() bytes of the pinned slot, from ``start``, into ``dest``
ToDevice = Callable[["torch.Tensor", int], None]

_ENTRY = struct.Struct(">BQ")
HEADER = {2: 1 + 2 * _ENTRY.size, 1: 1 + _ENTRY.size}  # k, then (plane codec, length) per plane


def coded_length(k: int, n: int, coded: int) -> int:
    """The payload's length for a chunk of ``n`` bytes whose ANS plane coded to ``coded`` bytes."""
    return HEADER[k] + (n // 2 if k == 2 else 0) + coded


def write_header(view: memoryview, at: int, k: int, n: int, coded: int) -> int:
    """The payload's header at ``view[at:]``; returns where the planes start (the raw low plane first when k = 2)."""
    view[at] = k
    if k == 2:
        _ENTRY.pack_into(view, at + 1, gpucodec.PLANE_RAW, n // 2)
        _ENTRY.pack_into(view, at + 1 + _ENTRY.size, gpucodec.PLANE_NVCOMP_ANS, coded)
    else:
        _ENTRY.pack_into(view, at + 1, gpucodec.PLANE_NVCOMP_ANS, coded)
    return at + HEADER[k]


def layout(payload: memoryview, n: int) -> int:
    """The ``k`` of a payload in a layout the GPU writes, that this process can decode on a device; else 0."""
    k = payload[0] if len(payload) else 0
    if k not in HEADER or len(payload) < HEADER[k] or not gpucodec.available():
        return 0
    if k == 2:
        low_codec, low_len = _ENTRY.unpack_from(payload, 1)
        high_codec, high_len = _ENTRY.unpack_from(payload, 1 + _ENTRY.size)
        fits = low_codec == gpucodec.PLANE_RAW and low_len == n // 2 and n % 2 == 0
        return (
            2
            if fits and high_codec == gpucodec.PLANE_NVCOMP_ANS and HEADER[2] + low_len + high_len == len(payload)
            else 0
        )
    codec, length = _ENTRY.unpack_from(payload, 1)
    return 1 if codec == gpucodec.PLANE_NVCOMP_ANS and HEADER[1] + length == len(payload) else 0


def decode_on_device(
    k: int, payload: memoryview, at: int, to_device: ToDevice, out: torch.Tensor, stream: torch.cuda.Stream, where: str
) -> None:
    """Decode a :func:`layout` payload into ``out`` (a contiguous uint8 device tensor), on ``stream``.

    ``to_device(dest, start)`` queues the copy of ``dest.numel()`` bytes of the pinned slot holding the payload,
    from ``start``, into the device tensor ``dest``; the payload starts at slot offset ``at``. k = 2: both planes
    cross in one copy into one scratch buffer that also takes the decoded high plane, and one kernel interleaves
    them into ``out``. k = 1: the coded plane crosses and decodes straight into ``out`` when it is 16-byte aligned
    (nvCOMP's rule), else into the scratch first. Few torch calls per chunk: each queued behind the other
    threads for the GIL."""
    import torch

    n = out.numel()
    if k == 1:
        coded_len = _ENTRY.unpack_from(payload, 1)[1]
        direct = out.data_ptr() % 16 == 0
        scratch = torch.empty((0 if direct else -(-n // 16) * 16) + coded_len, dtype=torch.uint8, device=out.device)
        coded_at = 0 if direct else -(-n // 16) * 16
        to_device(scratch[coded_at:], at + HEADER[1])
        base = scratch.data_ptr()
        target = gpucodec.DeviceBytes(out.data_ptr(), n, out) if direct else gpucodec.DeviceBytes(base, n, scratch)
        _decode(gpucodec.DeviceBytes(base + coded_at, coded_len, scratch), target, stream, where)
        if not direct:
            out.copy_(scratch[:n])
        return
    half = n // 2
    coded_len = _ENTRY.unpack_from(payload, 1 + _ENTRY.size)[1]
    # [decoded high plane | pad | low plane | coded high plane]: nvCOMP wants its output and its input on
    # 16-byte boundaries, and the low and coded planes arrive in one copy, so the low plane ends on one.
    low_at = -(-half // 16) * 16 + (-half) % 16
    scratch = torch.empty(low_at + half + coded_len, dtype=torch.uint8, device=out.device)
    base = scratch.data_ptr()
    to_device(scratch[low_at:], at + HEADER[2])
    _decode(
        gpucodec.DeviceBytes(base + low_at + half, coded_len, scratch),
        gpucodec.DeviceBytes(base, half, scratch),
        stream,
        where,
    )
    if gpucodec.merges(out):
        plane_kernels.merge(base + low_at, base, out)
    else:
        torch.stack((scratch[low_at : low_at + half], scratch[:half]), dim=1, out=out.view(-1, 2))


def _decode(coded: gpucodec.DeviceBytes, target: gpucodec.DeviceBytes, stream: torch.cuda.Stream, where: str) -> None:
    try:
        gpucodec.decode_plane(coded, target, stream)
    except IntegrityError as exc:
        raise IntegrityError(f"chunk{where}: {exc.message}") from None

"""Plane codec 3 (FORMAT.md, "Plane codec 3: nvcomp-ans"): exponent planes entropy-coded on the GPU.

A bf16 or fp16 chunk that lives in device memory is split into its two byte planes on the device
and the sign-and-exponent plane is coded there with NVIDIA nvCOMP's ANS coder, so only about 0.68
of the chunk's bytes cross PCIe (the mantissa plane is noise and stays raw). The payload is an
ordinary byte-plane payload (codec 2) whose high plane has plane codec 3.

nvCOMP is optional (PyPI ``nvidia-nvcomp-cu13`` with ``nvidia-libnvcomp-cu13``) and runs only on a
CUDA device: :func:`available` says whether this process can code or decode such planes. Its ANS
bitstream is nvCOMP's own (no CPU decoder exists), so an image holding such planes lists
``"nvcomp-ans"`` under the manifest's ``decoders``, and a reader without nvCOMP and a GPU says so
instead of misreading. nvCOMP's native bitstream carries its own sizes; it is used as is. Chunks of
other dtypes are coded whole with the same coder, as one-plane payloads (``gpupayload.py``).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from gpumigrate.errors import IntegrityError, TransferError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

# nvCOMP's Python package (``nvidia.nvcomp``) ships no types: its codec, its arrays and its decompression configs
NvComp = Any  # the nvidia.nvcomp module (None where it is not installed)
NvCodec = Any
NvArray = Any
NvConfig = Any


class NvStream(Protocol):
    """The stream nvCOMP hands its allocator: the device's index (-1: the current one) and the stream's address."""

    device: int
    ptr: int


DECODER = "nvcomp-ans"  # the manifest's name for what a reader needs to decode plane codec 3
PLANE_RAW = 0  # plane codec 0 (FORMAT.md): a plane stored as it is (a GPU payload's mantissa plane)
PLANE_NVCOMP_ANS = 3
GPU_ELEMENT_SIZES = (2,)  # bf16 / fp16: one sign-and-exponent plane, one mantissa plane
_local = threading.local()


class _TorchBlock:
    """Device memory for nvCOMP from torch's caching allocator, ordered on the stream nvCOMP names.

    nvCOMP's own allocations are cudaMalloc/cudaFree per call; cudaFree waits for the whole device,
    and nvCOMP frees while holding the GIL: every sealing thread then waited for every other one, and a
    capture ran several times slower (``bench/direct.py``). A block freed here
    returns to torch's pool for its stream: the caller keeps an output alive until every stream that
    reads it is done (the writer holds it until its device→host copy has landed).
    """

    def __init__(self, nbytes: int, stream: NvStream) -> None:
        import torch

        device = torch.device("cuda", stream.device if stream.device >= 0 else torch.cuda.current_device())
        with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr, device=device)):
            self._block = torch.empty(max(1, nbytes), dtype=torch.uint8, device=device)
        self.ptr = self._block.data_ptr()


@functools.cache
def _nvcomp() -> NvComp:
    try:
        from nvidia import nvcomp
    except Exception:  # not installed, or its library does not load: the CPU codec is used instead
        return None
    try:
        nvcomp.set_device_allocator(_TorchBlock)
    except Exception:  # an nvCOMP without allocator hooks: its own allocator is slower, still correct
        pass
    return nvcomp


@functools.cache
def available() -> bool:
    """True where planes can be coded and decoded here: nvCOMP imports and a CUDA device is present.

    Asked for every chunk a writer or reader handles: cached (``torch.cuda.is_available`` asks the driver
    each time, on a capture's one submitting thread).
    ``GPUMIGRATE_GPU_CODEC=0`` turns GPU coding off (decoding still works), e.g. to compare codecs.
    """
    try:
        import torch
    except ImportError:
        return False
    return _nvcomp() is not None and torch.cuda.is_available()


def enabled() -> bool:
    """Whether writers should code device chunks with this codec (available and not switched off)."""
    return os.environ.get("GPUMIGRATE_GPU_CODEC", "1") != "0" and available()


def _codec(stream: torch.cuda.Stream) -> NvCodec:
    """This thread's nvCOMP codec on ``stream`` (codec objects must not be shared between threads)."""
    nv = _nvcomp()
    key = int(stream.cuda_stream)
    codecs = getattr(_local, "codecs", None)
    if codecs is None:
        codecs = _local.codecs = {}
    codec = codecs.get(key)
    if codec is None:
        codec = codecs[key] = nv.Codec(algorithm="ANS", device_id=stream.device.index or 0, cuda_stream=key)
    return codec


class DeviceBytes:
    """Bytes in device memory by address, as nvCOMP and PyTorch take them (the CUDA array interface): no torch
    call to make a view. ``keep`` holds whatever owns the memory for as long as this object lives."""

    def __init__(self, ptr: int, nbytes: int, keep: object = None) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self._keep = keep
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


class PlaneSplit:
    """The byte planes of a batch of bf16/fp16 device chunks: chunk ``i``'s low plane at :meth:`low`, its high
    plane right after it (:meth:`high`), all in one device buffer (one Triton launch where Triton is here)."""

    def __init__(self, views: list[torch.Tensor], stream: torch.cuda.Stream) -> None:
        import torch

        self.lengths = [v.numel() for v in views]
        self.buffer: torch.Tensor | None = None  # the planes of every chunk, when one launch split them
        if _splittable(views):
            from gpumigrate.transfer.device import plane_kernels

            self.buffer, lows, highs = plane_kernels.split(views, stream)
            base = int(self.buffer.data_ptr())
            self._lows = [base + at for at in lows]
            self._highs = [base + at for at in highs]
            self._parts: list[torch.Tensor] = []
        else:  # no Triton, or views the kernel cannot address: torch's transpose, one chunk at a time
            with torch.cuda.stream(stream):
                self._parts = [v.view(-1, 2).t().contiguous() for v in views]
            self._lows = [int(p.data_ptr()) for p in self._parts]
            self._highs = [at + n // 2 for at, n in zip(self._lows, self.lengths, strict=True)]

    def low(self, i: int) -> DeviceBytes:
        return DeviceBytes(self._lows[i], self.lengths[i] // 2, self)

    def high(self, i: int) -> DeviceBytes:
        return DeviceBytes(self._highs[i], self.lengths[i] // 2, self)


def merges(out: torch.Tensor) -> bool:
    """Whether ``plane_kernels.merge`` can write ``out`` (Triton here; contiguous, 2-byte aligned, even length)."""
    from gpumigrate.transfer.device.devhash import _triton_present

    return _triton_present() and out.is_contiguous() and not (out.data_ptr() % 2 or out.numel() % 2)


def _splittable(views: list[torch.Tensor]) -> bool:
    from gpumigrate.transfer.device.devhash import _triton_present

    return bool(views) and _triton_present() and not any(v.data_ptr() % 2 or v.numel() % 2 for v in views)


def encode_planes(planes: Sequence[torch.Tensor | DeviceBytes], stream: torch.cuda.Stream) -> list[DeviceBytes]:
    """ANS payloads of uint8 device planes (tensors or :class:`DeviceBytes`), coded on ``stream`` as one batch.

    nvCOMP learns each coded size on the device; reading the sizes back waits once for the whole batch
    (a wait per chunk held the writer's only thread for a large part of a capture). ``stream`` must already be ordered after whatever wrote the planes. Each payload is
    returned by address (it holds nvCOMP's array, whose memory is torch's: :class:`_TorchBlock`).
    """
    nv = _nvcomp()
    codec = _codec(stream)
    batch_of = getattr(nv, "as_arrays", None)
    if batch_of is None or len(planes) == 1:  # an nvCOMP without batches: one call (and one wait) per plane
        return [_payload(codec.encode(nv.as_array(plane))) for plane in planes]
    coded = codec.encode(batch_of(planes, cuda_stream=int(stream.cuda_stream)))
    return [_payload(coded[i]) for i in range(len(planes))]


def _payload(array: NvArray) -> DeviceBytes:
    face = array.__cuda_array_interface__
    count = 1
    for dim in face["shape"]:
        count *= int(dim)
    return DeviceBytes(int(face["data"][0]), count * int(face["typestr"][2:]), array)


def decode_plane(
    payload: torch.Tensor | DeviceBytes, out: torch.Tensor | DeviceBytes, stream: torch.cuda.Stream
) -> None:
    """Decode an ANS payload into ``out`` (the plane's length); both uint8 device tensors or :class:`DeviceBytes`.

    The decode is queued on ``stream`` into ``out`` itself, with the layout taken from the plane's known
    length instead of the payload's header: nvCOMP then never waits for the device, so the reader's
    threads do not queue behind each other's waits (decoding that read the header first spent most of a
    restore waiting). A payload that decodes to anything else is caught where every chunk is:
    its BLAKE3 against its id, once it landed. An nvCOMP that refuses the known layout decodes the
    plain way, reading the header.
    """
    import torch

    nv = _nvcomp()
    codec = _codec(stream)
    size = out.nbytes if isinstance(out, DeviceBytes) else out.numel()
    try:
        config = _known_layout(codec, size)
        codec.decode(nv.as_array(payload), out=nv.as_array(out), decompression_config=config)
        return
    except (TypeError, AttributeError):  # no out= / config in this nvCOMP
        pass
    except Exception as exc:  # nvCOMP reports malformed streams as generic runtime errors
        raise IntegrityError(f"plane codec 3 (nvcomp-ans) payload does not decode: {exc}") from None
    try:
        plane = codec.decode(nv.as_array(payload))
        got = torch.as_tensor(plane, device=stream.device).view(torch.uint8).reshape(-1)  # out may be DeviceBytes
    except Exception as exc:
        raise IntegrityError(f"plane codec 3 (nvcomp-ans) payload does not decode: {exc}") from None
    if got.numel() != size:
        raise IntegrityError(f"plane codec 3 payload decodes to {got.numel()} bytes, the plane holds {size}")
    with torch.cuda.stream(stream):
        (torch.as_tensor(out, device=got.device) if isinstance(out, DeviceBytes) else out).copy_(got)


def _known_layout(codec: NvCodec, plane_bytes: int) -> NvConfig:
    """A decompression config for planes of ``plane_bytes`` coded by a codec set up like ``codec``
    (nvCOMP builds it from the compression settings, with no device read), cached per codec."""
    configs = getattr(_local, "layouts", None)
    if configs is None:
        configs = _local.layouts = {}
    key = (id(codec), plane_bytes)
    config = configs.get(key)
    if config is None:
        config = configs[key] = codec.decompression_config(codec.compression_config(plane_bytes))
    return config


def decode_plane_to_host(payload: memoryview, n: int) -> npt.NDArray[np.uint8]:
    """Host-side decode for readers without direct placement: through the GPU when there is one."""
    if not available():
        raise TransferError(
            "this chunk's exponent plane was coded on a GPU with nvCOMP's ANS (plane codec 3); decoding it "
            "needs a CUDA device and the nvidia-nvcomp-cu13 and nvidia-libnvcomp-cu13 packages"
        )
    import numpy as np
    import torch

    stream = torch.cuda.current_stream()
    dev_payload = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to("cuda", non_blocking=False)
    out = torch.empty(n, dtype=torch.uint8, device="cuda")
    decode_plane(dev_payload, out, stream)
    stream.synchronize()
    return np.asarray(out.cpu().numpy())

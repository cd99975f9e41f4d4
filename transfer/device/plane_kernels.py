"""Byte planes of bf16/fp16 chunks on the device, in one Triton launch per batch (plane codec 3, ``gpucodec``).

Per chunk, splitting in torch (``view(-1, 2).t().contiguous()`` and a row view) is three or four calls, and
merging (a strided copy per plane, or a stack) two or three; each lets the GIL go and queues to take it back
behind the writer's or reader's other threads: a GPU capture's one submitting thread spent most of its time
there (bench/README.md). Here :func:`split` addresses a batch's chunks, wherever they lie, by 16-bit word
offsets from the first one (as ``devhash``'s gathering kernels do) and writes each chunk's low and high plane
into one buffer; :func:`merge` interleaves two planes given by address into a destination.

Triton launches on the calling thread's *current* CUDA device, not its arguments': the engine's worker threads
have device 0 current, so each launch runs under its tensors' own device (``torch.cuda.device``; issue 32).

Imported only where Triton is (CUDA hosts); the Triton module itself loads on first use.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from gpumigrate.transfer.device.triton_types import Kernel, kernel

if TYPE_CHECKING:
    import torch

BLOCK = 4096  # words per program
ALIGN = 256  # where each plane starts in the split's buffer (nvCOMP wants 16 at least)


@functools.cache
def _kernel() -> Kernel:
    import triton.language as tl

    @kernel(do_not_specialize=["count"])  # one compiled kernel for every batch size (the warm-up compiles it)
    def split_kernel(
        src_ptr: tl.tensor, meta_ptr: tl.tensor, out_ptr: tl.tensor, count: tl.tensor, BLOCK: tl.constexpr
    ) -> None:
        chunk = tl.program_id(0)
        block = tl.program_id(1)
        start = tl.load(meta_ptr + chunk)  # the chunk's first word, in words from src_ptr (may be negative)
        words = tl.load(meta_ptr + count + chunk)
        low = tl.load(meta_ptr + 2 * count + chunk)  # its low plane's first byte in out
        high = tl.load(meta_ptr + 3 * count + chunk)  # and its high plane's
        idx = block * BLOCK + tl.arange(0, BLOCK)
        keep = idx < words
        w = tl.load(src_ptr + start + idx, mask=keep, other=0).to(tl.uint16, bitcast=True)
        tl.store(out_ptr + low + idx, (w & 0xFF).to(tl.uint8), mask=keep)
        tl.store(out_ptr + high + idx, (w >> 8).to(tl.uint8), mask=keep)

    return split_kernel


@functools.cache
def _merge_kernel() -> Kernel:
    import triton.language as tl

    @kernel(do_not_specialize=["words"])
    def merge_kernel(
        low_ptr: tl.tensor, high_ptr: tl.tensor, out_ptr: tl.tensor, words: tl.tensor, BLOCK: tl.constexpr
    ) -> None:
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        keep = idx < words
        lo = tl.load(low_ptr + idx, mask=keep, other=0).to(tl.uint16)
        hi = tl.load(high_ptr + idx, mask=keep, other=0).to(tl.uint16)
        tl.store(out_ptr + idx, (lo | (hi << 8)).to(tl.int16, bitcast=True), mask=keep)

    return merge_kernel


def split(views: list[torch.Tensor], stream: torch.cuda.Stream) -> tuple[torch.Tensor, list[int], list[int]]:
    """Split each flat uint8 device view (even length, 2-byte aligned) into its low and high byte planes, all in
    one new uint8 buffer queued on ``stream``; returns the buffer and each view's low and high plane offsets in
    it. Every plane starts on a multiple of ALIGN bytes (nvCOMP's batch coder reads them as its inputs)."""
    import torch

    anchor = views[0]
    base = anchor.data_ptr()
    starts = [(v.data_ptr() - base) // 2 for v in views]
    words = [v.numel() // 2 for v in views]
    lows: list[int] = []
    highs: list[int] = []
    at = 0
    for n in words:
        lows.append(at)
        at += -(-n // ALIGN) * ALIGN
        highs.append(at)
        at += -(-n // ALIGN) * ALIGN
    with torch.cuda.device(anchor.device), torch.cuda.stream(stream):  # the launch follows the current device
        meta = torch.tensor(starts + words + lows + highs, dtype=torch.int64, pin_memory=True)
        meta = meta.to(anchor.device, non_blocking=True)
        out = torch.empty(at, dtype=torch.uint8, device=anchor.device)
        grid = (len(views), -(-max(words) // BLOCK))
        _kernel()[grid](anchor.view(torch.int16), meta, out, len(views), BLOCK=BLOCK)
    return out, lows, highs


class _Pointer:
    """A device address as Triton takes a kernel's pointer argument (``data_ptr`` and ``dtype``): no torch view."""

    def __init__(self, address: int, dtype: torch.dtype) -> None:
        self._address = address
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self._address


def merge(low: int, high: int, out: torch.Tensor) -> None:
    """Interleave the low and high planes at device addresses ``low`` and ``high`` into ``out`` (a contiguous,
    2-byte aligned flat uint8 device tensor of twice a plane's length), on the current stream: one launch."""
    import torch

    words = out.numel() // 2
    grid = (-(-words // BLOCK),)
    with torch.cuda.device(out.device):  # the launch follows the current device (see the module)
        _merge_kernel()[grid](
            _Pointer(low, torch.uint8),
            _Pointer(high, torch.uint8),
            _Pointer(out.data_ptr(), torch.int16),
            words,
            BLOCK=BLOCK,
        )


def warm(device: torch.device) -> None:
    """Compile both kernels now (the SDK's warm-up), for planes that start on 16-byte boundaries and for planes
    that do not (Triton compiles one kernel per alignment): a first capture or restore would compile them
    inside its timed work."""
    import torch

    scratch = torch.zeros(3 << 12, dtype=torch.uint8, device=device)
    stream = torch.cuda.current_stream(device)
    for at in (0, 2):
        split([scratch[at : at + 2048]], stream)
        merge(scratch.data_ptr() + 4096 + at, scratch.data_ptr() + 6144, scratch[8192 + at : 8192 + at + 2048])
    torch.cuda.synchronize(device)

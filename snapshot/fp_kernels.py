"""The chunk fingerprint (chunks.py) of whole chunks scattered over many tensors, in one Triton launch.

A round fingerprints every chunk of the model. Per region, the compiled weighted sum costs a call of
its own (guards, launch) and most of a model's regions are small, so the launches, not the reading of
HBM, set the pace (bench/README.md). Here the whole chunks of all regions on a device are addressed by
word offsets from one of them, each program sums its share of one chunk's words times the weights, and
one reduction per chunk adds the shares. The sums wrap mod 2**64 like the eager and compiled versions
(int64 arithmetic; addition is associative), so the fingerprints are the same numbers.

Triton launches on the calling thread's *current* device, not on its arguments' device: every launch
here runs under its anchor's device (``torch.cuda.device``), for the engine's request thread (current
device 0) fingerprints the tensors of whichever device a rank uses.

Imported only where Triton is (CUDA hosts): :func:`available` says whether it is.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from typing import Any

import torch

WORDS_PER_PROGRAM = 1 << 16  # 256 KiB of a chunk per program: a 16 MiB chunk is 64 programs
BLOCK = 1024


@functools.cache
def available() -> bool:
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # Triton's language, not Python's: its parameters take Triton's types (and a Python annotation would change
    # how Triton specializes them), so neither the decorator (Triton ships no types) nor the function is typed.
    @triton.jit(do_not_specialize=["words"])  # type: ignore[untyped-decorator]
    def weighted_shares(base_ptr, offsets_ptr, weights_ptr, out_ptr, words, PER: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        chunk = tl.program_id(0)
        part = tl.program_id(1)
        start = tl.load(offsets_ptr + chunk)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for k in range(0, PER, BLOCK):
            idx = part * PER + k + tl.arange(0, BLOCK)
            keep = idx < words
            x = tl.load(base_ptr + start + idx, mask=keep, other=0).to(tl.int64)  # sign-extended, as the eager sum
            w = tl.load(weights_ptr + idx, mask=keep, other=0)
            acc += x * w
        tl.store(out_ptr + chunk * tl.num_programs(1) + part, tl.sum(acc, axis=0))

    return weighted_shares


@functools.cache
def _tail_kernel() -> Any:
    import triton
    import triton.language as tl

    # one compiled kernel however many short chunks a batch holds; untyped, as weighted_shares is
    @triton.jit(do_not_specialize=["count"])  # type: ignore[untyped-decorator]
    def tail_shares(base_ptr, meta_ptr, weights_ptr, out_ptr, count, PER: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        chunk = tl.program_id(0)
        part = tl.program_id(1)
        start = tl.load(meta_ptr + chunk)  # in bytes from base_ptr (may be negative)
        length = tl.load(meta_ptr + count + chunk)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for k in range(0, PER, BLOCK):
            idx = part * PER + k + tl.arange(0, BLOCK)
            keep = idx < length
            # bytes zero-extended, as the eager sum
            x = tl.load(base_ptr + start + idx, mask=keep, other=0).to(tl.int64)
            w = tl.load(weights_ptr + idx, mask=keep, other=0)
            acc += x * w
        tl.store(out_ptr + chunk * tl.num_programs(1) + part, tl.sum(acc, axis=0))

    return tail_shares


def weighted_sums(anchor: torch.Tensor, word_offsets: Sequence[int], words: int, weights: torch.Tensor) -> torch.Tensor:
    """For each offset, the weighted sum (int64, wrapping) of the ``words`` int32 words that start that many words
    from ``anchor``'s first (an int32 device tensor; offsets may be negative and reach other allocations)."""
    count = len(word_offsets)
    parts = -(-words // WORDS_PER_PROGRAM)
    with torch.cuda.device(anchor.device):
        offsets = torch.tensor(list(word_offsets), dtype=torch.int64, pin_memory=True).to(
            anchor.device, non_blocking=True
        )
        shares = torch.empty((count, parts), dtype=torch.int64, device=anchor.device)
        _kernel()[(count, parts)](anchor, offsets, weights, shares, words, PER=WORDS_PER_PROGRAM, BLOCK=BLOCK)
        return shares.sum(dim=1)


def tail_sums(
    anchor: torch.Tensor, byte_offsets: Sequence[int], lengths: Sequence[int], weights: torch.Tensor
) -> torch.Tensor:
    """The short-chunk fingerprint (chunks.py, ``_tail_fingerprint``: the bytes times byte weights, plus the length)
    of each (offset, length) from ``anchor``'s first byte (a uint8 device tensor), all in one launch. ``weights``
    holds at least the longest length's byte weights (their prefixes are the shorter lengths' weights)."""
    count = len(byte_offsets)
    per = WORDS_PER_PROGRAM * 4
    parts = max(1, -(-max(lengths) // per))
    with torch.cuda.device(anchor.device):
        meta = torch.tensor([*byte_offsets, *lengths], dtype=torch.int64, pin_memory=True).to(
            anchor.device, non_blocking=True
        )
        shares = torch.empty((count, parts), dtype=torch.int64, device=anchor.device)
        _tail_kernel()[(count, parts)](anchor, meta, weights, shares, count, PER=per, BLOCK=BLOCK)
        return shares.sum(dim=1) + meta[count:]

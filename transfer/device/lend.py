"""One lend pass of a device landing: every region copied out of the source's memory and hashed on the way.

:class:`~gpumigrate.transfer.device.landing.DeviceLanding` opens the source's memory (CUDA IPC, by allocation) and
hands it here with its own regions; :func:`copy_and_hash` issues the copies and hashes on the current CUDA
stream and returns the hashes without waiting for them (the landing compares them all with one wait).

How the work is cut, and why (the reference model: hundreds of tensors, 32 MiB chunks; bench/README.md):

* **Whole chunks** of every region go through ``devhash.blake3_copy_gather``, many regions per launch, with
  addresses only: a tensor view per region cost more than the copy. The launches grow (8, 16, ... 128 chunks)
  so the GPU starts after the first few allocations are mapped, while the mapping thread maps the rest
  (``cuda_ipc.Mapped.map_ahead``), and the Python side of a launch (its tree's launches) is paid rarely.
* **Short last chunks** (a model's biases and norms: most of its regions end in one) go through the same
  kernel, one launch per length, when their length is a whole number of the kernel's smaller blocks of leaves
  (8 KiB); copying each plainly and hashing the copies cost the pass's Python more, after the last launch.
* **Anything else** (memory the kernels do not take: unaligned, no Triton, lengths off the 8 KiB grid) is
  copied plainly in one fused launch (``torch._foreach_copy_``) and hashed where it landed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpumigrate.stageclock import STAGES

if TYPE_CHECKING:
    import torch

    from gpumigrate.transfer.device.cuda_ipc import LentMemory

# (region, chunk index, the chunk where it landed): chunks a landing hashes after copying them plainly
Landed = tuple[str, int, "torch.Tensor"]

HASH_GROUP = 256  # chunks per hash launch over plainly copied chunks (its tree's scratch: 32 B per KiB hashed)
LAUNCH_CHUNKS = 128  # whole chunks per gathering copy at most (its tree's scratch: 36 B per KiB copied)
# The first copy starts once a few chunks' allocations are mapped; launches then double, staying behind the mapping
# thread (which maps allocations only a little faster than the copy moves them): growing 4× at a time left the GPU
# waiting for the mapping of the next launch's chunks.
FIRST_LAUNCH_CHUNKS = 8


@dataclass
class Hashed:
    """BLAKE3 words ``[n, 8]`` computed where chunks landed, the ``(region, index)`` of each, and their bytes."""

    words: torch.Tensor
    keys: list[tuple[str, int]]
    nbytes: int


@dataclass
class _Piece:
    """Chunks of one region to copy: ``count`` chunks of ``length`` bytes from chunk ``first`` on."""

    name: str
    first: int
    count: int
    src: int  # address of the first byte, source side (this process's mapping of it)
    dst: int


def copy_and_hash(
    regions: Mapping[str, torch.Tensor],
    source: LentMemory,
    chunk_size: int,
    batch: int,
    hash_landed: Callable[[Sequence[Landed]], list[Hashed]],
    on_first_launch: Callable[[], None] | None = None,
) -> list[Hashed]:
    """Copy every region of ``regions`` (this process's device tensors) from the same-named region of ``source``
    (``cuda_ipc.Mapped`` or the landing's per-tensor fallback: ``address(name)``, ``tensor(name)``) and return the
    hashes of every chunk, computed on the way (still being computed: nothing here waits for the device)."""
    from gpumigrate.transfer.device import devhash

    device = next(iter(regions.values())).device
    kernels = devhash.available(device)
    size = chunk_size
    hashed: list[Hashed] = []
    pending: list[_Piece] = []
    short: dict[int, list[_Piece]] = {}  # length -> last chunks the kernel takes
    plain: list[tuple[str, int]] = []  # (region, first chunk copied plainly)
    launch, queued = min(batch, LAUNCH_CHUNKS), 0

    def gather(pieces: list[_Piece], length: int) -> None:
        anchor = pieces[0]
        src0, dst0 = source.tensor(anchor.name), regions[anchor.name]
        s0, d0 = src0.data_ptr(), dst0.data_ptr()
        src_at = [p.src - s0 + i * length for p in pieces for i in range(p.count)]
        dst_at = [p.dst - d0 + i * length for p in pieces for i in range(p.count)]
        keys = [(p.name, p.first + i) for p in pieces for i in range(p.count)]
        if on_first_launch is not None and not hashed:
            on_first_launch()
        hashed.append(Hashed(devhash.blake3_copy_gather(src0, src_at, dst0, dst_at, length), keys, len(keys) * length))

    t = time.perf_counter()
    for name, region in regions.items():
        n, src, dst = region.numel(), source.address(name), region.data_ptr()
        aligned = kernels and src % 16 == 0 and dst % 16 == 0
        whole = n // size if aligned and devhash.gather_chunk(size) else 0
        if whole:
            pending.append(_Piece(name, 0, whole, src, dst))
            queued += whole
            if queued >= min(launch, FIRST_LAUNCH_CHUNKS << len(hashed)):  # 8, 16, 32, 64, then 128 chunks
                gather(pending, size)
                pending, queued = [], 0
        rest = n - whole * size
        if rest and aligned and rest < size and devhash.gather_chunk(rest):
            short.setdefault(rest, []).append(_Piece(name, whole, 1, src + whole * size, dst + whole * size))
        elif rest:
            plain.append((name, whole))
    if pending:
        gather(pending, size)
    t = STAGES.add("lend.regions", t)
    for length, pieces in short.items():
        gather(pieces, length)
    hashed += _copy_plainly(regions, source, size, plain, hash_landed)
    STAGES.add("lend.tails", t)
    return hashed


def _copy_plainly(
    regions: Mapping[str, torch.Tensor],
    source: LentMemory,
    size: int,
    plain: Sequence[tuple[str, int]],
    hash_landed: Callable[[Sequence[Landed]], list[Hashed]],
) -> list[Hashed]:
    """The chunks the kernel does not take, from chunk ``first`` of each region on: one fused copy, then hashed
    where they landed."""
    if not plain:
        return []
    import torch

    into, out_of = [], []
    landed: list[Landed] = []
    for name, first in plain:
        region = regions[name]
        into.append(region[first * size :])
        out_of.append(source.tensor(name)[first * size :])
        landed += [(name, i, region[i * size : (i + 1) * size]) for i in range(first, -(-region.numel() // size))]
    torch._foreach_copy_(into, out_of)
    return hash_landed(landed)


def hash_landed(landed: Sequence[Landed], hasher: Callable[[torch.Tensor, int], torch.Tensor]) -> list[Hashed]:
    """BLAKE3 of chunks copied plainly, ``(region, index, view)``: device chunks of one length in launches of
    ``HASH_GROUP`` chunks (``devhash.blake3_device`` takes views anywhere in this process's memory), the rest one
    by one with ``hasher`` (a chunk's view and its length)."""
    from gpumigrate.transfer.device import devhash

    groups: dict[int, list[Landed]] = {}
    out: list[Hashed] = []
    for name, i, view in landed:
        if view.is_cuda and devhash.available(view.device) and devhash.eligible(view):
            groups.setdefault(view.numel(), []).append((name, i, view))
        else:
            out.append(Hashed(hasher(view, view.numel()), [(name, i)], view.numel()))
    for length, members in groups.items():
        for k in range(0, len(members), HASH_GROUP):
            part = members[k : k + HASH_GROUP]
            words = devhash.blake3_device([view for _, _, view in part])
            out.append(Hashed(words, [(name, i) for name, i, _ in part], length * len(part)))
    return out

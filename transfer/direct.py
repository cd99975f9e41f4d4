"""Direct placement: chunks move between the tensor where they live and the store with no caller copy.

This module holds what capture and restore share (pinned slots, side streams, the device ids, the worker
threads); the two sides are ``direct_writer.py`` and ``direct_reader.py``.

Capture (:class:`~.direct_writer.DirectStoreImageWriter`, the :class:`~gpumigrate.interfaces.DirectImageWriter`):

* device chunks get their ids from the BLAKE3 kernels (``devhash``), batched on a hash stream that
  trails the caller's stream, so the CPU hashes nothing;
* bf16/fp16 chunks are split into byte planes on the device and the exponent plane is coded there
  (``gpucodec``, plane codec 3) when nvCOMP is present, so about two thirds of the bytes cross PCIe; chunks of
  other dtypes are coded whole by the same coder and kept coded where that is smaller (``gpupayload``);
* each chunk (coded payload or raw bytes) is copied once, into a page-locked slot, at the offset where
  its payload belongs in the sealed object; a worker thread per core then seals it in place (AES-GCM
  releases the GIL) or, for raw bytes, encodes it with the CPU codec first, and stores it.

Restore (:class:`~.direct_reader.DirectStoreImageReader`): worker threads read each object into a pinned slot,
decrypt it in place, decode on the CPU (or send the coded plane to the GPU and decode there), copy
the plaintext to its destination tensor and, once every copy landed, check every chunk's BLAKE3 on
the device against its id. Host tensors go the plain way, into their own memory, verified on the CPU.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from gpumigrate import cudacalls
from gpumigrate.transfer.buffers import PinnedSlots, pinned_slots
from gpumigrate.transfer.format import codecs
from gpumigrate.transfer.format.chunkobj import HEADER_SIZE, TAG_SIZE

if TYPE_CHECKING:
    import torch

    # How a copy's completion is marked: a raw CUDA event (cudacalls) where the runtime library is here, else torch's.
    Landed = cudacalls.Event | torch.cuda.Event

# A slot holds one sealed object from OBJECT_AT, a page boundary, so a disk store writes and reads it there with
# direct I/O (stores/direct_io.py) and no copy through the page cache; its payload follows the object's header.
OBJECT_AT = 4096
PAYLOAD_AT = OBJECT_AT + HEADER_SIZE
HASH_BATCH = 64  # chunks per device hash launch: few launches, and the hash still trails the copies closely
# Sealing/opening threads: one per core, shared by the ranks a launcher started on this host (torchrun's
# LOCAL_WORLD_SIZE: each rank seals its own state at once, and more threads than cores only trade places);
# GPUMIGRATE_DIRECT_WORKERS overrides it, for benchmarks comparing counts.
_LOCAL_RANKS = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
WORKERS = int(os.environ.get("GPUMIGRATE_DIRECT_WORKERS", "0") or 0) or max(2, (os.cpu_count() or 2) // _LOCAL_RANKS)
SLOTS = 2 * WORKERS + 8  # a restore holds two per chunk that the CPU decodes; a few more keep the DMA busy


def slots_for(chunk_size: int, count: int) -> PinnedSlots:
    return pinned_slots(PAYLOAD_AT + codecs.scratch_size(chunk_size) + TAG_SIZE, count)


def warm_slots(chunk_size: int) -> None:
    """Page-lock the slots a direct capture or restore of ``chunk_size`` chunks uses, now, not inside a fresh
    target's first restore, where locking that much memory costs a noticeable part of it (the SDK's warm-up calls
    this)."""
    slots_for(chunk_size, SLOTS)


class SideStreams:
    """Side streams per (thread, device, use): hashing, nvCOMP coding and reader copies run beside
    the caller's stream, each thread on its own (nvCOMP codecs are per thread too)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, device: torch.device, use: str) -> torch.cuda.Stream:
        import torch

        found: dict[tuple[str, str], torch.cuda.Stream] | None = getattr(self._local, "streams", None)
        if found is None:
            found = self._local.streams = {}
        key = (str(device), use)
        stream = found.get(key)
        if stream is None:
            # The chunk ids a capture waits for go first on the device: a frozen round confirms every other chunk
            # with the same kernels on a default-priority stream meanwhile, and its workers wait for these ids.
            stream = found[key] = torch.cuda.Stream(device=device, priority=-1 if use == "hash" else 0)
        return stream


STREAMS = SideStreams()


class DeviceIds:
    """BLAKE3 ids of device views, hashed in batches on a stream that trails ``after`` and brought to
    pinned host memory; ``get(i)`` waits only for the batch holding view ``i`` (None: not eligible)."""

    def __init__(self, views: Sequence[torch.Tensor], after: torch.cuda.Stream) -> None:
        import torch

        from gpumigrate.transfer.device import devhash  # imports torch: only where device chunks are

        self._where: dict[int, tuple[int, int]] = {}
        self._batches: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._hex: dict[int, list[str]] = {}
        self.stream = STREAMS.get(after.device, "hash")
        self.stream.wait_stream(after)
        groups: dict[int, list[int]] = {}
        for i, view in enumerate(views):
            if devhash.eligible(view):
                groups.setdefault(view.numel(), []).append(i)
        with torch.cuda.stream(self.stream):
            for members in groups.values():
                for start in range(0, len(members), HASH_BATCH):
                    part = members[start : start + HASH_BATCH]
                    words = devhash.blake3_device([views[i] for i in part])
                    host = torch.empty(words.shape, dtype=words.dtype, pin_memory=True)
                    host.copy_(words, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(self.stream)
                    for row, i in enumerate(part):
                        self._where[i] = (len(self._batches), row)
                    self._batches.append((host, done))
        self._lock = threading.Lock()

    def get(self, i: int) -> str | None:
        where = self._where.get(i)
        if where is None:
            return None
        batch, row = where
        with self._lock:
            if batch not in self._hex:
                host, done = self._batches[batch]
                done.synchronize()
                from gpumigrate.transfer.device.devhash import words_hex

                self._hex[batch] = [words_hex(w) for w in host.tolist()]
            return self._hex[batch][row]


def wait_for(event: Landed, stream: torch.cuda.Stream) -> None:
    """Order ``stream`` (a torch stream) after ``event`` (a ``cudacalls.Event`` or a torch event)."""
    if isinstance(event, cudacalls.Event):
        event.wait_on(stream.cuda_stream)
    else:
        stream.wait_event(event)


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOL_LOCK = threading.Lock()


def pool(workers: int | None = None) -> ThreadPoolExecutor:
    """The process's sealing/opening threads: ``workers`` of them (a plan's ``transfer.parallelism`` for a live
    round), or one per core (:data:`WORKERS`; restores and frozen rounds). Shared by every direct writer and reader
    that asks for that many (an agent opens a new writer or reader every round: a pool each would leave threads
    behind), so a process holds one pool per count it was asked for, a migration's one or two."""
    size = workers or WORKERS
    with _POOL_LOCK:
        found = _POOLS.get(size)
        if found is None:
            found = _POOLS[size] = ThreadPoolExecutor(max_workers=size, thread_name_prefix=f"gm-direct{size}")
        return found

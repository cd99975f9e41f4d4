"""A pool of reusable byte buffers for the chunk hot path (encode scratch, sealed objects).

Allocating a fresh 4 MiB bytearray per chunk is not free: glibc serves it from a new mapping
whose pages fault in and are zeroed on first touch (and are handed back on free), which costs
more CPU than AES-GCM of the same chunk (bench/README.md). Buffers handed back
are kept (up to ``max_idle_bytes``) and reused by any thread and any writer.
"""

from __future__ import annotations

import mmap
import queue
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Buffers are rounded up to this granule so chunks of slightly different sizes share buffers.
GRANULE = 256 << 10
# Pinned slots start on this boundary (a page, and the block size direct I/O needs on any disk: stores/direct_io.py).
ALIGN = 4096


class BufferPool:
    def __init__(self, *, max_idle_bytes: int) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._free: list[bytearray] = []
        self._idle = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        """A buffer of at least ``size`` bytes (contents undefined)."""
        with self._lock:
            best = -1
            for i, buf in enumerate(self._free):
                if len(buf) >= size and (best < 0 or len(buf) < len(self._free[best])):
                    best = i
            if best >= 0:
                buf = self._free.pop(best)
                self._idle -= len(buf)
                return buf
        return bytearray(-(-size // GRANULE) * GRANULE)

    def give(self, buf: bytearray) -> None:
        """Hand a buffer back; nobody may use it (or a view of it) afterwards."""
        with self._lock:
            if self._idle + len(buf) <= self.max_idle_bytes:
                self._free.append(buf)
                self._idle += len(buf)


# Shared by every writer and reader in the process (encode scratch, sealed objects, decrypted payloads).
POOL = BufferPool(max_idle_bytes=96 << 20)


class PinnedSlots:
    """Equal host slots in page-locked memory, handed out in turn, for device↔host copies.

    Page-locked memory is what lets a copy to or from the GPU run at the link's rate without an extra
    host copy, but locking costs about a tenth of a second per GB, so one set per slot size serves
    every writer and reader of the process (:func:`pinned_slots`). ``take`` blocks while all slots
    are in use: that paces the copies to the threads that seal or decode the slots.

    The memory is an anonymous mapping that the CUDA runtime page-locks (``cudacalls.register_host``), each slot
    :data:`ALIGN`-aligned: a disk store then writes and reads a slot with direct I/O, no copy through the page
    cache (stores/direct_io.py); the driver's own page-locked allocations may refuse it. Where the runtime is not
    at hand, PyTorch's page-locked allocator serves instead.
    """

    def __init__(self, slot_bytes: int, count: int) -> None:
        import torch

        from gpumigrate import cudacalls

        self.slot_bytes = -(-slot_bytes // ALIGN) * ALIGN
        self.count = count
        self._map: mmap.mmap | None = None
        rt = cudacalls.runtime()
        memory = None
        if rt is not None:
            self._map = mmap.mmap(-1, self.slot_bytes * count)
            memory = torch.frombuffer(self._map, dtype=torch.uint8)
            try:
                cudacalls.register_host(rt, memory.data_ptr(), self.slot_bytes * count)
            except Exception:
                memory, self._map = None, None  # PyTorch's allocator below
        if memory is None:
            memory = torch.empty(self.slot_bytes * count, dtype=torch.uint8, pin_memory=True)
        self._memory = memory
        self._array = self._memory.numpy()
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(count):
            self._free.put(i)

    def take(self) -> int:
        return self._free.get()

    def give(self, slot: int) -> None:
        self._free.put(slot)

    def address(self, slot: int) -> int:
        """The host address where a slot starts (for raw device copies, ``cudacalls``)."""
        return int(self._memory.data_ptr()) + slot * self.slot_bytes

    def tensor(self, slot: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Bytes ``[start, stop)`` of a slot as a pinned uint8 torch tensor (a view, no copy)."""
        base = slot * self.slot_bytes
        return self._memory[base + start : base + (self.slot_bytes if stop is None else stop)]

    def view(self, slot: int) -> memoryview:
        """The whole slot as a writable memoryview (for the sealer, the codecs and file reads)."""
        base = slot * self.slot_bytes
        return self._array[base : base + self.slot_bytes].data


_PINNED: dict[int, PinnedSlots] = {}
_PINNED_LOCK = threading.Lock()
_OUTGROWN: list[PinnedSlots] = []  # sets replaced by larger ones, kept for the process's life


def pinned_slots(slot_bytes: int, count: int) -> PinnedSlots:
    """The process's pinned slots of at least ``slot_bytes`` each, at least ``count`` of them."""
    with _PINNED_LOCK:
        found = _PINNED.get(slot_bytes)
        if found is None or found.count < count:
            if found is not None:  # a writer may still copy through it; registered memory is never unmapped
                _OUTGROWN.append(found)
            found = _PINNED[slot_bytes] = PinnedSlots(slot_bytes, count)
        return found

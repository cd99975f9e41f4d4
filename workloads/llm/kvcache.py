"""The KV cache: one preallocated tensor, a slot per running request, and a log of what was written.

Layout ``[slots, positions, layers, 2 (key, value), kv_heads, head_dim]``: everything one request
wrote at one position (every layer's key and value) is one contiguous row of ``row_bytes``, and a
request's whole cache is one contiguous range of its slot. A decode step writes one row per running
request, so what changed since any moment is a short list of byte ranges, one per slot: the
migration's pre-copy ships the chunks those touch (``take_written``, the SDK's ``attach(written=...)``)
instead of hashing the whole cache each round.

Why a cache of our own rather than transformers' ``StaticCache``: that one is laid out per layer and
per batch row, with no notion of slots that requests join and leave between steps, and no record of
what was written; the engine needs all three.
"""

from __future__ import annotations

import threading

import torch


class KVCache:
    def __init__(
        self,
        *,
        slots: int,
        positions: int,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.slots = slots
        self.positions = positions
        self.kv = torch.zeros((slots, positions, layers, 2, kv_heads, head_dim), dtype=dtype, device=device)
        self.row_bytes = layers * 2 * kv_heads * head_dim * self.kv.element_size()
        self._free = list(range(slots))  # lowest slot first: the order slots are taken is deterministic
        self._written: dict[int, tuple[int, int]] = {}  # slot -> [first, end) positions written since the last take
        self._log_lock = threading.Lock()

    # -- slots
    @property
    def free_slots(self) -> int:
        return len(self._free)

    def take(self) -> int:
        slot = min(self._free)
        self._free.remove(slot)
        return slot

    def give_back(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not in use")
        self._free.append(slot)

    def claim(self, slot: int) -> None:
        """Take this very slot (an imported request keeps the slot its cache rows are in)."""
        if slot not in self._free:
            raise ValueError(f"slot {slot} is already in use")
        self._free.remove(slot)

    def reset_slots(self) -> None:
        self._free = list(range(self.slots))

    # -- views the forward pass reads and writes
    def layer(self, layer: int, which: int) -> torch.Tensor:
        """``[slots, positions, kv_heads, head_dim]`` (a strided view) of one layer's keys (0) or values (1)."""
        return self.kv[:, :, layer, which]

    def note_written(self, slot: int, first: int, end: int) -> None:
        """Record that positions [first, end) of ``slot`` were written (every layer)."""
        with self._log_lock:
            old = self._written.get(slot)
            self._written[slot] = (first, end) if old is None else (min(old[0], first), max(old[1], end))

    # -- dirty regions for pre-copy
    def take_written(self) -> list[tuple[int, int]]:
        """Byte ranges ``(offset, length)`` of ``kv`` written since the previous call, one per slot; starts a new record.

        A write is noted once it is issued (on a GPU, queued): the SDK waits for the device before it reads."""
        with self._log_lock:
            spans, self._written = sorted(self._written.items()), {}
        row = self.row_bytes
        return [((slot * self.positions + first) * row, (end - first) * row) for slot, (first, end) in spans]

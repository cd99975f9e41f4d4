"""A receiver's NIXL landing pool (``nixl://``): registered host slots that senders WRITE chunk objects into.

The receiver leases slots to an authenticated connection (NIXL_OPEN) and hands it :meth:`HostLanding.offer`; a
landed object is read through :meth:`HostLanding.view` and copied out before it is verified (``server.py``).
"""

from __future__ import annotations

import base64
import contextlib
import threading
from typing import Any

from gpumigrate.errors import InvalidInputError
from gpumigrate.transfer.stores.nixl_agent import host_buffer, make_agent, register_host

DEFAULT_SLOTS = 32  # landing slots in a receiver's pool
DEFAULT_SLOT_BYTES = 8 << 20  # a 4 MiB chunk's sealed object with room to spare; larger ones go inline


class HostLanding:
    """The receiver's pool of registered landing slots, leased to authenticated connections."""

    def __init__(
        self, *, slots: int = DEFAULT_SLOTS, slot_bytes: int = DEFAULT_SLOT_BYTES, transports: str | None = None
    ) -> None:
        if slots < 1 or slot_bytes < 4096:
            raise InvalidInputError("a NIXL landing pool needs at least 1 slot of at least 4096 bytes")
        self.agent = make_agent("recv", transports=transports)
        self.slot_bytes = slot_bytes
        self._owner, self.pool = host_buffer(slots * slot_bytes)
        self._reg = register_host(self.agent, self.pool)
        self._free = list(range(slots))
        self._lock = threading.Lock()

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def lease(self, wanted: int) -> list[int]:
        with self._lock:
            n = max(0, min(wanted, len(self._free)))
            taken, self._free = self._free[:n], self._free[n:]
        return taken

    def release(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    def offer(self, slots: list[int]) -> dict[str, Any]:
        """What a sender needs to WRITE into ``slots``: agent metadata and each slot's address."""
        base = self.pool.ctypes.data
        return {
            "agent": self.agent.name,
            "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "mem": "DRAM",
            "slot_bytes": self.slot_bytes,
            "slots": [[s, base + s * self.slot_bytes, self.slot_bytes, 0] for s in slots],
        }

    def view(self, slot: int, length: int) -> memoryview:
        if length > self.slot_bytes:
            raise InvalidInputError(f"an object of {length} bytes does not fit a {self.slot_bytes}-byte slot")
        start = slot * self.slot_bytes
        return self.pool[start : start + length].data

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.agent.deregister_memory(self._reg)

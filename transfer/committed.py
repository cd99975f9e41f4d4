"""Manifests this process committed, and the ``sequence`` each new manifest gets (FORMAT.md, Manifest).

The next round's writer takes its parent from here instead of reading the manifest back and checking its signature
(on the freeze → ready path): it is the very body this process signed and stored.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

# The bodies, by (store URL, image id, key id): the last few only.
_COMMITTED: OrderedDict[tuple[str, str, str | None], dict[str, Any]] = OrderedDict()
_COMMITTED_KEPT = 4
_COMMITTED_LOCK = threading.Lock()
_LAST_SEQUENCE = 0  # the last sequence this process gave a manifest (under _COMMITTED_LOCK)


def next_sequence(parent: dict[str, Any] | None) -> int:
    """A new manifest's ``sequence`` (FORMAT.md, Manifest): the clock in microseconds since the epoch, raised past
    the parent's sequence and past every sequence this process gave before. So an image always sorts after its
    parent and after this process's earlier images, and images of different writers sort as their clocks do."""
    global _LAST_SEQUENCE
    seq = (parent or {}).get("sequence")
    after = seq + 1 if type(seq) is int else 0
    with _COMMITTED_LOCK:
        _LAST_SEQUENCE = max(time.time_ns() // 1000, after, _LAST_SEQUENCE + 1)
        return _LAST_SEQUENCE


def committed_body(store_url: str, image_id: str, key_id: str | None) -> dict[str, Any] | None:
    """The body of a manifest this process committed to ``store_url`` with the key ``key_id``, if kept."""
    with _COMMITTED_LOCK:
        return _COMMITTED.get((store_url, image_id, key_id))


def remember(store_url: str, image_id: str, key_id: str | None, body: dict[str, Any]) -> None:
    """Keep the body of a manifest just committed (the oldest kept goes)."""
    with _COMMITTED_LOCK:
        _COMMITTED[(store_url, image_id, key_id)] = body
        _COMMITTED.move_to_end((store_url, image_id, key_id))
        while len(_COMMITTED) > _COMMITTED_KEPT:
            _COMMITTED.popitem(last=False)

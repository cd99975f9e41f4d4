"""Lending: the source's side of a fill from its memory (``fill.py``), its tracked bytes moved into a target's landing.

The bytes are read as they are now; the target checks each chunk against the image it restores, so a
tensor that changed since that image fails there, never silently. Blobs are not lent: a blob is
serialized afresh at each read, so its bytes are read from the image.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from gpumigrate.errors import SnapshotError
from gpumigrate.snapshot import tracked as tr
from gpumigrate.snapshot.chunks import byte_view
from gpumigrate.snapshot.engine.tracking import Tracker
from gpumigrate.snapshot.fill import Filler, Run, slices


def lend(
    tracker: Tracker,
    filler: Filler | None,
    landing: str,
    runs: Sequence[Run],
    chunk_size: int,
    *,
    control_key: bytes,
    tolerate: bool,
) -> dict[str, Any]:
    """Move ``runs`` of the tracked tensors into the target's landing at ``landing``."""
    if filler is None:
        raise SnapshotError("this agent cannot lend: the workload did not wire the transfer engine")
    if chunk_size <= 0 or chunk_size % 8:
        raise SnapshotError(f"chunk size {chunk_size} is not a positive multiple of 8 bytes")
    t0 = time.perf_counter()
    wanted = {run.region for run in runs}  # a final lend names a few of a model's tensors: views of those only
    views = {
        n: byte_view(t) for n, (it, t) in tracker.live().items() if n in wanted and not isinstance(it, tr.BlobItem)
    }
    lent = slices(views, runs, chunk_size)
    done = filler.lend(landing, lent, control_key=control_key, tolerate=tolerate)
    return {**done, "bytes_lent": sum(v.numel() for v in lent.values()), "seconds": time.perf_counter() - t0}

"""Zeroize: after the cut-over, the source's tracked memory is overwritten with zeros and read back.

Zeros are not a model: the workload stops answering (unready, and retired for good: requests fail at
once) before the first byte changes. The pipelines' ring slots held copies of that memory: wiped too.
Opaque state (blobs) lives in the workload's own objects, not in tracked memory, and is left alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gpumigrate.errors import SnapshotError
from gpumigrate.snapshot import tracked as tr
from gpumigrate.snapshot.chunks import byte_view
from gpumigrate.snapshot.engine.pipelines import Pipelines
from gpumigrate.snapshot.engine.tracking import Tracker
from gpumigrate.snapshot.stepgate import SafePointGate


def zeroize(
    tracker: Tracker,
    pipelines: Pipelines,
    *,
    gate: SafePointGate | None,
    set_ready: Callable[[bool], None] | None,
    forget: Callable[[], None],
    end_parked: bool = False,
) -> dict[str, Any]:
    """Overwrite the tracked tensors (and the ring buffers) with zeros, read back; the audit record.

    ``end_parked``: a training loop parked at the safe point ends its process once the freeze lease runs out
    (``SafePointGate.mark_retired``).

    ``forget`` is called once the memory is wiped: what the engine remembers of it (shipped, pre-loaded) is void."""
    if set_ready is not None:
        set_ready(False)  # zeros are not a model: stop answering before the first byte changes
    if gate is not None:
        gate.mark_retired(end_parked=end_parked)  # for good: /readyz says so, requests fail at once (no wait)
    t0 = time.perf_counter()
    regions = 0
    nbytes = 0
    failed: list[str] = []
    devices: set[str] = set()
    for item in tracker.items:
        if isinstance(item, tr.BlobItem):
            continue
        for name, t in item.tensors().items():
            view = byte_view(t)
            view.zero_()
            if bool(view.any()):
                failed.append(name)
            regions += 1
            nbytes += view.numel()
            devices.add(str(view.device))
    pipelines.zeroize()
    forget()
    if failed:
        raise SnapshotError(f"zeroize read-back found non-zero bytes in {', '.join(failed[:5])}")
    return {
        "zeroized_regions": regions,
        "zeroized_bytes": nbytes,
        "verified": True,
        "devices": sorted(devices),
        "seconds": time.perf_counter() - t0,
    }

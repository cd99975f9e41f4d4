"""Snapshot: live pre-copy rounds while the source serves, then freeze, the final image, and (inference) resume.

When to stop pre-copying is the one convergence rule (``snapshot/precopy.py``). Where the backend
pre-loads (agent), each round is loaded into the target while the source serves (``flows/preload.py``),
so that the restore phase loads only what the final image changed. The source is never left frozen: a
failed final round resumes it before the error goes on; a failed pre-load happens before any freeze.
"""

from __future__ import annotations

import time
from typing import Any

from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit
from gpumigrate.flows.freeze_lease import keep_frozen, release
from gpumigrate.flows.preload import precopy_rounds
from gpumigrate.flows.report import merge_result
from gpumigrate.flows.undo import undo_source
from gpumigrate.parity.urls import redact_url
from gpumigrate.snapshot.gchold import gc_held


def run(ctx: RunContext) -> dict[str, Any]:
    m, plan = ctx.migration, ctx.plan
    backend = ctx.backend()
    parent = ctx.runtime.image  # a resumed migration ships only what changed since
    rounds = plan.snapshot.precopy_rounds if backend.live_rounds else 0
    live = precopy_rounds(ctx, backend, max_rounds=rounds)  # each pre-loaded into the target where it can
    conv = live.convergence
    # No cyclic collection while the source is frozen: a full one holds this process for 40-100 ms
    # (snapshot/gchold.py), and here that is the workload's downtime.
    with gc_held():
        t_freeze = time.monotonic()
        # Under the plan's lease: a killed orchestrator leaves the source frozen for one lease at most.
        backend.freeze(plan.snapshot.freeze_lease_s)
        ctx.update(source_frozen=True)
        if backend.name == "agent":
            keep_frozen(ctx)  # renewed while this process lives, however long the final round takes
        try:
            image = backend.final()
        except BaseException:
            release(ctx)
            undo_source(ctx)
            raise
        frozen_ms = (time.monotonic() - t_freeze) * 1000
        if plan.workload.kind == "inference":
            # Weights are read-only: the source serves on while the target is restored and ramped.
            backend.resume()
            ctx.update(source_frozen=False)
    release(ctx)
    ctx.update(image=image)
    emit(
        m,
        "image.committed",
        {
            "backend": backend.name,
            "image_id": image.id if image else None,
            "store": redact_url(image.store) if image else None,
            "parent": parent.id if parent else None,
            "bytes_image": image.bytes_image if image else None,
            "bytes_sent": image.bytes_sent if image else None,
            "precopy_rounds": len(conv.rounds),
            "converged": conv.reason,
            "preloaded": len(live.preloads),
            "bytes_preloaded": live.bytes_preloaded,
        },
    )
    if image is not None:
        merge_result(m, bytes={"image": image.bytes_image, "stored": image.bytes_stored})
    return {
        "image_id": image.id if image else None,
        "precopy_rounds": len(conv.rounds),
        "preloaded": len(live.preloads),
        "frozen_ms": round(frozen_ms, 1),
        "bytes_image": image.bytes_image if image else None,
    }

"""Snapshot: live pre-copy rounds while the source runs, then freeze, the final image, and (inference) resume.

When to stop pre-copying is the one convergence rule (``snapshot/precopy.py``). Where the backend
pre-loads (agent), each round is loaded into the target while the source runs (``flows/preload.py``),
so that the restore phase loads only what the final image changed. The freeze lands at the workload's
safe point (between requests, or between training steps: the step it froze at is recorded, the restore and
parity phases count the target's steps from it) under ``snapshot.freeze_lease_s``, which the flow renews
while it works on the frozen source (``flows/freeze_lease.py``): if this process dies, the source resumes by
itself. An inference source resumes after the final image (its weights are read-only: it serves on while
the target is restored and ramped); a training source stays frozen (two copies of one job must never both
train) until the finalize phase parks it for good, or an undo resumes it. A source whose workload hands its work in
flight over (the SDK's ``InFlight``: an LLM server's generations, captured between two decode steps) keeps that work
sealed, unadvanced, while it serves new requests; the lease that held the freeze holds it, renewed until the restore
phase hands it to the target (or an undo takes it back).

The source is never left frozen by a failure: a failed final round resumes it before the error goes on; a
failed pre-load happens before any freeze.
"""

from __future__ import annotations

import time
from typing import Any

from gpumigrate.flows import client_figures
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
    client_figures.mark(ctx)  # the front door's requests from here on: the baseline, then the freeze's stall
    parent = ctx.runtime.image  # a resumed migration ships only what changed since
    rounds = plan.snapshot.precopy_rounds if backend.live_rounds else 0
    live = precopy_rounds(ctx, backend, max_rounds=rounds)  # each pre-loaded into the target where it can
    conv = live.convergence
    # No cyclic collection while the source is frozen: a full one pauses this process for a visible while
    # (snapshot/gchold.py), and here that pause is the workload's downtime.
    with gc_held():
        frozen_at, t_freeze = time.time(), time.monotonic()
        # Under the plan's lease: a killed orchestrator leaves the source frozen for one lease at most.
        step = backend.freeze(plan.snapshot.freeze_lease_s)
        ctx.update(source_frozen=True, **({} if ctx.runtime.froze_at else {"froze_at": frozen_at}))
        try:
            keep_frozen(ctx, backend)  # renewed while this process lives, however long the final round takes
            image = backend.final()
        except BaseException:
            release(ctx)
            undo_source(ctx)
            raise
        frozen_ms = (time.monotonic() - t_freeze) * 1000
        if plan.workload.kind == "inference":
            # Weights are read-only: the source serves on while the target is restored and ramped.
            backend.resume()
            held = bool(backend.work("source").get("held"))  # work in flight sealed in the image, for its hand-over
            ctx.update(source_frozen=False, resumed_at=time.time(), source_holds_work=held)
            if not held:
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
            "freeze_step": step,
            "freeze_lease_s": plan.snapshot.freeze_lease_s,
            "frozen_ms": round(frozen_ms, 1),
            "work_held": ctx.runtime.source_holds_work,
        },
    )
    if image is not None:
        merge_result(m, bytes={"image": image.bytes_image, "stored": image.bytes_stored})
    return {
        "image_id": image.id if image else None,
        "precopy_rounds": len(conv.rounds),
        "preloaded": len(live.preloads),
        "freeze_step": step,
        "frozen_at": frozen_at,
        "frozen_ms": round(frozen_ms, 1),
        "bytes_image": image.bytes_image if image else None,
    }

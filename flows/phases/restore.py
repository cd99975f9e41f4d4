"""Restore: rebuild the state on the target from the verified image, then wait until the target runs.

A target the snapshot phase pre-loaded (``flows/preload.py``) loads only the chunks the final image
changed: ``image.restored`` and ``result.bytes.restored`` say how much that was. A service runs once its
ready path answers; a training job runs once its first step after the freeze completed on the target
(``result.pause_ms``: from the freeze to that step), while the source stays frozen under its lease.

Work in flight that the final image carried (the source's workload hands it over: an LLM server's generations)
goes on at the target as soon as it is ready: the source is told to hand it over (``SnapshotBackend.hand_over``,
with the target's service URL) and relays its clients' streams from there. ``work.handed_over`` records what moved;
the freeze-to-hand-over time is the longest pause those clients saw (``result.handover_ms``).
"""

from __future__ import annotations

import time
from typing import Any

from gpumigrate.errors import InvalidInputError
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit
from gpumigrate.flows.freeze_lease import keep_frozen, release
from gpumigrate.flows.preload import final_load
from gpumigrate.flows.report import merge_result
from gpumigrate.infra.launch import wait_http

READY_TIMEOUT_S = 300
STEPS_TIMEOUT_S = 600.0  # for the target's steps to show up (its first after the restore, the parity steps)


def run(ctx: RunContext) -> dict[str, Any]:
    m, plan = ctx.migration, ctx.plan
    backend = ctx.backend()
    keep_frozen(ctx, backend)  # a training source is still frozen (a resumed migration renews it again)
    image = ctx.runtime.image
    restored = backend.restore(image)
    if restored.pid is not None:  # a process the restore started (CRIU): its undo must find it
        ctx.update(target_pid=restored.pid, target_pid_start=restored.pid_start)
    out: dict[str, Any] = {"image_id": image.id if image else None, "ready": True}
    resumed: dict[str, Any] | None = None
    if plan.workload.kind == "training":  # no ready path: the target runs once it took a step past the freeze
        step, frozen_at = freeze_cut(ctx)
        backend.wait_for_steps("target", since=step, count=1, timeout_s=STEPS_TIMEOUT_S)
        pause_ms = round((time.time() - frozen_at) * 1000, 1)
        merge_result(m, pause_ms=pause_ms)
        out.update(pause_ms=pause_ms, chunks_loaded=restored.chunks_loaded)
        resumed = {"on": "target", "after_step": step, "pause_ms": pause_ms}
    else:
        wait_http(ctx.target_endpoint(), path=plan.workload.ready_path, timeout_s=READY_TIMEOUT_S)
        if ctx.runtime.source_holds_work:
            out.update(hand_over(ctx))
    emit(
        m,
        "image.restored",
        {
            "backend": backend.name,
            "image_id": restored.image_id or None,
            "host": ctx.target_host().name,
            **final_load(ctx, backend, restored),
            "pid": restored.pid,
        },
    )
    if resumed is not None:
        emit(m, "training.resumed", resumed)
    return out


def hand_over(ctx: RunContext) -> dict[str, Any]:
    """The source's work in flight goes on at the ready target; the hold's lease is no longer renewed."""
    m = ctx.migration
    handed = ctx.backend().hand_over(ctx.target_endpoint())
    frozen_at = float((m.phase("snapshot").get("result") or {}).get("frozen_at") or time.time())
    handover_ms = round((time.time() - frozen_at) * 1000, 1)
    ctx.update(source_holds_work=False, work_handed_over=bool(handed.get("handed_over")))
    release(ctx)
    if handed.get("handed_over"):
        emit(m, "work.handed_over", {"target": handed.get("target"), "handover_ms": handover_ms,
                                     "figures": handed.get("figures") or {}})  # fmt: skip
        moved = (handed.get("figures") or {}).get("moved")
        merge_result(m, streams={"handover_ms": handover_ms, "handed_over": moved})
        return {"handover_ms": handover_ms}
    emit(m, "work.kept_on_source", {"reason": str(handed.get("reason") or "the source handed nothing over")[:300]})
    return {"handover_ms": None}


def freeze_cut(ctx: RunContext) -> tuple[int, float]:
    """The step the source froze at and when (epoch seconds), from the snapshot phase's record."""
    done = ctx.migration.phase("snapshot").get("result") or {}
    if done.get("freeze_step") is None or "frozen_at" not in done:
        raise InvalidInputError(f"migration {ctx.migration.id}: the snapshot phase has not recorded its freeze")
    return int(done["freeze_step"]), float(done["frozen_at"])

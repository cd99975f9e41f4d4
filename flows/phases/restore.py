"""Restore: rebuild the state on the target from the verified image; wait until the target reports ready."""

from __future__ import annotations

from typing import Any

from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit
from gpumigrate.infra.launch import wait_http

READY_TIMEOUT_S = 300


def run(ctx: RunContext) -> dict[str, Any]:
    m, plan = ctx.migration, ctx.plan
    backend = ctx.backend()
    image = ctx.runtime.image
    restored = backend.restore(image)
    if restored.pid is not None:  # a process the restore started (CRIU): its undo must find it
        ctx.update(target_pid=restored.pid, target_pid_start=restored.pid_start)
    wait_http(ctx.target_endpoint(), path=plan.workload.ready_path, timeout_s=READY_TIMEOUT_S)
    emit(
        m,
        "image.restored",
        {
            "backend": backend.name,
            "image_id": restored.image_id or None,
            "host": ctx.target_host().name,
            "bytes_loaded": restored.bytes_loaded,
            "chunks_loaded": restored.chunks_loaded,
            "chunks_skipped": restored.chunks_skipped,
            "seconds": round(restored.seconds, 3),
            "pid": restored.pid,
        },
    )
    return {"image_id": image.id if image else None, "ready": True}

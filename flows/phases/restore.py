"""Restore: rebuild the state on the target from the verified image; wait until the target reports ready.

A target the snapshot phase pre-loaded (``flows/preload.py``) loads only the chunks the final image
changed: ``image.restored`` and ``result.bytes.restored`` say how much that was.
"""

from __future__ import annotations

from typing import Any

from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit
from gpumigrate.flows.preload import final_load
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
            **final_load(ctx, backend, restored),
            "pid": restored.pid,
        },
    )
    return {"image_id": image.id if image else None, "ready": True}

"""Finalize: keep the source warm through the rollback window, or retire it at once when the window is 0."""

from __future__ import annotations

import time
from typing import Any

from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit


def run(ctx: RunContext) -> dict[str, Any]:
    m, plan = ctx.migration, ctx.plan
    window = plan.traffic.rollback_window_s
    deadline = time.time() + window
    ctx.update(rollback_deadline=deadline)
    if window <= 0:
        emit(m, "source.zeroized", ctx.backend().retire())
        ctx.update(source_zeroized=True, source_retired=True)
        return {"source": "zeroized"}
    emit(
        m,
        "source.kept_warm",
        {
            "until": deadline,
            "rollback_window_s": window,
            "note": f"`gpumigrate rollback {m.id}` works until then; "
            f"`gpumigrate retire {m.id}` zeroizes the source after it",
        },
    )
    return {"source": "warm", "rollback_window_s": window}

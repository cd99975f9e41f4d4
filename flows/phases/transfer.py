"""Transfer: push the image to the target's store (only missing chunks move), or verify it where it is.

Residency is checked for the store the bytes land in, before any byte moves there. The push is
resumable by the transfer engine: a re-run sends only the chunks the destination lacks.
"""

from __future__ import annotations

import os
from typing import Any

from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit, notify
from gpumigrate.flows.prefect_artifacts import Progress
from gpumigrate.flows.report import merge_result
from gpumigrate.infra.residency import check_store
from gpumigrate.parity.urls import redact_url
from gpumigrate.transfer.keys import resolve_key
from gpumigrate.transfer.push import push, verify

# bytes/s cap of the push: emulates a slow link (tests, demos)
RATE_LIMIT_ENV = "GPUMIGRATE_TRANSFER_RATE_LIMIT"


def run(ctx: RunContext) -> dict[str, Any]:
    m, plan, rt = ctx.migration, ctx.plan, ctx.runtime
    if rt.image is None:
        return {"skipped": "the state stays in the source process (in place): no image moves"}
    image_id = rt.image.id
    src = ctx.store_url()
    dst = rt.target_store or src
    ref = ctx.key_ref()
    key = resolve_key(env=ref.get("env"), file=ref.get("file")) if ref else None
    if dst == src:
        verify(src, image_id, key=key)
        emit(m, "image.verified", {"image_id": image_id, "store": redact_url(src)})
        return {"image_id": image_id, "pushed": False, "bytes_sent": 0}
    host = ctx.target_host()
    check_store(
        dst,
        host.region if dst.startswith("file://") else plan.transfer.store_region,
        plan.data.allowed_jurisdictions,
        target_provider=plan.target.provider,
        target_region=plan.target.region,
        record=m.record,
    )
    progress = Progress(f"transfer of image {image_id[:12]} to {host.name}")

    def on_progress(done: int, total: int) -> None:
        progress.update(100.0 * done / total if total else 100.0)
        notify(m.id, "transfer.progress", {"done": done, "total": total})

    rate = os.environ.get(RATE_LIMIT_ENV)
    stats = push(
        src,
        dst,
        image_id,
        key=key,
        parallelism=plan.transfer.parallelism,
        progress=on_progress,
        rate_limit=float(rate) if rate else None,
    )
    progress.update(100.0, force=True)
    figures = {
        "chunks_total": stats.chunks_total,
        "chunks_sent": stats.chunks_sent,
        "chunks_skipped": stats.chunks_skipped,
        "chunks_resent_invalid": stats.chunks_resent_invalid,
        "bytes_logical": stats.bytes_logical,
        "bytes_sent": stats.bytes_sent,
        "seconds": round(stats.seconds, 3),
    }
    emit(m, "image.transferred", {"image_id": image_id, "from": redact_url(src), "to": redact_url(dst), **figures})
    sent = (m.read().get("result", {}).get("bytes", {}).get("sent") or 0) + stats.bytes_sent
    merge_result(m, bytes={"sent": sent})
    return {"image_id": image_id, "pushed": True, **figures}

"""Transfer: check the image where the target reads it; move only what is missing there, if anything.

The source's agent wrote the image straight to where the target reads it (flows/target_store.py), so
nothing is stored and forwarded: this phase checks the image there from its signed manifest and the
store's listing, reading no payload back (a receiver verified every chunk by its AES-GCM tag and
BLAKE3 before storing it; the target's reader checks each one again before using it), then stops
the receiver the flow started. An image written elsewhere (a migration resumed from a state an older
gpumigrate wrote) is pushed there by the transfer engine, which sends only the chunks the
destination lacks, its residency checked first.
"""

from __future__ import annotations

import os
from typing import Any

from gpumigrate.flows import target_store
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit, notify
from gpumigrate.flows.prefect_artifacts import Progress
from gpumigrate.flows.report import merge_result
from gpumigrate.infra.residency import check_store
from gpumigrate.parity.urls import redact_url
from gpumigrate.transfer.format.keys import resolve_key
from gpumigrate.transfer.progress import TransferStats
from gpumigrate.transfer.push import check_landed, push

# bytes/s cap of a push: emulates a slow link (tests, demos)
RATE_LIMIT_ENV = "GPUMIGRATE_TRANSFER_RATE_LIMIT"


def run(ctx: RunContext) -> dict[str, Any]:
    m, rt = ctx.migration, ctx.runtime
    if rt.image is None:
        return {"skipped": "the state stays in the source process (in place): no image moves"}
    image_id, written = rt.image.id, rt.image.store
    dst = rt.image_store or ctx.store_url()
    ref = ctx.key_ref()
    key = resolve_key(env=ref.get("env"), file=ref.get("file")) if ref else None
    pushed = written != dst
    stats = _push(ctx, written, dst, key) if pushed else None
    where = dst
    if target_store.is_receiver(dst):  # asked of the receiver; once the flow stopped it, of its store
        where = rt.target_store or dst if rt.receiver_stopped else target_store.control_url(dst)
    landed = check_landed(where, image_id, key=key)
    target_store.stop_target_receiver(ctx)
    figures = {**_figures(stats or landed, sent=stats is not None), "bytes_landed": landed.bytes_landed}
    emit(m, "image.verified", {"image_id": image_id, "store": redact_url(dst), "read_back": False, **figures})
    if stats is not None:
        sent = (m.read().get("result", {}).get("bytes", {}).get("sent") or 0) + stats.bytes_sent
        merge_result(m, bytes={"sent": sent})
    else:  # the source's agent wrote the image there: what crossed is what landed
        merge_result(m, bytes={"sent": landed.bytes_landed})
    return {"image_id": image_id, "pushed": pushed, **figures}


def _figures(stats: TransferStats, *, sent: bool) -> dict[str, Any]:
    return {
        "chunks_total": stats.chunks_total,
        "chunks_sent": stats.chunks_sent if sent else 0,
        "chunks_skipped": stats.chunks_skipped,
        "chunks_resent_invalid": stats.chunks_resent_invalid,
        "bytes_logical": stats.bytes_logical,
        "bytes_sent": stats.bytes_sent if sent else 0,
        "seconds": round(stats.seconds, 3),
    }


def _push(ctx: RunContext, src: str, dst: str, key: bytes | None) -> TransferStats:
    """An image that is not where the target reads it: only what ``dst`` lacks moves."""
    m, plan, rt = ctx.migration, ctx.plan, ctx.runtime
    host = ctx.target_host()
    image_id = ctx.need(rt.image, "the image").id
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
    emit(
        m,
        "image.transferred",
        {"image_id": image_id, "from": redact_url(src), "to": redact_url(dst), **_figures(stats, sent=True)},
    )
    return stats

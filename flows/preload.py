"""The pre-loaded target: each live pre-copy round is loaded into the target while the source still runs.

The snapshot phase (``flows/phases/snapshot.py``, every workload kind) runs its live rounds through
:func:`precopy_rounds`. Where the plan's backend declares ``preloads``
(agent), the target was started by provision, awaiting its restore, with its store decided
(``flows/target_store.py``); after each round the image is checked where the target reads it (its
signed manifest and the store's listing, no payload read back) and loaded into the target, which stays
unready. The restore phase's final load then moves only the chunks the final image changed (the agent
skips a chunk already loaded into the same tensor with the same content id). A backend that cannot
pre-load (criu, cuda-driver) runs its rounds as before and restores the whole image.

Safety: a pre-load acts on the target only, before the source is frozen. A failed one raises a
:class:`SnapshotError` naming the round's image; the flow's undo tears the target down and the source,
never frozen, serves on. A target that reports ready after a pre-load is refused: it would serve a state
older than the source's.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from gpumigrate.errors import GpumigrateError, SnapshotError
from gpumigrate.flows import target_store
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit, notify
from gpumigrate.flows.report import merge_result
from gpumigrate.infra.launch import accepts, answers
from gpumigrate.interfaces import ImageRef, Restored, Round, SnapshotBackend
from gpumigrate.parity.urls import redact_url
from gpumigrate.snapshot.client import parse_address
from gpumigrate.snapshot.precopy import Convergence, converge
from gpumigrate.snapshot.rankmath import rank_addresses
from gpumigrate.transfer.format.keys import resolve_key
from gpumigrate.transfer.push import check_landed

TARGET_AGENT_WAIT_S = 60.0  # for the target's agent to accept connections before the first round
POLL_S = 0.1


@dataclass
class Precopy:
    """The live rounds and what each pre-loaded into the target (empty: the backend does not pre-load)."""

    convergence: Convergence
    preloads: list[Restored] = field(default_factory=list)

    @property
    def bytes_preloaded(self) -> int:
        return sum(r.bytes_loaded for r in self.preloads)


def precopy_rounds(ctx: RunContext, backend: SnapshotBackend, *, max_rounds: int) -> Precopy:
    """Live pre-copy rounds until they converge (``snapshot/precopy.py``), each pre-loaded into the target
    where the backend can; ``result.bytes.preloaded`` records what the target loaded meanwhile."""
    m, plan = ctx.migration, ctx.plan
    preloading = backend.preloads and max_rounds > 0
    if preloading:
        wait_for_target(ctx)  # before the first round: a target that is not there fails with the source untouched
    out = Precopy(Convergence())

    def one_round() -> Round:
        done = backend.precopy()
        notify(m.id, "snapshot.precopy", {**asdict(done.stats), "image_id": done.image.id})
        if preloading:
            out.preloads.append(preload(ctx, backend, done.image, round_no=done.stats.round))
        return done

    out.convergence = converge(one_round, max_rounds=max_rounds, max_downtime_ms=plan.snapshot.max_downtime_ms)
    if out.preloads:
        merge_result(m, bytes={"preloaded": out.bytes_preloaded})
    return out


def wait_for_target(ctx: RunContext, timeout_s: float | None = None) -> None:
    """Every rank's agent on the target accepts connections (provision started the workload awaiting its restore;
    a workload's health path may answer a moment before its agent listens, and rank 0's before rank 1's: CI once
    pre-loaded a 2-rank world whose rank 1 did not listen yet)."""
    timeout_s = TARGET_AGENT_WAIT_S if timeout_s is None else timeout_s
    first = ctx.need(ctx.runtime.target_agent, "the target's agent")
    deadline = time.monotonic() + timeout_s
    for address in rank_addresses(first, ctx.plan.workload.ranks):
        host, port = parse_address(address)
        while not accepts(host, port):
            if time.monotonic() > deadline:
                raise SnapshotError(
                    f"the target's agent at {address} does not accept connections after {timeout_s:g} s: the "
                    "target must be started, awaiting its restore, before the first pre-copy round is loaded into it"
                )
            time.sleep(POLL_S)


def preload(ctx: RunContext, backend: SnapshotBackend, image: ImageRef, *, round_no: int | None = None) -> Restored:
    """Check one pre-copy image where the target reads it, then load it into the target, which stays unready."""
    m = ctx.migration
    host = ctx.target_host().name
    t0 = time.monotonic()
    try:
        _verify(ctx, image)
        loaded = backend.preload(image)
    except (GpumigrateError, OSError) as exc:
        raise SnapshotError(
            f"pre-load of pre-copy image {image.id[:16]} into the target {host} failed: {exc}; the source was "
            "not frozen and serves on, the migration is undone (the target torn down)"
        ) from None
    seconds = time.monotonic() - t0
    if loaded.ready or _target_ready(ctx):
        raise SnapshotError(
            f"the target {host} reports ready after the pre-load of image {image.id[:16]}: a target must stay "
            "unready until the final restore (it would serve an older state than the source's)"
        )
    emit(
        m,
        "image.preloaded",
        {
            "image_id": image.id,
            "host": host,
            "round": round_no,
            "bytes_image": image.bytes_image,
            "bytes_loaded": loaded.bytes_loaded,
            "chunks_loaded": loaded.chunks_loaded,
            "chunks_skipped": loaded.chunks_skipped,
            "seconds": round(seconds, 3),
            "load_seconds": round(loaded.seconds, 3),
            **_from_source(loaded),
        },
    )
    return loaded


def _verify(ctx: RunContext, image: ImageRef) -> None:
    """The round's image where the target reads it, from its signed manifest and the store's listing (no
    payload read back; the target's reader checks each chunk's tag and BLAKE3 as it loads). A receiver the
    flow started keeps running: the rounds after this one and the final image still land through it."""
    rt = ctx.runtime
    dst = rt.image_store or ctx.store_url()
    where = target_store.control_url(dst) if target_store.is_receiver(dst) else dst
    ref = ctx.key_ref()
    key = resolve_key(env=ref.get("env"), file=ref.get("file")) if ref else None
    landed = check_landed(where, image.id, key=key)
    emit(
        ctx.migration,
        "image.verified",
        {
            "image_id": image.id,
            "store": redact_url(dst),
            "read_back": False,
            "preload": True,
            "chunks_total": landed.chunks_total,
            "chunks_skipped": landed.chunks_skipped,
            "bytes_logical": landed.bytes_logical,
            "bytes_landed": landed.bytes_landed,
            "seconds": round(landed.seconds, 3),
        },
    )


def _target_ready(ctx: RunContext) -> bool:
    """Whether the target's workload answers its ready path (a workload that serves no HTTP: its agent said)."""
    endpoint = ctx.runtime.target_endpoint
    return bool(endpoint) and answers(str(endpoint), path=ctx.plan.workload.ready_path)


def final_load(ctx: RunContext, backend: SnapshotBackend, restored: Restored) -> dict[str, Any]:
    """What the final restore loaded, for its ``image.restored`` event; ``result.bytes.restored`` where the
    backend loads chunk by chunk (``preloads``): the final delta after pre-loads, else the whole image."""
    if backend.preloads:
        merge_result(ctx.migration, bytes={"restored": restored.bytes_loaded})
    return {
        "bytes_loaded": restored.bytes_loaded,
        "chunks_loaded": restored.chunks_loaded,
        "chunks_skipped": restored.chunks_skipped,
        "seconds": round(restored.seconds, 3),
        **_from_source(restored),
        **({"ranks": [dict(r) for r in restored.ranks]} if restored.ranks else {}),  # a world: each rank's GPU map
    }


def _from_source(restored: Restored) -> dict[str, Any]:
    """How much of a load the source's memory filled (``transfer.restore_from: source``), and how."""
    return {"from_source": dict(restored.from_source)} if restored.from_source else {}

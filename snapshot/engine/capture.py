"""Capture rounds: ship what changed since the last shipped image, reference the rest.

A live round (the workload runs) fingerprints every chunk where it lives and ships the chunks whose
fingerprint changed; the others are ``reuse_chunk`` references to the last shipped image. The frozen
final round trusts no fingerprint alone: every chunk it would reuse is hashed (BLAKE3) beside the
shipping of the dirty ones, and one whose hash no longer matches its id ships after all. A tensor shipped
before with this layout skips the fingerprint pass in a frozen round where the hash is cheap enough to
decide alone (on the host, or on the device for a writer that hashes there): its chunks that changed are
the ones whose id changed. A tensor whose workload reports what it wrote (``dirty.py``, a KV cache) skips both:
its round ships the chunks the reported ranges touch and references the rest. What each region gets is
``planning.py``.

The chunks of the regions the last round shipped a chunk of (*hot*: the state every request changes) are hashed
first, at the devices' higher priority, so that those found changed ship while the others (*cold*: a model's
weights) are still being hashed. A frozen round given ``reopen`` commits once the hot ones are settled and
returns; the cold ones' verdict is taken later (``confirmation.py``). See bench/README.md for what each step costs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import repeat
from typing import Any

import torch

from gpumigrate.errors import GpumigrateError, SnapshotError
from gpumigrate.interfaces import ChunkRun, DirectImageWriter, ImageRef, ImageWriter, RoundStats
from gpumigrate.snapshot.engine.clock import Phases
from gpumigrate.snapshot.engine.confirmation import PendingConfirmation, Reopen, Verdict, no_verdict
from gpumigrate.snapshot.engine.dirty import WrittenRanges, settle
from gpumigrate.snapshot.engine.fingerprinting import (
    chunk_fingerprints,
    chunk_jobs,
    confirm_on_host,
    fingerprint_all,
    read_back,
)
from gpumigrate.snapshot.engine.pipelines import Pipelines
from gpumigrate.snapshot.engine.planning import RoundPlan, Shipped, decided_by_hash, plan_round, same_layout
from gpumigrate.snapshot.engine.state import EngineState
from gpumigrate.snapshot.engine.tracking import Tracker
from gpumigrate.snapshot.environment import env_facts
from gpumigrate.snapshot.pipeline import Job

log = logging.getLogger("gpumigrate.agent")

FORMAT = 1  # of the engine's metadata in an image (``META_KEY``)
META_KEY = "snapshot"


class CaptureRounds:
    """The capture side of the engine: rounds into image writers, and what the last one shipped."""

    def __init__(
        self, tracker: Tracker, pipelines: Pipelines, state: EngineState, rank_id: Callable[[], dict[str, int] | None]
    ) -> None:
        self.tracker = tracker
        self.pipelines = pipelines
        self.state = state
        self.rank_id = rank_id  # this process's {"rank", "world_size"} as images record it, or None
        self.shipped: dict[str, Shipped] = {}
        # The regions the last committed round shipped a chunk of (hot); the first round ships every region
        self.hot: set[str] = set()
        self.written = WrittenRanges()  # the regions whose workload reports what it wrote (dirty.py)
        self._confirmer: ThreadPoolExecutor | None = None  # the final round's host BLAKE3, beside its shipping
        self.pending: PendingConfirmation | None = None  # a frozen round's cold chunks, still being hashed
        self.verdict: Verdict | None = None  # the last frozen round's, once taken

    def run(
        self, writer: ImageWriter, *, frozen: bool, clock: Phases | None = None, reopen: Reopen | None = None
    ) -> tuple[RoundStats, ImageRef]:
        """One round into ``writer``, whose parent must hold the last shipped image's chunks. ``reopen`` (a frozen
        round): commit before the cold chunks are confirmed (``confirmation.py``), a follow-up opened with it."""
        clock = clock or Phases()
        self.settle()  # an earlier round's verdict first: this round's parent is the image it leaves
        self.verdict = None
        cs = int(writer.chunk_size)
        if cs <= 0 or cs % 8:
            raise SnapshotError(f"writer chunk size {cs} is not a positive multiple of 8 bytes")
        live, views, infos = self.tracker.regions()
        # Before any byte is read: a write reported after this belongs to the next round.
        written = self.written.take({n: t for n, (_, t) in live.items()})
        writer.add_regions(infos.values())
        clock.mark("regions")
        by_ranges = {n: r for n, r in written.items() if r is not None and same_layout(self.shipped, n, infos[n], cs)}
        settle(live[n][1] for n in by_ranges)  # the writes reported so far, done on their devices
        on_device = isinstance(writer, DirectImageWriter)
        by_hash = decided_by_hash(self.shipped, views, infos, cs, frozen=frozen, on_device=on_device) - set(by_ranges)
        # Fingerprint every chunk where it lives. With no earlier round to compare against, every chunk ships anyway,
        # so the fingerprints (kept for the next round) are read back only after the copies, which they then overlap.
        compared = [n for n in views if n not in by_hash and n not in by_ranges]
        dev_fps = fingerprint_all({n: views[n] for n in compared}, cs)
        comparable = any(name in self.shipped for name in compared)
        host_fps = read_back(dev_fps) if comparable else None
        clock.mark("fingerprint")
        plan = plan_round(self.shipped, views, infos, by_hash, by_ranges, host_fps, cs, frozen=frozen)
        if plan.reused:
            writer.reuse_chunks(plan.reused)
        clock.mark("plan")
        # The confirmation hashes the unchanged chunks beside the shipping of the dirty ones (other threads, and
        # side streams on a GPU: all only read frozen bytes): the hot ones first, the cold ones behind them.
        hot = [run for run in plan.unchanged if run.region in self.hot]
        cold = [run for run in plan.unchanged if run.region not in self.hot]
        confirming = self._confirm_beside(writer, hot, cs, background=False)
        confirming_cold = self._confirm_beside(writer, cold, cs, background=True)
        deferred = confirming_cold is not None and reopen is not None
        try:
            shipped_fps = self._ship(writer, plan.jobs, cs, plan, frozen=frozen)
            clock.mark("ship")
            confirmed = confirming() if confirming is not None else []
            confirming = None
            clock.mark("confirm")  # what the confirmation took beyond the shipping
            if host_fps is None:
                for name, fps in read_back(dev_fps).items():
                    plan.new[name].fingerprints = list(fps)
            for job, fp in shipped_fps:  # live rounds record the fingerprint of the bytes actually shipped
                if job.region not in by_ranges:  # a reported region keeps no fingerprints
                    plan.new[job.region].fingerprints[job.index] = fp
            clock.mark("fingerprint")  # a first round reads them back only now, after its copies
            unrecorded: list[Job] | None = [] if deferred else None  # recorded at the verdict, still frozen
            self._settle_runs(writer, plan, hot, confirmed, cs, by_hash, clock, unrecorded)
            if confirming_cold is not None and not deferred:
                cold_oks, confirming_cold = confirming_cold(), None
                clock.mark("confirm")
                self._settle_runs(writer, plan, cold, cold_oks, cs, by_hash, clock)
            elif deferred:  # referenced now, pending their hashes (confirmation.py)
                _reference(writer, cold, [None] * len(cold))
                clock.mark("reuse")
            stats, ref = self._commit(writer, plan, cs, frozen=frozen, clock=clock)
        except BaseException:
            for waiting in (confirming, confirming_cold):
                if waiting is not None:
                    with contextlib.suppress(BaseException):
                        waiting()  # it reads the tracked tensors: done before the error leaves
            raise
        if deferred:
            assert confirming_cold is not None and reopen is not None
            self.pending = PendingConfirmation(
                ref, cold, confirming_cold, reopen, plan, by_hash, infos, cs, unrecorded or []
            )
        elif frozen:
            self.verdict = Verdict(ref, ref, 0)  # every chunk confirmed before the commit
        return stats, ref

    def settle(self) -> Verdict | None:
        """Take the pending confirmation's verdict, if one is pending (see ``confirmation.py``); the last verdict."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self.verdict = self._verdict(pending)
        return self.verdict

    def confirmation(self, image_id: str) -> Verdict:
        """The verdict of the frozen round that committed ``image_id`` (taken now if still pending)."""
        waiting, pending = self.verdict, self.pending
        if pending is not None and pending.image.id == image_id:
            done = self.settle()
            assert done is not None
            return done
        if pending is None and waiting is not None and waiting.of_image.id == image_id:
            return waiting
        raise no_verdict(image_id, waiting, pending)

    def _verdict(self, pending: PendingConfirmation) -> Verdict:
        """Wait for the cold chunks' hashes; where one was caught changed, ship it in a follow-up image."""
        clock = Phases()
        count = sum(len(run.indices) for run in pending.runs)
        try:
            self._fingerprint_shipped(pending.plan, pending.unrecorded, pending.chunk_size)
            clock.mark("fingerprint")
            oks = pending.wait()
            clock.mark("confirm")
            caught = sum(not ok for run_oks in oks for ok in run_oks)
            if not caught:
                return Verdict(pending.image, pending.image, count, deferred=True, seconds=clock.seconds(),
                               phases=clock.phases())  # fmt: skip
            stats, follow_up = self._follow_up(pending, oks, clock)
        except GpumigrateError as exc:
            self.forget()  # what it shipped is unknown: the next round ships everything
            return Verdict(pending.image, pending.image, count, deferred=True, error=exc)
        except Exception as exc:  # a device or store failure: no image may be restored on this verdict
            self.forget()
            error = SnapshotError(f"the final round's confirmation failed: {type(exc).__name__}: {exc}")
            return Verdict(pending.image, pending.image, count, deferred=True, error=error)
        return Verdict(pending.image, follow_up, count, caught, True, clock.seconds(), clock.phases(), stats)

    def _follow_up(
        self, pending: PendingConfirmation, oks: list[list[bool]], clock: Phases
    ) -> tuple[RoundStats, ImageRef]:
        """The round's image again, as a child of it, with the chunks the hashes caught shipped: its stats and ref."""
        plan, by_hash, cs = pending.plan, pending.by_hash, pending.chunk_size
        plan.touched, plan.dirty_chunks, plan.dirty_bytes = set(), 0, 0  # the follow-up's own
        stale = {(run.region, i) for run, run_oks in zip(pending.runs, oks, strict=True)
                 for i, ok in zip(run.indices, run_oks, strict=True) if not ok}  # fmt: skip
        writer = pending.reopen(pending.image.id)
        writer.add_regions(pending.infos.values())
        writer.reuse_chunks(
            [(name, i, cid) for name, s in plan.new.items() for i, cid in enumerate(s.ids) if (name, i) not in stale]
        )
        clock.mark("reuse")
        changed = self._stale_jobs(plan, pending.runs, oks, cs, by_hash)
        self._ship_changed(writer, plan, changed, cs, by_hash, clock)
        return self._commit(writer, plan, cs, frozen=True, clock=clock)

    def forget(self) -> None:
        """The next round ships everything (its parent holds none of the chunks shipped so far)."""
        self.shipped = {}
        self.hot = set()

    def close(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            with contextlib.suppress(BaseException):
                pending.wait()  # its hashes read the tracked tensors: done before they may go
        if self._confirmer is not None:
            self._confirmer.shutdown(wait=True)
            self._confirmer = None

    # ------------------------------------------------------------------ the round's steps
    def _settle_runs(
        self,
        writer: ImageWriter,
        plan: RoundPlan,
        runs: Sequence[ChunkRun],
        confirmed: list[list[bool]],
        cs: int,
        by_hash: set[str],
        clock: Phases,
        later: list[Job] | None = None,
    ) -> None:
        """Reference the chunks of ``runs`` the hash confirmed; ship those it found changed."""
        if not runs:
            return
        _reference(writer, runs, confirmed)
        clock.mark("reuse")
        changed = self._stale_jobs(plan, runs, confirmed, cs, by_hash)
        if changed:
            self._ship_changed(writer, plan, changed, cs, by_hash, clock, later)

    def _stale_jobs(
        self, plan: RoundPlan, runs: Sequence[ChunkRun], confirmed: list[list[bool]], cs: int, by_hash: set[str]
    ) -> dict[str, list[Job]]:
        """The chunks of ``runs`` the hash found changed (to ship now), by device."""
        changed: dict[str, list[Job]] = {}
        for run, oks in zip(runs, confirmed, strict=True):
            if all(oks):
                continue
            stale = [i for i, same in zip(run.indices, oks, strict=True) if not same]
            for job in chunk_jobs(run.region, run.view, stale, cs):
                if job.region not in by_hash:  # the fingerprint called it unchanged
                    self._collision(job)
                changed.setdefault(str(job.data.device), []).append(job)
                plan.dirty_chunks += 1
                plan.dirty_bytes += job.data.numel()
        return changed

    def _ship_changed(
        self,
        writer: ImageWriter,
        plan: RoundPlan,
        changed: dict[str, list[Job]],
        cs: int,
        by_hash: set[str],
        clock: Phases,
        later: list[Job] | None = None,
    ) -> None:
        """Ship the chunks the hash caught changed; record the fingerprints of what shipped (``later``: leave those of
        the regions left to the hash in it, for a pending confirmation's verdict to record while still frozen)."""
        self._ship(writer, changed, cs, plan, frozen=True)
        clock.mark("ship")
        hashed = [j for jobs in changed.values() for j in jobs if j.region in by_hash]
        if later is not None:
            later.extend(hashed)
            return
        self._fingerprint_shipped(plan, hashed, cs)
        clock.mark("fingerprint")

    def _fingerprint_shipped(self, plan: RoundPlan, hashed: Sequence[Job], cs: int) -> None:
        """The fingerprints of chunks the hash alone shipped: the next round (after a rollback) compares against
        them; one whose fingerprint did not change with its bytes is a collision all the same."""
        for job, fp in zip(hashed, chunk_fingerprints([j.data for j in hashed], cs), strict=True):
            shipped = plan.own(job.region)
            if fp == shipped.fingerprints[job.index]:
                self._collision(job)
            shipped.fingerprints[job.index] = fp

    def _commit(
        self, writer: ImageWriter, plan: RoundPlan, cs: int, *, frozen: bool, clock: Phases
    ) -> tuple[RoundStats, ImageRef]:
        rank = self.rank_id()
        meta: dict[str, Any] = {
            "format": FORMAT,
            "chunk_size": cs,
            "round": self.state.rounds + 1,
            "final": frozen,
            "environment": env_facts(),
            "items": self.tracker.metadata(),
            "chunks": {n: s.ids for n, s in plan.new.items()},
            **({"rank": rank} if rank is not None else {}),
        }
        writer.set_metadata(META_KEY, meta)
        clock.mark("metadata")
        ref = writer.commit()
        clock.mark("commit")
        pacing = writer.pacing() if isinstance(writer, DirectImageWriter) else {}
        self.written.committed()
        self.shipped, self.hot = plan.new, plan.touched
        self.state.last_image = ref
        self.state.rounds += 1
        stats = RoundStats(
            self.state.rounds, plan.total, plan.dirty_chunks, plan.dirty_bytes, clock.seconds(), clock.phases(), pacing
        )
        return stats, ref

    # ------------------------------------------------------------------ helpers
    def _collision(self, job: Job) -> None:
        """The bytes of a chunk changed under an unchanged fingerprint: the final round's hash caught it."""
        self.state.fingerprint_collisions += 1
        log.warning(
            "gpumigrate agent: chunk %d of %s changed but kept its fingerprint; the final full hash caught it",
            job.index,
            job.region,
        )

    def _ship(
        self,
        writer: ImageWriter,
        jobs_by_device: Mapping[str, list[Job]],
        cs: int,
        plan: RoundPlan,
        *,
        frozen: bool,
    ) -> list[tuple[Job, int]]:
        """Capture the jobs, record their ids in the plan; a live round returns the fingerprints of the bytes shipped."""
        shipped_fps: list[tuple[Job, int]] = []
        for device, jobs in jobs_by_device.items():
            sent_ids, sent_fps = self.pipelines.get(torch.device(device), cs).capture(writer, jobs, stage=not frozen)
            for k, job in enumerate(jobs):
                plan.own(job.region).ids[job.index] = sent_ids[k]
                plan.touched.add(job.region)
            if not frozen:
                shipped_fps.extend(zip(jobs, sent_fps, strict=True))
        return shipped_fps

    def _confirm_beside(
        self, writer: ImageWriter, runs: Sequence[ChunkRun], cs: int, *, background: bool
    ) -> Callable[[], list[list[bool]]] | None:
        """Start confirming ``runs`` (every chunk's BLAKE3 against the id it would reuse) beside the shipping: a
        direct writer hashes where the bytes live (CUDA chunks on their device; ``background``: behind the rest of
        the round's device work); else the engine's confirming thread hashes on the host, in the order asked.
        Returns the function that waits for the verdicts, per run and chunk."""
        if not runs:
            return None
        if isinstance(writer, DirectImageWriter):
            return writer.confirm_chunks(runs, background=background)
        if self._confirmer is None:
            self._confirmer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gm-confirm")
        return self._confirmer.submit(confirm_on_host, runs, cs).result


def _reference(writer: ImageWriter, runs: Sequence[ChunkRun], confirmed: Sequence[Sequence[bool] | None]) -> None:
    """Reference the chunks of ``runs`` the hash confirmed (all of a run whose verdict is None: pending): a run of a
    whole region, all confirmed, as the region (``reuse_regions``), the others chunk by chunk."""
    whole: list[tuple[str, Sequence[str]]] = []
    chunks: list[tuple[str, int, str]] = []
    for run, oks in zip(runs, confirmed, strict=True):
        every = oks is None or all(oks)
        if every and isinstance(run.indices, range) and run.indices.start == 0 and len(run.indices) == len(run.ids):
            whole.append((run.region, run.ids))
        elif every:
            chunks.extend(zip(repeat(run.region), run.indices, run.ids))
        else:
            assert oks is not None
            chunks.extend((run.region, i, cid) for i, cid, same in zip(run.indices, run.ids, oks, strict=True) if same)
    if whole:
        writer.reuse_regions(whole)
    if chunks:
        writer.reuse_chunks(chunks)

"""Capture rounds: ship what changed since the last shipped image, reference the rest.

A live round (the workload runs) fingerprints every chunk where it lives and ships the chunks whose
fingerprint changed; the others are ``reuse_chunk`` references to the last shipped image. The frozen
final round trusts no fingerprint alone: every chunk it would reuse is hashed (BLAKE3) beside the
shipping of the dirty ones, and one whose hash no longer matches its id ships after all. A tensor shipped
before with this layout skips the fingerprint pass in a frozen round where the hash is cheap enough to
decide alone (on the host, or on the device for a writer that hashes there): its chunks that changed are
the ones whose id changed. A tensor whose workload reports what it wrote (``dirty.py``, a KV cache) skips both:
its round ships the chunks the reported ranges touch and references the rest. See bench/README.md for what each
step costs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from gpumigrate.errors import SnapshotError
from gpumigrate.interfaces import ChunkRun, DirectImageWriter, ImageRef, ImageWriter, RegionInfo, RoundStats
from gpumigrate.snapshot.chunks import chunk_count
from gpumigrate.snapshot.engine.clock import Phases
from gpumigrate.snapshot.engine.dirty import Ranges, WrittenRanges, chunks_of, settle
from gpumigrate.snapshot.engine.fingerprinting import (
    chunk_fingerprints,
    chunk_jobs,
    confirm_on_host,
    fingerprint_all,
    read_back,
)
from gpumigrate.snapshot.engine.pipelines import Pipelines
from gpumigrate.snapshot.engine.state import EngineState
from gpumigrate.snapshot.engine.tracking import Tracker
from gpumigrate.snapshot.environment import env_facts
from gpumigrate.snapshot.pipeline import Job

log = logging.getLogger("gpumigrate.agent")

FORMAT = 1  # of the engine's metadata in an image (``META_KEY``)
META_KEY = "snapshot"


@dataclass
class Shipped:
    """One region as the last committed round left it: its layout, and each chunk's fingerprint and id."""

    nbytes: int
    dtype: str | None
    shape: tuple[int, ...] | None
    chunk_size: int
    fingerprints: list[int]
    ids: list[str]


@dataclass
class RoundPlan:
    """What one round does with each region, decided before anything ships."""

    new: dict[str, Shipped] = field(default_factory=dict)  # every region as this round will leave it
    jobs: dict[str, list[Job]] = field(default_factory=dict)  # dirty chunks to ship, by device
    unchanged: list[ChunkRun] = field(default_factory=list)  # frozen round: reused once their BLAKE3 confirms
    reused: list[tuple[str, int, str]] = field(default_factory=list)  # live round: referenced at once
    total: int = 0
    dirty_chunks: int = 0
    dirty_bytes: int = 0


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
        self.written = WrittenRanges()  # the regions whose workload reports what it wrote (dirty.py)
        self._confirmer: ThreadPoolExecutor | None = None  # the final round's host BLAKE3, beside its shipping

    def run(self, writer: ImageWriter, *, frozen: bool, clock: Phases | None = None) -> tuple[RoundStats, ImageRef]:
        """One round into ``writer``, whose parent must hold the last shipped image's chunks."""
        clock = clock or Phases()
        cs = int(writer.chunk_size)
        if cs <= 0 or cs % 8:
            raise SnapshotError(f"writer chunk size {cs} is not a positive multiple of 8 bytes")
        live, views, infos = self.tracker.regions()
        # Before any byte is read: a write reported after this belongs to the next round.
        written = self.written.take({n: t for n, (_, t) in live.items()})
        for info in infos.values():
            writer.add_region(info)
        clock.mark("regions")
        by_ranges = {n: r for n, r in written.items() if r is not None and self._same_layout(n, infos[n], cs)}
        settle(live[n][1] for n in by_ranges)  # the writes reported so far, done on their devices
        by_hash = self._decided_by_hash(
            views, infos, cs, frozen=frozen, on_device=isinstance(writer, DirectImageWriter)
        ) - set(by_ranges)
        # Fingerprint every chunk where it lives. With no earlier round to compare against, every chunk ships anyway,
        # so the fingerprints (kept for the next round) are read back only after the copies, which they then overlap.
        compared = [n for n in views if n not in by_hash and n not in by_ranges]
        dev_fps = fingerprint_all({n: views[n] for n in compared}, cs)
        comparable = any(name in self.shipped for name in compared)
        host_fps = read_back(dev_fps) if comparable else None
        clock.mark("fingerprint")
        plan = self._plan(views, infos, by_hash, by_ranges, host_fps, cs, frozen=frozen)
        if plan.reused:
            writer.reuse_chunks(plan.reused)
        clock.mark("plan")
        # The confirmation hashes the unchanged chunks beside the shipping of the dirty ones (another thread, and
        # side streams on a GPU: both only read frozen bytes); a chunk it catches changed ships after it.
        confirming = self._confirm_beside(writer, plan.unchanged, cs)
        try:
            shipped_fps = self._ship(writer, plan.jobs, cs, plan.new, frozen=frozen)
        except BaseException:
            if confirming is not None:
                with contextlib.suppress(BaseException):
                    confirming()  # it reads the tracked tensors: done before the error leaves
            raise
        clock.mark("ship")
        confirmed = confirming() if confirming is not None else []
        clock.mark("confirm")  # what the confirmation took beyond the shipping
        if host_fps is None:
            for name, fps in read_back(dev_fps).items():
                plan.new[name].fingerprints = list(fps)
        for job, fp in shipped_fps:  # live rounds record the fingerprint of the bytes actually shipped
            if job.region not in by_ranges:  # a reported region keeps no fingerprints
                plan.new[job.region].fingerprints[job.index] = fp
        clock.mark("fingerprint")  # a first round reads them back only now, after its copies
        changed = self._settle_confirmed(writer, plan, confirmed, cs, by_hash)
        clock.mark("reuse")
        if changed:
            self._ship_changed(writer, plan, changed, cs, by_hash, clock)
        return self._commit(writer, plan, cs, frozen=frozen, clock=clock)

    def forget(self) -> None:
        """The next round ships everything (its parent holds none of the chunks shipped so far)."""
        self.shipped = {}

    def close(self) -> None:
        if self._confirmer is not None:
            self._confirmer.shutdown(wait=True)
            self._confirmer = None

    # ------------------------------------------------------------------ the round's steps
    def _decided_by_hash(
        self,
        views: Mapping[str, torch.Tensor],
        infos: Mapping[str, RegionInfo],
        cs: int,
        *,
        frozen: bool,
        on_device: bool,
    ) -> set[str]:
        """The regions of a frozen round whose every chunk is a candidate for the hash alone (no fingerprint pass).

        The frozen round hashes every chunk it shipped before anyway (the confirmation: BLAKE3 decides). On the host
        a fingerprint pass costs more than the hash (one core against all of them); on a device a writer that hashes
        there would read the tensors twice (the pass, then the confirmation) where once suffices."""
        if not frozen:
            return set()
        return {
            n
            for n, v in views.items()
            if (on_device or not v.is_cuda) and infos[n].kind != "blob" and self._same_layout(n, infos[n], cs)
        }

    def _plan(
        self,
        views: Mapping[str, torch.Tensor],
        infos: Mapping[str, RegionInfo],
        by_hash: set[str],
        by_ranges: Mapping[str, Ranges],
        host_fps: Mapping[str, list[int]] | None,
        cs: int,
        *,
        frozen: bool,
    ) -> RoundPlan:
        """Which chunks of each region ship, which are referenced, which a frozen round confirms first."""
        plan = RoundPlan()
        for name, view in views.items():
            info = infos[name]
            if name in by_ranges:  # the workload said what it wrote: those chunks ship, the rest are referenced
                self._plan_reported(plan, name, view, info, by_ranges[name], cs)
                continue
            if name in by_hash:  # every chunk is a candidate; the hash sorts them
                was = self.shipped[name]
                plan.unchanged.append(ChunkRun(name, view, range(len(was.ids)), was.ids))
                plan.total += len(was.ids)
                plan.new[name] = Shipped(info.nbytes, info.dtype, info.shape, cs, list(was.fingerprints), list(was.ids))
                continue
            fps = host_fps[name] if host_fps is not None else None
            prev = self.shipped.get(name)
            count = chunk_count(view.numel(), cs)
            plan.total += count
            ids: list[str]
            kept: Sequence[int]
            dirty: Sequence[int]
            # Reuse only against the same layout and the same chunk boundaries.
            if fps is None or prev is None or not self._same_layout(name, info, cs) or len(prev.fingerprints) != count:
                ids, kept, dirty = [""] * count, (), range(count)
            elif prev.fingerprints == fps:  # the whole region is unchanged (most are): no comparison per chunk
                ids, kept, dirty = list(prev.ids), range(count), ()
            else:
                ids = [""] * count
                kept = [i for i in range(count) if prev.fingerprints[i] == fps[i]]
                dirty = [i for i in range(count) if prev.fingerprints[i] != fps[i]]
                for i in kept:
                    ids[i] = prev.ids[i]
            if frozen:
                if kept:
                    plan.unchanged.append(
                        ChunkRun(name, view, kept, ids if len(kept) == count else [ids[i] for i in kept])
                    )
            else:
                plan.reused.extend((name, i, ids[i]) for i in kept)
            if dirty:
                pieces = chunk_jobs(name, view, dirty, cs)
                plan.jobs.setdefault(str(view.device), []).extend(pieces)
                plan.dirty_chunks += len(pieces)
                plan.dirty_bytes += sum(j.data.numel() for j in pieces)
            plan.new[name] = Shipped(info.nbytes, info.dtype, info.shape, cs, list(fps or ()), ids)
        return plan

    def _plan_reported(
        self, plan: RoundPlan, name: str, view: torch.Tensor, info: RegionInfo, ranges: Ranges, cs: int
    ) -> None:
        """A region with a written-ranges report: the chunks its ranges touch ship, the others are referenced (live
        or frozen: the report, not a hash, says they are unchanged). It keeps no fingerprints: a later round whose
        report cannot say ships it whole."""
        was = self.shipped[name]
        count = len(was.ids)
        dirty = [i for i in chunks_of(ranges, cs) if i < count]
        ids = list(was.ids)
        for i in dirty:
            ids[i] = ""
        touched = set(dirty)
        plan.reused.extend((name, i, ids[i]) for i in range(count) if i not in touched)
        plan.total += count
        if dirty:
            pieces = chunk_jobs(name, view, dirty, cs)
            plan.jobs.setdefault(str(view.device), []).extend(pieces)
            plan.dirty_chunks += len(pieces)
            plan.dirty_bytes += sum(j.data.numel() for j in pieces)
        plan.new[name] = Shipped(info.nbytes, info.dtype, info.shape, cs, [], ids)

    def _settle_confirmed(
        self, writer: ImageWriter, plan: RoundPlan, confirmed: list[list[bool]], cs: int, by_hash: set[str]
    ) -> dict[str, list[Job]]:
        """Reference the chunks the hash confirmed; return those it found changed (to ship now), by device."""
        changed: dict[str, list[Job]] = {}
        if not plan.unchanged:
            return changed
        writer.reuse_chunks(
            [
                (run.region, i, cid)
                for run, oks in zip(plan.unchanged, confirmed, strict=True)
                for i, cid, same in zip(run.indices, run.ids, oks, strict=True)
                if same
            ]
        )
        for run, oks in zip(plan.unchanged, confirmed, strict=True):
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
    ) -> None:
        """Ship the chunks the hash caught changed; record the fingerprints of what shipped."""
        self._ship(writer, changed, cs, plan.new, frozen=True)
        clock.mark("ship")
        # The next round (after a rollback) compares against the fingerprints of what was shipped; a chunk of a hashed
        # tensor whose fingerprint did not change with its bytes is a collision all the same.
        hashed = [j for jobs in changed.values() for j in jobs if j.region in by_hash]
        for job, fp in zip(hashed, chunk_fingerprints([j.data for j in hashed], cs), strict=True):
            if fp == plan.new[job.region].fingerprints[job.index]:
                self._collision(job)
            plan.new[job.region].fingerprints[job.index] = fp
        clock.mark("fingerprint")

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
        self.shipped = plan.new
        self.state.last_image = ref
        self.state.rounds += 1
        stats = RoundStats(
            self.state.rounds, plan.total, plan.dirty_chunks, plan.dirty_bytes, clock.seconds(), clock.phases(), pacing
        )
        return stats, ref

    # ------------------------------------------------------------------ helpers
    def _same_layout(self, name: str, info: RegionInfo, cs: int) -> bool:
        """Whether the last shipped image holds ``name`` with this layout and these chunk boundaries."""
        prev = self.shipped.get(name)
        return prev is not None and (prev.nbytes, prev.dtype, prev.shape, prev.chunk_size) == (
            info.nbytes,
            info.dtype,
            info.shape,
            cs,
        )

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
        new: Mapping[str, Shipped],
        *,
        frozen: bool,
    ) -> list[tuple[Job, int]]:
        """Capture the jobs, record their ids in ``new``; a live round returns the fingerprints of the bytes shipped."""
        shipped_fps: list[tuple[Job, int]] = []
        for device, jobs in jobs_by_device.items():
            sent_ids, sent_fps = self.pipelines.get(torch.device(device), cs).capture(writer, jobs, stage=not frozen)
            for k, job in enumerate(jobs):
                new[job.region].ids[job.index] = sent_ids[k]
            if not frozen:
                shipped_fps.extend(zip(jobs, sent_fps, strict=True))
        return shipped_fps

    def _confirm_beside(
        self, writer: ImageWriter, runs: Sequence[ChunkRun], cs: int
    ) -> Callable[[], list[list[bool]]] | None:
        """Start confirming ``runs`` (every chunk's BLAKE3 against the id it would reuse) beside the shipping: a
        direct writer hashes where the bytes live (CUDA chunks on their device); else the engine's confirming
        thread hashes on the host. Returns the function that waits for the verdicts, per run and chunk."""
        if not runs:
            return None
        if isinstance(writer, DirectImageWriter):
            return writer.confirm_chunks(runs)
        if self._confirmer is None:
            self._confirmer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gm-confirm")
        return self._confirmer.submit(confirm_on_host, runs, cs).result

"""What one capture round does with each region, decided before anything ships (``capture.py`` runs it).

Against what the last committed round shipped (:class:`Shipped`, per region), each region's chunks are
shipped (dirty), referenced at once (a live round's unchanged chunks, a written-ranges report's untouched
ones) or, in a frozen round, referenced once their BLAKE3 confirms them (``unchanged``). A frozen round of a
region shipped before with this layout may leave the whole region to the hash (``decided_by_hash``): its
chunks that changed are those whose id changed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from gpumigrate.interfaces import ChunkRun, RegionInfo
from gpumigrate.snapshot.chunks import chunk_count
from gpumigrate.snapshot.engine.dirty import Ranges, chunks_of
from gpumigrate.snapshot.engine.fingerprinting import chunk_jobs
from gpumigrate.snapshot.pipeline import Job


@dataclass
class Shipped:
    """One region as the last committed round left it: its layout, and each chunk's fingerprint and id."""

    nbytes: int
    dtype: str | None
    shape: tuple[int, ...] | None
    chunk_size: int
    fingerprints: list[int]
    ids: list[str]
    info: RegionInfo | None = None  # the description it was shipped under (the tracker hands the same one out again)


@dataclass
class RoundPlan:
    """What one round does with each region, decided before anything ships."""

    new: dict[str, Shipped] = field(default_factory=dict)  # every region as this round will leave it
    jobs: dict[str, list[Job]] = field(default_factory=dict)  # dirty chunks to ship, by device
    unchanged: list[ChunkRun] = field(default_factory=list)  # frozen round: reused once their BLAKE3 confirms
    reused: list[tuple[str, int, str]] = field(default_factory=list)  # live round: referenced at once
    touched: set[str] = field(default_factory=set)  # regions with a chunk shipped: the next round's hot ones
    borrowed: set[str] = field(default_factory=set)  # regions whose ``new`` is the last round's object, unchanged
    total: int = 0
    dirty_chunks: int = 0
    dirty_bytes: int = 0

    def own(self, name: str) -> Shipped:
        """``new[name]``, copied first where it is still the last round's (about to change: a chunk shipped)."""
        was = self.new[name]
        if name in self.borrowed:
            self.borrowed.discard(name)
            was = self.new[name] = Shipped(
                was.nbytes, was.dtype, was.shape, was.chunk_size, list(was.fingerprints), list(was.ids), was.info
            )
        return was

    def ship(self, name: str, view: torch.Tensor, dirty: Sequence[int], cs: int) -> None:
        """Chunks ``dirty`` of region ``name`` ship this round."""
        pieces = chunk_jobs(name, view, dirty, cs)
        self.jobs.setdefault(str(view.device), []).extend(pieces)
        self.dirty_chunks += len(pieces)
        self.dirty_bytes += sum(j.data.numel() for j in pieces)


def same_layout(shipped: Mapping[str, Shipped], name: str, info: RegionInfo, cs: int) -> bool:
    """Whether the last shipped image holds ``name`` with this layout and these chunk boundaries."""
    prev = shipped.get(name)
    if prev is None or prev.chunk_size != cs:
        return False
    if prev.info is info:  # the very description (RegionInfo is frozen): most regions of a model, every round
        return True
    return (prev.nbytes, prev.dtype, prev.shape) == (info.nbytes, info.dtype, info.shape)


def decided_by_hash(
    shipped: Mapping[str, Shipped],
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
        if (on_device or not v.is_cuda) and infos[n].kind != "blob" and same_layout(shipped, n, infos[n], cs)
    }


def plan_round(
    shipped: Mapping[str, Shipped],
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
            _plan_reported(plan, shipped[name], name, view, info, by_ranges[name], cs)
            continue
        if name in by_hash:  # every chunk is a candidate; the hash sorts them
            was = shipped[name]
            plan.unchanged.append(ChunkRun(name, view, range(len(was.ids)), was.ids))
            plan.total += len(was.ids)
            plan.new[name] = was  # the same layout (by_hash): the last round's, copied where a chunk ships
            plan.borrowed.add(name)
            continue
        fps = host_fps[name] if host_fps is not None else None
        prev = shipped.get(name)
        count = chunk_count(view.numel(), cs)
        plan.total += count
        ids: list[str]
        kept: Sequence[int]
        dirty: Sequence[int]
        # Reuse only against the same layout and the same chunk boundaries.
        if fps is None or prev is None or not same_layout(shipped, name, info, cs) or len(prev.fingerprints) != count:
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
                plan.unchanged.append(ChunkRun(name, view, kept, ids if len(kept) == count else [ids[i] for i in kept]))
        else:
            plan.reused.extend((name, i, ids[i]) for i in kept)
        if dirty:
            plan.ship(name, view, dirty, cs)
        plan.new[name] = Shipped(info.nbytes, info.dtype, info.shape, cs, list(fps or ()), ids, info)
    return plan


def _plan_reported(
    plan: RoundPlan, was: Shipped, name: str, view: torch.Tensor, info: RegionInfo, ranges: Ranges, cs: int
) -> None:
    """A region with a written-ranges report: the chunks its ranges touch ship, the others are referenced (live
    or frozen: the report, not a hash, says they are unchanged). It keeps no fingerprints: a later round whose
    report cannot say ships it whole."""
    count = len(was.ids)
    dirty = [i for i in chunks_of(ranges, cs) if i < count]
    ids = list(was.ids)
    for i in dirty:
        ids[i] = ""
    touched = set(dirty)
    plan.reused.extend((name, i, ids[i]) for i in range(count) if i not in touched)
    plan.total += count
    if dirty:
        plan.ship(name, view, dirty, cs)
    plan.new[name] = Shipped(info.nbytes, info.dtype, info.shape, cs, [], ids, info)

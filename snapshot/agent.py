"""The in-process snapshot agent: embedded in a workload, it captures and restores its tracked state.

Source side (:class:`~gpumigrate.interfaces.Snapshotter`): ``precopy`` rounds while the workload
runs ship only chunks whose on-device fingerprint changed since the last shipped image (the rest are
``reuse_chunk`` references to it); ``freeze`` stops the workload at its safe point, under a lease
that ``renew`` extends (``lease.py``: an abandoned freeze resumes by itself); ``final`` ships the
last dirty set, after confirming every chunk the fingerprints call unchanged by its BLAKE3, and
commits; ``advance`` lets a frozen training source take N more steps; ``resume`` un-freezes on
rollback; ``zeroize`` wipes tracked memory after cutover. A rank of a process group (``ranks.py``)
freezes with its peers (``hold``, then ``freeze`` at the group's step), writes its rank into its
images, tears its communicators down and builds them again around an in-place capture
(``teardown``/``rebuild``), and restores its part of a world image (``worldimage.py``); any rank's
agent can ``compose_world`` the ranks' images into one. Target side (:class:`~gpumigrate.interfaces.Restorer`): ``restore`` checks the image
against the live model (names, shapes, dtypes) and the environment policy, loads the chunks that
differ from what is already loaded, and only then reports ready.

The agent never sees a key: ``precopy_to``/``final_to``/``restore_from`` take a store URL and a key
*reference*, and the factories given at construction (the public SDK, ``gpumigrate.agent``, wires
the transfer engine) resolve it locally.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypeVar

import torch

from gpumigrate.errors import SnapshotError
from gpumigrate.interfaces import (
    ChunkRun,
    DirectImageWriter,
    ImageReader,
    ImageRef,
    ImageWriter,
    RegionInfo,
    RoundStats,
)
from gpumigrate.snapshot import tracked as tr
from gpumigrate.snapshot.chunks import Fingerprints, byte_view, chunk_count, unchanged_by_hash
from gpumigrate.snapshot.environment import check_policy, env_facts
from gpumigrate.snapshot.errors import ImageMismatchError
from gpumigrate.snapshot.fill import Filler, Run, runs_of, slices
from gpumigrate.snapshot.gchold import gc_held, release_later
from gpumigrate.snapshot.lease import Lease, lease_arg
from gpumigrate.snapshot.pipeline import Job, Pipeline
from gpumigrate.snapshot.ranks import RankGroup
from gpumigrate.snapshot.stepgate import SafePointGate
from gpumigrate.snapshot.worldimage import RankView, compose, rank_reader

log = logging.getLogger("gpumigrate.agent")
ADVANCE_TIMEOUT_S = 600.0

FORMAT = 1
META_KEY = "snapshot"

_V = TypeVar("_V")
WriterFactory = Callable[[str, Mapping[str, str], "str | None"], ImageWriter]
ReaderFactory = Callable[[str, str, Mapping[str, str]], ImageReader]


class Phases:
    """Seconds per step of one agent command, in the order the steps ran: a reply's ``phases`` sum to
    nearly its ``seconds``, so a slow call shows which step was slow (PROTOCOL.md)."""

    def __init__(self) -> None:
        self.t0 = self._last = time.perf_counter()
        self._phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        """The time since the previous mark (or the start) was spent in step ``name``."""
        now = time.perf_counter()
        self._phases[name] = self._phases.get(name, 0.0) + now - self._last
        self._last = now

    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def phases(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in self._phases.items()}


@dataclass
class _Shipped:
    nbytes: int
    dtype: str | None
    shape: tuple[int, ...] | None
    chunk_size: int
    fingerprints: list[int]
    ids: list[str]


class Agent:
    """Tracks a workload's state and moves it through ImageWriter/ImageReader objects."""

    def __init__(
        self,
        *,
        writer_factory: WriterFactory | None = None,
        reader_factory: ReaderFactory | None = None,
        freezer: SafePointGate | None = None,
        set_ready: Callable[[bool], None] | None = None,
        workers: int = 4,
        streams: int = 2,
        group: RankGroup | None = None,
        filler: Filler | None = None,
        warming: Callable[[], bool] | None = None,
    ) -> None:
        self.writer_factory = writer_factory
        self.reader_factory = reader_factory
        self.filler = filler  # a restore filled straight from the source's memory (fill.py), and its lending
        self.warming = warming  # whether the SDK still compiles the device kernels in the background
        self.freezer = freezer  # the workload's safe point: freeze() waits for it, resume() reopens it
        self.set_ready = set_ready
        self.workers = workers
        self.streams = streams
        self.items: list[tr.Item] = []
        self.group = group  # this process as one rank of a torch.distributed group, if it is one
        self.frozen = False  # parked and settled: no safe point in flight
        self.held = False  # gate shut, safe points may still be in flight (a group freeze's first move)
        self.ready: bool | None = None
        self.rounds = 0
        self.last_image: ImageRef | None = None
        self._shipped: dict[str, _Shipped] = {}
        self._infos: dict[str, RegionInfo] = {}  # the last round's region infos (reused where unchanged)
        self._loaded: dict[str, tuple[int, list[str]]] = {}  # region -> (destination data_ptr, chunk ids)
        self._loaded_cs = 0  # chunk size of the pre-loaded image (ids compare only at the same size)
        self._pipelines: dict[tuple[str, int], Pipeline] = {}
        self._confirmer: ThreadPoolExecutor | None = None  # the final round's BLAKE3 confirmation, beside its shipping
        self._lock = threading.RLock()
        self.lease = Lease(self._lock, self._resume_locked)
        self.fingerprint_collisions = 0  # chunks the final round's full hash caught changed
        self.state_version = 0  # bumped when a restore or zeroize rewrote the tracked state in place
        if freezer is not None:  # the step counter and reported losses travel with the state
            self.track_state("progress", freezer.progress, freezer.set_progress)

    # ------------------------------------------------------------------ tracking API
    def _add(self, item: tr.Item) -> tr.Item:
        for other in self.items:
            if (
                other.prefix == item.prefix
                or other.prefix.startswith(item.prefix + "/")
                or item.prefix.startswith(other.prefix + "/")
            ):
                raise SnapshotError(f"tracked name {item.prefix!r} overlaps {other.prefix!r}: pick distinct names")
        self.items.append(item)
        return item

    def track(self, item: tr.Item) -> None:
        """Track a ready-made item (``tracked.py``); the track_* methods below build the usual ones."""
        self._add(item)

    def track_module(self, name: str, module: torch.nn.Module) -> None:
        self._add(tr.ModuleItem(name, module))

    def track_optimizer(self, name: str, optimizer: torch.optim.Optimizer) -> None:
        self._add(tr.OptimizerItem(name, optimizer))

    def track_tensor(self, name: str, tensor: torch.Tensor) -> None:
        self._add(tr.TensorsItem(name, lambda: {"": tensor}))

    def track_tensors(
        self, name: str, tensors: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]]
    ) -> None:
        self._add(tr.TensorsItem(name, tensors if callable(tensors) else (lambda: tensors)))

    def track_state(
        self, name: str, getter: Callable[[], Any], setter: Callable[[Any], None], *, raw: bool = False
    ) -> None:
        """Arbitrary state: JSON values by default, bytes with ``raw=True``."""
        self._add(tr.BlobItem(name, getter, setter) if raw else tr.json_blob(name, getter, setter))

    def track_rng(self, name: str = "rng", *, cuda_devices: list[int] | None = None) -> None:
        for item in tr.rng_items(name, cuda_devices=cuda_devices):
            self._add(item)

    # ------------------------------------------------------------------ inspection
    def _live(self) -> dict[str, tuple[tr.Item, torch.Tensor]]:
        out: dict[str, tuple[tr.Item, torch.Tensor]] = {}
        for item in self.items:
            for name, tensor in item.tensors().items():
                out[name] = (item, tensor)
        return out

    @staticmethod
    def _info(name: str, item: tr.Item, t: torch.Tensor) -> RegionInfo:
        return RegionInfo(name, *_region_fields(item, t))

    def _region_info(self, name: str, item: tr.Item, t: torch.Tensor) -> RegionInfo:
        """:meth:`_info`, the last round's object where every field is the same (RegionInfo is frozen): making
        one is most of the cost, and a round's 500 regions are nearly always those of the round before."""
        fields = _region_fields(item, t)
        was = self._infos.get(name)
        if was is not None and (was.nbytes, was.kind, was.dtype, was.shape, was.device) == fields:
            return was
        info = self._infos[name] = RegionInfo(name, *fields)
        return info

    def _devices(self, regions: list[RegionInfo]) -> list[str]:
        return sorted({r.device for r in regions if r.kind != "blob" and r.device}) or ["cpu"]

    def info(self) -> dict[str, Any]:
        with self._lock:
            regions = [self._info(n, it, t) for n, (it, t) in self._live().items()]
        return {
            "regions": [asdict(r) for r in regions],
            "bytes_total": sum(r.nbytes for r in regions),
            "environment": env_facts(),
            "frozen": self.frozen,
            "held": self.held,
            "ready": self.ready,
            "rank": self.group.describe(self._devices(regions)) if self.group is not None else None,
            "rounds": self.rounds,
            "last_image": self.last_image.id if self.last_image else None,
            "lease": self.lease.state(),
            "lease_expiries": self.lease.expiries,
            "fingerprint_collisions": self.fingerprint_collisions,
            "steps": self.freezer.steps if self.freezer is not None else 0,
            "warming": bool(self.warming()) if self.warming is not None else False,
        }

    # ------------------------------------------------------------------ source side
    def _pipeline(self, device: torch.device, chunk_size: int) -> Pipeline:
        key = (str(device), chunk_size)
        p = self._pipelines.get(key)
        if p is None:
            p = Pipeline(device, chunk_size, streams=self.streams, workers=self.workers)
            self._pipelines[key] = p
        return p

    def _round(self, writer: ImageWriter, *, frozen: bool, opened: Phases | None = None) -> tuple[RoundStats, ImageRef]:
        clock = opened or Phases()
        cs = int(writer.chunk_size)
        if cs <= 0 or cs % 8:
            raise SnapshotError(f"writer chunk size {cs} is not a positive multiple of 8 bytes")
        live = self._live()
        views = {n: byte_view(t) for n, (_, t) in live.items()}
        infos = {n: self._region_info(n, it, t) for n, (it, t) in live.items()}
        for info in infos.values():
            writer.add_region(info)
        clock.mark("regions")
        # The frozen round hashes every chunk it shipped before anyway (the confirmation: BLAKE3 decides), so
        # a tensor shipped before with this layout skips the fingerprint pass: its chunks that changed are the
        # ones whose id changed, and the others keep their fingerprints. On the host a fingerprint pass costs
        # more than the hash (one core against all of them); on a device a writer that hashes there reads the
        # 16 GiB once instead of twice (the pass and then the confirmation took 27 ms of a 58 ms final round
        # on an H100), and ships the changed chunks once the hash has sorted them.
        hashes_on_device = isinstance(writer, DirectImageWriter)
        by_hash = {
            n
            for n, v in views.items()
            if frozen
            and (hashes_on_device or not v.is_cuda)
            and infos[n].kind != "blob"
            and self._same_layout(n, infos[n], cs)
        }
        # Fingerprint every chunk where it lives, on a side stream; one host copy per device. With no
        # earlier round to compare against, every chunk ships anyway, so the fingerprints (kept for the
        # next round) are read back only after the copies, which they then overlap.
        dev_fps = _fingerprint_all({n: v for n, v in views.items() if n not in by_hash}, cs)
        comparable = any(name in self._shipped for name in views if name not in by_hash)
        host_fps = _fps_to_host(dev_fps) if comparable else None
        clock.mark("fingerprint")
        jobs_by_device: dict[str, list[Job]] = {}
        new: dict[str, _Shipped] = {}
        total = dirty_chunks = dirty_bytes = 0
        unchanged: list[ChunkRun] = []  # frozen round: reused only once their BLAKE3 confirms the id
        reused: list[tuple[str, int, str]] = []  # live round: referenced at once
        for name, view in views.items():
            info = infos[name]
            if name in by_hash:  # every chunk is a candidate; the hash sorts them
                was = self._shipped[name]
                unchanged.append(ChunkRun(name, view, range(len(was.ids)), was.ids))
                total += len(was.ids)
                new[name] = _Shipped(info.nbytes, info.dtype, info.shape, cs, list(was.fingerprints), list(was.ids))
                continue
            fps = host_fps[name] if host_fps is not None else None
            prev = self._shipped.get(name)
            count = chunk_count(view.numel(), cs)
            total += count
            ids: list[str]
            kept: Sequence[int]
            dirty: Sequence[int]
            # Reuse only against the same layout and the same chunk boundaries.
            if fps is None or prev is None or not self._same_layout(name, info, cs):
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
                    unchanged.append(ChunkRun(name, view, kept, ids if len(kept) == count else [ids[i] for i in kept]))
            else:
                reused.extend((name, i, ids[i]) for i in kept)
            if dirty:
                pieces = _jobs(name, view, dirty, cs)
                jobs_by_device.setdefault(str(view.device), []).extend(pieces)
                dirty_chunks += len(pieces)
                dirty_bytes += sum(j.data.numel() for j in pieces)
            new[name] = _Shipped(info.nbytes, info.dtype, info.shape, cs, list(fps or ()), ids)
        if reused:
            writer.reuse_chunks(reused)
        clock.mark("plan")
        # The confirmation hashes the unchanged chunks beside the shipping of the dirty ones (another thread, and
        # side streams on a GPU: both only read frozen bytes); a chunk it catches changed ships after it.
        confirming = self._confirm_beside(writer, unchanged, cs)
        try:
            shipped_fps = self._ship(writer, jobs_by_device, cs, new, frozen=frozen)
        except BaseException:
            if confirming is not None:
                with contextlib.suppress(BaseException):
                    confirming()  # it reads the tracked tensors: done before the error leaves
            raise
        clock.mark("ship")
        confirmed = confirming() if confirming is not None else []
        clock.mark("confirm")  # what the confirmation took beyond the shipping
        if host_fps is None:
            for name, fps in _fps_to_host(dev_fps).items():
                new[name].fingerprints = list(fps)
        for job, fp in shipped_fps:  # live rounds record the fingerprint of the bytes actually shipped
            new[job.region].fingerprints[job.index] = fp
        clock.mark("fingerprint")  # a first round reads them back only now, after its copies
        changed: dict[str, list[Job]] = {}  # chunks the hash found changed: shipped now
        if unchanged:
            writer.reuse_chunks(
                [
                    (run.region, i, cid)
                    for run, oks in zip(unchanged, confirmed, strict=True)
                    for i, cid, same in zip(run.indices, run.ids, oks, strict=True)
                    if same
                ]
            )
        for run, oks in zip(unchanged, confirmed, strict=True):
            if all(oks):
                continue
            for job in _jobs(
                run.region, run.view, [i for i, same in zip(run.indices, oks, strict=True) if not same], cs
            ):
                if job.region not in by_hash:  # the fingerprint called it unchanged
                    self._collision(job)
                changed.setdefault(str(job.data.device), []).append(job)
                dirty_chunks += 1
                dirty_bytes += job.data.numel()
        clock.mark("reuse")
        if changed:
            self._ship(writer, changed, cs, new, frozen=True)
            clock.mark("ship")
            # The next round (after a rollback) compares against the fingerprints of what was shipped; a chunk
            # of a hashed tensor whose fingerprint did not change with its bytes is a collision all the same.
            hashed = [j for jobs in changed.values() for j in jobs if j.region in by_hash]
            for job, fp in zip(hashed, _chunk_fingerprints([j.data for j in hashed], cs), strict=True):
                if fp == new[job.region].fingerprints[job.index]:
                    self._collision(job)
                new[job.region].fingerprints[job.index] = fp
            clock.mark("fingerprint")
        writer.set_metadata(
            META_KEY,
            {
                "format": FORMAT,
                "chunk_size": cs,
                "round": self.rounds + 1,
                "final": frozen,
                "environment": env_facts(),
                "items": {it.prefix: it.meta() for it in self.items},
                "chunks": {n: s.ids for n, s in new.items()},
                **({"rank": self._rank_id()} if self.group is not None else {}),
            },
        )
        clock.mark("metadata")
        ref = writer.commit()
        clock.mark("commit")
        self._shipped = new
        self.last_image = ref
        self.rounds += 1
        stats = RoundStats(self.rounds, total, dirty_chunks, dirty_bytes, clock.seconds(), clock.phases())
        return stats, ref

    def _same_layout(self, name: str, info: RegionInfo, cs: int) -> bool:
        """Whether the last shipped image holds ``name`` with this layout and these chunk boundaries."""
        prev = self._shipped.get(name)
        return prev is not None and (prev.nbytes, prev.dtype, prev.shape, prev.chunk_size) == (
            info.nbytes,
            info.dtype,
            info.shape,
            cs,
        )

    def _collision(self, job: Job) -> None:
        """The bytes of a chunk changed under an unchanged fingerprint: the final round's hash caught it."""
        self.fingerprint_collisions += 1
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
        new: Mapping[str, _Shipped],
        *,
        frozen: bool,
    ) -> list[tuple[Job, int]]:
        """Capture the jobs, record their ids in ``new``; a live round returns the fingerprints of the bytes shipped."""
        shipped_fps: list[tuple[Job, int]] = []
        for device, jobs in jobs_by_device.items():
            sent_ids, sent_fps = self._pipeline(torch.device(device), cs).capture(writer, jobs, stage=not frozen)
            for k, job in enumerate(jobs):
                new[job.region].ids[job.index] = sent_ids[k]
            if not frozen:
                shipped_fps.extend(zip(jobs, sent_fps, strict=True))
        return shipped_fps

    def _confirm_beside(
        self, writer: ImageWriter, runs: Sequence[ChunkRun], cs: int
    ) -> Callable[[], list[list[bool]]] | None:
        """Start confirming ``runs`` (every chunk's BLAKE3 against the id it would reuse) beside the shipping: a
        direct writer hashes where the bytes live (CUDA chunks on their device); else the agent's confirming
        thread hashes on the host. Returns the function that waits for the verdicts, per run and chunk."""
        if not runs:
            return None
        if isinstance(writer, DirectImageWriter):
            return writer.confirm_chunks(runs)
        if self._confirmer is None:
            self._confirmer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gm-confirm")
        return self._confirmer.submit(_confirm_on_host, runs, cs).result

    def precopy(self, writer: ImageWriter) -> RoundStats:
        """One live round. The writer's parent must be :attr:`last_image` (or a store holding its chunks)."""
        with self._lock:
            return self._round(writer, frozen=self.frozen)[0]

    def _rank_id(self) -> dict[str, int]:
        assert self.group is not None
        return {"rank": self.group.rank, "world_size": self.group.world_size}  # as images record it

    def freeze(self, lease_s: float | None = None, *, timeout_s: float = 60.0, at_step: int | None = None) -> None:
        """Park the workload at its safe point under a lease (``lease_s``, default 60 s): unless
        renewed, it resumes by itself when the lease runs out. Freezing a frozen agent renews.

        ``at_step``: a group freeze (after ``hold`` on every rank): first take the steps this rank
        lacks to have started ``at_step``. A rank of a group larger than one is frozen only so; a
        freeze of it alone could leave a peer inside a collective for ever."""
        lease = lease_arg(lease_s)
        if at_step is not None and (isinstance(at_step, bool) or not isinstance(at_step, int) or at_step < 0):
            raise SnapshotError(f"at_step {at_step!r}: must be a whole number of at least 0")
        with gc_held(), self._lock:
            if self.freezer is not None and (not self.frozen or at_step is not None):
                if at_step is None and self.group is not None and self.group.world_size > 1:
                    raise SnapshotError(
                        f"this process is rank {self.group.rank} of a group of {self.group.world_size}: "
                        "freeze the whole group at one step, never one rank alone",
                        hint="hold every rank, then freeze each at_step = the highest step any started "
                        "(gpumigrate.snapshot.world.World.freeze; snapshot/PROTOCOL.md)",
                    )
                try:
                    self.freezer.freeze(timeout_s, at_step=at_step)
                except SnapshotError:
                    self.held = self.frozen = False  # the gate reopened: the workload runs on
                    self.lease.clear()
                    raise
            self.frozen, self.held = True, False
            self.lease.start(lease)

    def hold(self, lease_s: float | None = None) -> dict[str, Any]:
        """Shut the safe point to new steps without waiting for the one in flight (the first move of
        a group freeze), under a lease like a freeze. Returns the steps completed, in flight, started."""
        lease = lease_arg(lease_s)
        with self._lock:
            if self.freezer is None:
                raise SnapshotError("hold needs a workload with a safe point (attach() gives one)")
            counts = self.freezer.hold() if not self.frozen else self.freezer.metrics()
            self.held = not self.frozen
            self.lease.start(lease)
            return {
                "steps": counts["steps"],
                "in_flight": counts["in_flight"],
                "started": counts["steps"] + counts["in_flight"],
                "frozen": self.frozen,
                "lease_s": lease,
            }

    def teardown(self) -> dict[str, Any]:
        """Destroy the group's communicators (before an in-place capture of the whole process). Frozen only."""
        with self._lock:
            if self.group is None:
                raise SnapshotError("teardown: this process is not a rank of a process group")
            if not self.frozen:
                raise SnapshotError("teardown needs the group frozen first (hold, then freeze at_step)")
            if not self.group.torn_down:
                self.group.teardown()
                self.group.torn_down = True
            return {"group": "torn down"}

    def rebuild(self) -> dict[str, Any]:
        """Build the group's communicators again (every rank at once: it is a rendezvous). Idempotent."""
        with self._lock:
            self._rebuild_locked()
            return {"group": "up"}

    def _rebuild_locked(self) -> None:
        if self.group is None:
            raise SnapshotError("rebuild: this process is not a rank of a process group")
        if self.group.torn_down:
            self.group.rebuild()
            self.group.torn_down = False

    def renew(self, lease_s: float | None = None) -> dict[str, Any]:
        """Extend the freeze lease from now (never waits for a command in progress)."""
        return self.lease.renew(lease_s)

    def advance(self, steps: int, *, timeout_s: float = ADVANCE_TIMEOUT_S) -> dict[str, Any]:
        """Let a frozen source take exactly ``steps`` more safe points, then hold it frozen again
        (lease restarted). Returns the step counter and the losses reported for those steps."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise SnapshotError(f"steps {steps!r}: must be a whole number of at least 1")
        with self._lock:
            if self.freezer is None or not self.frozen:
                raise SnapshotError("advance needs a frozen workload with a safe point: send freeze first")
            if self.group is not None and self.group.torn_down:
                raise SnapshotError("advance needs the process group: send rebuild first")
            try:
                losses = self.freezer.advance(steps, timeout_s)
            finally:
                self.lease.start(self.lease.lease_s or lease_arg(None))
            return {"steps": self.freezer.steps, "losses": [[s, loss] for s, loss in losses]}

    def metrics(self, since: int = 0) -> dict[str, Any]:
        """Safe points completed (steps), the recent losses reported after step ``since``, the gate."""
        if self.freezer is None:
            return {
                "steps": 0,
                "losses": [],
                "in_flight": 0,
                "held": 0,
                "frozen": self.frozen,
                "ready": self.ready,
                "retired": False,
            }
        return self.freezer.metrics(since)

    def final(self, writer: ImageWriter) -> ImageRef:
        with gc_held(), self._lock:
            if not self.frozen:
                raise SnapshotError("final() needs a frozen workload: call freeze() first")
            return self._round(writer, frozen=True)[1]

    def resume(self) -> None:
        with self._lock:
            self._resume_locked()

    def _resume_locked(self) -> None:
        if self.group is not None and self.group.torn_down:
            self._rebuild_locked()  # the workload's next step needs its communicators
        self.lease.clear()
        if (self.frozen or self.held) and self.freezer is not None:
            self.freezer.resume()
        self.frozen = self.held = False

    def forget_shipped(self) -> None:
        """Next round ships everything (e.g. a new store that holds none of the earlier chunks)."""
        with self._lock:
            self._shipped = {}

    # ------------------------------------------------------------------ target side
    def restore(
        self,
        reader: ImageReader,
        *,
        policy: Mapping[str, str] | None = None,
        ready: bool = True,
        rank: int | None = None,
        source: str | None = None,
        control_key: bytes | None = None,
        clock: Phases | None = None,
    ) -> dict[str, Any]:
        """Load a verified image into the tracked state; with ``ready`` report ready afterwards.

        ``ready=False`` pre-loads a pre-copy image while the source still serves; the next restore
        then loads only chunks whose ids changed (the target has not served, so nothing else did).
        A world image restores rank ``rank``'s part (default: this process's rank). ``source``: the
        source agent's address on this host; its tensors' chunks are then copied out of its memory and
        checked against the image's ids (``fill.py``), and only blobs are read from the image.
        """
        if source is not None and (self.filler is None or control_key is None):
            raise SnapshotError("this agent cannot fill from the source: the workload did not wire the transfer engine")
        clock = clock or Phases()  # restore_from's started before it opened the reader
        with gc_held(), self._lock:
            clock.mark("lock")
            reader = rank_reader(reader, rank, self._rank_id() if self.group is not None else None)
            meta = reader.metadata().get(META_KEY)
            if not isinstance(meta, Mapping) or meta.get("format") != FORMAT:
                raise SnapshotError(f"image {reader.ref.id} is not a gpumigrate snapshot image of format {FORMAT}")
            env = check_policy(meta.get("environment") or {}, env_facts(), policy)
            regions = {r.name: r for r in reader.regions()}
            cs = int(meta["chunk_size"])
            # The chunk ids by region, read in place: the manifest's own lists, never changed (no copy of 1,400 ids).
            table: Mapping[str, list[str]] = meta["chunks"]
            targets = self._targets(regions, meta)
            jobs_by_device: dict[str, list[Job]] = {}
            from_source: list[tuple[str, int]] = []  # chunks the source's memory fills
            skipped = 0
            before = self._loaded if self._loaded_cs == cs else {}  # ids compare only at the same chunk size
            count, ids_of, loaded_before = reader.chunk_count, table.get, before.get  # bound once: 500 regions
            for name, dst in targets.items():
                n = chunk_count(dst.numel() * dst.element_size(), cs)
                ids = ids_of(name, ())
                if count(name) != n or len(ids) != n:
                    raise ImageMismatchError(f"region {name}: image has {count(name)} chunks, {n} expected")
                blob = regions[name].kind == "blob"
                prev = loaded_before(name)
                # Skip a chunk only if it went into this very tensor before and its content id is unchanged.
                have = prev[1] if prev is not None and not blob and prev[0] == dst.data_ptr() else None
                if have is not None and have == ids:  # the whole region is loaded already (most are)
                    skipped += n
                    continue
                view = byte_view(dst)
                for i in range(n):
                    if have is not None and have[i] == ids[i]:
                        skipped += 1
                        continue
                    if source is not None and not blob:  # a blob is re-serialized at each read
                        from_source.append((name, i))
                        continue
                    jobs_by_device.setdefault(str(view.device), []).append(Job(name, i, view[i * cs : (i + 1) * cs]))
            self._loaded = {}  # unknown until this load completes
            if self.set_ready is not None:
                self.set_ready(False)
            self.ready = False
            clock.mark("check")
            loaded = 0
            for device, jobs in jobs_by_device.items():
                loaded += self._pipeline(torch.device(device), cs).restore(reader, jobs)
            clock.mark("from_image")
            filled: dict[str, Any] = {}
            if from_source:
                assert source is not None and control_key is not None
                moved, filled = self._fill(reader, source, targets, from_source, table, cs, control_key)
                loaded += moved
            clock.mark("from_source")
            owned = self._by_item(targets)
            for item in self.items:
                item.after_restore((meta.get("items") or {}).get(item.prefix) or {}, owned[item.prefix])
            # the manifest's lists themselves (nothing changes them): what this pre-load put where
            self._loaded = (
                {}
                if ready
                else {k: (t.data_ptr(), got) for k, t in targets.items() if (got := table.get(k)) is not None}
            )
            self._loaded_cs = cs
            self.last_image = reader.ref
            self.state_version += 1
            clock.mark("after")
            if ready:
                if self.set_ready is not None:
                    self.set_ready(True)
                self.ready = True
            clock.mark("ready")
            return {
                "image": reader.ref.id,
                "bytes_loaded": loaded,
                "chunks_loaded": sum(len(j) for j in jobs_by_device.values()) + len(from_source),
                "chunks_skipped": skipped,
                "ready": ready,
                "seconds": clock.seconds(),
                # where the seconds went: opening the reader (the manifest read and its signature checked), waiting
                # for the agent, checking the manifest against the model, chunks read from the image, chunks filled
                # from the source, the items' own restore hooks, the switch to ready
                "phases": clock.phases(),
                "environment": env,
                **({"from_source": filled} if filled else {}),
                **({"world": reader.source()} if isinstance(reader, RankView) else {}),
            }

    def _fill(
        self,
        reader: ImageReader,
        source: str,
        targets: Mapping[str, torch.Tensor],
        chunks: Sequence[tuple[str, int]],
        table: Mapping[str, Sequence[str]],
        cs: int,
        control_key: bytes,
    ) -> tuple[int, dict[str, Any]]:
        """``chunks`` copied out of the source's memory (``fill.py``), each checked against ``table``; those the
        source changed since its image (a KV cache that serves on) are read from the image instead."""
        assert self.filler is not None
        views = {k: byte_view(v) for k, v in targets.items()}
        landed = self.filler.land(source, views, runs_of(chunks), table, cs, control_key=control_key)
        again: dict[str, list[Job]] = {}
        for name, i in landed.failed:
            again.setdefault(str(views[name].device), []).append(Job(name, i, views[name][i * cs : (i + 1) * cs]))
        moved = landed.bytes_moved - sum(j.data.numel() for jobs in again.values() for j in jobs)
        for device, jobs in again.items():
            moved += self._pipeline(torch.device(device), cs).restore(reader, jobs)
        return moved, {
            "way": landed.way,
            "chunks": len(chunks) - len(landed.failed),
            "chunks_from_image": len(landed.failed),
            "seconds": round(landed.seconds, 4),
            "phases": dict(landed.phases),
        }

    def _targets(self, regions: Mapping[str, RegionInfo], meta: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        targets: dict[str, torch.Tensor] = {}
        owned = self._by_item(regions)
        items_meta = meta.get("items") or {}
        for item in self.items:
            targets.update(item.targets(owned[item.prefix], items_meta.get(item.prefix) or {}))
        if targets.keys() != regions.keys():  # one set comparison; the names only when they differ
            missing = sorted(set(targets) - set(regions))
            extra = sorted(set(regions) - set(targets))
            raise ImageMismatchError(
                "image does not fit this workload: "
                + (
                    f"missing in image: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; "
                    if missing
                    else ""
                )
                + (f"not tracked here: {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}" if extra else "")
            )
        problems = []
        names: dict[torch.dtype, str] = {}  # dtype -> its name, once per dtype rather than once per region
        for name, dst in targets.items():
            info = regions[name]
            if info.kind == "blob":
                continue
            dtype = dst.dtype
            dtype_name = names.get(dtype) or names.setdefault(dtype, tr.dtype_name(dtype))
            shape = info.shape if type(info.shape) is tuple else tuple(info.shape or ())
            if info.dtype != dtype_name or shape != dst.shape:  # torch.Size: a tuple
                problems.append(f"{name}: image {info.dtype}{list(shape)}, model {dtype_name}{list(dst.shape)}")
        if problems:
            raise ImageMismatchError(
                "image shapes/dtypes do not match the model: "
                + "; ".join(problems[:5])
                + " (the target allocates its own tensors, so each must have the source's shape and dtype when it "
                "moves: build the model from the same config, and allocate state that grows, such as an appended "
                "cache, at its full size, e.g. a ring buffer with a fill count in state)"
            )
        return targets

    def _by_item(self, regions: Mapping[str, _V]) -> dict[str, dict[str, _V]]:
        """``regions`` split by the tracked item that owns each (its prefix, or a path under it), in their order.

        Prefixes never nest (``_add``), so the owner is the one item prefix among the name and its parents: a
        few lookups per region, where asking every item about every region cost a model's 500 regions times
        the items, twice on the freeze → ready path."""
        out: dict[str, dict[str, _V]] = {item.prefix: {} for item in self.items}
        for name, value in regions.items():
            owner = name
            while owner not in out:
                cut = owner.rfind("/")
                if cut < 0:
                    break
                owner = owner[:cut]
            else:
                out[owner][name] = value
        return out

    # ------------------------------------------------------------------ after cutover
    def zeroize(self) -> dict[str, Any]:
        """Overwrite tracked tensors (and the ring buffers) with zeros, read back, return an audit record."""
        with self._lock:
            if self.set_ready is not None:
                self.set_ready(False)  # zeros are not a model: stop answering before the first byte changes
            if self.freezer is not None:
                self.freezer.retire()  # and for good: /readyz says so, requests fail at once (no wait)
            t0 = time.perf_counter()
            regions = 0
            nbytes = 0
            failed: list[str] = []
            devices: set[str] = set()
            for item in self.items:
                if isinstance(item, tr.BlobItem):
                    continue  # opaque state lives in the workload's own objects, not tracked memory
                for name, t in item.tensors().items():
                    view = byte_view(t)
                    view.zero_()
                    if bool(view.any()):
                        failed.append(name)
                    regions += 1
                    nbytes += view.numel()
                    devices.add(str(view.device))
            for p in self._pipelines.values():
                p.ring.zeroize()
            self.state_version += 1
            self._shipped = {}
            self._loaded = {}
            if failed:
                raise SnapshotError(f"zeroize read-back found non-zero bytes in {', '.join(failed[:5])}")
            return {
                "zeroized_regions": regions,
                "zeroized_bytes": nbytes,
                "verified": True,
                "devices": sorted(devices),
                "seconds": time.perf_counter() - t0,
            }

    # ------------------------------------------------------------------ wire-level operations
    def precopy_to(
        self,
        store: str,
        key_ref: Mapping[str, str],
        parent: str | None = None,
        *,
        options: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        clock = Phases()
        with self._lock:
            clock.mark("lock")
            writer = self._open_writer(store, key_ref, parent, options)
            clock.mark("open")
            stats, ref = self._round(writer, frozen=self.frozen, opened=clock)
            return {"stats": asdict(stats), "image": asdict(ref)}

    def final_to(
        self,
        store: str,
        key_ref: Mapping[str, str],
        parent: str | None = None,
        *,
        options: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        clock = Phases()
        with gc_held(), self._lock:
            clock.mark("lock")
            if not self.frozen:
                raise SnapshotError("final needs a frozen workload: send freeze first")
            writer = self._open_writer(store, key_ref, parent, options)
            clock.mark("open")
            stats, ref = self._round(writer, frozen=True, opened=clock)
            return {"stats": asdict(stats), "image": asdict(ref)}

    def restore_from(
        self,
        store: str,
        image_id: str,
        key_ref: Mapping[str, str],
        *,
        policy: Mapping[str, str] | None = None,
        ready: bool = True,
        rank: int | None = None,
        source: str | None = None,
        control_key: bytes | None = None,
    ) -> dict[str, Any]:
        if self.reader_factory is None:
            raise SnapshotError("this agent has no image reader: the workload did not wire the transfer engine")
        clock = Phases()
        with gc_held():  # from the manifest's read on: every pause here is downtime in the final restore
            reader = self.reader_factory(store, image_id, key_ref)
            clock.mark("open")
            try:
                return self.restore(
                    reader, policy=policy, ready=ready, rank=rank, source=source, control_key=control_key, clock=clock
                )
            finally:
                # The restore that ends the downtime frees its manifest a second later, off that path. A pre-load frees
                # its own at once: a second later could land inside the final restore that follows it.
                if ready:
                    release_later(reader)

    def lend_to(
        self, landing: str, runs: Sequence[Run], chunk_size: int, *, control_key: bytes, tolerate: bool
    ) -> dict[str, Any]:
        """Source: move ``runs`` of the tracked tensors into the target's landing at ``landing`` (``fill.py``).

        The bytes are read as they are now; the target checks each chunk against the image it restores,
        so a tensor that changed since that image fails there, never silently. Blobs are not lent."""
        if self.filler is None:
            raise SnapshotError("this agent cannot lend: the workload did not wire the transfer engine")
        if chunk_size <= 0 or chunk_size % 8:
            raise SnapshotError(f"chunk size {chunk_size} is not a positive multiple of 8 bytes")
        with gc_held(), self._lock:  # the target's final restore waits on this lend: downtime, as final's is
            t0 = time.perf_counter()
            wanted = {run.region for run in runs}  # a final lend names a few of a model's 500 tensors: views of those
            views = {
                n: byte_view(t)
                for n, (it, t) in self._live().items()
                if n in wanted and not isinstance(it, tr.BlobItem)
            }
            lent = slices(views, runs, chunk_size)
            done = self.filler.lend(landing, lent, control_key=control_key, tolerate=tolerate)
            return {**done, "bytes_lent": sum(v.numel() for v in lent.values()), "seconds": time.perf_counter() - t0}

    def compose_world(
        self,
        store: str,
        key_ref: Mapping[str, str],
        images: list[str],
        ranks: list[Mapping[str, Any]],
        *,
        step: int | None = None,
    ) -> dict[str, Any]:
        """Compose the ranks' images (rank r's at ``images[r]``, all in ``store``) into one world image
        (``worldimage.py``): no chunk is copied. ``ranks[r]`` describes rank r (its ``info().rank``)."""
        if self.reader_factory is None or self.writer_factory is None:
            raise SnapshotError("this agent has no image reader/writer: the workload did not wire the transfer engine")
        with self._lock:
            t0 = time.perf_counter()
            readers = [self.reader_factory(store, image_id, key_ref) for image_id in images]
            ref = compose(self.writer_factory(store, key_ref, None), readers, ranks, step=step)
            return {"image": asdict(ref), "world_size": len(images), "seconds": time.perf_counter() - t0}

    def _open_writer(
        self, store: str, key_ref: Mapping[str, str], parent: str | None, options: Mapping[str, Any] | None = None
    ) -> ImageWriter:
        if self.writer_factory is None:
            raise SnapshotError("this agent has no image writer: the workload did not wire the transfer engine")
        if parent is None and self.last_image is not None and self.last_image.store == store:
            parent = self.last_image.id
        if parent is None or self.last_image is None or parent != self.last_image.id:
            self._shipped = {}  # the parent holds none of our chunk ids: ship everything
        # Options (compression, parallelism from the plan) only when given: factories may take just three.
        return (
            self.writer_factory(store, key_ref, parent, **dict(options))
            if options
            else self.writer_factory(store, key_ref, parent)
        )

    def close(self) -> None:
        self.lease.close()
        for p in self._pipelines.values():
            p.close()
        self._pipelines.clear()
        if self._confirmer is not None:
            self._confirmer.shutdown(wait=True)
            self._confirmer = None


def _region_fields(
    item: tr.Item, t: torch.Tensor
) -> tuple[int, Literal["tensor", "blob"], str | None, tuple[int, ...] | None, str]:
    """RegionInfo's fields after the name: nbytes, kind, dtype, shape, device."""
    if isinstance(item, tr.BlobItem):
        return t.numel() * t.element_size(), "blob", None, None, str(t.device)
    return t.numel() * t.element_size(), "tensor", tr.dtype_name(t.dtype), tuple(t.shape), str(t.device)


def _jobs(name: str, view: torch.Tensor, indices: Iterable[int], cs: int) -> list[Job]:
    """Jobs for chunks ``indices`` of region ``name``: a region of one chunk is its own piece (no slice made)."""
    if view.numel() <= cs:
        return [Job(name, i, view) for i in indices]
    return [Job(name, i, view[i * cs : (i + 1) * cs]) for i in indices]


def _chunk_fingerprints(pieces: Sequence[torch.Tensor], chunk_size: int) -> list[int]:
    """The fingerprint of each piece (one chunk each), read back once."""
    found = Fingerprints({str(k): p for k, p in enumerate(pieces)}, chunk_size).to_host()
    return [found[str(k)][0] for k in range(len(pieces))]


def _confirm_on_host(runs: Sequence[ChunkRun], cs: int) -> list[list[bool]]:
    """Whether each run's chunks still hash to their ids (BLAKE3 on the host, a device's bytes copied there)."""
    out = []
    for run in runs:
        pieces = [job.data for job in _jobs(run.region, run.view, run.indices, cs)]
        out.append(unchanged_by_hash(pieces, run.ids, None))
    return out


def _fingerprint_all(views: Mapping[str, torch.Tensor], chunk_size: int) -> _Fingerprints:
    """Fingerprints of every chunk, launched on a side stream per GPU (after a device-wide sync, so
    everything the workload queued is in the bytes) so that they can overlap the first copies."""
    by_device: dict[torch.device, dict[str, torch.Tensor]] = {}
    for name, view in views.items():
        by_device.setdefault(view.device, {})[name] = view
    sets: list[Fingerprints] = []
    side: list[torch.cuda.Stream] = []
    for device, mine in by_device.items():
        if device.type != "cuda":
            sets.append(Fingerprints(mine, chunk_size))
            continue
        torch.cuda.synchronize(device)
        side.append(torch.cuda.Stream(device=device))
        with torch.cuda.stream(side[-1]):
            sets.append(Fingerprints(mine, chunk_size))
    return _Fingerprints(sets, side)


@dataclass
class _Fingerprints:
    sets: list[Fingerprints]  # one per device
    streams: list[torch.cuda.Stream]


def _fps_to_host(fps: _Fingerprints) -> dict[str, list[int]]:
    for stream in fps.streams:  # the reads below come after the fingerprint kernels
        torch.cuda.current_stream(stream.device).wait_stream(stream)
    out: dict[str, list[int]] = {}
    for one in fps.sets:
        out.update(one.to_host())
    return out

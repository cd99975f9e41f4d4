"""The snapshot engine: embedded in a workload's process, it captures and restores the state it tracks.

One small object composing one part per concern, each in its module of this package:

* ``tracking.py``: what is tracked (modules, optimizers, tensors, opaque state, RNG streams) and its regions;
* ``capture.py``: capture rounds into an image writer, live (only what changed ships) or frozen (the final
  round, each chunk it reuses confirmed by its BLAKE3; ``planning.py`` decides what each region gets, and
  ``confirmation.py`` holds the verdict of a final round that returned before its confirmation ended);
* ``loading.py``: loading an image into the tracked state (a pre-load stays unready), filled from the
  source's memory where it can;
* ``lending.py``: the source's side of that fill;
* ``freezing.py``: parking at the safe point under a lease, holding, advancing N steps, unparking;
* ``group.py``: the process as one rank of a group (teardown and rebuild of its communicators);
* ``zeroize.py``: wiping the tracked memory after the cut-over;
* ``dirty.py``: the written ranges a workload reports for a tensor (a KV cache), which its rounds ship;
* ``work.py``: work in flight that travels at the safe point (the workload's hooks), held, handed over or taken back.

Every command runs under the engine's lock (:attr:`lock`); the lease's renewal never waits for it. The
engine moves bytes only through the writers, readers and filler it is given: the public SDK
(``gpumigrate.agent``) wires the transfer engine's, and the control server (``server.py``,
``server_commands.py``) is the engine's face on the wire.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch

from gpumigrate.bounds import OPTION_KEYS
from gpumigrate.errors import SnapshotError
from gpumigrate.interfaces import ImageReader, ImageRef, ImageWriter, Round
from gpumigrate.snapshot import tracked as tr
from gpumigrate.snapshot.engine.capture import CaptureRounds
from gpumigrate.snapshot.engine.clock import Phases
from gpumigrate.snapshot.engine.confirmation import Reopen, Verdict
from gpumigrate.snapshot.engine.dirty import Report
from gpumigrate.snapshot.engine.freezing import ADVANCE_TIMEOUT_S, Freezing
from gpumigrate.snapshot.engine.group import GroupControl
from gpumigrate.snapshot.engine.lending import lend
from gpumigrate.snapshot.engine.loading import Loader
from gpumigrate.snapshot.engine.pipelines import Pipelines
from gpumigrate.snapshot.engine.state import EngineState
from gpumigrate.snapshot.engine.tracking import Tracker, devices
from gpumigrate.snapshot.engine.work import InFlightWork, WorkHold
from gpumigrate.snapshot.engine.zeroize import zeroize
from gpumigrate.snapshot.environment import env_facts
from gpumigrate.snapshot.fill import Filler, Run
from gpumigrate.snapshot.gchold import gc_held
from gpumigrate.snapshot.lease import Lease
from gpumigrate.snapshot.ranks import RankGroup
from gpumigrate.snapshot.stepgate import SafePointGate

# (store, key reference, parent image) -> a writer; options (compression, a live round's bounds) as keywords when given
WriterFactory = Callable[..., ImageWriter]
ReaderFactory = Callable[[str, str, Mapping[str, str]], ImageReader]  # (store, image id, key reference) -> a reader


class SnapshotEngine:
    """Tracks a workload's state and moves it through ImageWriter/ImageReader objects, in its own process."""

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
        timeline: Callable[[], Mapping[str, Any]] | None = None,
        key_check: Callable[[Mapping[str, str]], str | None] | None = None,
    ) -> None:
        self.writer_factory = writer_factory  # how images are opened for a store URL and a key reference
        self.reader_factory = reader_factory
        self.filler = filler  # a restore filled straight from the source's memory (fill.py), and its lending
        self.warming = warming  # whether the SDK still compiles the device kernels in the background
        self.timeline = timeline  # when the process reached each point of its start (the SDK's, for ``info``)
        self.key_check = key_check  # key reference -> the key's id (None: no key), read in this process
        self.freezer = freezer  # the workload's safe point: park waits for it, unpark reopens it
        self.set_ready = set_ready
        self.lock = threading.RLock()
        self.state = EngineState()
        # Parked: frozen (no safe point in flight), or a target whose gate holds every safe point until its restore.
        self.tracker = Tracker(parked=lambda: self.state.frozen or self.state.ready is False)
        self.ranks = GroupControl(group, self.state)
        self.pipelines = Pipelines(workers=workers, streams=streams)
        self.capture = CaptureRounds(self.tracker, self.pipelines, self.state, self.ranks.rank_id)
        self.work = WorkHold(self.lock, lambda: self.state.frozen)
        self.loader = Loader(
            self.tracker,
            self.pipelines,
            self.state,
            rank_id=self.ranks.rank_id,
            filler=filler,
            set_ready=set_ready,
            before_ready=self.work.when_ready,
        )
        # Whatever lets the workload run again, or changes its state, waits for a pending confirmation first: its
        # hashes read the frozen bytes (confirmation.py)
        self.freezing = Freezing(freezer, self.state, self.ranks, self.lock, before_running=self.capture.settle)
        if freezer is not None:  # the step counter and reported losses travel with the state
            self.track_state("progress", freezer.progress, freezer.set_progress)

    # ------------------------------------------------------------------ what it tracks (tracking.py)
    def track(self, item: tr.Item) -> None:
        self.tracker.track(item)

    def track_module(self, name: str, module: torch.nn.Module) -> None:
        self.tracker.track_module(name, module)

    def track_optimizer(self, name: str, optimizer: torch.optim.Optimizer) -> None:
        self.tracker.track_optimizer(name, optimizer)

    def track_tensor(self, name: str, tensor: torch.Tensor) -> None:
        self.tracker.track_tensor(name, tensor)

    def track_tensors(
        self, name: str, tensors: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]]
    ) -> None:
        self.tracker.track_tensors(name, tensors)

    def track_state(
        self, name: str, getter: Callable[[], Any], setter: Callable[[Any], None], *, raw: bool = False
    ) -> None:
        """Arbitrary state: JSON values by default, bytes with ``raw=True``."""
        self.tracker.track_state(name, getter, setter, raw=raw)

    def track_rng(self, name: str = "rng", *, cuda_devices: list[int] | None = None) -> None:
        self.tracker.track_rng(name, cuda_devices=cuda_devices)

    def track_written(self, region: str, report: Report) -> None:
        """Region ``region`` (a tracked tensor) reports the byte ranges written since its last report: its rounds
        ship the chunks those touch, with no fingerprint pass or hash of the rest (dirty.py)."""
        live = self.tracker.live()
        if region not in live or isinstance(live[region][0], tr.BlobItem):
            tensors = sorted(n for n, (it, _) in live.items() if not isinstance(it, tr.BlobItem))
            raise SnapshotError(f"{region!r} is not a tracked tensor region; these are: {', '.join(tensors[:20])}")
        self.capture.written.watch(region, report)

    def track_work(self, hooks: InFlightWork) -> None:
        """Work in flight that travels at the safe point, through ``hooks`` (work.py): its JSON rides every image,
        the final image's is restored on the target before it reports ready, and the source holds it sealed
        until ``hand_over`` or ``take_back``."""
        self.tracker.track(self.work.track(hooks))

    # ------------------------------------------------------------------ where it stands
    @property
    def items(self) -> list[tr.Item]:
        return self.tracker.items

    @property
    def frozen(self) -> bool:
        return self.state.frozen

    @property
    def held(self) -> bool:
        return self.state.held

    @property
    def ready(self) -> bool | None:
        return self.state.ready

    @property
    def rounds(self) -> int:
        return self.state.rounds

    @property
    def last_image(self) -> ImageRef | None:
        return self.state.last_image

    @property
    def fingerprint_collisions(self) -> int:
        return self.state.fingerprint_collisions

    @property
    def state_version(self) -> int:
        return self.state.state_version

    @property
    def group(self) -> RankGroup | None:
        return self.ranks.group

    @property
    def lease(self) -> Lease:
        return self.freezing.lease

    def info(self) -> dict[str, Any]:
        with self.lock:
            regions = [self.tracker.describe(n, it, t) for n, (it, t) in self.tracker.live().items()]
        return {
            "regions": [asdict(r) for r in regions],
            "bytes_total": sum(r.nbytes for r in regions),
            "environment": env_facts(),
            "frozen": self.state.frozen,
            "held": self.state.held,
            "ready": self.state.ready,
            "rank": self.ranks.describe(devices(regions)),
            "rounds": self.state.rounds,
            "last_image": self.state.last_image.id if self.state.last_image else None,
            "lease": self.lease.state(),
            "lease_expiries": self.lease.expiries,
            "fingerprint_collisions": self.state.fingerprint_collisions,
            "steps": self.freezer.steps if self.freezer is not None else 0,
            "warming": bool(self.warming()) if self.warming is not None else False,
            "timeline": dict(self.timeline()) if self.timeline is not None else {},
            "work": self.work.figures(),
            "confirmation": self._confirmation_state(),
        }

    def _confirmation_state(self) -> dict[str, Any] | None:
        pending, verdict = self.capture.pending, self.capture.verdict
        if pending is not None:
            return {"of_image": pending.image.id, "image": None, "pending": True, "caught": 0, "failed": False}
        return verdict.state() if verdict is not None else None

    # ------------------------------------------------------------------ capture (capture.py)
    def open_writer(
        self, store: str, key_ref: Mapping[str, str], parent: str | None, options: Mapping[str, Any] | None = None
    ) -> ImageWriter:
        """A writer for the next round into ``store``: its parent is the last image there unless ``parent`` says
        otherwise, and a round on another parent ships everything (that parent holds none of our chunk ids)."""
        if self.writer_factory is None:
            raise SnapshotError("this agent has no image writer: the workload did not wire the transfer engine")
        self.capture.settle()  # a pending confirmation may leave a follow-up image: the last one then
        last = self.state.last_image
        if parent is None and last is not None and last.store == store:
            parent = last.id
        if parent is None or last is None or parent != last.id:
            self.capture.forget()
        if options and self.state.frozen:
            # The plan's bounds (threads, bytes/s, pacing: gpumigrate/bounds.py) are for rounds of a serving source;
            # a frozen one serves nobody, and every core it takes shortens the downtime.
            options = {k: v for k, v in options.items() if k not in OPTION_KEYS}
        # Options (compression, the bounds from the plan) only when given: factories may take just three.
        return (
            self.writer_factory(store, key_ref, parent, **dict(options))
            if options
            else self.writer_factory(store, key_ref, parent)
        )

    def capture_round(self, writer: ImageWriter, *, clock: Phases | None = None) -> Round:
        """One round (live unless the workload is parked). The writer's parent must hold the last shipped image."""
        with self.lock:
            return Round(*self.capture.run(writer, frozen=self.state.frozen, clock=clock))

    def capture_final(self, writer: ImageWriter, *, clock: Phases | None = None, reopen: Reopen | None = None) -> Round:
        """The frozen round: the last dirty set, every reused chunk confirmed by its hash. With ``reopen`` (the
        follow-up's writer, from the parent's id) it may commit before the cold chunks' hashes end: their verdict
        is :meth:`confirmation`'s (confirmation.py)."""
        with gc_held(), self.lock:
            if not self.state.frozen:
                raise SnapshotError("final needs a frozen workload: send freeze first")
            done = Round(*self.capture.run(writer, frozen=True, clock=clock, reopen=reopen))
            self.work.seal(self.lease.lease_s)  # the image holds the work in flight: kept aside until handed over
            return done

    def confirmation(self, image_id: str) -> Verdict:
        """The verdict of the final round that committed ``image_id``: the image a target may be made ready from
        (``image_id``'s, or a follow-up with the chunks its confirmation caught). Waits for the hashes outside the
        lock (a target's fill may ``lend`` meanwhile), then takes the verdict under it."""
        pending = self.capture.pending
        if pending is not None and pending.image.id == image_id:
            with contextlib.suppress(BaseException):  # a failure is the verdict's, taken below
                pending.wait()
        with gc_held(), self.lock:
            return self.capture.confirmation(image_id)

    def forget_shipped(self) -> None:
        """The next round ships everything (e.g. a new store that holds none of the earlier chunks)."""
        with self.lock:
            self.capture.forget()

    # ------------------------------------------------------------------ the safe point (freezing.py, group.py)
    def park(self, lease_s: float | None = None, *, timeout_s: float = 60.0, at_step: int | None = None) -> None:
        self.freezing.park(lease_s, timeout_s=timeout_s, at_step=at_step)

    def hold(self, lease_s: float | None = None) -> dict[str, Any]:
        return self.freezing.hold(lease_s)

    def renew_lease(self, lease_s: float | None = None) -> dict[str, Any]:
        """Extend the freeze's lease, and the hold of sealed work in flight; refused when there is neither."""
        holding = self.work.held
        try:
            out = self.freezing.renew_lease(lease_s)
        except SnapshotError:
            if not holding:
                raise
            out = {"frozen": False}
        if holding:
            out = {**self.work.renew(lease_s), **out}
        return {**out, "holding": holding}

    def advance_steps(self, steps: int, *, timeout_s: float = ADVANCE_TIMEOUT_S) -> dict[str, Any]:
        return self.freezing.advance_steps(steps, timeout_s=timeout_s)

    def step_metrics(self, since: int = 0) -> dict[str, Any]:
        return {**self.freezing.step_metrics(since), "work": self.work.figures()}

    # ------------------------------------------------------------------ work in flight (work.py)
    def hand_over(self, target: str) -> dict[str, Any]:
        """Source: the sealed work runs on ``target`` (its service URL) now."""
        with self.lock:
            return self.work.hand_over(target)

    def take_back(self) -> dict[str, Any]:
        """Source: the sealed work goes on here (a rollback)."""
        with self.lock:
            return self.work.take_back()

    def unpark(self) -> None:
        self.freezing.unpark()

    def teardown_group(self) -> dict[str, Any]:
        with self.lock:
            return self.ranks.teardown()

    def rebuild_group(self) -> dict[str, Any]:
        with self.lock:
            return self.ranks.rebuild()

    # ------------------------------------------------------------------ target side (loading.py, lending.py)
    def load(
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
        """Load a verified image into the tracked state; with ``ready`` report ready afterwards (loading.py).

        A world image loads rank ``rank``'s part (default: this process's rank). ``source``: the source agent's
        address on this host; its tensors' chunks are copied out of its memory and checked (``fill.py``)."""
        if source is not None and (self.filler is None or control_key is None):
            raise SnapshotError("this agent cannot fill from the source: the workload did not wire the transfer engine")
        clock = clock or Phases()  # restore_from's started before it opened the reader
        with gc_held(), self.lock:
            self.capture.settle()  # the load rewrites the tracked state a pending confirmation reads
            clock.mark("lock")
            return self.loader.run(
                reader, policy=policy, ready=ready, rank=rank, source=source, control_key=control_key, clock=clock
            )

    def mark_ready(self, image_id: str) -> dict[str, Any]:
        """Target: report ready on image ``image_id``, which the last load put here unready (loading.py)."""
        with gc_held(), self.lock:
            return self.loader.mark_ready(image_id)

    def lend(
        self, landing: str, runs: Sequence[Run], chunk_size: int, *, control_key: bytes, tolerate: bool
    ) -> dict[str, Any]:
        """Source: move ``runs`` of the tracked tensors into the target's landing at ``landing`` (lending.py)."""
        with gc_held(), self.lock:  # the target's final restore waits on this lend: downtime, as final's is
            return lend(
                self.tracker, self.filler, landing, runs, chunk_size, control_key=control_key, tolerate=tolerate
            )

    # ------------------------------------------------------------------ after the cut-over (zeroize.py)
    def zeroize(self, *, end_parked: bool = False) -> dict[str, Any]:
        with self.lock:
            self.capture.settle()  # a pending confirmation reads what is about to be wiped
            return zeroize(self.tracker, self.pipelines, gate=self.freezer, set_ready=self.set_ready,
                           forget=self._forget_memory, end_parked=end_parked)  # fmt: skip

    def check_key(self, key_ref: Mapping[str, str]) -> dict[str, Any]:
        """Whether this process can read the image key ``key_ref`` names (preflight: before anything moves)."""
        if self.key_check is None:
            raise SnapshotError("this agent cannot check image keys: the workload did not wire the transfer engine")
        return {"key_id": self.key_check(key_ref)}

    def _forget_memory(self) -> None:
        self.state.state_version += 1
        self.capture.forget()
        self.loader.forget()

    def close(self) -> None:
        self.lease.close()
        self.work.close()
        self.capture.close()  # waits for a pending confirmation's hashes
        self.pipelines.close()

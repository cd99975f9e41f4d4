"""The byte pipelines: device → pinned host ring → writer (capture), and reader → ring → device (restore).

Capture: the main thread walks the dirty chunks and, on one of ≥ 2 CUDA streams in turn, copies each
into a free pinned host slot (``non_blocking``) and records an event; a pool of worker threads waits
for the event and hands the slot to ``writer.put_chunk`` (hash, compress, encrypt, send), then frees
the slot. So the PCIe copy of chunk k+1 overlaps the CPU work on chunk k. While the workload still
runs (pre-copy), each chunk is first copied on the device into a staging slot and fingerprinted
there, so the fingerprint recorded for a chunk is exactly that of the bytes shipped (a chunk that
changes during the copy and changes back is still caught in the next round).

Restore: workers fetch verified chunks into pinned slots and copy them into the pre-allocated
destination tensors on their own streams. On the CPU the same code runs with plain memory, and
restore reads straight into the destination tensor (no staging copy).

Direct placement: a :class:`~gpumigrate.interfaces.DirectImageWriter` takes the chunks as tensors
and moves their bytes itself (ids hashed on the device, one copy into its own pinned memory, codec
and AEAD on its threads), and a :class:`~gpumigrate.interfaces.DirectImageReader` fills the
destination tensors and verifies them where they landed. The pipeline then only stages live chunks
(batches of staging slots, reused in stream order) and fingerprints them.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from gpumigrate import cudacalls
from gpumigrate.errors import SnapshotError
from gpumigrate.interfaces import DirectImageWriter, ImageReader, ImageWriter, TensorChunk, reads_directly
from gpumigrate.snapshot.chunks import Fingerprints, fingerprint_chunks, fingerprints_to_host
from gpumigrate.stageclock import STAGES, both_now

STAGE_SLOTS = 16  # device staging slots of a live round: one batch handed to a direct writer at a time


@dataclass
class Job:
    region: str
    index: int
    data: torch.Tensor  # flat uint8 view of the chunk's bytes, on the source device (capture) or destination


class Ring:
    """Fixed set of host slots (pinned when a GPU is involved) plus device staging slots, handed out in turn.

    Each set is allocated when first used: a capture into a direct writer on a GPU needs only the
    staging slots, and pinning host slots it would never touch costs time inside the first round.
    """

    def __init__(self, chunk_size: int, slots: int, device: torch.device) -> None:
        self.chunk_size = chunk_size
        self.device = device
        self.slots = slots
        self._host: list[torch.Tensor] = []
        self._stage: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.free: queue.Queue[int] = queue.Queue()
        for i in range(slots):
            self.free.put(i)

    @property
    def host(self) -> list[torch.Tensor]:
        with self._lock:
            if not self._host:
                cuda = self.device.type == "cuda"
                self._host = [
                    torch.empty(self.chunk_size, dtype=torch.uint8, pin_memory=cuda) for _ in range(self.slots)
                ]
            return self._host

    @property
    def stage(self) -> list[torch.Tensor]:
        with self._lock:
            if not self._stage and self.device.type == "cuda":
                count = max(self.slots, STAGE_SLOTS)
                self._stage = [
                    torch.empty(self.chunk_size, dtype=torch.uint8, device=self.device) for _ in range(count)
                ]
            return self._stage

    def zeroize(self) -> None:
        """Ring slots held copies of workload memory: wipe them before they are freed."""
        with self._lock:
            for t in self._host + self._stage:
                t.zero_()


def _cuda_streams(device: torch.device, count: int) -> list[torch.cuda.Stream]:
    return [torch.cuda.Stream(device=device) for _ in range(count)]


class Pipeline:
    """Reusable capture/restore machinery for one device (rings and streams are allocated once)."""

    def __init__(
        self, device: torch.device, chunk_size: int, *, slots: int = 8, streams: int = 2, workers: int = 4
    ) -> None:
        self.device = device
        self.chunk_size = chunk_size
        self.workers = max(1, workers)
        self._slots = max(slots, self.workers + streams)
        self._ring: Ring | None = None
        self._ring_lock = threading.Lock()
        self.streams = _cuda_streams(device, max(2, streams)) if device.type == "cuda" else []
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="gm-snap")

    @property
    def ring(self) -> Ring:
        """Allocated on first use: a restore from a reader with direct placement never needs its
        pinned slots, and pinning them is a visible part of a multi-GB restore's time."""
        with self._ring_lock:
            if self._ring is None:
                self._ring = Ring(self.chunk_size, self._slots, self.device)
            return self._ring

    def close(self, *, zeroize: bool = True) -> None:
        self._pool.shutdown(wait=True)
        if zeroize and self._ring is not None:
            self._ring.zeroize()

    # ------------------------------------------------------------------ capture
    def capture(self, writer: ImageWriter, jobs: Sequence[Job], *, stage: bool) -> tuple[list[str], list[int]]:
        """Ship ``jobs``; return their chunk ids and the fingerprints of the bytes shipped, in job order."""
        ids: list[str | None] = [None] * len(jobs)
        fps: list[torch.Tensor | None] = [None] * len(jobs)
        futures: list[Future[None]] = []
        cuda = self.device.type == "cuda"
        if cuda:
            # Work queued before this round is in the bytes (the caller synchronised the device before
            # fingerprinting; those kernels, on their own stream, may still run beside the copies).
            torch.cuda.current_stream(self.device).synchronize()
        for job in jobs:
            if job.data.numel() > self.chunk_size:
                raise SnapshotError(
                    f"chunk {job.region}#{job.index} is {job.data.numel()} bytes, larger than the ring slot"
                )
        if isinstance(writer, DirectImageWriter):
            return self._capture_direct(writer, jobs, stage=stage)
        error: list[BaseException] = []

        def send(i: int, slot: int, n: int, event: torch.cuda.Event | None) -> None:
            try:
                if event is not None:
                    event.synchronize()
                if not error:
                    job = jobs[i]
                    ids[i] = writer.put_chunk(job.region, job.index, self.ring.host[slot].numpy().data[:n])
            except BaseException as exc:  # reported once, after the pool drains
                error.append(exc)
            finally:
                self.ring.free.put(slot)

        for i, job in enumerate(jobs):
            if error:
                break
            n = job.data.numel()
            # Every chunk in flight holds a slot: this paces the device→host copies to the hashing
            # workers instead of letting the DMA race ahead and fight them for host memory bandwidth.
            slot = self.ring.free.get()
            host = self.ring.host[slot][:n]
            event = None
            if cuda and job.data.is_cuda:
                stream = self.streams[i % len(self.streams)]
                with torch.cuda.stream(stream):
                    src = job.data
                    if stage:
                        staged = self.ring.stage[slot][:n]
                        staged.copy_(src, non_blocking=True)
                        fps[i] = fingerprint_chunks(staged, self.chunk_size, fused=False)
                        src = staged
                    host.copy_(src, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
            else:
                host.copy_(job.data)
                fps[i] = fingerprint_chunks(host, self.chunk_size) if stage else None
            futures.append(self._pool.submit(send, i, slot, n, event))
        for f in futures:
            f.result()
        if error:
            raise error[0]
        return [i for i in ids if i is not None], _to_host(fps) if stage else []

    def _capture_direct(
        self, writer: DirectImageWriter, jobs: Sequence[Job], *, stage: bool
    ) -> tuple[list[str], list[int]]:
        """Hand the chunks to the writer as tensors. Frozen bytes go as they are; live ones are staged
        first (a device copy, or a host ring slot) and fingerprinted there, one batch of staging slots
        at a time: on a GPU the next batch's staging copies are queued on the same stream after the
        writer's reads (its contract), on the host they wait for the batch's chunks to be stored."""
        if not stage:
            chunks = [TensorChunk(job.region, job.index, job.data) for job in jobs]
            return [f.result() for f in writer.put_tensors(chunks)], []
        cuda = self.device.type == "cuda"
        slots = self.ring.stage if cuda else self.ring.host
        stream = self.streams[0] if cuda else None
        rt = cudacalls.runtime() if cuda else None
        futures: list[Future[str]] = []
        fps: list[Fingerprints] = []  # one set per batch, in job order
        # This thread sets a live round's pace (it queues every device step); its stages, wall and CPU time apart,
        # say whether it works or waits (GPUMIGRATE_STAGES_LOG, bench/e2e.py).
        t = both_now()
        for start in range(0, len(jobs), len(slots)):
            batch: list[TensorChunk] = []
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for slot, job in zip(slots, jobs[start : start + len(slots)], strict=False):
                    staged = slot[: job.data.numel()]
                    if rt is not None and stream is not None and job.data.is_contiguous():
                        # a raw copy keeps the GIL: torch's copy_ let it go and queued to get it back behind the
                        # writer's threads, a large share of a live round (bench/live_round.py, bench/README.md)
                        n = job.data.numel()
                        cudacalls.copy(
                            rt, self.device.index or 0, staged.data_ptr(), job.data.data_ptr(), n, stream.cuda_stream
                        )
                    else:
                        staged.copy_(job.data, non_blocking=cuda)
                    batch.append(TensorChunk(job.region, job.index, staged))
                t = STAGES.add_both("capture.submit.stage", t)
                # The batch's fingerprints in two gathered launches (whole chunks, short ones), queued before the
                # writer's reads and the next batch's copies: per chunk, the eager sum's launches and the GIL
                # crossings of each torch call held the one submitting thread for most of a round (bench/live_round.py).
                fps.append(Fingerprints({str(k): c.data for k, c in enumerate(batch)}, self.chunk_size))
                t = STAGES.add_both("capture.submit.fingerprint", t)
                placed = writer.put_tensors(batch)
                t = STAGES.add_both("capture.submit.put", t)
            if not cuda:
                for f in placed:
                    f.result()
            futures.extend(placed)
        ids = [f.result() for f in futures]
        t = STAGES.add_both("capture.submit.ids_wait", t)
        prints: list[int] = []
        for host in fingerprints_to_host(fps):
            prints.extend(v for k in range(len(host)) for v in host[str(k)])
        STAGES.add_both("capture.submit.fingerprints_to_host", t)
        return ids, prints

    # ------------------------------------------------------------------ restore
    def read_into(self, reader: ImageReader, jobs: Sequence[Job]) -> int:
        """Fill each job's destination bytes from the image; return the bytes loaded."""
        if reads_directly(reader):
            return reader.read_tensors([TensorChunk(job.region, job.index, job.data) for job in jobs])
        streams = self.streams

        def load(i: int, job: Job) -> int:
            n = job.data.numel()
            if not job.data.is_cuda:
                # CPU destination: read straight into the tensor's memory.
                got = reader.read_chunk_into(job.region, job.index, job.data.numpy().data)
                _check_len(job, got, n)
                return got
            slot = self.ring.free.get()
            try:
                got = reader.read_chunk_into(job.region, job.index, self.ring.host[slot].numpy().data[:n])
                _check_len(job, got, n)
                stream = streams[i % len(streams)]
                with torch.cuda.stream(stream):
                    job.data.copy_(self.ring.host[slot][:n], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                event.synchronize()
                return got
            finally:
                self.ring.free.put(slot)

        total = 0
        for f in [self._pool.submit(load, i, job) for i, job in enumerate(jobs)]:
            total += f.result()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return total


def _check_len(job: Job, got: int, want: int) -> None:
    if got != want:
        raise SnapshotError(f"image chunk {job.region}#{job.index} holds {got} bytes; the destination needs {want}")


def _to_host(fps: Sequence[torch.Tensor | None]) -> list[int]:
    """Fingerprints to Python ints with one device→host copy per device (not one sync per chunk)."""
    out = [0] * len(fps)
    by_device: dict[str, list[int]] = {}
    for i, f in enumerate(fps):
        if f is not None:
            by_device.setdefault(str(f.device), []).append(i)
    for idx in by_device.values():
        values = torch.cat([fps[i] for i in idx]).cpu().tolist()  # type: ignore[misc]
        for i, v in zip(idx, values, strict=True):
            out[i] = int(v)
    return out

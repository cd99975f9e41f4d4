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

Zero-copy: a writer with ``reserve``/``put_reserved`` receives the device→host copy straight into
its own (pinned) memory, and a reader with ``chunk_tensor``/``verify_chunk`` lets the host→device copy
start from its memory while the chunk's BLAKE3 is checked (PROTOCOL.md, "Optional zero-copy
methods"). Every chunk in flight still holds a ring slot, which paces the DMA to the hash workers.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from gpumigrate.errors import IntegrityError, SnapshotError
from gpumigrate.interfaces import ImageReader, ImageWriter
from gpumigrate.snapshot import devhash
from gpumigrate.snapshot.chunks import fingerprint_chunks

DEVICE_HASH_BATCH = 64  # chunks per device hash launch: few launches, and the hash trails the DMA closely


@dataclass
class Job:
    region: str
    index: int
    data: torch.Tensor  # flat uint8 view of the chunk's bytes, on the source device (capture) or destination


class Ring:
    """Fixed set of host slots (pinned when a GPU is involved) plus device staging slots, handed out in turn."""

    def __init__(self, chunk_size: int, slots: int, device: torch.device) -> None:
        self.chunk_size = chunk_size
        self.device = device
        cuda = device.type == "cuda"
        self.host = [torch.empty(chunk_size, dtype=torch.uint8, pin_memory=cuda) for _ in range(slots)]
        self.stage = [torch.empty(chunk_size, dtype=torch.uint8, device=device) for _ in range(slots)] if cuda else []
        self.free: queue.Queue[int] = queue.Queue()
        for i in range(slots):
            self.free.put(i)

    def zeroize(self) -> None:
        """Ring slots held copies of workload memory: wipe them before they are freed."""
        for t in self.host + self.stage:
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
        if devhash.available(device):
            devhash.warm(device)

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
        """Ship ``jobs``; return their chunk ids and the fingerprints of the bytes shipped, in job order.

        A writer with direct placement (``reserve(region, index, n) -> host tensor | None`` and
        ``put_reserved(region, index) -> chunk id``, e.g. an in-memory sink with a pinned arena) gets
        the device→host copy straight into its own memory: no ring slot, no extra host copy.
        """
        ids: list[str | None] = [None] * len(jobs)
        fps: list[torch.Tensor | None] = [None] * len(jobs)
        futures: list[Future[None]] = []
        cuda = self.device.type == "cuda"
        direct = hasattr(writer, "reserve") and hasattr(writer, "put_reserved")
        if cuda:
            # Work queued before this round is in the bytes (the caller synchronised the device before
            # fingerprinting; those kernels, on their own stream, may still run beside the copies).
            torch.cuda.current_stream(self.device).synchronize()
        error: list[BaseException] = []
        if direct and cuda and not stage and hasattr(writer, "put_reserved_hashed") and devhash.available(self.device):
            return self._capture_frozen_hashed_on_device(writer, jobs), []

        def send(i: int, slot: int, n: int, event: torch.cuda.Event | None, reserved: bool) -> None:
            try:
                if event is not None:
                    event.synchronize()
                if not error:
                    job = jobs[i]
                    if reserved:
                        ids[i] = writer.put_reserved(job.region, job.index)  # type: ignore[attr-defined]
                    else:
                        ids[i] = writer.put_chunk(job.region, job.index, memoryview(self.ring.host[slot].numpy())[:n])
            except BaseException as exc:  # reported once, after the pool drains
                error.append(exc)
            finally:
                self.ring.free.put(slot)

        for i, job in enumerate(jobs):
            if error:
                break
            n = job.data.numel()
            if n > self.chunk_size:
                raise SnapshotError(f"chunk {job.region}#{job.index} is {n} bytes, larger than the ring slot")
            host = writer.reserve(job.region, job.index, n) if direct else None  # type: ignore[attr-defined]
            reserved = host is not None
            on_gpu = cuda and job.data.is_cuda
            # Every chunk in flight holds a slot (for the ring copy, the staging copy, or just as a token):
            # this paces the device→host copies to the hashing workers instead of letting the DMA race
            # ahead and fight them for host memory bandwidth.
            slot = self.ring.free.get()
            if host is None:
                host = self.ring.host[slot][:n]
            event = None
            if on_gpu:
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
            futures.append(self._pool.submit(send, i, slot, n, event, reserved))
        for f in futures:
            f.result()
        if error:
            raise error[0]
        return [i for i in ids if i is not None], _to_host(fps) if stage else []

    def _capture_frozen_hashed_on_device(self, writer: ImageWriter, jobs: Sequence[Job]) -> list[str]:
        """Frozen bytes cannot change between a hash and a copy, so the ids come from the GPU (on a
        side stream, beside the copies) and the CPU has no per-chunk work left: the copies go
        straight from the main thread into the writer's reserved memory, unpaced by any ring."""
        ids: list[str] = [""] * len(jobs)
        placed: list[tuple[int, torch.cuda.Event]] = []
        for i, job in enumerate(jobs):
            n = job.data.numel()
            if n > self.chunk_size:
                raise SnapshotError(f"chunk {job.region}#{job.index} is {n} bytes, larger than the ring slot")
            host = writer.reserve(job.region, job.index, n)  # type: ignore[attr-defined]
            if host is None:  # the writer's memory is full: this chunk goes the plain way
                ids[i] = writer.put_chunk(job.region, job.index, memoryview(job.data.cpu().numpy()))
                continue
            stream = self.streams[i % len(self.streams)]
            with torch.cuda.stream(stream):
                host.copy_(job.data, non_blocking=True)
                landed = torch.cuda.Event()
                landed.record(stream)
            placed.append((i, landed))
        # Queued after the copies so that they start at once; the kernels still finish long before
        # the copies do (HBM-bound hashing at hundreds of GB/s against PCIe's ~55). Each chunk is then
        # recorded as soon as its own copy has landed, so the bookkeeping overlaps the later copies.
        device_ids = _DeviceIds(self.device, jobs)
        for i, landed in placed:
            job, known = jobs[i], device_ids.get(i)
            landed.synchronize()
            if known is not None:
                ids[i] = writer.put_reserved_hashed(job.region, job.index, known)  # type: ignore[attr-defined]
            else:  # a length the kernels do not take: hashed on the CPU
                ids[i] = writer.put_reserved(job.region, job.index)  # type: ignore[attr-defined]
        return ids

    # ------------------------------------------------------------------ restore
    def restore(self, reader: ImageReader, jobs: Sequence[Job]) -> int:
        """Fill each job's destination bytes from the image; return the bytes loaded."""
        streams = self.streams

        direct = hasattr(reader, "chunk_tensor")
        if direct and hasattr(reader, "chunk_id") and devhash.available(self.device):
            return self._restore_verified_on_device(reader, jobs)

        def load(i: int, job: Job) -> int:
            n = job.data.numel()
            if direct:
                # The reader holds the plaintext in (pinned) host memory: start the host→device copy,
                # verify the chunk's BLAKE3 while the DMA runs, and fail the restore if it does not match
                # (the target is not ready then, so unverified bytes are never served).
                split = hasattr(reader, "verify_chunk")
                src = reader.chunk_tensor(job.region, job.index, verified=not split)  # type: ignore[attr-defined]
                _check_len(job, src.numel(), n)
                if not job.data.is_cuda:
                    if split:
                        reader.verify_chunk(job.region, job.index)  # type: ignore[attr-defined]
                    job.data.copy_(src)
                    return n
                stream = streams[i % len(streams)]
                with torch.cuda.stream(stream):
                    job.data.copy_(src, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                try:
                    if split:
                        reader.verify_chunk(job.region, job.index)  # type: ignore[attr-defined]
                finally:
                    event.synchronize()
                return n
            if not job.data.is_cuda:
                # CPU destination: read straight into the tensor's memory.
                got = reader.read_chunk_into(job.region, job.index, memoryview(job.data.numpy()))
                _check_len(job, got, n)
                return got
            slot = self.ring.free.get()
            try:
                got = reader.read_chunk_into(job.region, job.index, memoryview(self.ring.host[slot].numpy())[:n])
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

    def _restore_verified_on_device(self, reader: ImageReader, jobs: Sequence[Job]) -> int:
        """Host→device copies from the reader's pinned memory, each chunk's BLAKE3 then computed on
        the GPU from the bytes that landed (a hash stream trails the copy streams batch by batch)
        and compared with its id. The CPU hashes only what the kernels do not take (odd lengths).
        A mismatch fails the restore; the target is not ready then, so unverified bytes never serve.
        """
        device = self.device
        hash_stream = torch.cuda.Stream(device=device)
        for stream in self.streams:  # whatever the caller queued on the destinations lands first
            stream.wait_stream(torch.cuda.current_stream(device))
        batches: list[tuple[torch.Tensor, list[Job], list[str]]] = []
        cpu_checks: list[Future[None]] = []
        batch: dict[int, tuple[list[torch.Tensor], list[Job], list[str]]] = {}  # chunk length -> pending

        def flush(size: int) -> None:
            views, owners, ids = batch.pop(size)
            for stream in self.streams:  # the batch's copies are queued on these streams before now
                event = torch.cuda.Event()
                event.record(stream)
                hash_stream.wait_event(event)
            with torch.cuda.stream(hash_stream):
                batches.append((devhash.blake3_device(views), owners, ids))

        total = 0
        for i, job in enumerate(jobs):
            n = job.data.numel()
            src = reader.chunk_tensor(job.region, job.index, verified=False)  # type: ignore[attr-defined]
            _check_len(job, src.numel(), n)
            expected = reader.chunk_id(job.region, job.index)  # type: ignore[attr-defined]
            if not job.data.is_cuda:
                if expected is not None:
                    reader.verify_chunk(job.region, job.index)  # type: ignore[attr-defined]
                job.data.copy_(src)
            else:
                with torch.cuda.stream(self.streams[i % len(self.streams)]):
                    job.data.copy_(src, non_blocking=True)
                if expected is not None and devhash.eligible(job.data):
                    views, owners, ids = batch.setdefault(n, ([], [], []))
                    views.append(job.data)
                    owners.append(job)
                    ids.append(expected)
                    if len(views) >= DEVICE_HASH_BATCH:
                        flush(n)
                elif expected is not None:
                    cpu_checks.append(self._pool.submit(reader.verify_chunk, job.region, job.index))  # type: ignore[attr-defined]
            total += n
        for size in list(batch):
            flush(size)
        for f in cpu_checks:
            f.result()
        torch.cuda.synchronize(device)
        for words, owners, ids in batches:
            for job, got, want in zip(owners, words.cpu().tolist(), ids, strict=True):
                if devhash.words_hex(got) != want:
                    raise IntegrityError(
                        f"chunk {job.index} of {job.region}: BLAKE3 digest does not match its id (corrupted)"
                    )
        return total


class _DeviceIds:
    """BLAKE3 ids of the jobs' device bytes, hashed in batches on a side stream and brought to
    pinned host memory; ``get(i)`` waits only for the batch holding job ``i``."""

    def __init__(self, device: torch.device, jobs: Sequence[Job]) -> None:
        self._where: dict[int, tuple[int, int]] = {}  # job -> (batch, row)
        self._batches: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._hex: dict[int, list[str]] = {}  # batch -> its ids, converted once
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        groups: dict[int, list[int]] = {}
        for i, job in enumerate(jobs):
            if job.data.is_cuda and devhash.eligible(job.data):
                groups.setdefault(job.data.numel(), []).append(i)
        with torch.cuda.stream(stream):
            for members in groups.values():
                for start in range(0, len(members), DEVICE_HASH_BATCH):
                    part = members[start : start + DEVICE_HASH_BATCH]
                    words = devhash.blake3_device([jobs[i].data for i in part])
                    host = torch.empty(words.shape, dtype=words.dtype, pin_memory=True)
                    host.copy_(words, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(stream)
                    for row, i in enumerate(part):
                        self._where[i] = (len(self._batches), row)
                    self._batches.append((host, done))

    def get(self, i: int) -> str | None:
        where = self._where.get(i)
        if where is None:
            return None
        batch, row = where
        if batch not in self._hex:
            host, done = self._batches[batch]
            done.synchronize()
            self._hex[batch] = [devhash.words_hex(words) for words in host.tolist()]
        return self._hex[batch][row]


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

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
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from gpumigrate.errors import SnapshotError
from gpumigrate.interfaces import ImageReader, ImageWriter
from gpumigrate.snapshot.chunks import fingerprint_chunks


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

    def __init__(self, device: torch.device, chunk_size: int, *, slots: int = 8, streams: int = 2, workers: int = 4) -> None:
        self.device = device
        self.chunk_size = chunk_size
        self.workers = max(1, workers)
        self.ring = Ring(chunk_size, max(slots, self.workers + streams), device)
        self.streams = _cuda_streams(device, max(2, streams)) if device.type == "cuda" else []
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="gm-snap")

    def close(self, *, zeroize: bool = True) -> None:
        self._pool.shutdown(wait=True)
        if zeroize:
            self.ring.zeroize()

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
            torch.cuda.synchronize(self.device)  # work the workload queued before this round is in the bytes
        error: list[BaseException] = []

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

    # ------------------------------------------------------------------ restore
    def restore(self, reader: ImageReader, jobs: Sequence[Job]) -> int:
        """Fill each job's destination bytes from the image; return the bytes loaded."""
        streams = self.streams

        direct = hasattr(reader, "chunk_tensor")

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

"""The direct writer: a :class:`StoreImageWriter` that also takes chunks as tensors (``direct.py`` says how).

Device chunks get their ids from the BLAKE3 kernels (:class:`~.direct.DeviceIds`), are coded on the device where
that pays (``device/gpucodec.py``, ``device/gpupayload.py``), and cross into a pinned slot once, at the offset
where their payload belongs in the sealed object; a worker thread then seals and stores each in place.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from gpumigrate import cudacalls
from gpumigrate.errors import InvalidInputError, TransferError
from gpumigrate.interfaces import ChunkRun, TensorChunk
from gpumigrate.stageclock import STAGES, log_stages
from gpumigrate.transfer import confirm
from gpumigrate.transfer.buffers import PinnedSlots
from gpumigrate.transfer.device import gpucodec, gpupayload
from gpumigrate.transfer.direct import (
    OBJECT_AT,
    PAYLOAD_AT,
    SLOTS,
    STREAMS,
    WORKERS,
    DeviceIds,
    pool,
    slots_for,
    wait_for,
)
from gpumigrate.transfer.format import codecs
from gpumigrate.transfer.format.chunkobj import chunk_id_of, sealed_size
from gpumigrate.transfer.writer import BUFFERS, StoreImageWriter

if TYPE_CHECKING:
    import torch

    from gpumigrate.interfaces import ImageRef
    from gpumigrate.transfer.direct import Landed

CODE_BATCH = 16  # chunks per nvCOMP batch: one wait for their coded sizes, and a bounded amount of planes in flight
# A chunk coded on the device: its low plane (None for a one-plane payload), its coded plane, and the event after
# which both may be copied out.
Coded = tuple["gpucodec.DeviceBytes | None", "gpucodec.DeviceBytes", "Landed"]


class DirectStoreImageWriter(StoreImageWriter):
    """A :class:`StoreImageWriter` that also takes chunks as tensors (see the module docstring)."""

    def _opened(self) -> None:
        # Every sealing thread holds an encode buffer at a time: keep that many idle between chunks, or
        # each chunk maps (and faults in) a fresh one; 16 threads then contend for the address space.
        need = (WORKERS + 4) * sealed_size(codecs.scratch_size(self.chunk_size), True)
        BUFFERS.max_idle_bytes = max(BUFFERS.max_idle_bytes, need)
        self._queued: list[Future[str]] = []
        # Chunks between coding and host memory: each holds a pinned slot (or will), and a coded one its planes on
        # the device. Bounding them paces the coding to the workers and caps the device memory in flight.
        self._in_flight = threading.Semaphore(SLOTS)

    def put_tensors(self, chunks: Sequence[TensorChunk]) -> list[Future[str]]:
        self._check_open()
        futures: list[Future[str] | None] = [None] * len(chunks)
        by_device: dict[str, list[int]] = {}
        workers = pool(self.parallelism)
        for i, chunk in enumerate(chunks):
            self.contents.region(chunk.region)  # unknown regions fail here, not in a worker
            if chunk.data.is_cuda:
                by_device.setdefault(str(chunk.data.device), []).append(i)
            else:
                futures[i] = workers.submit(self._put_host, chunk)  # put_chunk passes the limiter
        for members in by_device.values():
            # the round's pace (rate_limit, pacing): before any device work of these chunks is queued
            self._limiter.take(sum(chunks[i].data.numel() for i in members))
            self._put_device([chunks[i] for i in members], futures, members)
        queued = [f for f in futures if f is not None]
        assert len(queued) == len(chunks)  # every chunk was queued, on the host or on its device
        with self._lock:
            self._queued.extend(queued)
        return queued

    def commit(self) -> ImageRef:
        """As the plain writer's, once every queued chunk is stored; a chunk that failed fails the commit."""
        with self._lock:
            queued, self._queued = self._queued, []
        failed = [exc for exc in (f.exception() for f in queued) if exc is not None]
        if failed:
            self.abort()
            raise TransferError(f"storing chunks in {self.store.url} failed: {failed[0]}") from failed[0]
        log_stages("capture")
        return super().commit()

    def confirm_chunks(self, runs: Sequence[ChunkRun], *, background: bool = False) -> Callable[[], list[list[bool]]]:
        """Device chunks by the BLAKE3 kernels from byte offsets, on one of this writer's threads (``confirm.py``)."""
        return confirm.start(runs, self.chunk_size, pool(self.parallelism), background=background)

    def _put_host(self, chunk: TensorChunk) -> str:
        return self.put_chunk(chunk.region, chunk.index, memoryview(chunk.data.numpy()))

    def _gpu_coded(self, chunk: TensorChunk) -> int:
        """The ``k`` of the GPU payload this chunk gets (``gpupayload.py``): 2 for bf16/fp16 planes, 1 for a chunk of
        another dtype coded whole (compression ``auto`` only); 0 where it is not coded on the device."""
        from gpumigrate.transfer.device import devhash  # imports torch: only where device chunks are

        if not (devhash.eligible(chunk.data) and gpucodec.enabled()):  # a coded chunk's plaintext never reaches
            return 0  # the host to hash
        k = codecs.float_itemsize(self.contents.region(chunk.region).info.dtype)
        if k is None:
            return 1 if self.compression == "auto" else 0
        planar = self.compression in ("auto", "byteplane") and k in gpucodec.GPU_ELEMENT_SIZES
        return 2 if planar and chunk.data.numel() % 2 == 0 else 0

    def _put_device(self, chunks: Sequence[TensorChunk], futures: list[Future[str] | None], members: list[int]) -> None:
        import torch

        device = chunks[0].data.device
        current = torch.cuda.current_stream(device)
        ids = DeviceIds([c.data for c in chunks], current)
        coder = STREAMS.get(device, "code") if any(self._gpu_coded(c) for c in chunks) else None
        if coder is not None:
            coder.wait_stream(current)
        slots = slots_for(self.chunk_size, SLOTS)
        for first in range(0, len(chunks), CODE_BATCH):
            group = range(first, min(first + CODE_BATCH, len(chunks)))
            for k in group:
                if chunks[k].data.numel() > self.chunk_size:
                    c = chunks[k]
                    raise InvalidInputError(
                        f"chunk {c.region}#{c.index} is {c.data.numel()} bytes, more than the chunk size"
                    )
            t = time.perf_counter()
            for _ in group:
                self._in_flight.acquire()  # released by the worker once the chunk's bytes are stored
            t = STAGES.add("capture.main.slot_wait", t)
            coded = self._code_on_device(chunks, group, coder, current) if coder is not None else {}
            STAGES.add("capture.main.gpu_encode", t)
            for k in group:
                self._queue_device(chunks[k], slots, coded.get(k), current, ids, k, futures, members)
        current.wait_stream(ids.stream)  # the caller's later writes come after the hash reads
        if coder is not None:
            current.wait_stream(coder)

    def _code_on_device(
        self, chunks: Sequence[TensorChunk], group: range, coder: torch.cuda.Stream, current: torch.cuda.Stream
    ) -> dict[int, Coded]:
        """The group's coded chunks in one nvCOMP batch: bf16/fp16 chunks split into byte planes (one launch) and
        their exponent planes ANS-coded, chunks of other dtypes ANS-coded whole. Only chunks that come out
        smaller than raw are kept (their coded bytes live until the copies that read them). No torch call per
        chunk: each one queued behind the sealing threads for the GIL."""
        kinds = {k: self._gpu_coded(chunks[k]) for k in group}
        planar = [k for k in group if kinds[k] == 2]
        whole = [k for k in group if kinds[k] == 1]
        if not planar and not whole:
            return {}
        split = gpucodec.PlaneSplit([chunks[k].data for k in planar], coder) if planar else None
        inputs = [split.high(i) for i in range(len(planar))] if split is not None else []
        inputs += [gpucodec.DeviceBytes(chunks[k].data.data_ptr(), chunks[k].data.numel()) for k in whole]
        his = gpucodec.encode_planes(inputs, coder)
        event = cudacalls.recorded(coder.device, coder)
        wait_for(event, current)
        out: dict[int, Coded] = {}
        for i, (k, hi) in enumerate(zip(planar + whole, his, strict=True)):
            n = chunks[k].data.numel()
            if gpupayload.coded_length(kinds[k], n, hi.nbytes) < n:
                # the worker copies the planes out after ``event``, holding them till then
                out[k] = (split.low(i) if kinds[k] == 2 and split is not None else None, hi, event)
        return out

    def _queue_device(
        self,
        chunk: TensorChunk,
        slots: PinnedSlots,
        coded: Coded | None,
        current: torch.cuda.Stream,
        ids: DeviceIds,
        k: int,
        futures: list[Future[str] | None],
        members: list[int],
    ) -> None:
        """Hand one chunk to a worker: a coded one as it is (the worker copies its planes out, on a stream of its
        own: this thread then only codes and submits), raw bytes copied into a pinned slot on ``current`` first
        (they are the caller's memory, which the caller may change once its stream moves on)."""
        import torch

        t = time.perf_counter()
        if coded is not None:
            futures[members[k]] = pool(self.parallelism).submit(self._finish_coded, chunk, slots, ids, k, coded)
            STAGES.add("capture.main.queue", t)
            return
        n = chunk.data.numel()
        slot = slots.take()
        t = STAGES.add("capture.main.slot_wait", t)
        rt = cudacalls.runtime()
        if rt is not None and chunk.data.is_contiguous():
            device = chunk.data.device.index or 0
            cudacalls.copy(rt, device, slots.address(slot) + PAYLOAD_AT, chunk.data.data_ptr(), n, current.cuda_stream)
            landed: Landed = cudacalls.Event(rt, device).record(current.cuda_stream)
        else:
            with torch.cuda.stream(current):
                slots.tensor(slot, PAYLOAD_AT, PAYLOAD_AT + n).copy_(chunk.data, non_blocking=True)
                landed = torch.cuda.Event()
                landed.record(current)
        futures[members[k]] = pool(self.parallelism).submit(
            self._finish_device, chunk, slots, slot, landed, ids, k, n, None
        )
        STAGES.add("capture.main.queue", t)

    def _finish_coded(self, chunk: TensorChunk, slots: PinnedSlots, ids: DeviceIds, k: int, coded: Coded) -> str:
        """A coded chunk's planes into a pinned slot, in the layout of a byte-plane payload, then stored."""
        import torch

        low, hi, ready = coded
        n = chunk.data.numel()
        t = time.perf_counter()
        slot = -1
        try:
            slot = slots.take()
            t = STAGES.add("capture.worker.slot_wait", t)
            stream = STREAMS.get(chunk.data.device, "copy")
            wait_for(ready, stream)
            view = slots.view(slot)
            planes = 2 if low is not None else 1
            at = gpupayload.write_header(view, PAYLOAD_AT, planes, n, hi.nbytes)
            parts = [(at, low), (at + n // 2, hi)] if low is not None else [(at, hi)]
            rt = cudacalls.runtime()
            if rt is not None:
                device, raw, base = chunk.data.device.index or 0, stream.cuda_stream, slots.address(slot)
                for place, part in parts:
                    cudacalls.copy(rt, device, base + place, part.ptr, part.nbytes, raw)
                landed: Landed = cudacalls.Event(rt, device).record(raw)
            else:
                with torch.cuda.stream(stream):
                    for place, part in parts:
                        source = torch.as_tensor(part, device=chunk.data.device)
                        slots.tensor(slot, place, place + part.nbytes).copy_(source, non_blocking=True)
                    landed = torch.cuda.Event()
                    landed.record(stream)
        except BaseException:
            if slot >= 0:
                slots.give(slot)
            self._in_flight.release()
            raise
        STAGES.add("capture.worker.copy_queue", t)
        length = gpupayload.coded_length(planes, n, hi.nbytes)
        return self._finish_device(chunk, slots, slot, landed, ids, k, length, coded)

    def _finish_device(
        self,
        chunk: TensorChunk,
        slots: PinnedSlots,
        slot: int,
        landed: Landed,
        ids: DeviceIds,
        k: int,
        length: int,
        coded: Coded | None,
    ) -> str:
        try:
            t = time.perf_counter()
            landed.synchronize()
            t = STAGES.add("capture.worker.copy_wait", t)
            n = chunk.data.numel()
            view = slots.view(slot)
            chunk_id = ids.get(k) or chunk_id_of(view[PAYLOAD_AT : PAYLOAD_AT + n])  # odd lengths: on the CPU
            t = STAGES.add("capture.worker.id_wait", t)
            reg = self.contents.region(chunk.region)
            if self.contents.claim(reg, chunk.index, chunk_id, n):
                if coded is not None:
                    with self._lock:
                        self.decoders.add(gpucodec.DECODER)
                    self._store_sealed(chunk_id, codecs.BYTEPLANE, n, view[OBJECT_AT:], length)
                    STAGES.add("capture.worker.seal_store", t)
                else:  # raw bytes in pinned memory: the CPU codec reads them there
                    self._send(reg, chunk.index, chunk_id, view[PAYLOAD_AT : PAYLOAD_AT + n])
                    STAGES.add("capture.worker.cpu_codec_seal_store", t)
            self._progress.add(n)
            return chunk_id
        finally:
            slots.give(slot)
            self._in_flight.release()

"""Direct placement: chunks move between the tensor where they live and the store with no caller copy.

Capture (:class:`DirectStoreImageWriter`, the :class:`~gpumigrate.interfaces.DirectImageWriter`):

* device chunks get their ids from the BLAKE3 kernels (``devhash``), batched on a hash stream that
  trails the caller's stream, so the CPU hashes nothing;
* bf16/fp16 chunks are split into byte planes on the device and the exponent plane is coded there
  (``gpucodec``, plane codec 3) when nvCOMP is present, so about 0.68 of the bytes cross PCIe; chunks of
  other dtypes are coded whole by the same coder and kept coded where that is smaller (``gpupayload``);
* each chunk (coded payload or raw bytes) is copied once, into a page-locked slot, at the offset where
  its payload belongs in the sealed object; a worker thread per core then seals it in place (AES-GCM
  releases the GIL) or, for raw bytes, encodes it with the CPU codec first, and stores it.

Restore (:class:`DirectStoreImageReader`): worker threads read each object into a pinned slot,
decrypt it in place, decode on the CPU (or send the coded plane to the GPU and decode there), copy
the plaintext to its destination tensor and, once every copy landed, check every chunk's BLAKE3 on
the device against its id. Host tensors go the plain way, into their own memory, verified on the CPU.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from gpumigrate import cudacalls
from gpumigrate.errors import IntegrityError, InvalidInputError, TransferError
from gpumigrate.interfaces import ChunkRun, TensorChunk
from gpumigrate.stageclock import STAGES, log_stages
from gpumigrate.transfer import codecs, confirm, gpucodec, gpupayload
from gpumigrate.transfer.buffers import PinnedSlots, pinned_slots
from gpumigrate.transfer.chunkobj import HEADER_SIZE, TAG_SIZE, chunk_id_of, sealed_size
from gpumigrate.transfer.reader import StoreImageReader
from gpumigrate.transfer.writer import BUFFERS, StoreImageWriter

# A slot's payload starts on a page boundary (DMA-friendly); the object's header sits just before it.
PAYLOAD_AT = 4096
HASH_BATCH = 64  # chunks per device hash launch: few launches, and the hash still trails the copies closely
CODE_BATCH = 16  # chunks per nvCOMP batch: one wait for their coded sizes, and ~0.4 GiB of planes in flight
# Sealing/opening threads: one per core (GPUMIGRATE_DIRECT_WORKERS overrides it, for benchmarks comparing counts).
WORKERS = int(os.environ.get("GPUMIGRATE_DIRECT_WORKERS", "0") or 0) or max(2, os.cpu_count() or 2)
SLOTS = 2 * WORKERS + 8  # a restore holds two per chunk that the CPU decodes; a few more keep the DMA busy


def _devhash() -> Any:
    """The device BLAKE3 module (it imports torch, which the rest of the transfer engine does not need)."""
    from gpumigrate.transfer import devhash

    return devhash


def _torch() -> Any:
    import torch

    return torch


def _host_id(data: Any) -> str:
    """The chunk id of a flat uint8 tensor's bytes (copied to the host first if it lives on a device)."""
    return chunk_id_of(data.cpu().numpy().data if data.numel() else b"")


def _slots(chunk_size: int, count: int) -> PinnedSlots:
    return pinned_slots(PAYLOAD_AT + codecs.scratch_size(chunk_size) + TAG_SIZE, count)


def warm_slots(chunk_size: int) -> None:
    """Page-lock the slots a direct capture or restore of ``chunk_size`` chunks uses, now: about 0.7 GB at 16 MiB
    chunks, which took 0.6 s inside a fresh target's first restore on a GPU host (the SDK's warm-up calls this)."""
    _slots(chunk_size, SLOTS)


class _Streams:
    """Side streams per (thread, device, use): hashing, nvCOMP coding and reader copies run beside
    the caller's stream, each thread on its own (nvCOMP codecs are per thread too)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, device: Any, use: str) -> Any:
        import torch

        found = getattr(self._local, "streams", None)
        if found is None:
            found = self._local.streams = {}
        key = (str(device), use)
        stream = found.get(key)
        if stream is None:
            # The chunk ids a capture waits for go first on the device: a frozen round confirms every other chunk
            # with the same kernels on a default-priority stream meanwhile, and its workers wait for these ids.
            stream = found[key] = torch.cuda.Stream(device=device, priority=-1 if use == "hash" else 0)
        return stream


_STREAMS = _Streams()


class DeviceIds:
    """BLAKE3 ids of device views, hashed in batches on a stream that trails ``after`` and brought to
    pinned host memory; ``get(i)`` waits only for the batch holding view ``i`` (None: not eligible)."""

    def __init__(self, views: Sequence[Any], after: Any) -> None:
        import torch

        self._where: dict[int, tuple[int, int]] = {}
        self._batches: list[tuple[Any, Any]] = []
        self._hex: dict[int, list[str]] = {}
        self.stream = _STREAMS.get(after.device, "hash")
        self.stream.wait_stream(after)
        groups: dict[int, list[int]] = {}
        for i, view in enumerate(views):
            if _devhash().eligible(view):
                groups.setdefault(view.numel(), []).append(i)
        with torch.cuda.stream(self.stream):
            for members in groups.values():
                for start in range(0, len(members), HASH_BATCH):
                    part = members[start : start + HASH_BATCH]
                    words = _devhash().blake3_device([views[i] for i in part])
                    host = torch.empty(words.shape, dtype=words.dtype, pin_memory=True)
                    host.copy_(words, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(self.stream)
                    for row, i in enumerate(part):
                        self._where[i] = (len(self._batches), row)
                    self._batches.append((host, done))
        self._lock = threading.Lock()

    def get(self, i: int) -> str | None:
        where = self._where.get(i)
        if where is None:
            return None
        batch, row = where
        with self._lock:
            if batch not in self._hex:
                host, done = self._batches[batch]
                done.synchronize()
                self._hex[batch] = [_devhash().words_hex(w) for w in host.tolist()]
            return self._hex[batch][row]


def _wait(event: Any, stream: Any) -> None:
    """Order ``stream`` (a torch stream) after ``event`` (a ``cudacalls.Event`` or a torch event)."""
    if isinstance(event, cudacalls.Event):
        event.wait_on(stream.cuda_stream)
    else:
        stream.wait_event(event)


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The process's sealing/opening threads, one per core, shared by every direct writer and reader
    (an agent opens a new writer or reader every round: a pool each would leave threads behind)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="gm-direct")
        return _POOL


class DirectStoreImageWriter(StoreImageWriter):
    """A :class:`StoreImageWriter` that also takes chunks as tensors (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
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
        for i, chunk in enumerate(chunks):
            self._region(chunk.region)  # unknown regions fail here, not in a worker
            if chunk.data.is_cuda:
                by_device.setdefault(str(chunk.data.device), []).append(i)
            else:
                futures[i] = _pool().submit(self._put_host, chunk)
        for members in by_device.values():
            self._put_device([chunks[i] for i in members], [futures, members])
        with self._lock:
            self._queued.extend(f for f in futures if f is not None)
        return futures  # type: ignore[return-value]

    def commit(self) -> Any:
        """As the plain writer's, once every queued chunk is stored; a chunk that failed fails the commit."""
        with self._lock:
            queued, self._queued = self._queued, []
        failed = [exc for exc in (f.exception() for f in queued) if exc is not None]
        if failed:
            self.abort()
            raise TransferError(f"storing chunks in {self.store.url} failed: {failed[0]}") from failed[0]
        log_stages("capture")
        return super().commit()

    def confirm_chunks(self, runs: Sequence[ChunkRun]) -> Callable[[], list[list[bool]]]:
        """Device chunks by the BLAKE3 kernels from byte offsets, on one of this writer's threads (``confirm.py``)."""
        return confirm.start(runs, self.chunk_size, _pool())

    def _put_host(self, chunk: TensorChunk) -> str:
        return self.put_chunk(chunk.region, chunk.index, memoryview(chunk.data.numpy()))

    def _gpu_coded(self, chunk: TensorChunk) -> int:
        """The ``k`` of the GPU payload this chunk gets (``gpupayload.py``): 2 for bf16/fp16 planes, 1 for a chunk of
        another dtype coded whole (compression ``auto`` only); 0 where it is not coded on the device."""
        if not (_devhash().eligible(chunk.data) and gpucodec.enabled()):  # a coded chunk's plaintext never reaches
            return 0  # the host to hash
        k = codecs.float_itemsize(self._region(chunk.region).info.dtype)
        if k is None:
            return 1 if self.compression == "auto" else 0
        planar = self.compression in ("auto", "byteplane") and k in gpucodec.GPU_ELEMENT_SIZES
        return 2 if planar and chunk.data.numel() % 2 == 0 else 0

    def _put_device(self, chunks: Sequence[TensorChunk], out: list[Any]) -> None:
        import torch

        futures, members = out
        device = chunks[0].data.device
        current = torch.cuda.current_stream(device)
        ids = DeviceIds([c.data for c in chunks], current)
        coder = _STREAMS.get(device, "code") if any(self._gpu_coded(c) for c in chunks) else None
        if coder is not None:
            coder.wait_stream(current)
        slots = _slots(self.chunk_size, SLOTS)
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

    def _code_on_device(self, chunks: Sequence[TensorChunk], group: range, coder: Any, current: Any) -> dict[int, Any]:
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
        _wait(event, current)
        out: dict[int, Any] = {}
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
        coded: Any,
        current: Any,
        ids: DeviceIds,
        k: int,
        futures: list[Any],
        members: list[int],
    ) -> None:
        """Hand one chunk to a worker: a coded one as it is (the worker copies its planes out, on a stream of its
        own: this thread then only codes and submits), raw bytes copied into a pinned slot on ``current`` first
        (they are the caller's memory, which the caller may change once its stream moves on)."""
        import torch

        t = time.perf_counter()
        if coded is not None:
            futures[members[k]] = _pool().submit(self._finish_coded, chunk, slots, ids, k, coded)
            STAGES.add("capture.main.queue", t)
            return
        n = chunk.data.numel()
        slot = slots.take()
        t = STAGES.add("capture.main.slot_wait", t)
        rt = cudacalls.runtime()
        if rt is not None and chunk.data.is_contiguous():
            device = chunk.data.device.index or 0
            cudacalls.copy(rt, device, slots.address(slot) + PAYLOAD_AT, chunk.data.data_ptr(), n, current.cuda_stream)
            landed: Any = cudacalls.Event(rt, device).record(current.cuda_stream)
        else:
            with torch.cuda.stream(current):
                slots.tensor(slot, PAYLOAD_AT, PAYLOAD_AT + n).copy_(chunk.data, non_blocking=True)
                landed = torch.cuda.Event()
                landed.record(current)
        futures[members[k]] = _pool().submit(self._finish_device, chunk, slots, slot, landed, ids, k, n, None)
        STAGES.add("capture.main.queue", t)

    def _finish_coded(self, chunk: TensorChunk, slots: PinnedSlots, ids: DeviceIds, k: int, coded: Any) -> str:
        """A coded chunk's planes into a pinned slot, in the layout of a byte-plane payload, then stored."""
        import torch

        low, hi, ready = coded
        n = chunk.data.numel()
        t = time.perf_counter()
        slot = -1
        try:
            slot = slots.take()
            t = STAGES.add("capture.worker.slot_wait", t)
            stream = _STREAMS.get(chunk.data.device, "copy")
            _wait(ready, stream)
            view = slots.view(slot)
            planes = 2 if low is not None else 1
            at = gpupayload.write_header(view, PAYLOAD_AT, planes, n, hi.nbytes)
            parts = [(at, low), (at + n // 2, hi)] if low is not None else [(at, hi)]
            rt = cudacalls.runtime()
            if rt is not None:
                device, raw, base = chunk.data.device.index or 0, stream.cuda_stream, slots.address(slot)
                for place, part in parts:
                    cudacalls.copy(rt, device, base + place, part.ptr, part.nbytes, raw)
                landed: Any = cudacalls.Event(rt, device).record(raw)
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
        landed: Any,
        ids: DeviceIds,
        k: int,
        length: int,
        coded: Any,
    ) -> str:
        try:
            t = time.perf_counter()
            landed.synchronize()
            t = STAGES.add("capture.worker.copy_wait", t)
            n = chunk.data.numel()
            view = slots.view(slot)
            chunk_id = ids.get(k) or chunk_id_of(view[PAYLOAD_AT : PAYLOAD_AT + n])  # odd lengths: on the CPU
            t = STAGES.add("capture.worker.id_wait", t)
            reg = self._region(chunk.region)
            if self._claim(reg, chunk.index, chunk_id, n):
                if coded is not None:
                    with self._lock:
                        self.decoders.add(gpucodec.DECODER)
                    self._store_sealed(chunk_id, codecs.BYTEPLANE, n, view[PAYLOAD_AT - HEADER_SIZE :], length)
                    STAGES.add("capture.worker.seal_store", t)
                else:  # raw bytes in pinned memory: the CPU codec reads them there
                    self._send(reg, chunk.index, chunk_id, view[PAYLOAD_AT : PAYLOAD_AT + n])
                    STAGES.add("capture.worker.cpu_codec_seal_store", t)
            self._progress.add(n)
            return chunk_id
        finally:
            slots.give(slot)
            self._in_flight.release()


class DirectStoreImageReader(StoreImageReader):
    """A :class:`StoreImageReader` that also fills tensors (see the module docstring)."""

    def read_tensors(self, chunks: Sequence[TensorChunk]) -> int:
        import torch

        pool = _pool()
        futures: list[Future[int]] = []
        devices: set[Any] = set()
        # The copies run on side streams: they must start after whatever the caller's stream still has
        # queued for the destinations (a zero fill of a fresh tensor would otherwise land on top of them).
        producers: dict[Any, Any] = {}
        for chunk in chunks:
            if chunk.data.numel() != self.chunk_length(chunk.region, chunk.index):
                raise IntegrityError(
                    f"image chunk {chunk.region}#{chunk.index} holds {self.chunk_length(chunk.region, chunk.index)} "
                    f"bytes; the destination needs {chunk.data.numel()}"
                )
            if chunk.data.is_cuda:
                devices.add(chunk.data.device)
                if chunk.data.device not in producers:
                    current = torch.cuda.current_stream(chunk.data.device)
                    producers[chunk.data.device] = cudacalls.recorded(chunk.data.device, current)
                futures.append(pool.submit(self._load_device, chunk, producers[chunk.data.device]))
            else:
                futures.append(pool.submit(self._load_host, chunk))
        try:
            total = sum(f.result() for f in futures)
        finally:
            for f in futures:  # none may still write into a destination after we return
                f.exception()
        for device in devices:
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        self._verify_on_device([c for c in chunks if c.data.is_cuda])
        STAGES.add("restore.main.verify", t)
        log_stages("restore")
        return total

    def _load_host(self, chunk: TensorChunk) -> int:
        return self.read_chunk_into(chunk.region, chunk.index, memoryview(chunk.data.numpy()))

    def _load_device(self, chunk: TensorChunk, after: Any) -> int:
        import torch

        n = chunk.data.numel()
        chunk_id = self._region(chunk.region)["chunks"][chunk.index]
        where = f" ({chunk.region}[{chunk.index}])"
        slots = _slots(self.chunk_size, SLOTS)
        t = time.perf_counter()
        slot = slots.take()
        t = STAGES.add("restore.worker.slot_wait", t)
        plain: int | None = None
        try:
            view = slots.view(slot)
            size = self._fetch_into(chunk_id, view[PAYLOAD_AT - HEADER_SIZE :])
            t = STAGES.add("restore.worker.read", t)
            hdr, payload = self.sealer.open_payload(
                chunk_id, view[PAYLOAD_AT - HEADER_SIZE : PAYLOAD_AT - HEADER_SIZE + size], where
            )
            t = STAGES.add("restore.worker.open", t)
            if hdr.raw_len != n:
                raise IntegrityError(f"chunk {chunk_id[:16]}{where} records {hdr.raw_len} bytes, the manifest says {n}")
            stream = _STREAMS.get(chunk.data.device, "copy")
            _wait(after, stream)
            with torch.cuda.stream(stream):
                if hdr.codec == codecs.NONE:
                    if len(payload) != n:
                        raise IntegrityError(f"chunk {chunk_id[:16]}{where} is truncated or padded")
                    _to_device(chunk.data, slots, slot, PAYLOAD_AT, stream)
                elif hdr.codec == codecs.BYTEPLANE and (k := gpupayload.layout(payload, n)):
                    gpupayload.decode_on_device(
                        k,
                        payload,
                        PAYLOAD_AT,
                        lambda dest, start: _to_device(dest, slots, slot, start, stream),
                        chunk.data,
                        stream,
                        where,
                    )
                else:  # CPU codecs (and deltas): decoded into a second slot, then one copy
                    plain = slots.take()
                    out = slots.view(plain)
                    if hdr.codec & codecs.DELTA_FLAG:
                        self.sealer.open_into(chunk_id, self._fetch(chunk_id), out, self.read_object, where)
                    else:
                        try:
                            codecs.decode_into(hdr.codec, payload, n, out)
                        except IntegrityError as exc:
                            raise IntegrityError(f"chunk {chunk_id[:16]}{where}: {exc.message}") from None
                    _to_device(chunk.data, slots, plain, 0, stream)
                done = cudacalls.recorded(chunk.data.device, stream)
            t = STAGES.add("restore.worker.decode_queue", t)
            done.synchronize()
            STAGES.add("restore.worker.copy_wait", t)
            return n
        finally:
            slots.give(slot)
            if plain is not None:
                slots.give(plain)

    def _fetch_into(self, chunk_id: str, out: memoryview) -> int:
        if not self.store.readable:
            raise InvalidInputError(
                f"{self.store.url} is write-only: read the image's chunks from the receiver's store"
            )
        try:
            return self.store.get_chunk_into(chunk_id, out)
        except IntegrityError:
            raise
        except Exception as exc:
            raise IntegrityError(f"image {self.image_id[:16]}: {getattr(exc, 'message', exc)}") from None

    def _verify_on_device(self, chunks: Sequence[TensorChunk]) -> None:
        """Every chunk's BLAKE3 from the bytes that landed, against its id; the CPU hashes odd lengths."""
        import torch

        by_device: dict[str, list[TensorChunk]] = {}
        for chunk in chunks:
            by_device.setdefault(str(chunk.data.device), []).append(chunk)
        for members in by_device.values():
            ids = DeviceIds([c.data for c in members], torch.cuda.current_stream(members[0].data.device))
            for i, chunk in enumerate(members):
                want = self._region(chunk.region)["chunks"][chunk.index]
                got = ids.get(i) or chunk_id_of(memoryview(chunk.data.cpu().numpy()))
                if got != want:
                    raise IntegrityError(
                        f"chunk {chunk.index} of {chunk.region}: BLAKE3 of the restored bytes does not match its id "
                        "(corrupted)"
                    )


def _to_device(out: Any, slots: PinnedSlots, slot: int, start: int, stream: Any) -> None:
    """Queue the copy of ``out.numel()`` bytes from the slot (from ``start``) into the contiguous device tensor
    ``out``, on ``stream`` (the current stream): raw where the runtime is here (``cudacalls``), else torch's."""
    rt = cudacalls.runtime()
    if rt is None or not out.is_contiguous():
        out.copy_(slots.tensor(slot, start, start + out.numel()), non_blocking=True)
        return
    cudacalls.copy(
        rt, out.device.index or 0, out.data_ptr(), slots.address(slot) + start, out.numel(), stream.cuda_stream
    )

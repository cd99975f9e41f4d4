"""Direct placement: chunks move between the tensor where they live and the store with no caller copy.

Capture (:class:`DirectStoreImageWriter`, the :class:`~gpumigrate.interfaces.DirectImageWriter`):

* device chunks get their ids from the BLAKE3 kernels (``devhash``), batched on a hash stream that
  trails the caller's stream, so the CPU hashes nothing;
* bf16/fp16 chunks are split into byte planes on the device and the exponent plane is coded there
  (``gpucodec``, plane codec 3) when nvCOMP is present, so about 0.68 of the bytes cross PCIe;
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
import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from gpumigrate import cudacalls
from gpumigrate.errors import IntegrityError, InvalidInputError, TransferError
from gpumigrate.interfaces import TensorChunk
from gpumigrate.transfer import codecs, gpucodec, plane_kernels
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
_PLANE_ENTRY = struct.Struct(">BQ")
_GPU_PLANES_HEADER = 1 + 2 * _PLANE_ENTRY.size  # k = 2: element size, then (codec, length) per plane


class StageClock:
    """Seconds spent per stage, summed over threads: where a direct capture or restore waits and works.

    Cheap enough to stay on (a lock and an add per stage per chunk); ``bench/direct.py`` reads it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.totals: dict[str, float] = {}

    def add(self, stage: str, since: float) -> float:
        now = time.perf_counter()
        with self._lock:
            self.totals[stage] = self.totals.get(stage, 0.0) + now - since
        return now

    def take(self) -> dict[str, float]:
        with self._lock:
            out, self.totals = self.totals, {}
        return {k: round(v, 4) for k, v in sorted(out.items())}


STAGES = StageClock()


def _log_stages(what: str) -> None:
    """Append this process's stage totals to ``GPUMIGRATE_STAGES_LOG`` (one JSON line), if set: how
    ``bench/e2e.py`` sees where a source's capture and a target's restore spent their threads' time."""
    path = os.environ.get("GPUMIGRATE_STAGES_LOG")
    if path:
        import json

        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"pid": os.getpid(), "what": what, "stages": STAGES.take()}) + "\n")


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
            stream = found[key] = torch.cuda.Stream(device=device)
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
        _log_stages("capture")
        return super().commit()

    def chunk_ids(self, chunks: Sequence[TensorChunk]) -> list[str]:
        """BLAKE3 ids where the bytes live: CUDA chunks of whole 1 KiB leaves by the device kernels, in
        batches of one length; the rest on the host, one chunk per core (BLAKE3 releases the GIL)."""
        out: list[str] = [""] * len(chunks)
        on_device: dict[tuple[str, int], list[int]] = {}
        on_host: list[int] = []
        devhash = _devhash() if any(c.data.is_cuda for c in chunks) else None
        for k, chunk in enumerate(chunks):
            if devhash is not None and devhash.eligible(chunk.data) and devhash.available(chunk.data.device):
                on_device.setdefault((str(chunk.data.device), chunk.data.numel()), []).append(k)
            else:
                on_host.append(k)
        for k, cid in zip(on_host, _pool().map(lambda k: _host_id(chunks[k].data), on_host), strict=True):
            out[k] = cid
        launched: list[tuple[list[int], Any]] = []
        for members in on_device.values():
            assert devhash is not None  # only CUDA chunks are grouped for the device
            for start in range(0, len(members), HASH_BATCH):
                part = members[start : start + HASH_BATCH]
                launched.append((part, devhash.blake3_device([chunks[k].data for k in part])))
        # Every batch is queued before any is read back: one wait for the device, not one per batch (the
        # final round confirms every unchanged chunk this way while the workload is frozen).
        by_device: dict[str, list[tuple[list[int], Any]]] = {}
        for part, words in launched:
            by_device.setdefault(str(words.device), []).append((part, words))
        for batches in by_device.values():
            rows = _torch().cat([words for _, words in batches]).cpu().tolist()
            order = [k for part, _ in batches for k in part]
            for k, w in zip(order, rows, strict=True):
                out[k] = devhash.words_hex(w)  # type: ignore[union-attr]
        return out

    def _put_host(self, chunk: TensorChunk) -> str:
        return self.put_chunk(chunk.region, chunk.index, memoryview(chunk.data.numpy()))

    def _gpu_coded(self, chunk: TensorChunk) -> bool:
        k = codecs.float_itemsize(self._region(chunk.region).info.dtype)
        n = chunk.data.numel()
        return (
            self.compression in ("auto", "byteplane")
            and k in gpucodec.GPU_ELEMENT_SIZES
            and n % 2 == 0
            and _devhash().eligible(chunk.data)  # a coded chunk's plaintext never reaches the host to hash
            and gpucodec.enabled()
        )

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
        """Byte planes of the group's coded chunks (one split launch), the exponent planes ANS-coded in one nvCOMP
        batch; only chunks that come out smaller than raw are kept (their planes live until the copies that read
        them). No torch call per chunk: each one queued behind the sealing threads for the GIL."""
        eligible = [k for k in group if self._gpu_coded(chunks[k])]
        if not eligible:
            return {}
        split = gpucodec.PlaneSplit([chunks[k].data for k in eligible], coder)
        his = gpucodec.encode_planes([split.high(i) for i in range(len(eligible))], coder)
        event = cudacalls.recorded(coder.device, coder)
        _wait(event, current)
        out: dict[int, Any] = {}
        for i, (k, hi) in enumerate(zip(eligible, his, strict=True)):
            n = chunks[k].data.numel()
            if _GPU_PLANES_HEADER + n // 2 + hi.nbytes < n:
                out[k] = (split.low(i), hi, event)  # the worker copies both out after ``event``, holding them till then
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
        """A coded chunk's two planes into a pinned slot, in the layout of a byte-plane payload, then stored."""
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
            at = PAYLOAD_AT + _GPU_PLANES_HEADER
            view[PAYLOAD_AT] = 2
            _PLANE_ENTRY.pack_into(view, PAYLOAD_AT + 1, codecs.NONE, n // 2)
            _PLANE_ENTRY.pack_into(view, PAYLOAD_AT + 1 + _PLANE_ENTRY.size, gpucodec.PLANE_NVCOMP_ANS, hi.nbytes)
            rt = cudacalls.runtime()
            if rt is not None:
                device, raw, base = chunk.data.device.index or 0, stream.cuda_stream, slots.address(slot)
                cudacalls.copy(rt, device, base + at, low.ptr, n // 2, raw)
                cudacalls.copy(rt, device, base + at + n // 2, hi.ptr, hi.nbytes, raw)
                landed: Any = cudacalls.Event(rt, device).record(raw)
            else:
                with torch.cuda.stream(stream):
                    for place, part in ((at, low), (at + n // 2, hi)):
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
        length = at + n // 2 + hi.nbytes - PAYLOAD_AT
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
        _log_stages("restore")
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
                elif hdr.codec == codecs.BYTEPLANE and _gpu_planes(payload, n):
                    self._decode_on_device(slots, slot, payload, chunk, stream, where)
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

    def _decode_on_device(
        self, slots: PinnedSlots, slot: int, payload: memoryview, chunk: TensorChunk, stream: Any, where: str
    ) -> None:
        """The two planes cross to the device in one copy (they lie side by side in the slot) into one scratch
        buffer that also takes the decoded high plane; one kernel interleaves the planes into the destination.
        Called on ``stream``. Few torch calls per chunk: each one queued behind the other threads for the GIL."""
        import torch

        n = chunk.data.numel()
        half = n // 2
        coded_len = _PLANE_ENTRY.unpack_from(payload, 1 + _PLANE_ENTRY.size)[1]
        # [decoded high plane | pad | low plane | coded high plane]: nvCOMP wants its output and its input on
        # 16-byte boundaries, and the low and coded planes arrive in one copy, so the low plane ends on one.
        low_at = -(-half // 16) * 16 + (-half) % 16
        scratch = torch.empty(low_at + half + coded_len, dtype=torch.uint8, device=chunk.data.device)
        base = scratch.data_ptr()
        landing = scratch[low_at:]
        _to_device(landing, slots, slot, PAYLOAD_AT + _GPU_PLANES_HEADER, stream)
        try:
            gpucodec.decode_plane(
                gpucodec.DeviceBytes(base + low_at + half, coded_len, scratch),
                gpucodec.DeviceBytes(base, half, scratch),
                stream,
            )
        except IntegrityError as exc:
            raise IntegrityError(f"chunk{where}: {exc.message}") from None
        if gpucodec.merges(chunk.data):
            plane_kernels.merge(base + low_at, base, chunk.data)
        else:
            torch.stack((scratch[low_at : low_at + half], scratch[:half]), dim=1, out=chunk.data.view(-1, 2))

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


def _gpu_planes(payload: memoryview, n: int) -> bool:
    """A byte-plane payload in the layout the GPU writes: k = 2, raw low plane, plane codec 3 high plane."""
    if len(payload) < _GPU_PLANES_HEADER or payload[0] != 2:
        return False
    low_codec, low_len = _PLANE_ENTRY.unpack_from(payload, 1)
    high_codec, high_len = _PLANE_ENTRY.unpack_from(payload, 1 + _PLANE_ENTRY.size)
    return (
        low_codec == codecs.NONE
        and low_len == n // 2
        and high_codec == gpucodec.PLANE_NVCOMP_ANS
        and _GPU_PLANES_HEADER + low_len + high_len == len(payload)
        and gpucodec.available()
    )

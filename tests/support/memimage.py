"""An in-process image sink: ImageWriter/ImageReader over host memory, for benchmarks and tests.

It is the "capture to host memory" end of the snapshot engine's pipeline: chunk ids are BLAKE3 of the
plaintext, chunks are content-addressed (dedup), and the manifest is signed with HMAC-SHA256 so a
reader refuses forged or altered manifests and chunks, as the transfer engine's reader does. It
does no compression or encryption and moves nothing between hosts; real migrations use
``gpumigrate.transfer`` (wired in the public SDK, ``agent/images.py``).

With an ``arena`` (a pre-allocated, optionally pinned host tensor) it is a direct writer and reader
(:class:`~gpumigrate.interfaces.DirectImageWriter`): each chunk is copied once, from the device into
an arena slice and back, and hashed there with BLAKE3 on the CPU's threads, so no byte is copied on
the host. (The transfer engine hashes on the GPU instead; this sink stays a plain host-memory one.)
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import torch

from gpumigrate.errors import IntegrityError, NotFoundError, SnapshotError
from gpumigrate.interfaces import ChunkRun, ImageRef, RegionInfo, TensorChunk

_POOL = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="gm-memimage")

try:
    import blake3 as _blake3

    def _digest(data: Any) -> str:
        return _blake3.blake3(data).hexdigest()
except ImportError:  # pragma: no cover - blake3 is a project dependency; the fallback keeps GPU hosts going

    def _digest(data: Any) -> str:
        return hashlib.blake2b(data, digest_size=32).hexdigest()


class MemoryStore:
    """Chunks and signed manifests in a dict. ``url`` is informational (``mem://name``)."""

    def __init__(self, url: str = "mem://local", *, arena: torch.Tensor | None = None) -> None:
        self.url = url
        self.chunks: dict[str, bytes] = {}
        self.placed: dict[str, tuple[int, int]] = {}  # chunk id -> (offset, length) in the arena
        self.manifests: dict[str, tuple[bytes, str]] = {}
        self._lock = threading.Lock()
        self.arena = arena
        self._arena_np = arena.numpy() if arena is not None else None
        self._top = 0

    def has(self, chunk_id: str) -> bool:
        return chunk_id in self.chunks or chunk_id in self.placed

    def alloc(self, n: int) -> int | None:
        """Offset of ``n`` free arena bytes (4 KiB aligned), or None when there is no (room in the) arena."""
        if self.arena is None:
            return None
        with self._lock:
            off = self._top
            if off + n > self.arena.numel():
                return None
            self._top = off + ((n + 4095) & ~4095)
            return off

    def view(self, off: int, n: int) -> memoryview:
        if self._arena_np is None:
            raise SnapshotError("this in-memory store was made without an arena: nothing was placed in one")
        return self._arena_np[off : off + n].data

    def data(self, chunk_id: str) -> memoryview | bytes | None:
        loc = self.placed.get(chunk_id)
        if loc is not None:
            return self.view(*loc)
        return self.chunks.get(chunk_id)

    def writer(
        self, key: bytes, *, chunk_size: int = 4 << 20, parent: str | None = None, hash_chunks: bool = True
    ) -> MemoryWriter:
        return MemoryWriter(self, key, chunk_size=chunk_size, parent=parent, hash_chunks=hash_chunks)

    def reader(self, image_id: str, key: bytes, *, verify_chunks: bool = True) -> MemoryReader:
        return MemoryReader(self, image_id, key, verify_chunks=verify_chunks)


class MemoryWriter:
    def __init__(
        self, store: MemoryStore, key: bytes, *, chunk_size: int, parent: str | None, hash_chunks: bool
    ) -> None:
        self.store = store
        self.chunk_size = chunk_size
        self._key = key
        self._parent = parent
        self._hash = hash_chunks
        self._regions: dict[str, RegionInfo] = {}
        self._ids: dict[str, dict[int, str]] = {}
        self._meta: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self._serial = 0

    def add_region(self, info: RegionInfo) -> None:
        self._regions[info.name] = info
        self._ids.setdefault(info.name, {})

    def add_regions(self, infos: Iterable[RegionInfo]) -> None:
        for info in infos:
            self.add_region(info)

    def put_chunk(self, region: str, index: int, data: memoryview) -> str:
        blob = bytes(data)  # the copy out of the caller's (ring) buffer
        cid = self._id_of(blob)
        with self.store._lock:
            self.store.chunks.setdefault(cid, blob)
        with self._lock:
            self._ids[region][index] = cid
            self.bytes_sent += len(blob)
        return cid

    def _id_of(self, data: Any) -> str:
        if self._hash:
            return _digest(data)
        with self._lock:  # benchmark variant: measures the pipeline without hashing; never restorable
            self._serial += 1
            return f"nohash-{id(self)}-{self._serial}"

    def confirm_chunks(self, runs: Sequence[ChunkRun], *, background: bool = False) -> Callable[[], list[list[bool]]]:
        """Chunk ids hashed on the host, on one of the pool's threads (this sink has no device hashing; the
        transfer engine's writer does)."""
        from gpumigrate.snapshot.chunks import host_chunk_ids

        cs = self.chunk_size

        def confirm() -> list[list[bool]]:
            out = []
            for run in runs:
                got = host_chunk_ids([run.view[i * cs : (i + 1) * cs] for i in run.indices])
                out.append([g == want for g, want in zip(got, run.ids, strict=True)])
            return out

        return _POOL.submit(confirm).result

    def pacing(self) -> dict[str, Any]:
        return {}  # an in-memory sink moves nothing a source's requests could feel: it is never paced

    def put_tensors(self, chunks: Sequence[TensorChunk]) -> list[Future[str]]:
        """Each chunk copied once into an arena slice (device chunks on the current stream), then hashed
        and recorded on the pool's threads; without room in the arena, the plain way."""
        import torch

        futures: list[Future[str]] = []
        for chunk in chunks:
            n = chunk.data.numel()
            off = self.store.alloc(n)
            if off is None:
                host = chunk.data.cpu() if chunk.data.is_cuda else chunk.data
                futures.append(_POOL.submit(self.put_chunk, chunk.region, chunk.index, memoryview(host.numpy())))
                continue
            dst = self.store.arena[off : off + n]  # type: ignore[index]
            landed = None
            if chunk.data.is_cuda:
                dst.copy_(chunk.data, non_blocking=True)
                landed = torch.cuda.Event()
                landed.record(torch.cuda.current_stream(chunk.data.device))
            else:
                dst.copy_(chunk.data)
            futures.append(_POOL.submit(self._put_placed, chunk.region, chunk.index, off, n, landed))
        return futures

    def _put_placed(self, region: str, index: int, off: int, n: int, landed: Any) -> str:
        if landed is not None:
            landed.synchronize()
        cid = self._id_of(self.store.view(off, n))
        with self.store._lock:
            if not self.store.has(cid):
                self.store.placed[cid] = (off, n)
        with self._lock:
            self._ids[region][index] = cid
            self.bytes_sent += n
        return cid

    def reuse_chunk(self, region: str, index: int, chunk_id: str) -> None:
        if not self.store.has(chunk_id):
            raise SnapshotError(f"reuse of chunk {chunk_id[:12]} that the store does not hold")
        with self._lock:
            self._ids[region][index] = chunk_id

    def reuse_chunks(self, chunks: Iterable[tuple[str, int, str]]) -> None:
        for region, index, chunk_id in chunks:
            self.reuse_chunk(region, index, chunk_id)

    def reuse_regions(self, regions: Iterable[tuple[str, Sequence[str]]]) -> None:
        for region, ids in regions:
            for index, chunk_id in enumerate(ids):
                self.reuse_chunk(region, index, chunk_id)

    def set_metadata(self, key: str, value: Any) -> None:
        self._meta[key] = value

    def commit(self) -> ImageRef:
        chunks: dict[str, list[str]] = {}
        for name, info in self._regions.items():
            got = self._ids[name]
            n = len(got)
            if sorted(got) != list(range(n)):
                raise SnapshotError(f"region {name} has gaps in its chunks")
            chunks[name] = [got[i] for i in range(n)]
            del info
        manifest = json.dumps(
            {
                "regions": [asdict(r) for r in self._regions.values()],
                "chunks": chunks,
                "metadata": self._meta,
                "parent": self._parent,
                "chunk_size": self.chunk_size,
            },
            sort_keys=True,
        ).encode()
        image_id = _digest(manifest)
        sig = hmac.new(self._key, manifest, hashlib.sha256).hexdigest()
        with self.store._lock:
            self.store.manifests[image_id] = (manifest, sig)
        total = sum(r.nbytes for r in self._regions.values())
        return ImageRef(
            id=image_id,
            store=self.store.url,
            parent=self._parent,
            bytes_image=total,
            bytes_sent=self.bytes_sent,
            bytes_stored=self.bytes_sent,
        )


class MemoryReader:
    """``verify_chunks=False`` exists for the benchmark's pipeline-bound figure only; restores verify."""

    def __init__(self, store: MemoryStore, image_id: str, key: bytes, *, verify_chunks: bool = True) -> None:
        self.verify = verify_chunks
        if image_id not in store.manifests:
            raise NotFoundError(f"image {image_id} is not in {store.url}")
        manifest, sig = store.manifests[image_id]
        if not hmac.compare_digest(hmac.new(key, manifest, hashlib.sha256).hexdigest(), sig):
            raise IntegrityError(
                f"image {image_id}: manifest signature does not verify (forged, altered, or wrong key)"
            )
        if _digest(manifest) != image_id:
            raise IntegrityError(f"image {image_id}: manifest digest does not match its id")
        doc = json.loads(manifest)
        self.store = store
        self.ref = ImageRef(id=image_id, store=store.url, parent=doc["parent"])
        self._regions = [
            RegionInfo(**{**r, "shape": tuple(r["shape"]) if r["shape"] is not None else None}) for r in doc["regions"]
        ]
        self._chunks: dict[str, list[str]] = doc["chunks"]
        self._meta = doc["metadata"]

    def regions(self) -> Sequence[RegionInfo]:
        return self._regions

    def metadata(self) -> Mapping[str, Any]:
        return self._meta

    def chunk_count(self, region: str) -> int:
        return len(self._chunks[region])

    def _verified(self, region: str, index: int) -> tuple[str, memoryview | bytes]:
        cid = self._chunks[region][index]
        data = self.store.data(cid)
        if data is None:
            raise IntegrityError(f"chunk {cid[:12]} of {region} is missing from {self.store.url}")
        if _digest(data) != cid:
            raise IntegrityError(f"chunk {index} of {region}: BLAKE3 digest does not match its id (corrupted)")
        return cid, data

    def read_tensors(self, chunks: Sequence[TensorChunk]) -> int:
        """Copy each chunk from the arena (pinned: straight to the device) and check its BLAKE3 there
        on the pool's threads while the copies run; a mismatch fails the whole read."""
        import torch

        checks: list[Future[Any]] = []
        devices = set()
        for chunk in chunks:
            cid = self._chunks[chunk.region][chunk.index]
            data = self.store.data(cid)
            if data is None:
                raise IntegrityError(f"chunk {cid[:12]} of {chunk.region} is missing from {self.store.url}")
            if len(data) != chunk.data.numel():
                raise IntegrityError(
                    f"chunk {chunk.index} of {chunk.region} is {len(data)} bytes, not {chunk.data.numel()}"
                )
            loc = self.store.placed.get(cid)
            src = (
                self.store.arena[loc[0] : loc[0] + loc[1]]  # type: ignore[index]
                if loc is not None
                else torch.frombuffer(bytearray(data), dtype=torch.uint8)
            )
            if len(data):
                chunk.data.copy_(src, non_blocking=chunk.data.is_cuda)
            if chunk.data.is_cuda:
                devices.add(chunk.data.device)
            if self.verify:
                checks.append(_POOL.submit(self._verified, chunk.region, chunk.index))
        for check in checks:
            check.result()
        for device in devices:
            torch.cuda.synchronize(device)
        return sum(c.data.numel() for c in chunks)

    def read_chunk_into(self, region: str, index: int, out: memoryview) -> int:
        _, data = self._verified(region, index)
        if len(data) > len(out):
            raise IntegrityError(f"chunk {index} of {region} is {len(data)} bytes, larger than its slot")
        out[: len(data)] = data
        return len(data)

"""An in-process image sink: ImageWriter/ImageReader over host memory, for benchmarks and tests.

It is the "capture to host memory" end of the agent's pipeline: chunk ids are BLAKE3 of the
plaintext, chunks are content-addressed (dedup), and the manifest is signed with HMAC-SHA256 so a
reader refuses forged or altered manifests and chunks, as the transfer engine's reader does. It
does no compression or encryption and moves nothing between hosts; real migrations use
``gpumigrate.transfer`` (wired in ``workloads/agent_hook.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from gpumigrate.errors import IntegrityError, NotFoundError, SnapshotError
from gpumigrate.interfaces import ImageRef, RegionInfo

try:
    import blake3 as _blake3

    def _digest(data: Any) -> str:
        return _blake3.blake3(data).hexdigest()
except ImportError:  # pragma: no cover - blake3 is a project dependency; the fallback keeps GPU hosts going

    def _digest(data: Any) -> str:
        return hashlib.blake2b(data, digest_size=32).hexdigest()


class MemoryStore:
    """Chunks and signed manifests in a dict. ``url`` is informational (``mem://name``)."""

    def __init__(self, url: str = "mem://local") -> None:
        self.url = url
        self.chunks: dict[str, bytes] = {}
        self.manifests: dict[str, tuple[bytes, str]] = {}
        self._lock = threading.Lock()

    def writer(self, key: bytes, *, chunk_size: int = 4 << 20, parent: str | None = None, hash_chunks: bool = True) -> MemoryWriter:
        return MemoryWriter(self, key, chunk_size=chunk_size, parent=parent, hash_chunks=hash_chunks)

    def reader(self, image_id: str, key: bytes) -> MemoryReader:
        return MemoryReader(self, image_id, key)


class MemoryWriter:
    def __init__(self, store: MemoryStore, key: bytes, *, chunk_size: int, parent: str | None, hash_chunks: bool) -> None:
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

    def put_chunk(self, region: str, index: int, data: memoryview) -> str:
        blob = bytes(data)  # the copy out of the caller's (ring) buffer
        if self._hash:
            cid = _digest(blob)
        else:  # benchmark variant: measures the pipeline without hashing; never used for restores
            with self._lock:
                self._serial += 1
                cid = f"nohash-{id(self)}-{self._serial}"
        with self.store._lock:
            self.store.chunks.setdefault(cid, blob)
        with self._lock:
            self._ids[region][index] = cid
            self.bytes_sent += len(blob)
        return cid

    def reuse_chunk(self, region: str, index: int, chunk_id: str) -> None:
        if chunk_id not in self.store.chunks:
            raise SnapshotError(f"reuse of chunk {chunk_id[:12]} that the store does not hold")
        with self._lock:
            self._ids[region][index] = chunk_id

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
            {"regions": [asdict(r) for r in self._regions.values()], "chunks": chunks, "metadata": self._meta,
             "parent": self._parent, "chunk_size": self.chunk_size},
            sort_keys=True,
        ).encode()
        image_id = _digest(manifest)
        sig = hmac.new(self._key, manifest, hashlib.sha256).hexdigest()
        with self.store._lock:
            self.store.manifests[image_id] = (manifest, sig)
        total = sum(r.nbytes for r in self._regions.values())
        return ImageRef(id=image_id, store=self.store.url, parent=self._parent, bytes_image=total,
                        bytes_sent=self.bytes_sent, bytes_stored=self.bytes_sent)


class MemoryReader:
    def __init__(self, store: MemoryStore, image_id: str, key: bytes) -> None:
        if image_id not in store.manifests:
            raise NotFoundError(f"image {image_id} is not in {store.url}")
        manifest, sig = store.manifests[image_id]
        if not hmac.compare_digest(hmac.new(key, manifest, hashlib.sha256).hexdigest(), sig):
            raise IntegrityError(f"image {image_id}: manifest signature does not verify (forged, altered, or wrong key)")
        if _digest(manifest) != image_id:
            raise IntegrityError(f"image {image_id}: manifest digest does not match its id")
        doc = json.loads(manifest)
        self.store = store
        self.ref = ImageRef(id=image_id, store=store.url, parent=doc["parent"])
        self._regions = [RegionInfo(**{**r, "shape": tuple(r["shape"]) if r["shape"] is not None else None}) for r in doc["regions"]]
        self._chunks: dict[str, list[str]] = doc["chunks"]
        self._meta = doc["metadata"]

    def regions(self) -> Sequence[RegionInfo]:
        return self._regions

    def metadata(self) -> Mapping[str, Any]:
        return self._meta

    def chunk_count(self, region: str) -> int:
        return len(self._chunks[region])

    def read_chunk_into(self, region: str, index: int, out: memoryview) -> int:
        cid = self._chunks[region][index]
        data = self.store.chunks.get(cid)
        if data is None:
            raise IntegrityError(f"chunk {cid[:12]} of {region} is missing from {self.store.url}")
        if _digest(data) != cid:
            raise IntegrityError(f"chunk {index} of {region}: BLAKE3 digest does not match its id (corrupted)")
        if len(data) > len(out):
            raise IntegrityError(f"chunk {index} of {region} is {len(data)} bytes, larger than its slot")
        out[: len(data)] = data
        return len(data)

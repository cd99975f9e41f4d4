"""The ImageWriter: hash → dedup → encode → seal in the caller's thread, store in an upload pool.

Callers (the snapshot agent's ring-buffer threads, ``pack_paths``' readers) call ``put_chunk`` from
several threads; each call does the CPU work on its own thread (BLAKE3, zstd, numpy and AES-GCM all
release the GIL) and hands the sealed object to a bounded upload pool, so the caller's buffer is
free as soon as the object is sealed and network writes overlap the next chunk's CPU work. Local
stores (``writes_inline``: a page-cache write, syncs already on their own threads) are written on
the sealing thread instead: no handoff, and the object is still in that core's cache.

What the manifest will list (each region's chunks, the objects they name, what the parent holds) is the writer's
:class:`~.contents.ImageContents`; the manifests this process committed, and their sequence, are ``committed.py``'s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from gpumigrate.errors import InvalidInputError, TransferError
from gpumigrate.interfaces import ImageRef, LatencySignal, RegionInfo
from gpumigrate.transfer.buffers import POOL
from gpumigrate.transfer.committed import committed_body, next_sequence, remember
from gpumigrate.transfer.contents import ImageContents, Region
from gpumigrate.transfer.format import codecs
from gpumigrate.transfer.format.chunkobj import HEADER_SIZE, MAX_RAW_LEN, Sealer, chunk_id_of, sealed_size
from gpumigrate.transfer.format.manifest import seal_manifest
from gpumigrate.transfer.pacing import PacingController, fixed_rate_report
from gpumigrate.transfer.progress import ProgressCallback, ProgressCounter, RateLimiter
from gpumigrate.transfer.stores import Store

if TYPE_CHECKING:
    from gpumigrate.transfer.reader import StoreImageReader

# committed_body stays importable from here, where callers found it
__all__ = ["BUFFERS", "DEFAULT_CHUNK_SIZE", "UPLOADS", "StoreImageWriter", "committed_body"]

DEFAULT_CHUNK_SIZE = 4 << 20
UPLOADS = 4  # upload threads (connections, requests in flight) to a remote store when no parallelism is given
# Encoding scratch and sealed objects live in recycled buffers (buffers.py says why).
BUFFERS = POOL


class StoreImageWriter:
    """Implements :class:`gpumigrate.interfaces.ImageWriter` over a :class:`Store`."""

    def __init__(
        self,
        store: Store,
        sealer: Sealer,
        *,
        parent: dict[str, Any] | None = None,
        parent_id: str | None = None,
        parent_reader: StoreImageReader | None = None,
        compression: str = "auto",
        parallelism: int | None = None,
        chunk_size: int | None = None,
        source: str | None = None,
        delta: bool = False,
        progress: ProgressCallback | None = None,
        rate_limit: float | None = None,
        latency: LatencySignal | None = None,
    ) -> None:
        self.store = store
        self.sealer = sealer
        self.compression = codecs.check_mode(compression)
        self.chunk_size = int(chunk_size or (parent or {}).get("chunk_size") or DEFAULT_CHUNK_SIZE)
        if self.chunk_size <= 0 or self.chunk_size % 8 or self.chunk_size > MAX_RAW_LEN:
            raise InvalidInputError(
                f"chunk size {self.chunk_size} must be a positive multiple of 8 bytes, at most {MAX_RAW_LEN}"
            )
        self.source = source
        self.parent_id = parent_id
        self.parent_body: dict[str, Any] | None = parent  # the verified parent manifest body, if any
        self._parent_reader = parent_reader if delta else None
        # The parent's chunk at each index: delta bases, so only a delta writer needs them (one entry per chunk).
        self._parent_chunks: dict[tuple[str, int], str] = {}
        for reg in (parent or {}).get("regions", []) if self._parent_reader is not None else ():
            for i, cid in enumerate(reg["chunks"]):
                self._parent_chunks[(reg["name"], i)] = cid
        self._metadata: dict[str, Any] = {}
        # one lock for the writer and its contents (re-entered when an object's delta base is looked up)
        self._lock = threading.RLock()
        # parallelism: the threads this writer seals and stores with (None: a direct writer's one per core; uploads
        # to a remote store then use UPLOADS connections)
        self.parallelism = parallelism
        uploads = parallelism or UPLOADS
        self._slots = threading.BoundedSemaphore(max(2, uploads * 2))
        self._pool = ThreadPoolExecutor(max_workers=max(1, uploads), thread_name_prefix="gm-upload")
        # Every chunk passes the limiter before its bytes move: a fixed rate_limit, or one the pacing steers from the
        # source's request latency (pacing.py). Uncapped, it only counts.
        self._limiter = RateLimiter(rate_limit)
        self._pacer = PacingController(latency, self._limiter, ceiling=rate_limit) if latency is not None else None
        self._pacing: dict[str, Any] = {}
        self._futures: list[Future[None]] = []
        self._errors: list[BaseException] = []
        self._committed = False
        self._t0 = time.monotonic()
        self._progress = ProgressCounter(progress, 0)
        # the regions and objects the manifest will list, under this writer's lock
        self.contents = ImageContents(store, self.chunk_size, parent, self._lock, self._progress)
        self.decoders: set[str] = set()  # optional decoders a reader needs (FORMAT.md, "decoders")
        self._opened()
        if self._pacer is not None:
            self._pacer.start()  # the base latency: the source's requests before this round moved a byte

    def _opened(self) -> None:
        """A subclass's own set-up, once the writer is ready (the direct writer's slots and queue)."""

    # -- what the image holds (the contents count it)

    @property
    def bytes_sent(self) -> int:
        return self.contents.bytes_sent

    @property
    def bytes_logical(self) -> int:
        return self.contents.bytes_logical

    @property
    def chunks_new(self) -> int:
        return self.contents.chunks_new

    @property
    def chunks_reused(self) -> int:
        return self.contents.chunks_reused

    # -- regions and metadata

    def add_region(self, info: RegionInfo) -> None:
        self.add_regions((info,))

    def add_regions(self, infos: Iterable[RegionInfo]) -> None:
        """:meth:`add_region` of each, under one hold of the lock (a round adds a model's hundreds at once)."""
        self.contents.add_regions(infos)

    def set_metadata(self, key: str, value: object) -> None:
        with self._lock:
            self._metadata[key] = value

    # -- chunks

    def put_chunk(self, region: str, index: int, data: memoryview | bytes | bytearray) -> str:
        self._check_open()
        reg = self.contents.region(region)
        view = memoryview(data)
        if not view.c_contiguous:
            raise InvalidInputError(
                f"put_chunk({region!r}, {index}): the buffer must be C-contiguous (copy strided views first)"
            )
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if len(view) > MAX_RAW_LEN:
            raise InvalidInputError(
                f"put_chunk({region!r}, {index}): {len(view)} bytes is more than a chunk may hold ({MAX_RAW_LEN})"
            )
        self._limiter.take(len(view))
        chunk_id = chunk_id_of(view)
        if self.contents.claim(reg, index, chunk_id, len(view)):
            self._send(reg, index, chunk_id, view)
        self._progress.add(len(view))
        return chunk_id

    def _send(self, reg: Region, index: int, chunk_id: str, view: memoryview) -> None:
        base_id = None
        payload_src = view
        if self._parent_reader is not None:
            parent_cid = self._parent_chunks.get((reg.info.name, index))
            parent_entry = self.contents.parent_objects.get(parent_cid or "")
            if parent_cid and parent_cid != chunk_id and parent_entry and not parent_entry[2]:
                base_plain = self._parent_reader.read_object(parent_cid)
                payload_src = codecs.xor_with_base(view, base_plain).data
                base_id = parent_cid
        # One buffer per chunk, asked for at whole-chunk size so every buffer in the pool fits any
        # chunk: the encoder writes its payload at HEADER_SIZE, where the sealer encrypts it in place
        # behind the header (payloads elsewhere, raw or whole-chunk zstd, are sealed into it).
        buf = BUFFERS.take(sealed_size(codecs.scratch_size(max(self.chunk_size, len(view))), True))
        try:
            scratch = memoryview(buf)[HEADER_SIZE:]
            codec, payload = codecs.encode_into(
                payload_src, scratch, mode=self.compression, dtype=reg.info.dtype, plan=None if base_id else reg.planes
            )
            in_place = isinstance(payload, memoryview) and payload.obj is buf
            if base_id:
                codec |= codecs.DELTA_FLAG
            blob = self.sealer.seal(chunk_id, codec, len(view), payload, base_id, out=buf, in_place=in_place)
        except BaseException:
            BUFFERS.give(buf)
            raise
        if not self.contents.add_new(chunk_id, [len(blob), codec, base_id]):  # another thread sent the same content
            BUFFERS.give(buf)
            return
        if self.store.writes_inline:
            self._store_inline(chunk_id, blob, buf)
            return
        self._slots.acquire()
        try:
            fut = self._pool.submit(self._upload, chunk_id, blob, buf)
        except BaseException:
            self._slots.release()
            raise
        with self._lock:
            self._futures.append(fut)

    def _store_inline(self, chunk_id: str, blob: bytearray | memoryview, buf: bytearray) -> None:
        """Store on the sealing thread (local stores): no handoff, and the object is still in cache."""
        try:
            self._put_object(chunk_id, blob, buf)
        except BaseException as exc:
            raise TransferError(f"storing chunk {chunk_id[:16]} in {self.store.url} failed: {exc}") from exc

    def _upload(self, chunk_id: str, blob: bytearray | memoryview, buf: bytearray) -> None:
        try:
            self._put_object(chunk_id, blob, buf)
        finally:
            self._slots.release()

    def _store_sealed(self, chunk_id: str, codec: int, raw_len: int, out: memoryview, payload_len: int) -> None:
        """Seal a payload that already lies at ``out[HEADER_SIZE:]`` where it lies, and store it now.

        For callers that own ``out`` (a pinned slot the device copied the payload into): no copy,
        and the object is stored on this thread so ``out`` is free again on return.
        """
        payload = out[HEADER_SIZE : HEADER_SIZE + payload_len]
        blob = self.sealer.seal(chunk_id, codec, raw_len, payload, None, out=out, in_place=True)
        if not self.contents.add_new(chunk_id, [len(blob), codec, None]):  # another thread sent the same content
            return
        try:
            self._put_object(chunk_id, blob, None)
        except BaseException as exc:
            raise TransferError(f"storing chunk {chunk_id[:16]} in {self.store.url} failed: {exc}") from exc

    def _put_object(self, chunk_id: str, blob: bytearray | memoryview, buf: bytearray | None) -> None:
        """One object into the store; a failure is kept for commit. A pooled buffer goes back either way."""
        try:
            self.store.put_chunk(chunk_id, blob)
        except BaseException as exc:
            with self._lock:
                self._errors.append(exc)
            raise
        finally:
            if isinstance(blob, memoryview):
                blob.release()
            if buf is not None:
                BUFFERS.give(buf)  # stores never keep the buffer past put_chunk

    def reuse_chunk(self, region: str, index: int, chunk_id: str, length: int | None = None) -> None:
        """Reference a chunk the parent (or the store) holds. ``length`` is needed for variable-size chunks."""
        self._check_open()
        self.contents.reuse_chunk(region, index, chunk_id, length)

    def reuse_chunks(self, chunks: Iterable[tuple[str, int, str]]) -> None:
        """:meth:`reuse_chunk` of each (region, index, chunk id) of fixed-size chunks, in order, under one hold of
        the lock (:meth:`ImageContents.reuse_chunks`)."""
        self._check_open()
        self.contents.reuse_chunks(chunks)

    def reuse_regions(self, regions: Iterable[tuple[str, Sequence[str]]]) -> None:
        """:meth:`reuse_chunks` of every chunk of each region, ``ids[i]`` at index ``i``; a region the parent holds
        exactly so is taken whole, as its manifest entry (:meth:`ImageContents.reuse_regions`)."""
        self._check_open()
        self.contents.reuse_regions(regions)

    # -- commit

    def _check_open(self) -> None:
        if self._committed:
            raise InvalidInputError("this image writer was already committed")

    def _wait_uploads(self) -> None:
        for fut in list(self._futures):
            try:
                fut.result()
            except BaseException:
                pass
        if self._errors:
            exc = self._errors[0]
            raise TransferError(f"storing chunks in {self.store.url} failed: {exc}") from exc

    def commit(self) -> ImageRef:
        self._check_open()
        try:
            self._wait_uploads()
        finally:
            self._pool.shutdown(wait=True)
            self._end_pacing()
        self._committed = True
        regions = self.contents.region_entries()
        objects = self.contents.objects
        self.store.flush()
        body: dict[str, Any] = {
            "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "sequence": next_sequence(self.parent_body),
            "source": self.source,
            "parent": self.parent_id,
            "chunk_size": self.chunk_size,
            "encryption": "aes-256-gcm" if self.sealer.encrypted else "none",
            "key_id": self.sealer.key_id,
            "regions": regions,
            "objects": dict(objects),  # in any order: the manifest's bytes sort its keys
            "metadata": self._metadata,
        }
        if self.decoders:  # only when needed: images without them keep the manifest of earlier versions
            body["decoders"] = sorted(self.decoders)
        image_id, data = seal_manifest(body, self.sealer)
        self.store.put_manifest(image_id, data)
        remember(self.store.url, image_id, self.sealer.key_id, body)
        self._progress.finish()
        bytes_stored = sum(e[0] for e in objects.values())
        return ImageRef(
            id=image_id,
            store=self.store.url,
            parent=self.parent_id,
            bytes_image=sum(r["nbytes"] for r in regions),
            bytes_sent=self.bytes_sent + len(data),
            bytes_stored=bytes_stored,
        )

    def abort(self) -> None:
        """Stop without writing a manifest (chunks already stored stay, harmless and reusable)."""
        self._committed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._end_pacing()

    def _end_pacing(self) -> None:
        if self._pacer is not None:
            self._pacing, self._pacer = self._pacer.stop(), None
        elif self._limiter.rate is not None:
            self._pacing = fixed_rate_report(self._limiter)

    def pacing(self) -> dict[str, Any]:
        """What this round's pacing did (``pacing.py``), once committed; empty for a round that was not bounded."""
        return self._pacing

    @property
    def seconds(self) -> float:
        return time.monotonic() - self._t0

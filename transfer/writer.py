"""The ImageWriter: hash → dedup → encode → seal in the caller's thread, store in an upload pool.

Callers (the snapshot agent's ring-buffer threads, ``pack_paths``' readers) call ``put_chunk`` from
several threads; each call does the CPU work on its own thread (BLAKE3, zstd, numpy and AES-GCM all
release the GIL) and hands the sealed object to a bounded upload pool, so the caller's buffer is
free as soon as the object is sealed and network writes overlap the next chunk's CPU work. Local
stores (``writes_inline``: a page-cache write, syncs already on their own threads) are written on
the sealing thread instead: no handoff, and the object is still in that core's cache.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from gpumigrate.errors import InvalidInputError, TransferError
from gpumigrate.interfaces import ImageRef, LatencySignal, RegionInfo
from gpumigrate.transfer.buffers import POOL
from gpumigrate.transfer.format import codecs
from gpumigrate.transfer.format.chunkobj import HEADER_SIZE, MAX_RAW_LEN, Sealer, chunk_id_of, parse_header, sealed_size
from gpumigrate.transfer.format.manifest import region_entry, seal_manifest
from gpumigrate.transfer.pacing import PacingController, fixed_rate_report
from gpumigrate.transfer.progress import ProgressCallback, ProgressCounter, RateLimiter
from gpumigrate.transfer.stores import Store

if TYPE_CHECKING:
    from gpumigrate.transfer.reader import StoreImageReader

DEFAULT_CHUNK_SIZE = 4 << 20
UPLOADS = 4  # upload threads (connections, requests in flight) to a remote store when no parallelism is given
# Encoding scratch and sealed objects live in recycled buffers (buffers.py says why).
BUFFERS = POOL
# Manifests this process committed, by (store URL, image id, key id): the next round's writer takes its
# parent from here instead of reading the manifest back and checking its signature (on the freeze → ready
# path). It is the very body this process signed and stored.
_COMMITTED: OrderedDict[tuple[str, str, str | None], dict[str, Any]] = OrderedDict()
_COMMITTED_KEPT = 4
_COMMITTED_LOCK = threading.Lock()
_LAST_SEQUENCE = 0  # the last sequence this process gave a manifest (under _COMMITTED_LOCK)


def next_sequence(parent: dict[str, Any] | None) -> int:
    """A new manifest's ``sequence`` (FORMAT.md, Manifest): the clock in microseconds since the epoch, raised past
    the parent's sequence and past every sequence this process gave before. So an image always sorts after its
    parent and after this process's earlier images, and images of different writers sort as their clocks do."""
    global _LAST_SEQUENCE
    seq = (parent or {}).get("sequence")
    after = seq + 1 if type(seq) is int else 0
    with _COMMITTED_LOCK:
        _LAST_SEQUENCE = max(time.time_ns() // 1000, after, _LAST_SEQUENCE + 1)
        return _LAST_SEQUENCE


def committed_body(store_url: str, image_id: str, key_id: str | None) -> dict[str, Any] | None:
    """The body of a manifest this process committed to ``store_url`` with the key ``key_id``, if kept."""
    with _COMMITTED_LOCK:
        return _COMMITTED.get((store_url, image_id, key_id))


def _remember(store_url: str, image_id: str, key_id: str | None, body: dict[str, Any]) -> None:
    with _COMMITTED_LOCK:
        _COMMITTED[(store_url, image_id, key_id)] = body
        _COMMITTED.move_to_end((store_url, image_id, key_id))
        while len(_COMMITTED) > _COMMITTED_KEPT:
            _COMMITTED.popitem(last=False)


class _Region:
    """One region of the image being written: its chunks by index, or ``whole``, its parent's entry, where it holds
    exactly the parent's chunks (:meth:`StoreImageWriter.reuse_regions`: no record per chunk)."""

    __slots__ = ("chunks", "info", "lengths", "planes", "whole")

    def __init__(self, info: RegionInfo) -> None:
        self.info = info
        self.chunks: dict[int, str] = {}
        self.lengths: dict[int, int] = {}
        self.planes = codecs.PlanePlan()  # byte-plane sample verdicts
        self.whole: dict[str, Any] | None = None

    def entry(self, chunk_size: int) -> dict[str, Any]:
        """Its entry in the manifest body (FORMAT.md, Manifest)."""
        return self.whole if self.whole is not None else region_entry(self.info, self.chunks, self.lengths, chunk_size)


def _same_entry(info: RegionInfo, entry: dict[str, Any], ids: Sequence[str]) -> bool:
    """Whether a parent manifest's region ``entry`` is ``info``'s region holding exactly the chunks ``ids``."""
    shape, want = entry.get("shape"), info.shape
    return (
        entry.get("nbytes") == info.nbytes
        and entry.get("chunks") == ids
        and entry.get("dtype") == info.dtype
        and entry.get("kind") == info.kind
        and entry.get("device") == info.device
        and (shape is None if want is None else shape is not None and len(shape) == len(want) and tuple(shape) == want)
    )


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
        self._parent_objects: dict[str, list[Any]] = dict((parent or {}).get("objects", {}))
        self.parent_body: dict[str, Any] | None = parent  # the verified parent manifest body, if any
        self._parent_reader = parent_reader if delta else None
        # The parent's chunk at each index: delta bases, so only a delta writer needs them (one entry per chunk).
        self._parent_chunks: dict[tuple[str, int], str] = {}
        for reg in (parent or {}).get("regions", []) if self._parent_reader is not None else ():
            for i, cid in enumerate(reg["chunks"]):
                self._parent_chunks[(reg["name"], i)] = cid
        self._listing: dict[str, int] | None = None
        self._parent_regions: dict[str, dict[str, Any]] | None = None
        self._regions: dict[str, _Region] = {}
        self._objects: dict[str, list[Any]] = {}
        self._metadata: dict[str, Any] = {}
        self._lock = threading.RLock()  # re-entered when an object's delta base is looked up
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
        self.bytes_sent = 0
        self.bytes_logical = 0
        self.chunks_new = 0
        self.chunks_reused = 0
        self._progress = ProgressCounter(progress, 0)
        self.decoders: set[str] = set()  # optional decoders a reader needs (FORMAT.md, "decoders")
        self._opened()
        if self._pacer is not None:
            self._pacer.start()  # the base latency: the source's requests before this round moved a byte

    def _opened(self) -> None:
        """A subclass's own set-up, once the writer is ready (the direct writer's slots and queue)."""

    # -- regions and metadata

    def add_region(self, info: RegionInfo) -> None:
        self.add_regions((info,))

    def add_regions(self, infos: Iterable[RegionInfo]) -> None:
        """:meth:`add_region` of each, under one hold of the lock (a round adds a model's hundreds at once)."""
        added = 0
        with self._lock:
            regions = self._regions
            for info in infos:
                if info.name in regions:
                    raise InvalidInputError(f"region {info.name!r} was added twice")
                regions[info.name] = _Region(info)
                added += info.nbytes
        self._progress.grow(added)

    def set_metadata(self, key: str, value: object) -> None:
        with self._lock:
            self._metadata[key] = value

    def _region(self, name: str) -> _Region:
        try:
            return self._regions[name]
        except KeyError:
            raise InvalidInputError(f"unknown region {name!r}: call add_region first") from None

    # -- chunks

    def _record(self, region: _Region, index: int, chunk_id: str, length: int) -> None:
        if index < 0:
            raise InvalidInputError(f"chunk index {index} of region {region.info.name!r} is negative")
        if region.whole is not None:  # a region reused whole gets a chunk of its own: recorded chunk by chunk now
            self._unwhole(region)
        region.chunks[index] = chunk_id
        region.lengths[index] = length

    def _unwhole(self, region: _Region) -> None:
        whole, region.whole = region.whole, None
        assert whole is not None
        ids, sizes = whole["chunks"], whole.get("sizes")
        for i, cid in enumerate(ids):
            region.chunks[i] = cid
            region.lengths[i] = int(sizes[i]) if sizes else self._chunk_length(region, i)

    def _stored_size(self, chunk_id: str) -> int | None:
        if not self.store.prefers_listing:
            return self.store.chunk_size(chunk_id)
        with self._lock:
            if self._listing is None:
                self._listing = self.store.list_chunks()  # once per writer, not one request per chunk
            return self._listing.get(chunk_id)

    def _known_entry(self, chunk_id: str) -> list[Any] | None:
        """An object the image can reference without sending: already in it, in the parent, or in the store."""
        entry = self._objects.get(chunk_id) or self._parent_objects.get(chunk_id)
        if entry is not None:
            return entry
        size = self._stored_size(chunk_id)
        if size is None:
            return None
        header = parse_header(self.store.chunk_header(chunk_id, HEADER_SIZE), chunk_id)
        return [size, header.codec, header.base]

    def _add_object(self, chunk_id: str, entry: list[Any]) -> None:
        self._objects[chunk_id] = entry
        base = entry[2]
        if base and base not in self._objects:
            base_entry = self._parent_objects.get(base)
            if base_entry is None:
                size = self._stored_size(base)
                if size is None:
                    raise TransferError(
                        f"delta base {base[:16]} of chunk {chunk_id[:16]} is missing from {self.store.url}"
                    )
                base_entry = [size, codecs.NONE, None]
            self._objects[base] = base_entry

    def put_chunk(self, region: str, index: int, data: memoryview | bytes | bytearray) -> str:
        self._check_open()
        reg = self._region(region)
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
        if self._claim(reg, index, chunk_id, len(view)):
            self._send(reg, index, chunk_id, view)
        self._progress.add(len(view))
        return chunk_id

    def _claim(self, reg: _Region, index: int, chunk_id: str, length: int) -> bool:
        """Record chunk ``index`` as ``chunk_id``; True when its bytes must be sent (nothing holds them yet)."""
        with self._lock:
            self._record(reg, index, chunk_id, length)
            self.bytes_logical += length
            if chunk_id in self._objects:
                return False
        entry = self._known_entry(chunk_id)
        if entry is None:
            return True
        with self._lock:
            self.chunks_reused += 1
            self._add_object(chunk_id, entry)
        return False

    def _send(self, reg: _Region, index: int, chunk_id: str, view: memoryview) -> None:
        base_id = None
        payload_src = view
        if self._parent_reader is not None:
            parent_cid = self._parent_chunks.get((reg.info.name, index))
            parent_entry = self._parent_objects.get(parent_cid or "")
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
        with self._lock:
            if chunk_id in self._objects:  # another thread sent the same content meanwhile
                BUFFERS.give(buf)
                return
            self._add_object(chunk_id, [len(blob), codec, base_id])
            self.chunks_new += 1
            self.bytes_sent += len(blob)
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
        with self._lock:
            if chunk_id in self._objects:  # another thread sent the same content meanwhile
                return
            self._add_object(chunk_id, [len(blob), codec, None])
            self.chunks_new += 1
            self.bytes_sent += len(blob)
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
        reg = self._region(region)
        with self._lock:
            entry = self._objects.get(chunk_id) or self._parent_objects.get(chunk_id)
        if entry is None:
            entry = self._known_entry(chunk_id)
        if entry is None:
            raise InvalidInputError(
                f"reuse_chunk: chunk {chunk_id[:16]} ({region}[{index}]) is neither in the parent image nor in {self.store.url}"
            )
        if length is None:
            length = self._chunk_length(reg, index)
        with self._lock:
            self._record(reg, index, chunk_id, length)
            self._add_object(chunk_id, entry)
            self.chunks_reused += 1
            self.bytes_logical += length
        self._progress.add(length)

    def reuse_chunks(self, chunks: Iterable[tuple[str, int, str]]) -> None:
        """:meth:`reuse_chunk` of each (region, index, chunk id) of fixed-size chunks, in order: the same records,
        checks and errors, under one hold of the lock (a final round reuses thousands of chunks while the workload
        is frozen). A chunk neither in this image nor in its parent goes through :meth:`reuse_chunk` itself,
        with the lock released: it may ask the store."""
        self._check_open()
        todo = iter(chunks)
        while True:
            done, missing = 0, None
            try:
                with self._lock:
                    regions, objects, parent = self._regions, self._objects, self._parent_objects
                    for region, index, chunk_id in todo:
                        reg = regions.get(region) or self._region(region)
                        entry = objects.get(chunk_id) or parent.get(chunk_id)
                        if entry is None:
                            missing = (region, index, chunk_id)
                            break
                        length = self._chunk_length(reg, index)
                        self._record(reg, index, chunk_id, length)
                        self._add_object(chunk_id, entry)
                        self.chunks_reused += 1
                        self.bytes_logical += length
                        done += length
            finally:
                self._progress.add(done)
            if missing is None:
                return
            self.reuse_chunk(*missing)

    def reuse_regions(self, regions: Iterable[tuple[str, Sequence[str]]]) -> None:
        """:meth:`reuse_chunks` of every chunk of each region, ``ids[i]`` at index ``i``: the same image. Where the
        parent holds the region exactly so (its layout and these ids), its manifest entry is taken whole, with no
        record per chunk (a final round reuses most of a model's regions so); any other goes chunk by chunk."""
        self._check_open()
        parent = self._parent_entries()
        rest: list[tuple[str, int, str]] = []
        done = reused = 0
        with self._lock:
            known, objects, parent_objects = self._regions, self._objects, self._parent_objects
            for name, ids in regions:
                reg = known.get(name) or self._region(name)
                was = parent.get(name)
                if was is not None and not reg.chunks and reg.whole is None and _same_entry(reg.info, was, ids):
                    for cid in ids:
                        if cid in objects:
                            continue
                        entry = parent_objects.get(cid)
                        if entry is None:  # not the parent's after all: the store is asked, chunk by chunk
                            break
                        if entry[2]:
                            self._add_object(cid, entry)  # and its delta base
                        else:
                            objects[cid] = entry
                    else:
                        reg.whole = was
                        reused += len(ids)
                        done += reg.info.nbytes
                        continue
                rest.extend((name, i, cid) for i, cid in enumerate(ids))
            self.chunks_reused += reused
            self.bytes_logical += done
        self._progress.add(done)
        if rest:
            self.reuse_chunks(rest)

    def _parent_entries(self) -> dict[str, dict[str, Any]]:
        """The parent's region entries by name (made once per writer, when first asked)."""
        if self._parent_regions is None:
            self._parent_regions = {r["name"]: r for r in (self.parent_body or {}).get("regions", ())}
        return self._parent_regions

    def _chunk_length(self, reg: _Region, index: int) -> int:
        start = index * self.chunk_size
        if start >= reg.info.nbytes:
            raise InvalidInputError(f"chunk index {index} is past the end of region {reg.info.name!r}")
        return min(self.chunk_size, reg.info.nbytes - start)

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
        regions = [r.entry(self.chunk_size) for r in self._regions.values()]
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
            "objects": dict(self._objects),  # in any order: the manifest's bytes sort its keys
            "metadata": self._metadata,
        }
        if self.decoders:  # only when needed: images without them keep the manifest of earlier versions
            body["decoders"] = sorted(self.decoders)
        image_id, data = seal_manifest(body, self.sealer)
        self.store.put_manifest(image_id, data)
        _remember(self.store.url, image_id, self.sealer.key_id, body)
        self._progress.finish()
        bytes_stored = sum(e[0] for e in self._objects.values())
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

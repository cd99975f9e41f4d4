"""What the image being written lists (FORMAT.md, Manifest): each region's chunks, and the objects they name.

The writer (``writer.py``) owns one :class:`ImageContents` and records every chunk into it: one it sealed
(:meth:`~ImageContents.add_new`), one whose object something already holds (:meth:`~ImageContents.claim`), ones
the parent holds (:meth:`~ImageContents.reuse_chunk`, ``reuse_chunks``, ``reuse_regions``: no bytes move). An
object the image may name without sending is one already in it, in the parent's manifest, or in the store.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

from gpumigrate.errors import InvalidInputError, TransferError
from gpumigrate.interfaces import RegionInfo
from gpumigrate.transfer.format import codecs
from gpumigrate.transfer.format.chunkobj import HEADER_SIZE, parse_header
from gpumigrate.transfer.format.manifest import region_entry
from gpumigrate.transfer.progress import ProgressCounter
from gpumigrate.transfer.stores import Store


class Region:
    """One region of the image being written: its chunks by index, or ``whole``, its parent's entry, where it holds
    exactly the parent's chunks (:meth:`ImageContents.reuse_regions`: no record per chunk)."""

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


class ImageContents:
    """The regions and objects of the image being written, with the parent's it may reference, and their counts.

    Guarded by the writer's lock (``lock``: one hold covers a record and its counts); the bytes recorded are added
    to the writer's ``progress``.
    """

    def __init__(
        self,
        store: Store,
        chunk_size: int,
        parent: dict[str, Any] | None,
        lock: threading.RLock,
        progress: ProgressCounter,
    ) -> None:
        self.store = store
        self.chunk_size = chunk_size
        self.parent_body = parent  # the verified parent manifest body, if any
        self.parent_objects: dict[str, list[Any]] = dict((parent or {}).get("objects", {}))
        self.regions: dict[str, Region] = {}
        self.objects: dict[str, list[Any]] = {}
        self._listing: dict[str, int] | None = None
        self._parent_regions: dict[str, dict[str, Any]] | None = None
        self._lock = lock  # re-entered when an object's delta base is looked up
        self._progress = progress
        self.bytes_sent = 0
        self.bytes_logical = 0
        self.chunks_new = 0
        self.chunks_reused = 0

    # -- regions

    def add_regions(self, infos: Iterable[RegionInfo]) -> None:
        """Each region, under one hold of the lock (a round adds a model's hundreds at once)."""
        added = 0
        with self._lock:
            regions = self.regions
            for info in infos:
                if info.name in regions:
                    raise InvalidInputError(f"region {info.name!r} was added twice")
                regions[info.name] = Region(info)
                added += info.nbytes
        self._progress.grow(added)

    def region(self, name: str) -> Region:
        try:
            return self.regions[name]
        except KeyError:
            raise InvalidInputError(f"unknown region {name!r}: call add_region first") from None

    def region_entries(self) -> list[dict[str, Any]]:
        """The manifest body's ``regions``, in the order they were added."""
        return [r.entry(self.chunk_size) for r in self.regions.values()]

    def _record(self, region: Region, index: int, chunk_id: str, length: int) -> None:
        if index < 0:
            raise InvalidInputError(f"chunk index {index} of region {region.info.name!r} is negative")
        if region.whole is not None:  # a region reused whole gets a chunk of its own: recorded chunk by chunk now
            self._unwhole(region)
        region.chunks[index] = chunk_id
        region.lengths[index] = length

    def _unwhole(self, region: Region) -> None:
        whole, region.whole = region.whole, None
        assert whole is not None
        ids, sizes = whole["chunks"], whole.get("sizes")
        for i, cid in enumerate(ids):
            region.chunks[i] = cid
            region.lengths[i] = int(sizes[i]) if sizes else self._chunk_length(region, i)

    def _chunk_length(self, reg: Region, index: int) -> int:
        start = index * self.chunk_size
        if start >= reg.info.nbytes:
            raise InvalidInputError(f"chunk index {index} is past the end of region {reg.info.name!r}")
        return min(self.chunk_size, reg.info.nbytes - start)

    # -- objects

    def _stored_size(self, chunk_id: str) -> int | None:
        if not self.store.prefers_listing:
            return self.store.chunk_size(chunk_id)
        with self._lock:
            if self._listing is None:
                self._listing = self.store.list_chunks()  # once per writer, not one request per chunk
            return self._listing.get(chunk_id)

    def _known_entry(self, chunk_id: str) -> list[Any] | None:
        """An object the image can reference without sending: already in it, in the parent, or in the store."""
        entry = self.objects.get(chunk_id) or self.parent_objects.get(chunk_id)
        if entry is not None:
            return entry
        size = self._stored_size(chunk_id)
        if size is None:
            return None
        header = parse_header(self.store.chunk_header(chunk_id, HEADER_SIZE), chunk_id)
        return [size, header.codec, header.base]

    def _add_object(self, chunk_id: str, entry: list[Any]) -> None:
        self.objects[chunk_id] = entry
        base = entry[2]
        if base and base not in self.objects:
            base_entry = self.parent_objects.get(base)
            if base_entry is None:
                size = self._stored_size(base)
                if size is None:
                    raise TransferError(
                        f"delta base {base[:16]} of chunk {chunk_id[:16]} is missing from {self.store.url}"
                    )
                base_entry = [size, codecs.NONE, None]
            self.objects[base] = base_entry

    # -- chunks

    def claim(self, reg: Region, index: int, chunk_id: str, length: int) -> bool:
        """Record chunk ``index`` as ``chunk_id``; True when its bytes must be sent (nothing holds them yet)."""
        with self._lock:
            self._record(reg, index, chunk_id, length)
            self.bytes_logical += length
            if chunk_id in self.objects:
                return False
        entry = self._known_entry(chunk_id)
        if entry is None:
            return True
        with self._lock:
            self.chunks_reused += 1
            self._add_object(chunk_id, entry)
        return False

    def add_new(self, chunk_id: str, entry: list[Any]) -> bool:
        """An object just sealed (``entry``: its size, codec, base); False where another thread sent the same content
        meanwhile (this one is then not stored)."""
        with self._lock:
            if chunk_id in self.objects:
                return False
            self._add_object(chunk_id, entry)
            self.chunks_new += 1
            self.bytes_sent += entry[0]
        return True

    def reuse_chunk(self, region: str, index: int, chunk_id: str, length: int | None = None) -> None:
        """Reference a chunk the parent (or the store) holds. ``length`` is needed for variable-size chunks."""
        reg = self.region(region)
        with self._lock:
            entry = self.objects.get(chunk_id) or self.parent_objects.get(chunk_id)
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
        todo = iter(chunks)
        while True:
            done, missing = 0, None
            try:
                with self._lock:
                    regions, objects, parent = self.regions, self.objects, self.parent_objects
                    for region, index, chunk_id in todo:
                        reg = regions.get(region) or self.region(region)
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
        parent = self._parent_entries()
        rest: list[tuple[str, int, str]] = []
        done = reused = 0
        with self._lock:
            known, objects, parent_objects = self.regions, self.objects, self.parent_objects
            for name, ids in regions:
                reg = known.get(name) or self.region(name)
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

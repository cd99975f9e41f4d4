"""The ImageReader: opens a manifest only after its id, key and signature check out; verifies every chunk."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import Any

from gpumigrate.errors import IntegrityError, InvalidInputError, TransferError
from gpumigrate.interfaces import ImageRef, RegionInfo
from gpumigrate.transfer.device import gpucodec
from gpumigrate.transfer.format.chunkobj import Sealer, parse_header
from gpumigrate.transfer.format.manifest import open_manifest
from gpumigrate.transfer.stores import Store, check_image_id

BASE_CACHE_BYTES = 64 << 20
# RegionInfo objects by their fields, shared by the readers of one process: a frozen dataclass costs a fifth of a
# microsecond per field to make, and the images of one migration (the pre-copy rounds, then the final one) describe
# the same hundreds of regions again and again (looked up here, they cost the final restore's downtime half).
_INFOS: dict[tuple[Any, ...], RegionInfo] = {}
_INFOS_MAX = 1 << 16  # a bound, not a tuning: past it the table starts again
_INT = frozenset({int})
KNOWN_DECODERS = {gpucodec.DECODER}  # FORMAT.md, "decoders": optional decoders this reader can name


def _region_info(fields: tuple[Any, ...]) -> RegionInfo:
    """A new RegionInfo (positional: a fifth faster than by keyword), kept in ``_INFOS`` if its dimensions are whole
    numbers (1, 1.0 and True are one key, not one RegionInfo) and its fields hashable."""
    info = RegionInfo(*fields)
    shape = fields[4]
    if not shape or _INT.issuperset(map(type, shape)):
        if len(_INFOS) >= _INFOS_MAX:
            _INFOS.clear()
        with contextlib.suppress(TypeError):  # an unhashable field: not kept
            _INFOS[fields] = info
    return info


class StoreImageReader:
    """Implements :class:`gpumigrate.interfaces.ImageReader` over a :class:`Store`."""

    def __init__(self, store: Store, image_id: str, sealer: Sealer) -> None:
        self.store = store
        self.sealer = sealer
        check_image_id(image_id)  # before it names anything in a store
        self.body: dict[str, Any] = open_manifest(store.get_manifest(image_id), image_id, sealer)
        self.image_id = image_id
        unknown = sorted(set(self.body.get("decoders") or ()) - KNOWN_DECODERS)
        if unknown:
            raise TransferError(
                f"image {image_id[:16]} needs decoder(s) {', '.join(unknown)}, which this version of gpumigrate "
                f"does not have (it knows: {', '.join(sorted(KNOWN_DECODERS))})"
            )
        self.chunk_size: int = int(self.body["chunk_size"])
        self._regions: dict[str, dict[str, Any]] = {r["name"]: r for r in self.body["regions"]}
        self.objects: dict[str, list[Any]] = self.body["objects"]
        self._base_cache: dict[str, bytes] = {}
        self._base_lock = threading.Lock()
        self.ref = ImageRef(
            id=image_id,
            store=store.url,
            parent=self.body.get("parent"),
            bytes_image=sum(map(int, map(itemgetter("nbytes"), self.body["regions"]))),
            bytes_stored=sum(map(int, map(itemgetter(0), self.objects.values()))),
        )

    def regions(self) -> Sequence[RegionInfo]:
        out: list[RegionInfo] = []
        for r in self.body["regions"]:
            shape = r.get("shape")
            if shape is not None:
                shape = tuple(shape)
            fields = (r["name"], int(r["nbytes"]), r.get("kind", "tensor"), r.get("dtype"), shape, r.get("device"))
            try:
                info = _INFOS.get(fields) if not shape or _INT.issuperset(map(type, shape)) else None
            except TypeError:  # an unhashable field (a malformed manifest): the agent's checks say what is wrong
                info = None
            out.append(info or _region_info(fields))
        return out

    def metadata(self) -> Mapping[str, Any]:
        return dict(self.body.get("metadata") or {})

    def _region(self, name: str) -> dict[str, Any]:
        try:
            return self._regions[name]
        except KeyError:
            raise InvalidInputError(f"image {self.image_id[:16]} has no region {name!r}") from None

    def chunk_count(self, region: str) -> int:
        return len(self._region(region)["chunks"])

    def chunk_ids(self, region: str) -> list[str]:
        return list(self._region(region)["chunks"])

    def chunk_length(self, region: str, index: int) -> int:
        reg = self._region(region)
        if not 0 <= index < len(reg["chunks"]):
            raise InvalidInputError(f"region {region!r} has {len(reg['chunks'])} chunks, not index {index}")
        if reg.get("sizes"):
            return int(reg["sizes"][index])
        return min(self.chunk_size, int(reg["nbytes"]) - index * self.chunk_size)

    def chunk_offset(self, region: str, index: int) -> int:
        reg = self._region(region)
        if reg.get("sizes"):
            return sum(int(n) for n in reg["sizes"][:index])
        return index * self.chunk_size

    def _fetch(self, chunk_id: str) -> bytes:
        if not self.store.readable:
            raise InvalidInputError(
                f"{self.store.url} is write-only: read the image's chunks from the receiver's store"
            )
        try:
            return self.store.get_chunk(chunk_id)
        except TransferError as exc:
            raise IntegrityError(f"image {self.image_id[:16]}: {exc.message}") from None

    def read_object(self, chunk_id: str) -> bytes:
        """Verified plaintext of one object by id (used for delta bases; cached, bases are few)."""
        with self._base_lock:
            cached = self._base_cache.get(chunk_id)
        if cached is not None:
            return cached
        blob = self._fetch(chunk_id)
        out = bytearray(parse_header(blob, chunk_id).raw_len)  # parse_header bounds the length
        n = self.sealer.open_into(chunk_id, blob, memoryview(out), self.read_object)
        plain = bytes(out[:n])
        with self._base_lock:
            # Bases repeat across neighbouring chunks only; a small bounded cache is enough.
            if sum(len(v) for v in self._base_cache.values()) + len(plain) > BASE_CACHE_BYTES:
                self._base_cache.clear()
            self._base_cache[chunk_id] = plain
        return plain

    def read_chunk_into(self, region: str, index: int, out: memoryview) -> int:
        length = self.chunk_length(region, index)
        out = memoryview(out)
        if out.format != "B" or out.ndim != 1:
            out = out.cast("B")
        if len(out) < length:
            raise InvalidInputError(f"buffer of {len(out)} bytes is too small for {region}[{index}] ({length} bytes)")
        chunk_id = self._region(region)["chunks"][index]
        n = self.sealer.open_into(chunk_id, self._fetch(chunk_id), out, self.read_object, where=f" ({region}[{index}])")
        if n != length:
            raise IntegrityError(f"chunk {region}[{index}] holds {n} bytes, the manifest says {length}")
        return n

    def read_region(self, region: str) -> bytearray:
        """A whole region in one buffer (convenience for small regions and tests)."""
        reg = self._region(region)
        buf = bytearray(int(reg["nbytes"]))
        view = memoryview(buf)
        for i in range(len(reg["chunks"])):
            off = self.chunk_offset(region, i)
            self.read_chunk_into(region, i, view[off : off + self.chunk_length(region, i)])
        return buf

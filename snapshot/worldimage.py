"""The world image: one image holding every rank's regions, and the manifest of the world (PROTOCOL.md).

Each rank's agent commits its own image (its chunks, written in parallel by every rank). One agent
then composes the world image from them: each rank image's regions renamed ``rank<r>/<region>``,
every chunk referenced by its id (no byte is copied: chunks are content addressed), and the
metadata key ``world`` with the world size, the freeze step and, per rank, its image, its devices
and GPUs, and its own snapshot metadata. The world image is an ordinary image of the transfer
format, signed like any other, so it is pushed, verified and audited as one. A target rank restores
its part through :func:`rank_view`, which shows it as the image its rank committed (with the reader's direct
placement where the reader has it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from gpumigrate.errors import SnapshotError
from gpumigrate.interfaces import (
    DirectImageReader,
    ImageReader,
    ImageRef,
    ImageWriter,
    RegionInfo,
    TensorChunk,
    reads_directly,
)
from gpumigrate.snapshot.chunks import chunk_count
from gpumigrate.snapshot.errors import ImageMismatchError

WORLD_KEY = "world"
WORLD_FORMAT = 1
SNAPSHOT_KEY = "snapshot"  # the agent's own metadata key (agent.META_KEY)
RANK_FIELDS = ("host", "pid", "devices", "gpus", "backend", "local_rank", "agent")


def rank_prefix(rank: int) -> str:
    return f"rank{rank}/"


def _snapshot_meta(reader: ImageReader) -> Mapping[str, Any]:
    meta = reader.metadata().get(SNAPSHOT_KEY)
    if not isinstance(meta, Mapping) or not isinstance(meta.get("chunks"), Mapping):
        raise SnapshotError(f"image {reader.ref.id} is not an agent's snapshot image: it cannot join a world image")
    return meta


def compose(
    writer: ImageWriter, readers: Sequence[ImageReader], ranks: Sequence[Mapping[str, Any]], *, step: int | None
) -> ImageRef:
    """Write the world image of ``readers`` (rank r's image at index r) into ``writer`` and commit it.

    ``ranks[r]`` describes rank r where it ran (``RANK_FIELDS``). Each rank image must say it is
    rank r of this world (the agent records it), and all must share the writer's chunk size.
    """
    n = len(readers)
    if n == 0 or len(ranks) != n:
        raise SnapshotError(f"a world image needs one image and one description per rank; got {n} and {len(ranks)}")
    entries: list[dict[str, Any]] = []
    for r, reader in enumerate(readers):
        meta = _snapshot_meta(reader)
        own = meta.get("rank") or {}
        if own.get("rank") != r or own.get("world_size") != n:
            raise ImageMismatchError(
                f"image {reader.ref.id} was written by rank {own.get('rank')} of {own.get('world_size')}, "
                f"not by rank {r} of {n}"
            )
        cs = int(meta["chunk_size"])
        if cs != writer.chunk_size:
            raise SnapshotError(f"rank {r}'s image has {cs}-byte chunks, the world image {writer.chunk_size}")
        table: Mapping[str, Sequence[str]] = meta["chunks"]
        for info in reader.regions():
            name = rank_prefix(r) + info.name
            writer.add_region(replace(info, name=name))
            ids = table.get(info.name) or ()
            if len(ids) != chunk_count(info.nbytes, cs):
                raise ImageMismatchError(f"rank {r}'s image lists {len(ids)} chunks for {info.name}")
            for i, cid in enumerate(ids):
                writer.reuse_chunk(name, i, cid)
        described = {k: v for k, v in ranks[r].items() if k in RANK_FIELDS}
        entries.append({"rank": r, "image": reader.ref.id, **described, SNAPSHOT_KEY: dict(meta)})
    writer.set_metadata(WORLD_KEY, {"format": WORLD_FORMAT, "world_size": n, "step": step, "ranks": entries})
    return writer.commit()


def world_of(reader: ImageReader) -> dict[str, Any] | None:
    """The image's world manifest, checked; None for an image of one process."""
    world = reader.metadata().get(WORLD_KEY)
    if world is None:
        return None
    if not isinstance(world, Mapping) or world.get("format") != WORLD_FORMAT:
        raise SnapshotError(f"image {reader.ref.id} has a world manifest of an unknown format")
    n = world.get("world_size")
    ranks = world.get("ranks")
    if (
        not isinstance(n, int)
        or n < 1
        or not isinstance(ranks, list)
        or [e.get("rank") for e in ranks] != list(range(n))
    ):
        raise SnapshotError(
            f"image {reader.ref.id}: its world manifest (world_size {n!r}) does not list every rank once, in order"
        )
    return dict(world)


class RankView:
    """Rank r's part of a world image, read as the image that rank committed (an ImageReader)."""

    def __init__(self, reader: ImageReader, rank: int) -> None:
        world = world_of(reader)
        if world is None:
            raise ImageMismatchError(f"image {reader.ref.id} is not a world image: restore it without a rank")
        if not 0 <= rank < world["world_size"]:
            raise ImageMismatchError(f"image {reader.ref.id} holds ranks 0..{world['world_size'] - 1}, not rank {rank}")
        self._reader = reader
        self._prefix = rank_prefix(rank)
        self.world: dict[str, Any] = world
        self.entry: dict[str, Any] = world["ranks"][rank]
        self.ref = reader.ref

    def source(self) -> dict[str, Any]:
        """Where this rank ran on the source: its manifest entry less its snapshot metadata."""
        entry = {k: v for k, v in self.entry.items() if k != SNAPSHOT_KEY}
        return {**entry, "world_size": self.world["world_size"], "step": self.world.get("step")}

    def regions(self) -> list[RegionInfo]:
        p = self._prefix
        return [replace(i, name=i.name[len(p) :]) for i in self._reader.regions() if i.name.startswith(p)]

    def metadata(self) -> dict[str, Any]:
        return {SNAPSHOT_KEY: self.entry[SNAPSHOT_KEY]}

    def chunk_count(self, region: str) -> int:
        return self._reader.chunk_count(self._prefix + region)

    def read_chunk_into(self, region: str, index: int, out: memoryview) -> int:
        return self._reader.read_chunk_into(self._prefix + region, index, out)


class DirectRankView(RankView):
    """Rank r's part of a world image whose reader places chunks itself (a DirectImageReader): a rank restores
    through the same direct path (fetch, open, decode, copy, verify into the tensor on its device) as a process
    restoring its own image.

    ``read_tensors`` is a method of the class, not an attribute found through ``__getattr__``: from Python 3.12,
    ``isinstance`` against a runtime-checkable Protocol looks attributes up statically (``inspect.getattr_static``),
    so a view that offered it dynamically passed the check on 3.11 and failed it on the GPU machines' 3.12, and
    every rank restored chunk by chunk through the pipeline's host ring (issue 32: 3.2 GB/s against 21.7)."""

    def __init__(self, reader: DirectImageReader, rank: int) -> None:
        super().__init__(reader, rank)
        self._direct = reader

    def read_tensors(self, chunks: Sequence[TensorChunk]) -> int:
        prefix = self._prefix
        return self._direct.read_tensors([TensorChunk(prefix + c.region, c.index, c.data) for c in chunks])


def rank_view(reader: ImageReader, rank: int) -> RankView:
    """Rank ``rank``'s part of the world image ``reader`` reads: with direct placement exactly when ``reader`` has it
    (by the same rule as the pipeline's choice of path)."""
    return DirectRankView(reader, rank) if reads_directly(reader) else RankView(reader, rank)


def rank_reader(reader: ImageReader, rank: int | None, own: Mapping[str, int] | None) -> ImageReader:
    """What a process restores from ``reader``: rank ``rank``'s part of a world image (default: its
    own rank), or a plain image. ``own``: this process's ``{"rank", "world_size"}``, None for a
    process that is no rank. A rank or world size that does not fit is refused before any load."""
    world = world_of(reader)
    if world is None:
        if rank is not None:
            raise ImageMismatchError(f"image {reader.ref.id} is not a world image: restore it without a rank")
        meta = reader.metadata().get(SNAPSHOT_KEY)
        written_by = meta.get("rank") if isinstance(meta, Mapping) else None
        if own is not None and written_by is not None and dict(written_by) != dict(own):
            raise ImageMismatchError(
                f"image {reader.ref.id} holds rank {written_by.get('rank')} of {written_by.get('world_size')}; "
                f"this process is rank {own['rank']} of {own['world_size']}"
            )
        return reader
    if own is None and rank is None:
        raise ImageMismatchError(
            f"image {reader.ref.id} is a world image of {world['world_size']} ranks: name the rank to restore"
        )
    if own is not None:
        rank = own["rank"] if rank is None else rank
        if (rank, world["world_size"]) != (own["rank"], own["world_size"]):
            raise ImageMismatchError(
                f"asked to restore rank {rank} of a world of {world['world_size']} into rank {own['rank']} "
                f"of {own['world_size']}: rank r's state goes to rank r of a world of the same size"
            )
    assert rank is not None
    return rank_view(reader, rank)

"""Loading an image into the tracked state (the target's restore), and its fill from the source's memory.

The image is checked against the live model first (names, shapes, dtypes) and against the plan's
environment policy, then only the chunks that differ from what an earlier pre-load put into the very same
tensors are loaded; the workload reports ready only after the last byte (``ready=False``: a pre-load, the
target stays unready and the next load moves only what changed). With a source to fill from (one host),
the tensors' chunks are copied out of the source's memory and checked against the image's ids
(``fill.py``); blobs, and chunks the source changed since its image, are read from the image.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gpumigrate.errors import SnapshotError
from gpumigrate.interfaces import ImageReader, RegionInfo, reads_directly
from gpumigrate.snapshot import tracked as tr
from gpumigrate.snapshot.chunks import byte_view, chunk_count
from gpumigrate.snapshot.engine.capture import FORMAT, META_KEY
from gpumigrate.snapshot.engine.clock import Phases
from gpumigrate.snapshot.engine.pipelines import Pipelines
from gpumigrate.snapshot.engine.state import EngineState
from gpumigrate.snapshot.engine.tracking import Tracker
from gpumigrate.snapshot.environment import check_policy, env_facts
from gpumigrate.snapshot.errors import ImageMismatchError
from gpumigrate.snapshot.fill import Filler, runs_of
from gpumigrate.snapshot.pipeline import Job
from gpumigrate.snapshot.worldimage import RankView, rank_reader


@dataclass
class LoadPlan:
    """The chunks one load moves: read from the image (by device) or filled from the source; those it skips."""

    targets: dict[str, torch.Tensor]
    from_image: dict[str, list[Job]] = field(default_factory=dict)
    from_source: list[tuple[str, int]] = field(default_factory=list)
    skipped: int = 0


class Loader:
    """The restore side of the engine, and what the last pre-load put where."""

    def __init__(
        self,
        tracker: Tracker,
        pipelines: Pipelines,
        state: EngineState,
        *,
        rank_id: Callable[[], dict[str, int] | None],
        filler: Filler | None,
        set_ready: Callable[[bool], None] | None,
        before_ready: Callable[[], None] | None = None,
    ) -> None:
        self.tracker = tracker
        self.pipelines = pipelines
        self.state = state
        self.rank_id = rank_id
        self.filler = filler
        self.set_ready = set_ready
        self.before_ready = before_ready  # the workload takes over its work in flight (work.py) before it is ready
        self.loaded: dict[str, tuple[int, list[str]]] = {}  # region -> (destination data_ptr, chunk ids)
        self._loaded_cs = 0  # chunk size of the pre-loaded image (ids compare only at the same size)
        self.unready: str | None = None  # the image the last load put here without making it ready

    def run(
        self,
        reader: ImageReader,
        *,
        policy: Mapping[str, str] | None,
        ready: bool,
        rank: int | None,
        source: str | None,
        control_key: bytes | None,
        clock: Phases,
    ) -> dict[str, Any]:
        """Load ``reader``'s image (rank ``rank``'s part of a world image) into the tracked state; see the module."""
        reader = rank_reader(reader, rank, self.rank_id())
        meta = reader.metadata().get(META_KEY)
        if not isinstance(meta, Mapping) or meta.get("format") != FORMAT:
            raise SnapshotError(f"image {reader.ref.id} is not a gpumigrate snapshot image of format {FORMAT}")
        env = check_policy(meta.get("environment") or {}, env_facts(), policy)
        regions = {r.name: r for r in reader.regions()}
        cs = int(meta["chunk_size"])
        # The chunk ids by region, read in place: the manifest's own lists, never changed (no copy of a model's many ids).
        table: Mapping[str, list[str]] = meta["chunks"]
        plan = self._plan(reader, regions, meta, table, cs, fill=source is not None)
        self.loaded, self.unready = {}, None  # unknown until this load completes
        if self.set_ready is not None:
            self.set_ready(False)
        self.state.ready = False
        clock.mark("check")
        loaded = 0
        for device, jobs in plan.from_image.items():
            loaded += self.pipelines.get(torch.device(device), cs).read_into(reader, jobs)
        clock.mark("from_image")
        filled: dict[str, Any] = {}
        if plan.from_source:
            assert source is not None and control_key is not None
            moved, filled = self._fill(reader, source, plan, table, cs, control_key)
            loaded += moved
        clock.mark("from_source")
        owned = self.tracker.by_item(plan.targets)
        for item in self.tracker.items:
            item.after_restore((meta.get("items") or {}).get(item.prefix) or {}, owned[item.prefix])
        # the manifest's lists themselves (nothing changes them): what this pre-load put where
        self.loaded = (
            {}
            if ready
            else {k: (t.data_ptr(), got) for k, t in plan.targets.items() if (got := table.get(k)) is not None}
        )
        self._loaded_cs = cs
        self.state.last_image = reader.ref
        self.state.state_version += 1
        clock.mark("after")
        if ready:
            self._ready()
        else:
            self.unready = reader.ref.id
        clock.mark("ready")
        return {
            "image": reader.ref.id,
            "bytes_loaded": loaded,
            "chunks_loaded": sum(len(j) for j in plan.from_image.values()) + len(plan.from_source),
            "chunks_skipped": plan.skipped,
            # how chunks read from the image landed: "direct" (the reader fills and verifies each tensor where it
            # lives) or "ring" (chunk by chunk through the pipeline's host ring): a world's rank restores as directly
            # as a process restoring its own image (issue 32)
            "placement": "direct" if reads_directly(reader) else "ring",
            "ready": ready,
            "seconds": clock.seconds(),
            # where the seconds went: opening the reader (the manifest read and its signature checked), waiting
            # for the engine, checking the manifest against the model, chunks read from the image, chunks filled
            # from the source, the items' own restore hooks, the switch to ready
            "phases": clock.phases(),
            "environment": env,
            **({"from_source": filled} if filled else {}),
            **({"world": reader.source()} if isinstance(reader, RankView) else {}),
        }

    def mark_ready(self, image_id: str) -> dict[str, Any]:
        """Report ready on image ``image_id``, which the last load put here unready (the orchestrator restored the
        final image that way, then had the source's confirmation of it: PROTOCOL.md, ``ready``). Nothing is
        loaded: that load checked and loaded every chunk. A target already ready on it answers so again."""
        clock = Phases()
        last = self.state.last_image
        if self.state.ready and last is not None and last.id == image_id and self.unready is None:
            return {"image": image_id, "ready": True, "already": True, "seconds": 0.0, "phases": {}}
        if self.unready != image_id:
            now = f"image {self.unready[:16]} is" if self.unready else "no image is"
            raise SnapshotError(
                f"image {image_id[:16]} was not loaded here unready ({now}): restore it with ready false first"
            )
        self._ready()
        clock.mark("ready")
        return {
            "image": image_id,
            "ready": True,
            "already": False,
            "seconds": clock.seconds(),
            "phases": clock.phases(),
        }

    def _ready(self) -> None:
        """The workload serves (or trains) on the state loaded: its work in flight taken over first (work.py)."""
        self.loaded, self.unready = {}, None  # it runs now: what a pre-load put where no longer holds
        if self.before_ready is not None:
            self.before_ready()
        if self.set_ready is not None:
            self.set_ready(True)
        self.state.ready = True

    def forget(self) -> None:
        """Nothing counts as pre-loaded any more (the tracked memory was rewritten)."""
        self.loaded, self.unready = {}, None

    def _plan(
        self,
        reader: ImageReader,
        regions: Mapping[str, RegionInfo],
        meta: Mapping[str, Any],
        table: Mapping[str, list[str]],
        cs: int,
        *,
        fill: bool,
    ) -> LoadPlan:
        """Every chunk of the image: skipped (this tensor holds it from a pre-load), filled, or read."""
        plan = LoadPlan(targets(self.tracker, regions, meta))
        before = self.loaded if self._loaded_cs == cs else {}  # ids compare only at the same chunk size
        count, ids_of, loaded_before = reader.chunk_count, table.get, before.get  # bound once: 500 regions
        for name, dst in plan.targets.items():
            n = chunk_count(dst.numel() * dst.element_size(), cs)
            ids = ids_of(name, ())
            if count(name) != n or len(ids) != n:
                raise ImageMismatchError(f"region {name}: image has {count(name)} chunks, {n} expected")
            blob = regions[name].kind == "blob"
            prev = loaded_before(name)
            # Skip a chunk only if it went into this very tensor before and its content id is unchanged.
            have = prev[1] if prev is not None and not blob and prev[0] == dst.data_ptr() else None
            if have is not None and have == ids:  # the whole region is loaded already (most are)
                plan.skipped += n
                continue
            view = byte_view(dst)
            for i in range(n):
                if have is not None and have[i] == ids[i]:
                    plan.skipped += 1
                    continue
                if fill and not blob:  # a blob is re-serialized at each read
                    plan.from_source.append((name, i))
                    continue
                plan.from_image.setdefault(str(view.device), []).append(Job(name, i, view[i * cs : (i + 1) * cs]))
        return plan

    def _fill(
        self,
        reader: ImageReader,
        source: str,
        plan: LoadPlan,
        table: Mapping[str, Sequence[str]],
        cs: int,
        control_key: bytes,
    ) -> tuple[int, dict[str, Any]]:
        """The plan's chunks copied out of the source's memory (``fill.py``), each checked against ``table``; those
        the source changed since its image (a KV cache that serves on) are read from the image instead."""
        assert self.filler is not None
        views = {k: byte_view(v) for k, v in plan.targets.items()}
        chunks = plan.from_source
        landed = self.filler.land(source, views, runs_of(chunks), table, cs, control_key=control_key)
        again: dict[str, list[Job]] = {}
        for name, i in landed.failed:
            again.setdefault(str(views[name].device), []).append(Job(name, i, views[name][i * cs : (i + 1) * cs]))
        moved = landed.bytes_moved - sum(j.data.numel() for jobs in again.values() for j in jobs)
        for device, jobs in again.items():
            moved += self.pipelines.get(torch.device(device), cs).read_into(reader, jobs)
        return moved, {
            "way": landed.way,
            "chunks": len(chunks) - len(landed.failed),
            "chunks_from_image": len(landed.failed),
            "seconds": round(landed.seconds, 4),
            "phases": dict(landed.phases),
        }


def targets(tracker: Tracker, regions: Mapping[str, RegionInfo], meta: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors the image's regions load into, checked: the same names, shapes and dtypes as the image's."""
    found: dict[str, torch.Tensor] = {}
    owned = tracker.by_item(regions)
    items_meta = meta.get("items") or {}
    for item in tracker.items:
        found.update(item.targets(owned[item.prefix], items_meta.get(item.prefix) or {}))
    if found.keys() != regions.keys():  # one set comparison; the names only when they differ
        missing = sorted(set(found) - set(regions))
        extra = sorted(set(regions) - set(found))
        raise ImageMismatchError(
            "image does not fit this workload: "
            + (f"missing in image: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; " if missing else "")
            + (f"not tracked here: {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}" if extra else "")
        )
    problems = []
    names: dict[torch.dtype, str] = {}  # dtype -> its name, once per dtype rather than once per region
    for name, dst in found.items():
        info = regions[name]
        if info.kind == "blob":
            continue
        dtype = dst.dtype
        dtype_name = names.get(dtype) or names.setdefault(dtype, tr.dtype_name(dtype))
        shape = info.shape if type(info.shape) is tuple else tuple(info.shape or ())
        if info.dtype != dtype_name or shape != dst.shape:  # torch.Size: a tuple
            problems.append(f"{name}: image {info.dtype}{list(shape)}, model {dtype_name}{list(dst.shape)}")
    if problems:
        raise ImageMismatchError(
            "image shapes/dtypes do not match the model: "
            + "; ".join(problems[:5])
            + " (the target allocates its own tensors, so each must have the source's shape and dtype when it "
            "moves: build the model from the same config, and allocate state that grows, such as an appended "
            "cache, at its full size, e.g. a ring buffer with a fill count in state)"
        )
    return found

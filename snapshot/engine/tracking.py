"""What the engine captures and restores: the tracked items (``tracked.py``) and their regions.

Each item owns a prefix; a region is named by its item's prefix, or a path under it, so prefixes
never nest (two items may not claim one region). The region descriptions of the last round are kept
and handed out again where nothing changed: a round's 500 regions are nearly always those of the
round before, and building them is most of a round's bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch

from gpumigrate.errors import SnapshotError
from gpumigrate.interfaces import RegionInfo
from gpumigrate.snapshot import tracked as tr
from gpumigrate.snapshot.chunks import byte_view

_V = TypeVar("_V")
Live = dict[str, tuple[tr.Item, torch.Tensor]]
_Kept = tuple[torch.Tensor, int, torch.dtype, torch.Size, torch.Tensor, RegionInfo]  # tensor, address, ..., view, info


@dataclass
class _ItemRegions:
    """One item's regions as the last round made them, from the mapping of tensors it handed out then."""

    item: tr.Item
    tensors: Mapping[str, torch.Tensor]
    live: Live
    views: dict[str, torch.Tensor]
    infos: dict[str, RegionInfo]
    kept: dict[str, _Kept]


class Tracker:
    """The tracked items, in the order they were added, and their regions as they are now."""

    def __init__(self, parked: Callable[[], bool] = lambda: False) -> None:
        self.items: list[tr.Item] = []
        self._infos: dict[str, RegionInfo] = {}  # the last round's region infos (reused where unchanged)
        # the last round's regions, by item: each tensor's view and info, reused for the very same tensor at the same
        # address (a frozen round's, and a frozen source's next, find them all so), the whole item's for the very
        # same mapping of tensors
        self._last: dict[int, _ItemRegions] = {}
        self.parked = parked  # whether the workload is parked (no step can be running): a module's safe read
        self._owners: dict[str, str] = {}  # region name -> the prefix of the item that owns it (by_item)

    # ------------------------------------------------------------------ what to track
    def track(self, item: tr.Item) -> None:
        """Track a ready-made item (``tracked.py``); the methods below build the usual ones."""
        for other in self.items:
            if (
                other.prefix == item.prefix
                or other.prefix.startswith(item.prefix + "/")
                or item.prefix.startswith(other.prefix + "/")
            ):
                raise SnapshotError(f"tracked name {item.prefix!r} overlaps {other.prefix!r}: pick distinct names")
        if isinstance(item, tr.ModuleItem):
            item.parked = self.parked
        self.items.append(item)

    def track_module(self, name: str, module: torch.nn.Module) -> None:
        self.track(tr.ModuleItem(name, module))

    def track_optimizer(self, name: str, optimizer: torch.optim.Optimizer) -> None:
        self.track(tr.OptimizerItem(name, optimizer))

    def track_tensor(self, name: str, tensor: torch.Tensor) -> None:
        self.track(tr.TensorsItem(name, lambda: {"": tensor}))

    def track_tensors(
        self, name: str, tensors: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]]
    ) -> None:
        self.track(tr.TensorsItem(name, tensors if callable(tensors) else (lambda: tensors)))

    def track_state(
        self, name: str, getter: Callable[[], Any], setter: Callable[[Any], None], *, raw: bool = False
    ) -> None:
        """Arbitrary state: JSON values by default, bytes with ``raw=True``."""
        self.track(tr.BlobItem(name, getter, setter) if raw else tr.json_blob(name, getter, setter))

    def track_rng(self, name: str = "rng", *, cuda_devices: list[int] | None = None) -> None:
        for item in tr.rng_items(name, cuda_devices=cuda_devices):
            self.track(item)

    # ------------------------------------------------------------------ the regions now
    def live(self) -> Live:
        """Every region's tensor as it is now, with the item that owns it."""
        out: Live = {}
        for item in self.items:
            for name, tensor in item.tensors().items():
                out[name] = (item, tensor)
        return out

    def regions(self) -> tuple[Live, dict[str, torch.Tensor], dict[str, RegionInfo]]:
        """Every region as a round captures it: its tensor and item (:meth:`live`), its bytes (a flat uint8 view)
        and its :class:`RegionInfo`. The view and info of the very tensor object the last round had, at the same
        address, are that round's: between two rounds of a model nearly every tensor is, and a view and an info per
        tensor were most of a frozen round's bookkeeping (downtime). An item that hands out the very mapping of
        the last round (a module whose layout is unchanged: ``tracked.ModuleItem``) gets all of that round's at once."""
        live: Live = {}
        views: dict[str, torch.Tensor] = {}
        infos: dict[str, RegionInfo] = {}
        made: dict[int, _ItemRegions] = {}
        for item in self.items:
            tensors = item.tensors()
            was = self._last.get(id(item))
            if was is not None and was.item is item and was.tensors is tensors:
                mine = was
            else:
                mine = _ItemRegions(item, tensors, {}, {}, {}, {})
                last = was.kept if was is not None else {}
                for name, t in tensors.items():
                    hit = last.get(name)
                    address, dtype, shape = t.data_ptr(), t.dtype, t.shape
                    if hit is not None and hit[0] is t and hit[1] == address and hit[2] is dtype and hit[3] == shape:
                        view, info = hit[4], hit[5]
                    else:
                        view, info = byte_view(t), self.region_info(name, item, t)
                    mine.live[name], mine.views[name], mine.infos[name] = (item, t), view, info
                    mine.kept[name] = (t, address, dtype, shape, view, info)
            live.update(mine.live)
            views.update(mine.views)
            infos.update(mine.infos)
            made[id(item)] = mine
        self._last = made
        return live, views, infos

    @staticmethod
    def describe(name: str, item: tr.Item, t: torch.Tensor) -> RegionInfo:
        return RegionInfo(name, *_region_fields(item, t))

    def region_info(self, name: str, item: tr.Item, t: torch.Tensor) -> RegionInfo:
        """:meth:`describe`, the last round's object where every field is the same (RegionInfo is frozen)."""
        fields = _region_fields(item, t)
        was = self._infos.get(name)
        if was is not None and (was.nbytes, was.kind, was.dtype, was.shape, was.device) == fields:
            return was
        info = self._infos[name] = RegionInfo(name, *fields)
        return info

    def by_item(self, regions: Mapping[str, _V]) -> dict[str, dict[str, _V]]:
        """``regions`` split by the tracked item that owns each (its prefix, or a path under it), in their order.

        Prefixes never nest (:meth:`track`), so the owner is the one item prefix among the name and its parents,
        and a name keeps the owner once found (items are only ever added): a lookup per region, where asking every
        item about every region cost a model's 500 regions times the items, twice on the freeze → ready path."""
        out: dict[str, dict[str, _V]] = {item.prefix: {} for item in self.items}
        owners = self._owners
        for name, value in regions.items():
            owner = owners.get(name)
            if owner is None:
                owner = name
                while owner not in out:
                    cut = owner.rfind("/")
                    if cut < 0:
                        break
                    owner = owner[:cut]
                else:
                    owners[name] = owner
                    out[owner][name] = value
                continue
            out[owner][name] = value
        return out

    def metadata(self) -> dict[str, dict[str, Any]]:
        """Each item's small JSON metadata, as an image records it."""
        return {it.prefix: it.meta() for it in self.items}


def devices(regions: list[RegionInfo]) -> list[str]:
    """The accelerators the tensor regions live on (what a restore onto other GPUs maps), or ``["cpu"]`` for a
    workload on none. Host tensors beside GPU ones (an optimizer's ``step`` counters stay on the CPU) are not a
    device of the rank: every host has a CPU, and naming it would pair a rank's CPU with another's GPU."""
    found = {r.device for r in regions if r.kind != "blob" and r.device}
    return sorted(found - {"cpu"}) or ["cpu"]


def _region_fields(
    item: tr.Item, t: torch.Tensor
) -> tuple[int, Literal["tensor", "blob"], str | None, tuple[int, ...] | None, str]:
    """RegionInfo's fields after the name: nbytes, kind, dtype, shape, device."""
    if isinstance(item, tr.BlobItem):
        return t.numel() * t.element_size(), "blob", None, None, str(t.device)
    return t.numel() * t.element_size(), "tensor", tr.dtype_name(t.dtype), tuple(t.shape), str(t.device)

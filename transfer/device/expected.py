"""The chunk ids a device landing's bytes must hash to, as BLAKE3 words on the regions' device.

One table for every region (one copy to the device, not one per region), each region's rows a view into it, so a
landing compares every chunk of a pass with one gather and one wait for the device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from gpumigrate.errors import IntegrityError
from gpumigrate.transfer.device.channel import chunk_spans
from gpumigrate.transfer.device.devhash import ids_to_words

if TYPE_CHECKING:
    import torch


class ExpectedIds:
    """The expected ids of ``regions`` (flat uint8 tensors cut into ``chunk_size`` chunks), named region by region."""

    def __init__(self, regions: Mapping[str, torch.Tensor], chunk_size: int) -> None:
        self._regions = regions
        self._chunk_size = chunk_size
        self._ids: dict[str, list[str]] = {}
        self._table: torch.Tensor | None = None
        self._first_row: dict[str, int] = {}  # region -> its first row in the table
        self._rows: dict[str, torch.Tensor] = {}  # region -> its rows (a view into the table)

    def set(self, expected: Mapping[str, Sequence[str]]) -> None:
        """Take the ids of every region named (others keep theirs); each must name every chunk of its region."""
        for name, ids in expected.items():
            region = self._regions.get(name)
            if region is None or len(ids) != len(chunk_spans(region.numel(), self._chunk_size)):
                raise IntegrityError(f"expected ids for region {name!r} do not match its chunks")
        if not expected:
            return
        known = {name: ids for name, ids in self._ids.items() if name not in expected}
        self._ids = {**known, **{name: list(ids) for name, ids in expected.items()}}
        device = next(iter(self._regions.values())).device
        names = list(self._ids)
        self._table = ids_to_words([i for name in names for i in self._ids[name]], device)
        self._first_row, at = {}, 0
        for name in names:
            self._first_row[name] = at
            self._rows[name] = self._table[at : at + len(self._ids[name])]
            at += len(self._ids[name])

    def rows(self, name: str) -> torch.Tensor:
        """Region ``name``'s expected words ``[chunks, 8]``; an IntegrityError where none were given."""
        found = self._rows.get(name)
        if found is None:
            raise IntegrityError(f"no expected ids for region {name!r}: nothing landed there can be trusted")
        return found

    def differing(self, keys: Sequence[tuple[str, int]], words: Sequence[torch.Tensor]) -> list[int]:
        """The positions in ``keys`` ((region, chunk index) of each row of ``words``, wherever they were hashed) whose
        words differ from the expected ones: one gather of the expected words and one wait for the device."""
        import torch

        missing = sorted({name for name, _ in keys} - set(self._rows))
        if missing:
            self.rows(missing[0])  # raises, naming it
        table = self._table
        assert table is not None  # made with the first expected ids, which every region named here has
        at = torch.tensor([self._first_row[name] + i for name, i in keys], dtype=torch.int64, pin_memory=table.is_cuda)
        at = at.to(table.device, non_blocking=True)
        got = torch.cat([w.to(table.device) for w in words])
        positions: list[int] = (got != table[at]).any(dim=1).nonzero().flatten().tolist()
        return positions

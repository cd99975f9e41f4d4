"""Written ranges a workload reports for a tracked tensor: which chunks a round ships, with no fingerprint pass.

A tensor whose writer knows what it wrote (a KV cache: one row per running request per decode step)
gives the engine a *report*: a callable that returns the byte ranges ``(offset, length)`` written since
its previous call and starts a new record, or ``None`` when it cannot say. A round of a region shipped
before with this layout then ships the chunks those ranges touch and references every other chunk of
the last image: no fingerprint pass over the tensor and, in the frozen round, no BLAKE3 of its
unchanged chunks (hashing a 10 GB cache to find the few rows a step wrote is most of a final round).
The report is the contract: a write it does not report does not move (``agent/README.md``).

Ranges are taken at the start of a round, before any byte of it is read, and kept until the round
that took them commits: a round that fails loses none, the next one ships them too. A write reported
after the take belongs to the next round, whether or not this round's copy already saw it. On a GPU
a report is made when the write is *queued*, so the round waits for every device holding a reported
tensor (``settle``) before it reads: the bytes it copies then hold every write it was told about.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from gpumigrate.errors import SnapshotError

Ranges = list[tuple[int, int]]
Report = Callable[[], Sequence[tuple[int, int]] | None]


class WrittenRanges:
    """The reports of the regions that have one, and the ranges taken but not yet committed."""

    def __init__(self) -> None:
        self.reports: dict[str, Report] = {}
        self._pending: dict[str, Ranges] = {}  # taken by a round that has not committed yet

    def watch(self, region: str, report: Report) -> None:
        if not callable(report):
            raise SnapshotError(f"the written-ranges report of {region!r} must be callable; got {type(report)}")
        self.reports[region] = report
        self._pending.pop(region, None)

    def take(self, live: Mapping[str, torch.Tensor]) -> dict[str, Ranges | None]:
        """Every watched live region's ranges since the last committed round (``None``: the report could not say,
        so this round compares the region's fingerprints as any other's)."""
        out: dict[str, Ranges | None] = {}
        for region, report in self.reports.items():
            tensor = live.get(region)
            if tensor is None:
                continue
            got = report()
            if got is None:
                self._pending.pop(region, None)  # the fingerprint pass covers them
                out[region] = None
                continue
            ranges = self._pending.setdefault(region, [])
            ranges.extend(_checked(region, got, tensor.numel() * tensor.element_size()))
            out[region] = list(ranges)
        return out

    def committed(self) -> None:
        """The round that took the pending ranges committed: they are in an image now."""
        self._pending.clear()


def settle(tensors: Iterable[torch.Tensor]) -> None:
    """Wait until every write queued to the devices of ``tensors`` is done (a report is made when a write is queued)."""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.synchronize(device)


def chunks_of(ranges: Ranges, chunk_size: int) -> list[int]:
    """The indices of the chunks the byte ranges touch, in order."""
    hit: set[int] = set()
    for offset, length in ranges:
        if length > 0:
            hit.update(range(offset // chunk_size, (offset + length - 1) // chunk_size + 1))
    return sorted(hit)


def _checked(region: str, got: Sequence[tuple[int, int]], nbytes: int) -> Ranges:
    out: Ranges = []
    for item in got:
        try:
            offset, length = (int(v) for v in item)
        except (TypeError, ValueError):
            raise SnapshotError(
                f"the written ranges of {region!r} must be (offset, length) pairs; got {item!r}"
            ) from None
        if offset < 0 or length < 0 or offset + length > nbytes:
            raise SnapshotError(f"the written range ({offset}, {length}) of {region!r} is outside its {nbytes} bytes")
        out.append((offset, length))
    return out

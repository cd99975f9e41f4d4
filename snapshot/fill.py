"""Filling a target straight from the source's memory: the runs of chunks that move, and the two ends' calls.

On one host the target's agent need not read the image's chunks from the store: it asks the source's
agent (``lend``, PROTOCOL.md) to hand over the very bytes, and checks each chunk's BLAKE3 against the
image's signed manifest where it landed (on the GPU for device memory). The image is still written
to the store (audit, rollback, a later resume read it); only the target's load takes the short way.

Only chunks the target lacks move: the restore names them as **runs** (consecutive chunks of one
region), and both ends cut the same slices of their tensors from the runs, so a run is one landing
region on the target and one lent region on the source. The moving itself (CUDA IPC or NIXL READs,
the device hash kernels) belongs to the transfer engine; the SDK hands the agent a :class:`Filler`
(``agent/fill.py``), as it hands it the image writer and reader.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gpumigrate.errors import SnapshotError

MAX_RUNS = 1 << 20  # a run per chunk of a 4 TiB state at 4 MiB chunks; more is a malformed request


@dataclass(frozen=True)
class Run:
    """Chunks ``first .. first+count-1`` of region ``region``."""

    region: str
    first: int
    count: int

    @property
    def name(self) -> str:
        """The run's name at both ends of the move: its landing region on the target, its lent region on the source."""
        return f"{self.region}@{self.first}"

    def to_json(self) -> list[Any]:
        return [self.region, self.first, self.count]


def runs_of(chunks: Iterable[tuple[str, int]]) -> list[Run]:
    """Consecutive chunk indices of one region merged into runs, in the order given."""
    runs: list[Run] = []
    for region, index in chunks:
        last = runs[-1] if runs else None
        if last is not None and last.region == region and last.first + last.count == index:
            runs[-1] = Run(region, last.first, last.count + 1)
        else:
            runs.append(Run(region, index, 1))
    return runs


def runs_arg(value: Any) -> list[Run]:
    """``runs`` of a ``lend`` request: a list of ``[region, first, count]``, checked."""
    if not isinstance(value, list) or not value or len(value) > MAX_RUNS:
        raise SnapshotError(f"runs must be a non-empty list of [region, first, count] (at most {MAX_RUNS})")
    runs = []
    for item in value:
        ok = isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in item[1:])
        if not ok or item[1] < 0 or item[2] < 1:
            raise SnapshotError(f"run {str(item)[:60]}: must be [region name, first chunk >= 0, count >= 1]")
        runs.append(Run(item[0], item[1], item[2]))
    return runs


def slices(views: Mapping[str, torch.Tensor], runs: Sequence[Run], chunk_size: int) -> dict[str, torch.Tensor]:
    """Each run's bytes in ``views`` (flat uint8 views by region), keyed by :attr:`Run.name`."""
    out: dict[str, torch.Tensor] = {}
    for run in runs:
        view = views.get(run.region)
        if view is None:
            raise SnapshotError(f"region {run.region!r} is not tracked here")
        start, end = run.first * chunk_size, min((run.first + run.count) * chunk_size, view.numel())
        if start >= end or (run.first + run.count - 1) * chunk_size >= view.numel():
            raise SnapshotError(f"chunks {run.first}..{run.first + run.count - 1} lie outside region {run.region!r}")
        out[run.name] = view[start:end]
    return out


@dataclass(frozen=True)
class Landed:
    """What a fill moved: bytes, the chunks that failed their check (``(region, index)``), seconds, how."""

    bytes_moved: int
    failed: list[tuple[str, int]]
    seconds: float
    way: str  # "lend" (CUDA IPC, device memory) or "pull" (NIXL READs)
    phases: Mapping[str, float] = field(default_factory=dict)  # where the seconds went (sharing, opening, hashing)


class Filler(Protocol):
    """The transfer engine's two ends of a fill, wired by the SDK (``agent/fill.py``)."""

    def land(
        self,
        source: str,
        targets: Mapping[str, torch.Tensor],
        runs: Sequence[Run],
        expected: Mapping[str, Sequence[str]],
        chunk_size: int,
        *,
        control_key: bytes,
    ) -> Landed:
        """Target: land ``runs`` of ``targets`` (flat views by region) from the source agent at ``source``,
        each chunk checked against ``expected`` (ids by region). Chunks that still fail their check after the
        retries (the source changed them since the image) are returned, for the restore to read from the image."""
        ...

    def lend(
        self, landing: str, tensors: Mapping[str, torch.Tensor], *, control_key: bytes, tolerate: bool
    ) -> dict[str, Any]:
        """Source: move ``tensors`` (flat views by run name) into the landing listening at ``landing``."""
        ...


def failed_chunks(names: Iterable[str], runs: Sequence[Run]) -> list[tuple[str, int]]:
    """The landing's failure names (``"<run name>[<index in run>]"``) as ``(region, chunk index)``."""
    by_name = {run.name: run for run in runs}
    out = []
    for name in names:
        run_name, _, rest = name.rpartition("[")
        run = by_name.get(run_name)
        if run is None or not rest.rstrip("]").isdigit():
            raise SnapshotError(f"the landing named a chunk {name[:80]!r} of no run it was given")
        out.append((run.region, run.first + int(rest.rstrip("]"))))
    return out

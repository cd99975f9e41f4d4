"""What a live capture round may take from the source's host: the plan's transfer bounds, one small value.

The plan's ``transfer.parallelism``, ``transfer.rate_limit`` and ``transfer.pacing`` become one
:class:`TransferBounds`; the flow sends it with every pre-copy round (``precopy``'s ``options`` on the agent's wire,
snapshot/PROTOCOL.md), and the workload's SDK hands it to the image writer: ``parallelism`` is the number of host
threads that seal and store the round's chunks, ``rate_limit`` caps the bytes per second the round moves (its
device copies included), ``pacing: adaptive`` slows the round down while the source's own requests slow down and
speeds it up again when they do not (transfer/pacing.py). A frozen round (the final one: the source serves nobody
then) is not bounded: it takes every core, so that the downtime stays short.

Several ranks on one host share the host's bounds: :meth:`TransferBounds.share` gives each its part.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

PACING_MODES = ("adaptive", "off")
Pacing = Literal["adaptive", "off"]
MAX_PARALLELISM = 64
MIN_RATE = 1 << 20  # bytes/s: a cap below 1 MiB/s would make a pre-copy of any real model last for days
OPTION_KEYS = ("parallelism", "rate_limit", "pacing")  # the bounds' keys among a round's writer options

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*(?:/\s*s)?\s*$")


def parse_rate(value: object) -> int:
    """Bytes per second from a whole number or a size per second such as ``500MB/s``, ``2GiB/s``, ``1.5G``
    (decimal units, or binary ones with ``i``). ValueError names what is allowed."""
    if isinstance(value, bool):
        raise ValueError("must be bytes per second: a whole number, or a size such as 500MB/s or 2GiB/s")
    if isinstance(value, int | float):
        rate = float(value)
    elif isinstance(value, str) and (m := _RATE.match(value)):
        power = "_kmgt".index(m.group(2).lower()) if m.group(2) else 0
        rate = float(m.group(1)) * (1024 if m.group(3) else 1000) ** power
    else:
        raise ValueError(
            f"{str(value)[:40]!r} is not a rate: give bytes per second, or a size such as 500MB/s or 2GiB/s"
        )
    if rate < MIN_RATE:
        raise ValueError(f"{rate:.0f} bytes/s is below the smallest cap allowed, {MIN_RATE} (1 MiB/s)")
    return int(rate)


@dataclass(frozen=True)
class TransferBounds:
    """What one live capture round may take from its host (see the module docstring).

    ``parallelism``: host threads that seal and store chunks (None: one per core). ``rate_limit``: bytes per
    second the round moves (None: no cap). ``pacing``: "adaptive" yields to the source's request latency."""

    parallelism: int | None = None
    rate_limit: int | None = None
    pacing: Pacing = "off"

    def __post_init__(self) -> None:
        p = self.parallelism
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= MAX_PARALLELISM):
            raise ValueError(f"parallelism {p!r}: must be a whole number from 1 to {MAX_PARALLELISM}")
        if self.rate_limit is not None:
            parse_rate(self.rate_limit)
        if self.pacing not in PACING_MODES:
            raise ValueError(f"pacing {self.pacing!r}: allowed are {', '.join(PACING_MODES)}")

    def share(self, parts: int) -> TransferBounds:
        """One of ``parts`` equal shares (ranks of one world on the same host): threads and bytes per second
        divided, each share keeping at least one thread and the smallest cap; pacing as it is."""
        if parts <= 1:
            return self
        return TransferBounds(
            None if self.parallelism is None else max(1, self.parallelism // parts),
            None if self.rate_limit is None else max(MIN_RATE, self.rate_limit // parts),
            self.pacing,
        )

    def options(self) -> dict[str, int | str]:
        """The bounds as a round's writer options on the agent's wire (only those that are set)."""
        out: dict[str, int | str] = {"pacing": self.pacing}
        if self.parallelism is not None:
            out["parallelism"] = self.parallelism
        if self.rate_limit is not None:
            out["rate_limit"] = self.rate_limit
        return out

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> TransferBounds:
        """The bounds among a round's writer options (other keys ignored); ValueError names a bad one."""
        rate = options.get("rate_limit")
        return cls(
            options.get("parallelism"),
            None if rate is None else parse_rate(rate),
            options.get("pacing", "off"),
        )


__all__ = ["MAX_PARALLELISM", "MIN_RATE", "OPTION_KEYS", "PACING_MODES", "TransferBounds", "parse_rate"]

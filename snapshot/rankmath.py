"""A world's ranks as the orchestrator counts them (``world.py``): where each rank's agent listens, its share of
a round's bounds, and an error named by the rank it came from. No torch here: this runs in the orchestrator."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gpumigrate.errors import GpumigrateError, InvalidInputError
from gpumigrate.snapshot.client import parse_address


def rank_addresses(address: str, ranks: int) -> list[str]:
    """Rank r's agent address: ``address``'s host, its port + r (the SDK's rule for a group); one rank: as spelt."""
    host, port = parse_address(address)
    if ranks < 1 or port + ranks - 1 > 65535:
        raise InvalidInputError(f"{ranks} ranks from {address}: ports past 65535 or no rank at all")
    return [address] if ranks == 1 else [f"{host}:{port + r}" for r in range(ranks)]


def shares(options: Mapping[str, Any], hosts: Sequence[str]) -> list[dict[str, Any]]:
    """Each rank's part of a round's writer options: the ranks of one host share its bounds (``parallelism``
    threads, ``rate_limit`` bytes/s) in equal parts, each keeping at least one thread and 1 MiB/s; the other
    options as they are. ``hosts[r]``: the host rank r runs on."""
    per_host = {h: hosts.count(h) for h in hosts}
    out = []
    for host in hosts:
        parts, mine = per_host[host], dict(options)
        if parts > 1 and isinstance(mine.get("parallelism"), int):
            mine["parallelism"] = max(1, mine["parallelism"] // parts)
        if parts > 1 and isinstance(mine.get("rate_limit"), int):
            mine["rate_limit"] = max(1 << 20, mine["rate_limit"] // parts)
        out.append(mine)
    return out


def ranked(exc: GpumigrateError, rank: int, address: str) -> GpumigrateError:
    """The same error, its message naming the rank it came from."""
    out = type(exc).__new__(type(exc))
    GpumigrateError.__init__(out, f"rank {rank} ({address}): {exc.message}", hint=exc.hint)
    return out

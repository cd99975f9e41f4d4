"""A round's fingerprints of every chunk where it lives, and the host's BLAKE3 confirmation of unchanged chunks.

Each device's fingerprints are launched on a side stream of that device (after a device-wide sync, so
everything the workload queued is in the bytes) and under that device (the stream's context makes it
the thread's current device): the engine's request thread may run on any device's behalf, and a kernel
launched while another device is current cannot reach the tensors (``fp_kernels.py`` sets the device
at its own launches as well). Results stay on the device until :func:`read_back`, one copy per device.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from gpumigrate.interfaces import ChunkRun
from gpumigrate.snapshot.chunks import Fingerprints, unchanged_by_hash
from gpumigrate.snapshot.pipeline import Job


@dataclass
class DeviceFingerprints:
    """One round's fingerprints, still on their devices: a set per device and the side streams computing them."""

    sets: list[Fingerprints]
    streams: list[torch.cuda.Stream]


def fingerprint_all(views: Mapping[str, torch.Tensor], chunk_size: int) -> DeviceFingerprints:
    """Fingerprints of every chunk of ``views``, launched on a side stream per GPU so that they can overlap the
    first copies."""
    by_device: dict[torch.device, dict[str, torch.Tensor]] = {}
    for name, view in views.items():
        by_device.setdefault(view.device, {})[name] = view
    sets: list[Fingerprints] = []
    side: list[torch.cuda.Stream] = []
    for device, mine in by_device.items():
        if device.type != "cuda":
            sets.append(Fingerprints(mine, chunk_size))
            continue
        torch.cuda.synchronize(device)
        side.append(torch.cuda.Stream(device=device))
        with torch.cuda.stream(side[-1]):
            sets.append(Fingerprints(mine, chunk_size))
    return DeviceFingerprints(sets, side)


def read_back(fps: DeviceFingerprints) -> dict[str, list[int]]:
    """Every region's fingerprints as Python ints, once the side streams computed them."""
    for stream in fps.streams:  # the reads below come after the fingerprint kernels
        torch.cuda.current_stream(stream.device).wait_stream(stream)
    out: dict[str, list[int]] = {}
    for one in fps.sets:
        out.update(one.to_host())
    return out


def chunk_fingerprints(pieces: Sequence[torch.Tensor], chunk_size: int) -> list[int]:
    """The fingerprint of each piece (one chunk each), read back once."""
    found = Fingerprints({str(k): p for k, p in enumerate(pieces)}, chunk_size).to_host()
    return [found[str(k)][0] for k in range(len(pieces))]


def chunk_jobs(name: str, view: torch.Tensor, indices: Iterable[int], cs: int) -> list[Job]:
    """Jobs for chunks ``indices`` of region ``name``: a region of one chunk is its own piece (no slice made)."""
    if view.numel() <= cs:
        return [Job(name, i, view) for i in indices]
    return [Job(name, i, view[i * cs : (i + 1) * cs]) for i in indices]


def confirm_on_host(runs: Sequence[ChunkRun], cs: int) -> list[list[bool]]:
    """Whether each run's chunks still hash to their ids (BLAKE3 on the host, a device's bytes copied there)."""
    out = []
    for run in runs:
        pieces = [job.data for job in chunk_jobs(run.region, run.view, run.indices, cs)]
        out.append(unchanged_by_hash(pieces, run.ids, None))
    return out

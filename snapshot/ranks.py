"""One rank of a process group (``torch.distributed``) as the agent sees it, and the GPU map of a world.

A workload of N ranks embeds one agent per rank. Each agent knows its rank, the world size, the
group's backend and two hooks: ``teardown`` destroys the group's communicators before an in-place
capture of the whole process (the CUDA driver checkpoint or CRIU cannot capture NCCL communicators;
NVIDIA's answer is to tear them down and build them again), ``rebuild`` builds them again after the
restore, or on a rollback. The public SDK (``gpumigrate.agent``) makes the group from the user's
``process_group``; this module knows nothing of torch.distributed itself.

``visible_gpu_uuids`` lists every GPU this process sees: what ``world.gpu_pairs`` completes a
world's rank → GPU map over for the CUDA driver's restore.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from gpumigrate.errors import SnapshotError


@dataclass
class RankGroup:
    """This process's place in its group and the hooks that tear the group down and build it again."""

    rank: int
    world_size: int
    backend: str
    local_rank: int
    teardown: Callable[[], None]
    rebuild: Callable[[], None]
    torn_down: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise SnapshotError(f"rank {self.rank} is outside a world of {self.world_size}")

    def describe(self, devices: Iterable[str]) -> dict[str, Any]:
        """What ``info`` reports and the world manifest records for this rank."""
        used = sorted(set(devices))
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "backend": self.backend,
            "group": "torn down" if self.torn_down else "up",
            "host": socket.gethostname(),
            "pid": os.getpid(),  # what a backend that captures whole processes (the CUDA driver's) acts on
            "devices": used,
            "gpus": gpu_facts(used),
        }


def _uuid(props: torch.cuda._CudaDeviceProperties) -> str | None:
    """The GPU's UUID in the driver's form, GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx (torch prints it bare)."""
    raw = getattr(props, "uuid", None)
    if raw is None:
        return None
    digits = str(raw).removeprefix("GPU-").replace("-", "").lower()
    if len(digits) != 32:
        return str(raw)
    return f"GPU-{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"


def gpu_facts(devices: Iterable[str]) -> list[dict[str, Any]]:
    """Index, UUID and model of each CUDA device in ``devices``. The UUID names the physical GPU
    whatever ``CUDA_VISIBLE_DEVICES`` renumbered, so a map between hosts or GPUs is stated in UUIDs."""
    out: list[dict[str, Any]] = []
    for name in devices:
        dev = torch.device(name)
        if dev.type != "cuda" or not torch.cuda.is_available():
            continue
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        out.append(
            {
                "device": f"cuda:{index}",
                "uuid": _uuid(props),
                "name": props.name,
                "memory_bytes": int(props.total_memory),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            }
        )
    return out


def visible_gpu_uuids() -> list[str]:
    """UUIDs of every GPU this process's CUDA runtime sees, in index order."""
    if not torch.cuda.is_available():
        return []
    return [u for i in range(torch.cuda.device_count()) if (u := _uuid(torch.cuda.get_device_properties(i)))]

"""What the reference workloads of N ranks share: joining the group, each rank's device, JSON events.

Started once per rank by torchrun (``python -m torch.distributed.run --standalone --nproc-per-node N
-m gpumigrate.workloads.<job> ...``), which sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the
rendezvous (``MASTER_ADDR``/``MASTER_PORT``); any launcher that sets those works too. On CUDA rank r
uses ``cuda:<devices[r]>`` (``--devices 1,0`` puts rank 0 on GPU 1: a world restored onto swapped
GPUs) and the group talks NCCL; on the CPU, gloo.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Rank:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def parse_devices(text: str | None) -> list[int] | None:
    """``"1,0"`` → [1, 0]: rank r's CUDA device index; None: each rank on its local rank's device."""
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"--devices {text!r}: a comma-separated list of CUDA device indices, one per rank") from None


def join(device: str, devices: list[int] | None) -> Rank:
    """Join the process group (env://) and pick this rank's device; the backend follows the device."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        if devices is not None and len(devices) <= local_rank:
            raise SystemExit(f"--devices names {len(devices)} device(s); local rank {local_rank} has none")
        dev = torch.device("cuda", devices[local_rank] if devices is not None else local_rank)
        torch.cuda.set_device(dev)
        backend = "nccl"
    elif device == "cpu":
        dev, backend = torch.device("cpu"), "gloo"
    else:
        raise SystemExit(f"--device {device!r}: cpu or cuda")
    dist.init_process_group(backend)
    return Rank(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend)


def emit(event: str, **fields: Any) -> None:
    """One JSON line on stdout (torchrun gathers every rank's)."""
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()

"""``attach(..., process_group=...)``: this process as one rank of a torch.distributed group.

Each rank attaches its own agent; rank r's listens on ``GPUMIGRATE_AGENT_ADDR``'s port + its local
rank (``LOCAL_RANK``, set by torchrun; else its rank), so one address names the whole world.

NCCL communicators cannot be checkpointed (NVIDIA's answer: tear them down, build them again), so
around an in-place capture of the whole process (the CUDA driver's checkpoint, CRIU) the
orchestrator sends ``teardown`` and, after the restore or on a rollback, ``rebuild``:

- teardown: the user's ``on_teardown()`` (drop what holds the group: a DDP wrapper), then
  ``torch.distributed.destroy_process_group()``;
- rebuild: the default group is created again with the same backend, rank and world size, through
  ``env://`` (torchrun's store, or ``MASTER_ADDR``/``MASTER_PORT``) under a fresh key prefix (the
  store still holds the first rendezvous's addresses), then the user's ``on_rebuild()`` (subgroups,
  DDP wrappers).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

import torch

from gpumigrate.snapshot.ranks import RankGroup

Hook = Callable[[], None]


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def rank_group(process_group: Any, on_teardown: Hook | None, on_rebuild: Hook | None) -> RankGroup:
    """The RankGroup of ``process_group`` (``torch.distributed.group.WORLD``, or any group this
    process belongs to); TypeError names what is allowed."""
    dist = _dist()
    if not dist.is_available() or not dist.is_initialized():
        raise TypeError(
            "attach(process_group=...) needs torch.distributed initialised first: "
            "call torch.distributed.init_process_group(...) before attach()"
        )
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            "attach(process_group=...) takes a torch.distributed ProcessGroup (e.g. torch.distributed.group.WORLD); "
            f"got {type(process_group).__qualname__}"
        )
    for name, hook in (("on_teardown", on_teardown), ("on_rebuild", on_rebuild)):
        if hook is not None and not callable(hook):
            raise TypeError(f"attach({name}=...) takes a function of no arguments")
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise TypeError("attach(process_group=...): this process is not a member of that group")
    world = dist.get_world_size(process_group)
    backend = str(dist.get_backend(process_group))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return RankGroup(
        rank=rank,
        world_size=world,
        backend=backend,
        local_rank=local_rank,
        teardown=_teardown(on_teardown),
        rebuild=_rebuild(backend, rank, world, on_rebuild),
    )


def _teardown(user: Hook | None) -> Hook:
    def teardown() -> None:
        if user is not None:
            user()
        dist = _dist()
        if dist.is_initialized():
            dist.destroy_process_group()

    return teardown


def _rebuild(backend: str, rank: int, world: int, user: Hook | None) -> Hook:
    generation = itertools.count(1)

    def rebuild() -> None:
        dist = _dist()
        store, _, _ = next(dist.rendezvous("env://", rank, world))
        prefixed = dist.PrefixStore(f"gpumigrate/rebuild/{next(generation)}", store)
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world)
        if user is not None:
            user()

    return rebuild


def rank_address(host: str, port: int, group: RankGroup) -> tuple[str, int]:
    """Where this rank's agent listens: the base port + the local rank (port 0 stays 0: a free one)."""
    return host, (port + group.local_rank if port else 0)


def cuda_devices(tensors: dict[str, torch.Tensor]) -> list[int] | None:
    """The CUDA devices a rank's model lives on (its RNG streams travel by position); None: none."""
    found = sorted({t.get_device() for t in tensors.values() if t.is_cuda})
    return found or None

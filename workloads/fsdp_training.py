"""A fully sharded data-parallel training job of N ranks (FSDP2: ``torch.distributed.fsdp.fully_shard``).

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m gpumigrate.workloads.fsdp_training \\
        --steps 200 --device cpu|cuda [--devices 1,0] [--params-mb N] [--step-delay-ms 0]

How large models train: every parameter is a DTensor sharded over the ranks (each rank holds 1/N of every layer),
gathered for the forward and backward of its layer and sharded again, its gradients reduce-scattered; the AdamW
moments are sharded like the parameters. The job embeds the public SDK like any user's: ``gm.attach(model,
optimizer=..., state=..., process_group=WORLD)``, and what travels per rank is that rank's local shards of the
parameters and of the optimizer's moments, its step counter, its data generator and its RNG streams (the SDK takes
a DTensor's local shard, and on a fresh target it shards the optimizer's moments like their parameters). The
model's layers are the data-parallel job's (``dp_training.build``), so the two compare directly.

Each rank prints ``{"event": "step", "rank", "step", "loss"}`` per step; ``{"event": "done", ...}`` at the end.
``--params-mb`` sizes the whole model (before sharding): a rank's state is about 3 × N / ranks MB.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import gpumigrate.agent as gm
from gpumigrate.workloads.dp_training import INPUTS, build, shape_for
from gpumigrate.workloads.ranked import Rank, emit, join, parse_devices


def sharded_model(args: argparse.Namespace, me: Rank) -> torch.nn.Module:
    """The model with each Linear layer and the whole sharded over the world. On a target (awaiting the restore)
    the layers are made on the meta device and get empty shards: the restore brings their bytes."""
    width, depth = shape_for(args.params_mb)
    target = gm.awaiting_restore()
    if target:
        with torch.device("meta"):
            model = build(width, depth, args.dropout)
    else:
        torch.manual_seed(args.seed)  # the same full weights on every rank before each keeps its shard
        with me.device:
            model = build(width, depth, args.dropout)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    if target:
        model.to_empty(device=me.device)
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpumigrate.workloads.fsdp_training", description=__doc__)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--devices", default=None, help="rank r's CUDA device index, e.g. 1,0 (default: its local rank)")
    p.add_argument("--params-mb", type=float, default=None)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--step-delay-ms", type=float, default=0.0)
    args = p.parse_args(argv)

    me = join(args.device, parse_devices(args.devices))
    model = sharded_model(args, me)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # Each rank draws its own shard of the data stream; the generator travels with the rank's state.
    state: dict[str, Any] = {"step": 0, "data": torch.Generator().manual_seed(args.seed * 1000 + me.rank)}
    handle = gm.attach(model, optimizer=optimizer, state=state, process_group=dist.group.WORLD)
    emit("attached", rank=me.rank, world_size=me.world_size, agent=handle.address, device=str(me.device))

    while state["step"] < args.steps:
        with handle.safe_point() as step:  # a group freeze parks every rank here, after the same step
            x = torch.randn(args.batch, INPUTS, generator=state["data"]).to(me.device)
            y = x[:, :8].sum(1, keepdim=True).sin()
            loss = F.mse_loss(model(x), y)  # all-gathers each layer's shards, then reduce-scatters its gradients
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state["step"] += 1
            value = loss.item()
            step.report(loss=value)
        emit("step", rank=me.rank, step=state["step"], loss=value)
        if args.step_delay_ms:
            time.sleep(args.step_delay_ms / 1000)
    handle.close()
    dist.destroy_process_group()
    emit("done", rank=me.rank, step=state["step"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

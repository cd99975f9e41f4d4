"""A data-parallel training job of N ranks (DistributedDataParallel) that gpumigrate moves while it trains.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m gpumigrate.workloads.dp_training \\
        --steps 200 --device cpu|cuda [--devices 1,0] [--params-mb N] [--step-delay-ms 0]

Every rank embeds the public SDK like any user's job: ``gm.attach(model, optimizer=..., state=...,
process_group=WORLD, on_teardown=..., on_rebuild=...)``; rank r's agent listens on
``GPUMIGRATE_AGENT_ADDR``'s port + r. Each step (a safe point) runs a DDP all-reduce, so the ranks
must freeze at one step (the SDK's group freeze). What travels per rank: the model, the AdamW
state, the step counter, the rank's data generator (its shard of the stream) and its RNG streams
(dropout draws from them). Each rank prints ``{"event": "step", "rank", "step", "loss"}`` per step;
``{"event": "done", "rank", "step", "weights_digest"}`` at the end.

``--params-mb`` scales the model (square layers) so that a rank's state (weights + AdamW's two
moments) is about 3 × N MB.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import gpumigrate.agent as gm
from gpumigrate.workloads.model import weights_digest
from gpumigrate.workloads.ranked import Rank, emit, join, parse_devices

INPUTS = 32


def shape_for(params_mb: float | None) -> tuple[int, int]:
    """(width, hidden layers): the tiny default, or square layers adding up to ``params_mb`` of fp32."""
    if not params_mb:
        return 128, 1
    width = 1024 if params_mb < 1024 else 4096
    return width, max(1, round(params_mb * 2**20 / 4 / width**2))


def build(width: int, depth: int, dropout: float) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = [torch.nn.Linear(INPUTS, width), torch.nn.ReLU(), torch.nn.Dropout(dropout)]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def make_model(args: argparse.Namespace, me: Rank) -> torch.nn.Sequential:
    width, depth = shape_for(args.params_mb)
    if gm.awaiting_restore():  # a target: shapes only, the restore brings the weights
        with torch.device("meta"):
            model = build(width, depth, args.dropout)
        return model.to_empty(device=me.device)
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    with me.device:  # initialised where it lives: gigabytes of weights are drawn on the GPU, not the CPU
        return build(width, depth, args.dropout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpumigrate.workloads.dp_training", description=__doc__)
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
    model = make_model(args, me)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def wrap() -> DistributedDataParallel:
        return DistributedDataParallel(model, device_ids=[me.device] if me.device.type == "cuda" else None)

    net: dict[str, Any] = {"ddp": wrap()}  # the wrapper holds the group: dropped and made again around a teardown
    # Each rank draws its own shard of the data stream; the generator travels with the rank's state.
    state: dict[str, Any] = {"step": 0, "data": torch.Generator().manual_seed(args.seed * 1000 + me.rank)}
    handle = gm.attach(
        model,
        optimizer=optimizer,
        state=state,
        process_group=dist.group.WORLD,
        on_teardown=lambda: net.update(ddp=None),
        on_rebuild=lambda: net.update(ddp=wrap()),
    )
    emit("attached", rank=me.rank, world_size=me.world_size, agent=handle.address, device=str(me.device))

    while state["step"] < args.steps:
        with handle.safe_point() as step:  # a group freeze parks every rank here, after the same step
            x = torch.randn(args.batch, INPUTS, generator=state["data"]).to(me.device)
            y = x[:, :8].sum(1, keepdim=True).sin()
            loss = F.mse_loss(net["ddp"](x), y)
            optimizer.zero_grad()
            loss.backward()  # the all-reduce of every step
            optimizer.step()
            state["step"] += 1
            value = loss.item()
            step.report(loss=value)
        emit("step", rank=me.rank, step=state["step"], loss=value)
        if args.step_delay_ms:
            time.sleep(args.step_delay_ms / 1000)
    handle.close()
    dist.destroy_process_group()
    emit("done", rank=me.rank, step=state["step"], weights_digest=weights_digest(model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

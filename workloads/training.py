"""The reference training job: the same model family trained with PyTorch Lightning on synthetic data.

    GPUMIGRATE_AGENT_ADDR=127.0.0.1:17071 python -m gpumigrate.workloads.training --steps 50 --seed 0 --device cpu

Everything a migration must carry lives in one :class:`TrainingState` (``training_state.py``): weights, optimizer state,
step counter and losses (``progress``), and the RNG streams (python, numpy, torch, cuda). The batch
for step ``i`` is a pure function of ``(seed, i)``, so a state captured after step ``k`` and
restored in another process produces the identical loss at step ``k + 1``. :func:`run_steps` is the
plain-PyTorch loop (fast, for tests); :func:`train` drives the same math through a Lightning
``Trainer`` and accepts extra callbacks. ``main`` makes the job migratable like any user's
Lightning job: the public SDK's ``MigrationCallback``, carrying ``progress`` as its state; the agent
address and await-restore come from the environment contract (``--agent-port`` and
``--await-restore`` are thin overrides).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from gpumigrate.atomic import atomic_write_bytes
from gpumigrate.errors import GpumigrateError
from gpumigrate.workloads.contract import add_contract_flags, apply_contract_overrides
from gpumigrate.workloads.training_state import (
    CAPTURE_FORMAT,
    TrainingConfig,
    TrainingState,
    lm_loss,
    load_capture,
    save_capture,
    seed_everything,
    synthetic_batch,
)

__all__ = [
    "CAPTURE_FORMAT", "TrainingConfig", "TrainingState", "load_capture", "lm_loss", "main", "run_steps",
    "save_capture", "seed_everything", "synthetic_batch", "train",
]  # fmt: skip


def run_steps(state: TrainingState, k: int) -> list[float]:
    """Run ``k`` optimizer steps from ``state`` with a plain loop; return their losses.

    Same math as :func:`train` (Lightning's automatic optimization), without a Trainer's start-up cost.
    """
    state.model.train()
    out = []
    for _ in range(k):
        loss = lm_loss(state.model, state.current_batch())
        state.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        state.optimizer.step()
        state.record_step(float(loss.detach()))
        out.append(state.losses[-1])
    return out


def train(
    state: TrainingState, steps: int, callbacks: list[Any] | None = None, *, until_step: int | None = None
) -> list[float]:
    """Run ``steps`` steps from ``state.step`` through a Lightning Trainer; return their losses.

    Lightning is imported here, not at module import: it costs seconds and most users of
    :class:`TrainingState` (tests, the agent) never start a Trainer.
    """
    from gpumigrate.workloads.lightning_job import train_with_lightning

    return train_with_lightning(state, steps, callbacks, until_step=until_step)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpumigrate.workloads.training", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", default="tiny")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1", help="address the agent listens on (the host's address)")
    p.add_argument("--step-delay-ms", type=int, default=0, help="sleep after each step (time to migrate)")
    add_contract_flags(p)
    p.add_argument("--name", default="training")
    p.add_argument("--out", default=None, help="write the final losses and digest as JSON here")
    args = p.parse_args(argv)
    apply_contract_overrides(args)
    torch.set_num_threads(max(1, args.threads))
    try:
        cfg = TrainingConfig(args.seed, args.size, args.dtype, args.device, args.batch_size, args.seq_len, args.lr)
        state = TrainingState.create(cfg, name=args.name)
    except GpumigrateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    from gpumigrate.agent.lightning import MigrationCallback
    from gpumigrate.workloads.lightning_job import PrintSteps, StepDelay

    # The agent attaches when the Trainer starts (the module, the optimizer, the loop counters, the RNG
    # streams, and our step counter and losses); a target started to await a restore waits there.
    agent = MigrationCallback(state=state.progress)
    callbacks: list[Any] = [PrintSteps(state), StepDelay(args.step_delay_ms / 1000.0), agent]
    try:
        # Until the total step count: a restored target continues from the restored step.
        if args.steps > state.step:
            train(state, args.steps - state.step, callbacks, until_step=args.steps)
    except GpumigrateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        agent.close()
    result = {"event": "done", "step": state.step, "losses": state.losses, "weights_digest": state.weights_digest()}
    if args.out:
        atomic_write_bytes(args.out, (json.dumps(result) + "\n").encode())
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

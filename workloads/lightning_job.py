"""The Lightning half of the training job: the LightningModule, the Trainer and its callbacks.

Kept apart from ``training.py`` because importing Lightning costs seconds; the state, the capture
and the plain loop do not need it. Imports only ``training_state`` (the state and the loss both loops
share), so the two loops never import each other.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from gpumigrate.errors import InvalidInputError
from gpumigrate.workloads.model import TinyLM
from gpumigrate.workloads.training_state import TrainingState, lm_loss


class _Ticks(Dataset[int]):
    """``count`` placeholder items: the loader only paces the loop. The real batch is built inside
    ``training_step`` from the state's step counter, so a restore that moves the counter (the agent
    restoring step k on a target) is honoured even though Lightning prefetches loader items."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> int:
        return i


class LitTinyLM(pl.LightningModule):
    """Lightning wrapper. The optimizer is created by :class:`TrainingState` so it can be captured
    and restored outside a Trainer; ``configure_optimizers`` hands that same object to Lightning."""

    def __init__(self, model: TinyLM, training: TrainingState) -> None:
        super().__init__()
        self.model = model
        self._training_state = training

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return lm_loss(self.model, self._training_state.current_batch())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self._training_state.optimizer


class _RecordStep(pl.Callback):
    """First callback of every Trainer: counts the step so later callbacks (the agent) see it done.

    Lightning runs callback hooks before the module's own hook, so this cannot live in the module.
    """

    def __init__(self, state: TrainingState, until_step: int | None = None) -> None:
        self.state = state
        self.until_step = until_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.state.record_step(float(loss.detach()))
        if self.until_step is not None and self.state.step >= self.until_step:
            trainer.should_stop = True


class StepDelay(pl.Callback):
    """Slows the job down so there is time to migrate it while it runs (demo, tests)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.delay_s > 0:
            time.sleep(self.delay_s)


def train_with_lightning(
    state: TrainingState, steps: int, callbacks: list[pl.Callback] | None = None, *, until_step: int | None = None
) -> list[float]:
    """Run at most ``steps`` steps through a Lightning Trainer, stopping early once ``state.step``
    reaches ``until_step``; return the losses recorded during this call."""
    if steps < 1:
        raise InvalidInputError(f"steps must be >= 1, got {steps}")
    first = len(state.losses)
    device = state.config.device
    accel = "gpu" if device.startswith("cuda") else "cpu"
    trainer = pl.Trainer(
        accelerator=accel,
        devices=[int(device.split(":", 1)[1])] if accel == "gpu" and ":" in device else 1,
        max_steps=steps,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[_RecordStep(state, until_step), *(callbacks or [])],
    )
    # A private generator: otherwise creating the loader's iterator draws from the global torch RNG
    # and the plain loop (run_steps) and the Trainer would diverge.
    loader = DataLoader(_Ticks(steps), batch_size=None, shuffle=False, generator=torch.Generator())
    trainer.fit(LitTinyLM(state.model, state), train_dataloaders=loader)
    return state.losses[first:]


class PrintSteps(pl.Callback):
    def __init__(self, state: TrainingState) -> None:
        self.state = state

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        print(json.dumps({"event": "step", "step": self.state.step, "loss": self.state.losses[-1]}), flush=True)

"""``MigrationCallback``: a Lightning Trainer's job made migratable with one line.

    trainer = pl.Trainer(..., callbacks=[MigrationCallback()])

At ``on_train_start`` it attaches the agent to the LightningModule with the Trainer's optimizers and
LR schedulers, the loop counters (global step, epoch, batches stepped) and every RNG stream; the safe point is the
optimizer-step boundary (entered at a batch's start, left once the optimizer stepped, so gradient
accumulation never splits), and each step's loss is reported by itself. In a process started with
``GPUMIGRATE_AWAIT_RESTORE=1`` the first step waits until the restore has filled the model.

The batch the target trains on next comes from its own data loader: for identical losses after a
migration, derive each batch from ``trainer.global_step`` (which travels) or use a loader that
resumes where it stopped. Mixed-precision scaler state is not carried.
"""

from __future__ import annotations

from typing import Any

from gpumigrate.snapshot import tracked as tr
from gpumigrate.snapshot.stepgate import StepReport

from .handle import Handle, attach_items

try:
    import pytorch_lightning as pl
except ImportError:  # the unified package
    import lightning.pytorch as pl  # type: ignore[no-redef,import-not-found,unused-ignore]


def _loop_counters(trainer: Any) -> dict[str, Any]:
    loop = trainer.fit_loop.epoch_loop
    return {
        "optimizer_steps": loop.automatic_optimization.optim_progress.state_dict(),
        "manual_steps": loop.manual_optimization.optim_step_progress.state_dict(),
        "batches_that_stepped": loop._batches_that_stepped,
        "epochs": trainer.fit_loop.epoch_progress.state_dict(),
    }


def _set_loop_counters(trainer: Any, value: dict[str, Any]) -> None:
    loop = trainer.fit_loop.epoch_loop
    loop.automatic_optimization.optim_progress.load_state_dict(value["optimizer_steps"])
    loop.manual_optimization.optim_step_progress.load_state_dict(value["manual_steps"])
    loop._batches_that_stepped = int(value["batches_that_stepped"])
    trainer.fit_loop.epoch_progress.load_state_dict(value["epochs"])


class MigrationCallback(pl.Callback):
    """``state``: extra tensors and plain values to carry (as ``attach(state=...)``); ``name``: the
    model's name in the image (default "model")."""

    def __init__(self, *, state: dict[str, Any] | None = None, name: str | None = None) -> None:
        self.state = state
        self.name = name
        self.handle: Handle | None = None
        self._step: StepReport | None = None
        self._steps_before = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.handle is not None:
            return
        if trainer.world_size > 1:  # its ranks would each freeze alone: a peer left inside a collective
            raise RuntimeError(
                f"MigrationCallback carries a Trainer of one process; this one has {trainer.world_size} ranks. "
                "For several ranks, attach each rank yourself: gpumigrate.agent.attach(module, optimizer=..., "
                "process_group=torch.distributed.group.WORLD) (agent/README.md, 'Ranks')"
            )
        counters = tr.json_blob("lightning", lambda: _loop_counters(trainer), lambda v: _set_loop_counters(trainer, v))
        self.handle = attach_items(
            pl_module,
            optimizer=list(trainer.optimizers) or None,
            lr_scheduler=[config.scheduler for config in trainer.lr_scheduler_configs] or None,
            state=self.state,
            name=self.name,
            extra=[counters],
            training=True,
        )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._step is None and self.handle is not None:
            self.handle.gate.enter(None)  # waits here while frozen, or until a target's restore
            self._step = StepReport()
            self._steps_before = trainer.global_step  # read after the wait: a restore moves it

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._step is None or self.handle is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            self._step.report(loss=float(loss.detach()))
        if trainer.global_step != self._steps_before:  # the optimizer stepped: a step boundary
            step, self._step = self._step, None
            self.handle.gate.leave(step)

    def _abandon_step(self) -> None:
        if self._step is not None and self.handle is not None:
            self._step = None
            self.handle.gate.leave(completed=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._abandon_step()  # batches accumulated without an optimizer step: not a step

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._abandon_step()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self.close()

    def close(self) -> None:
        self._abandon_step()
        if self.handle is not None:
            self.handle.close()
            self.handle = None

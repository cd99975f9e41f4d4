"""A user's Lightning training job (not gpumigrate's reference job), made migratable with one callback.

The batch of each step is drawn from a generator seeded with ``trainer.global_step``, which the
callback carries; dropout draws from the global RNG, which it carries too.
"""

import json
import os
import time

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from gpumigrate.agent.lightning import MigrationCallback

STEPS = int(os.environ.get("STEPS", "40"))
DELAY_S = float(os.environ.get("STEP_DELAY_MS", "0")) / 1000
torch.set_num_threads(1)


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
        )

    def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(self.global_step))
        return torch.nn.functional.mse_loss(self.net(x), x.sum(1, keepdim=True).cos())

    def configure_optimizers(self) -> dict[str, object]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        # stepped every optimizer step: the MigrationCallback carries its position
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10_000)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class PrintSteps(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: dict, *args: object) -> None:
        print(json.dumps({"event": "step", "step": trainer.global_step, "loss": float(outputs["loss"])}), flush=True)
        time.sleep(DELAY_S)


torch.manual_seed(0)
quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
trainer = pl.Trainer(max_steps=STEPS, max_epochs=1, callbacks=[MigrationCallback(), PrintSteps()], **quiet)
trainer.fit(Regressor(), DataLoader(range(STEPS), batch_size=None))
print(json.dumps({"event": "done", "step": trainer.global_step}), flush=True)

"""A plain-PyTorch training loop (no Lightning) that gpumigrate can move while it trains.

The agent carries the model, the optimizer, the LR scheduler's position, the step counter, the data
stream's generator and the global RNG streams (dropout draws from them), so a restored loop takes the
very next step with the loss the source would have had. Each step prints {"event": "step", "step": n, "loss": x}.
"""

import json
import os
import time

import torch

import gpumigrate.agent as gm

STEPS = int(os.environ.get("STEPS", "300"))
STEP_DELAY_S = float(os.environ.get("STEP_DELAY_MS", "0")) / 1000

torch.manual_seed(0)  # a target's init is overwritten by the restore
model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(128, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
# The LR changes every step: a target whose schedule restarted would take its next step with another LR.
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10_000)
state = {"step": 0, "data": torch.Generator().manual_seed(1)}  # travels; restored into this very dict
handle = gm.attach(model, optimizer=optimizer, lr_scheduler=scheduler, state=state)

while state["step"] < STEPS:
    with handle.safe_point() as step:  # a freeze parks the loop here, between steps
        x = torch.randn(64, 32, generator=state["data"])
        loss = torch.nn.functional.mse_loss(model(x), x[:, :8].sum(1, keepdim=True).sin())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        state["step"] += 1
        step.report(loss=loss.item())  # the losses the migration's parity check compares
    print(json.dumps({"event": "step", "step": state["step"], "loss": loss.item()}), flush=True)
    time.sleep(STEP_DELAY_S)
handle.close()
print(json.dumps({"event": "done", "step": state["step"]}), flush=True)

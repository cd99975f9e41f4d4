"""gpumigrate.agent: the public SDK a user's own process imports to become migratable.

    import gpumigrate.agent as gm

    model = build_from_config() if gm.awaiting_restore() else load_with_weights()
    handle = gm.attach(model, optimizer=opt, state={"kv": kv_cache, "step": 0})
    with handle.safe_point() as step:      # around one request or one training step
        loss = train_step(...)
        step.report(loss=loss.item())      # training: the losses parity compares

``attach`` starts the agent's control server on ``GPUMIGRATE_AGENT_ADDR`` (default
127.0.0.1:7070), authenticated with the control key (``GPUMIGRATE_CONTROL_KEY_FILE``, or the state
root's ``control.key``). ``ReadinessMiddleware`` answers ``/healthz`` and ``/readyz`` for an ASGI
service; ``gpumigrate.agent.lightning.MigrationCallback`` does all of this for a Lightning Trainer.
Importing this package costs torch and gpumigrate's core, nothing else (no Prefect, Great
Expectations, boto3, Google or Envoy). Reference: README.md beside this file.
"""

from __future__ import annotations

from gpumigrate.snapshot.stepgate import SafePointUnavailable as Unavailable
from gpumigrate.snapshot.stepgate import StepReport as Step

from .asgi import ReadinessMiddleware
from .handle import AgentAddressError, Handle, attach, awaiting_restore, current
from .inflight import InFlight

__all__ = [
    "AgentAddressError",
    "Handle",
    "InFlight",
    "ReadinessMiddleware",
    "Step",
    "Unavailable",
    "attach",
    "awaiting_restore",
    "current",
]

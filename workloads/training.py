"""The reference training job: the same model family trained with PyTorch Lightning on synthetic data.

    GPUMIGRATE_AGENT_ADDR=127.0.0.1:17071 python -m gpumigrate.workloads.training --steps 50 --seed 0 --device cpu

Everything a migration must carry lives in one :class:`TrainingState`: weights, optimizer state,
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
import copy
import io
import json
import random
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gpumigrate.atomic import atomic_write_bytes
from gpumigrate.errors import GpumigrateError, SnapshotError
from gpumigrate.workloads.contract import add_contract_flags, apply_contract_overrides
from gpumigrate.workloads.model import TinyLM, build_model, weights_digest

CAPTURE_FORMAT = 1


@dataclass(frozen=True)
class TrainingConfig:
    seed: int = 0
    size: str = "tiny"
    dtype: str = "float32"
    device: str = "cpu"
    batch_size: int = 8
    seq_len: int = 64
    lr: float = 1e-3
    dropout: float = 0.1  # > 0 so the torch RNG stream matters: a restore that forgets it changes the loss


def synthetic_batch(seed: int, step: int, batch_size: int, seq_len: int) -> torch.Tensor:
    """Token ids for ``step``: repeated byte patterns (learnable) picked by a generator seeded from (seed, step)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    period = torch.randint(2, 9, (batch_size, 1), generator=gen)
    base = torch.randint(97, 123, (batch_size, 8), generator=gen)  # lowercase ASCII
    pos = torch.arange(seq_len + 1).unsqueeze(0) % period
    return torch.gather(base, 1, pos)


@dataclass
class TrainingState:
    """Weights, optimizer, step and RNG streams of one training job; the snapshot agent's handle."""

    config: TrainingConfig
    model: TinyLM
    optimizer: torch.optim.Optimizer
    # The step counter and losses, in one dict that the migration agent carries and restores in place.
    progress: dict[str, Any] = field(default_factory=lambda: {"step": 0, "losses": []})
    name: str = "training"

    @property
    def step(self) -> int:
        return int(self.progress["step"])

    @step.setter
    def step(self, value: int) -> None:
        self.progress["step"] = int(value)

    @property
    def losses(self) -> list[float]:
        return self.progress["losses"]

    @losses.setter
    def losses(self, value: list[float]) -> None:
        self.progress["losses"] = list(value)

    def __post_init__(self) -> None:
        self._module: Any = None
        self._lock = threading.Lock()

    @property
    def module(self) -> Any:
        """The LightningModule wrapping :attr:`model` (built on first use: Lightning imports slowly)."""
        if self._module is None:
            from gpumigrate.workloads.lightning_job import LitTinyLM

            self._module = LitTinyLM(self.model, self)
        return self._module

    @classmethod
    def create(cls, config: TrainingConfig, *, name: str = "training") -> TrainingState:
        """A fresh job: seeded weights, a new AdamW, all RNG streams seeded from ``config.seed``."""
        seed_everything(config.seed)
        model = build_model(config.seed, config.size, config.dtype, config.device, dropout=config.dropout).train()
        opt = torch.optim.AdamW(model.parameters(), lr=config.lr)
        return cls(config=config, model=model, optimizer=opt, name=name)

    def record_step(self, loss: float) -> None:
        with self._lock:
            self.step += 1
            self.losses.append(loss)

    def current_batch(self) -> torch.Tensor:
        """The batch of the next step: a pure function of (seed, step)."""
        cfg = self.config
        return synthetic_batch(cfg.seed, self.step, cfg.batch_size, cfg.seq_len)

    def weights_digest(self) -> str:
        return weights_digest(self.model)

    def capture(self) -> dict[str, Any]:
        """A deep copy of everything needed to continue elsewhere. Call between steps."""
        rng: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            "format": CAPTURE_FORMAT,
            "config": asdict(self.config),
            "step": self.step,
            "losses": list(self.losses),
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "rng": rng,
        }

    def restore(self, snap: dict[str, Any]) -> None:
        """Load a :meth:`capture` into this state in place (same tensors, same optimizer object)."""
        if snap.get("format") != CAPTURE_FORMAT:
            raise SnapshotError(
                f"training capture format {snap.get('format')!r} unsupported; expected {CAPTURE_FORMAT}"
            )
        if snap["config"] != asdict(self.config):
            raise SnapshotError(f"capture was taken with config {snap['config']}, this job runs {asdict(self.config)}")
        with torch.no_grad():
            for k, t in self.model.state_dict().items():
                t.copy_(snap["model"][k])
        # Deep copy: load_state_dict keeps the very tensors it is given (same device and dtype), so a
        # later step would otherwise mutate the capture and a second restore from it would differ.
        self.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
        self.step = int(snap["step"])
        self.losses = list(snap["losses"])
        rng = snap["rng"]
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def save_capture(snap: dict[str, Any], path: str | Path) -> None:
    buf = io.BytesIO()
    torch.save(snap, buf)
    atomic_write_bytes(path, buf.getbuffer())


def load_capture(path: str | Path) -> dict[str, Any]:
    # weights_only=False: the capture holds numpy RNG state (a tuple with an ndarray); only load your own files.
    return torch.load(path, map_location="cpu", weights_only=False)


def lm_loss(model: TinyLM, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``batch`` (ids, shape (batch, seq + 1))."""
    ids = batch.to(model.tok_emb.weight.device)
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


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

"""The training job's state: what a migration carries, and the one loss both training loops compute.

Everything a migration must carry lives in one :class:`TrainingState`: weights, optimizer state,
step counter and losses (``progress``), and the RNG streams (python, numpy, torch, cuda). The batch
for step ``i`` is a pure function of ``(seed, i)``, so a state captured after step ``k`` and
restored in another process produces the identical loss at step ``k + 1``. Both loops import this
module: the plain one (``training.run_steps``) and the Lightning one (``lightning_job``).
"""

from __future__ import annotations

import copy
import io
import random
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gpumigrate.atomic import atomic_write_bytes
from gpumigrate.errors import SnapshotError
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
        losses: list[float] = self.progress["losses"]
        return losses

    @losses.setter
    def losses(self, value: list[float]) -> None:
        self.progress["losses"] = list(value)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

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
    snap: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    return snap


def lm_loss(model: TinyLM, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``batch`` (ids, shape (batch, seq + 1))."""
    ids = batch.to(model.tok_emb.weight.device)
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

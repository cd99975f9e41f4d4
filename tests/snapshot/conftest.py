"""Fixtures for the snapshot tests: a real transfer-engine store (file://) with a key in the environment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture
def key_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    from gpumigrate import transfer

    monkeypatch.setenv("GM_SNAPSHOT_TEST_KEY", transfer.generate_key())
    return {"env": "GM_SNAPSHOT_TEST_KEY"}


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


class TinyNet(torch.nn.Module):
    """Small enough to step in milliseconds, with a buffer and dropout (so RNG matters)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(32, 128)
        self.drop = torch.nn.Dropout(0.2)
        self.l2 = torch.nn.Linear(128, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.drop(torch.relu(self.l1(x))))


def train_step(model: TinyNet, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    opt.zero_grad()
    noise = torch.randn_like(x) * 0.01  # draws from the RNG: a migrated RNG must draw the same
    loss = torch.nn.functional.mse_loss(model(x + noise), y)
    loss.backward()
    opt.step()
    model.steps += 1
    return float(loss.item())


@pytest.fixture
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)


@pytest.fixture
def net_cls() -> type[TinyNet]:
    return TinyNet


@pytest.fixture
def step_fn():  # noqa: ANN201 - the helper itself
    return train_step


@pytest.fixture(autouse=True)
def _private_state_root(gm_home: Path) -> Path:
    """Each test its own state root: the agents it starts create their control key there, and the
    clients (and the processes it starts, which inherit the environment) read it from there."""
    return gm_home

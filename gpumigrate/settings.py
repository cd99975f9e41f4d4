"""Where gpumigrate keeps its files. One environment variable per setting, documented in the README."""

from __future__ import annotations

import os
from pathlib import Path


def state_root() -> Path:
    """Root of per-migration directories: ``$GPUMIGRATE_HOME`` or ``./.gpumigrate``."""
    return Path(os.environ.get("GPUMIGRATE_HOME", ".gpumigrate")).resolve()


def migrations_dir() -> Path:
    return state_root() / "migrations"


def hosts_dir() -> Path:
    """Where local hosts keep their work directories and pid files."""
    return state_root() / "hosts"


def operator() -> str:
    """Who started an action, for the audit record."""
    return os.environ.get("GPUMIGRATE_OPERATOR") or os.environ.get("USER") or f"uid:{os.getuid()}"

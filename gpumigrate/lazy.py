"""Lazy public names for the subpackages: importing ``gpumigrate.transfer`` costs nothing until used.

Keeps ``gpumigrate --help`` and the agent client fast (no torch, GX or boto3 on import).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` that loads ``package.<module>`` when ``name`` is first used."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    return __getattr__

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
        loaded = importlib.import_module(f"{package}.{module}")
        # Bind every name the module exports, not only this one: importing ``transfer.push`` for
        # ``store_region`` also sets the package attribute ``push`` to the submodule, which would
        # shadow the function ``push`` for every later lookup.
        for other, where in exports.items():
            if where == module:
                setattr(sys.modules[package], other, getattr(loaded, other))  # later lookups skip this function
        return getattr(loaded, name)

    return __getattr__

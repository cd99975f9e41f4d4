"""Lazy public names for the subpackages: importing ``gpumigrate.transfer`` costs nothing until used.

Keeps ``gpumigrate --help`` and the agent client fast (no torch, GX or boto3 on import).
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any


class _LazyPackage(types.ModuleType):
    """A package whose exported names win over its submodules of the same name.

    ``gpumigrate.transfer.push`` is both a function and the module defining it. Importing the module
    (directly, or to load another of its names) makes the import system bind it on the package under
    the same name, which would shadow the function for every later ``transfer.push(...)``. (So
    ``import gpumigrate.transfer.push as m`` names the function too: take a module's names with
    ``from gpumigrate.transfer.push import ...``.)
    """

    def __setattr__(self, name: str, value: Any) -> None:
        exports: Mapping[str, str] = self.__dict__.get("_lazy_exports", {})
        if name in exports and isinstance(value, types.ModuleType) and value.__name__ == f"{self.__name__}.{name}":
            return  # the submodule stays reachable as sys.modules[...]; the name is the export's
        super().__setattr__(name, value)


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` that loads ``package.<module>`` when ``name`` is first used."""
    module_object = sys.modules[package]
    module_object.__class__ = _LazyPackage
    module_object._lazy_exports = dict(exports)  # type: ignore[attr-defined]  # read by _LazyPackage

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    return __getattr__

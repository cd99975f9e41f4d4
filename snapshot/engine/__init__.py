"""The in-process snapshot engine (workload side): one module per concern behind :class:`SnapshotEngine`."""

from __future__ import annotations

from gpumigrate.snapshot.engine.clock import Phases
from gpumigrate.snapshot.engine.engine import ReaderFactory, SnapshotEngine, WriterFactory

__all__ = ["Phases", "ReaderFactory", "SnapshotEngine", "WriterFactory"]

"""Snapshot-specific errors (no torch import here: the CLI and the client load this module)."""

from __future__ import annotations

from gpumigrate.errors import SnapshotError


class ImageMismatchError(SnapshotError):
    """The image does not fit this workload: missing/extra regions, other shapes or dtypes."""


class EnvironmentMismatchError(SnapshotError):
    """The image's source environment differs from this one where the plan forbids it."""


class AgentUnreachableError(SnapshotError):
    """The agent's control address did not answer as an agent does: nothing listens, the connection dropped, or
    what answered speaks no agent protocol (PROTOCOL.md). Nothing was asked of the workload."""


class TrainingLoopError(SnapshotError):
    """A training loop that cannot prove a move: it takes steps and reports no loss (``step.report``), or its
    process ended before it did. No retry changes that: the flow rolls back at once."""

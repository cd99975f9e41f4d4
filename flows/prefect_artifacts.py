"""Prefect artifacts for a migration: the markdown summary, the phase table, the ramp chart, progress.

Every function is a no-op outside a Prefect run (the CLI's report does not need Prefect), and none
raises: artifacts are for people, a failed artifact call must never fail a migration.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from uuid import UUID

from gpumigrate.result import MigrationResult
from gpumigrate.state import Migration

_log = logging.getLogger("gpumigrate.flows")


def _in_run() -> bool:
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def _key(migration_id: str, what: str) -> str:
    # Artifact keys: lowercase letters, digits and dashes only.
    safe = "".join(ch if ch.isalnum() else "-" for ch in migration_id.lower()).strip("-")
    return f"{what}-{safe}"[:100]


def publish(m: Migration, result: MigrationResult) -> None:
    if not _in_run():
        return
    try:
        from prefect.artifacts import create_image_artifact, create_markdown_artifact, create_table_artifact

        from gpumigrate.flows.report import phase_rows, summary_markdown

        create_markdown_artifact(
            markdown=summary_markdown(m, result),
            key=_key(m.id, "summary"),
            description=f"migration {m.id}: {result.status}",
        )
        create_table_artifact(table=phase_rows(m), key=_key(m.id, "phases"), description="phases")
        if result.chart:
            create_image_artifact(
                image_url=Path(result.chart).resolve().as_uri(),
                key=_key(m.id, "ramp-chart"),
                description="traffic weight, error rate and p99 over the ramp",
            )
    except Exception:
        _log.warning("could not publish Prefect artifacts", exc_info=True)


class Progress:
    """A Prefect progress artifact fed from any thread; updates at most every ``min_interval_s``."""

    def __init__(self, description: str, *, min_interval_s: float = 0.5) -> None:
        self._id: UUID | None = None
        self._last = 0.0
        self._lock = threading.Lock()
        self._min = min_interval_s
        if not _in_run():
            return
        try:
            from prefect.artifacts import create_progress_artifact

            made = create_progress_artifact(progress=0.0, description=description)
            self._id = made if isinstance(made, UUID) else None  # called outside an event loop: the id itself
        except Exception:
            _log.warning("could not create a progress artifact", exc_info=True)

    def update(self, percent: float, *, force: bool = False) -> None:
        if self._id is None:
            return
        now = time.monotonic()
        with self._lock:
            if not force and now - self._last < self._min:
                return
            self._last = now
        try:
            from prefect.artifacts import update_progress_artifact

            update_progress_artifact(artifact_id=self._id, progress=max(0.0, min(100.0, percent)))
        except Exception:
            _log.debug("progress update failed", exc_info=True)

"""Prefect artifacts for a migration: the markdown summary, the phase table, the ramp chart, progress,
what a rollback run did, and the audit chain's head.

The summary is kept true wherever the outcome changes: each publish writes a new version under the
migration's key (the latest one is what Prefect's Artifacts page shows), and a run other than the
migration's own (a ``rollback`` run, a retire) also rewrites the summary on the migration's own run
page, so that the page an SRE has open never says "completed" about a migration that rolled back.
The chart travels inside the artifacts as a ``data:`` URI: a ``file://`` URL is a broken image in a
browser on another machine.

Every function is a no-op outside a Prefect run (the CLI's report does not need Prefect), and none
raises: artifacts are for people, a failed artifact call must never fail a migration.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any
from uuid import UUID

from gpumigrate.audit import AuditLog
from gpumigrate.result import MigrationResult
from gpumigrate.state import Migration

_log = logging.getLogger("gpumigrate.flows")


def _in_run() -> bool:
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def _this_run() -> str | None:
    from prefect.runtime import flow_run

    return str(flow_run.id) if flow_run.id else None


def key(migration_id: str, what: str) -> str:
    """An artifact key of this migration (Prefect keys: lowercase letters, digits and dashes only)."""
    safe = "".join(ch if ch.isalnum() else "-" for ch in migration_id.lower()).strip("-")
    return f"{what}-{safe}"[:100]


def publish(m: Migration, result: MigrationResult) -> None:
    """The migration's summary (the chart drawn in), its phase table and its chart, in this run; and the
    summary on the migration's own run page brought up to date when this run is another one."""
    if not _in_run():
        return
    try:
        from prefect.artifacts import create_image_artifact, create_markdown_artifact, create_table_artifact

        from gpumigrate.flows.report import chart_data_uri, phase_rows, stream_rows, summary_markdown

        chart = chart_data_uri(result.chart)
        markdown = summary_markdown(m, result, chart_src=chart)
        description = f"migration {m.id}: {result.status}"
        create_markdown_artifact(markdown=markdown, key=key(m.id, "summary"), description=description)
        create_table_artifact(table=phase_rows(m), key=key(m.id, "phases"), description="phases")
        streams = stream_rows(list((m.read().get("runtime") or {}).get("ramp_samples") or []))
        if streams:
            create_table_artifact(
                table=streams,
                key=key(m.id, "streams"),
                description="streams in flight per side, time to first token and inter-token p99 (ms) per interval",
            )
        if chart:
            create_image_artifact(
                image_url=chart,
                key=key(m.id, "ramp-chart"),
                description="traffic weight, error rate and p99 over the ramp",
            )
        origin = m.read().get("flow_run_id")
        if origin and origin != _this_run():
            _rewrite(str(origin), key(m.id, "summary"), markdown, description)
    except Exception:
        _log.warning("could not publish Prefect artifacts", exc_info=True)


def _rewrite(flow_run_id: str, artifact_key: str, markdown: str, description: str) -> None:
    """Replace the content of the artifact ``artifact_key`` that run ``flow_run_id`` published."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[artifact_key]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(flow_run_id)]),
            )
        )
        for artifact in found:
            client.update_artifact(artifact.id, ArtifactUpdate(data=markdown, description=description))


def publish_action(m: Migration, what: str, outcome: Mapping[str, Any]) -> None:
    """What a run other than the migration's own did to it (a ``rollback`` run): a markdown artifact in
    that run, and one log line per fact in its log."""
    if not _in_run():
        return
    try:
        from prefect import get_run_logger
        from prefect.artifacts import create_markdown_artifact

        rows = [f"| {k} | {_cell(v)} |" for k, v in outcome.items()]
        markdown = "\n".join([f"# {what.capitalize()} of migration `{m.id}`", "", "| | |", "| --- | --- |", *rows, ""])
        create_markdown_artifact(markdown=markdown, key=key(m.id, what), description=f"{what}: {outcome.get('how')}")
        log = get_run_logger()
        for k, v in outcome.items():
            log.info("%s %s: %s = %s", what, m.id, k, _cell(v))
    except Exception:
        _log.warning("could not publish the %s artifact", what, exc_info=True)


def _cell(v: Any) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")[:300]


def anchor_audit(m: Migration) -> None:
    """The migration's audit chain head as a Prefect artifact (gpumigrate/AUDIT.md): outside the state
    directory, beside this run. Called at the end of every phase and when the run ends."""
    anchor_log(m.audit)


def anchor_log(log: AuditLog) -> None:
    """Publish ``log``'s verified head as a Prefect artifact (a migration's log, the cost-move log)."""
    if not _in_run():
        return
    try:
        from gpumigrate.audit_anchor_prefect import PrefectArtifactAnchor

        log.anchor_to(PrefectArtifactAnchor())
    except Exception:
        _log.warning("could not anchor the audit head of %s in Prefect", log.name, exc_info=True)


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

"""The rollback button: one path for ``gpumigrate rollback``, the ``rollback`` deployment and the gate.

While the migrate flow runs, a rollback is a request (``Migration.request_rollback``) that the ramp
controller polls every analysis interval, and that a flow paused on its run page (the manual gate,
or the rollback window after the cut-over) sees within a fraction of a second; the form behind
Resume is answered too, for a flow on another host. The flow then undoes in order. When no flow
acts on the migration any more (it ended, or its process died), this module does the undo itself:
traffic back to the source in one update, then the target torn down, then the source's agent resumed.

A run of the ``rollback`` deployment publishes what it did (an artifact and log lines in its own run)
and brings the migration's summary up to date, on the migration's own run page too. ``gpumigrate rollback``
acts first, without Prefect (flows/manual_rollback.py), then publishes the same where a server is set.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from gpumigrate.flows import flowrun, prefect_artifacts
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.manual_rollback import roll_back_here, rollback_migration
from gpumigrate.flows.report import build_result

__all__ = ["roll_back_here", "rollback_flow", "rollback_migration"]  # the first two live in manual_rollback.py


@flow(name="rollback", flow_run_name="rollback-{migration_id}", persist_result=False)
def rollback_flow(
    migration_id: str, reason: str = "rollback requested from the Prefect UI", acting_as: str = ""
) -> dict[str, Any]:
    """The rollback button: traffic to the source, the target torn down. Same path as the CLI.

    ``acting_as``: who is pressing it (the audit records it beside the identity this process has)."""
    flowrun.begin()  # a worker imported this module: Prefect's settings and the audit's actor
    outcome = rollback_migration(migration_id, reason=reason, actor=acting_as.strip()[:200] or None)
    _publish(migration_id, outcome, reason, acting_as)
    return outcome


@flow(name="rollback", flow_run_name="rollback-{migration_id}", persist_result=False)
def rollback_recorded_flow(migration_id: str, outcome: dict[str, Any], reason: str) -> dict[str, Any]:
    """What ``gpumigrate rollback`` did, published as a ``rollback`` run (a server's UI shows it beside the button's
    runs) once the command acted: the command never waits for Prefect before it moves traffic."""
    flowrun.begin()
    _publish(migration_id, outcome, reason, "")
    return outcome


def _publish(migration_id: str, outcome: dict[str, Any], reason: str, acting_as: str) -> None:
    m = RunContext.load(migration_id).migration
    prefect_artifacts.publish_action(m, "rollback", {**outcome, "reason": reason, "acting_as": acting_as or None})
    prefect_artifacts.publish(m, build_result(m))
    prefect_artifacts.anchor_audit(m)

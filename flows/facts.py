"""A workload's environment facts, whoever wrote it: its ``GET /v1/info`` if any, overlaid with its agent's.

The reference server answers ``/v1/info`` with its environment and its own identity (seed, pid, weights
digest). A user's service (``examples/byo``) or a training loop has no such endpoint (or one that means
something else), but every workload embeds the agent, and the agent's ``info`` carries the environment
facts (python, torch, cuda, GPU, driver, machine: ``snapshot/PROTOCOL.md``) from the core's collector; the
snapshot backend asks it (``SnapshotBackend.facts``). Preflight and the parity phase read facts only through
:func:`workload_facts`, so every workload gets the same check.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpumigrate.errors import GpumigrateError, ParityError
from gpumigrate.interfaces import Side, SnapshotBackend
from gpumigrate.parity.environment import fetch_info
from gpumigrate.parity.urls import redact_url


class FactsUnavailableError(ParityError):
    """Neither the workload's service nor its agent answered for its facts. ``tried`` holds (what was asked,
    why it failed) pairs, the agent first: every workload embeds the agent, a service may have no info path."""

    def __init__(self, side: str, tried: list[tuple[str, str]]) -> None:
        reasons = "; ".join(f"{what}: {why}" for what, why in tried) or "no endpoint and no agent address"
        super().__init__(f"the {side} did not answer for its environment facts: {reasons}")
        self.side = side
        self.tried = tried


def workload_facts(endpoint: str | None, agent: str | None, *, side: Side, backend: SnapshotBackend) -> dict[str, Any]:
    """The facts of one side.

    ``endpoint``'s ``/v1/info`` (when it answers a JSON object) overlaid with the environment its agent at
    ``agent`` reports through ``backend``: the agent's facts are collected by gpumigrate's own collector, so
    they win over whatever a service's own info path says under the same names. Raises FactsUnavailableError
    (a ParityError) naming both attempts, the agent's first, when neither answers.
    """
    facts: dict[str, Any] = {}
    tried: list[tuple[str, str]] = []
    agent_facts: Mapping[str, Any] = {}
    if agent:
        try:
            agent_facts = backend.facts(side)
        except GpumigrateError as exc:
            tried.append((f"its agent at {agent}", str(exc)))
    if endpoint:
        try:
            facts.update(fetch_info(endpoint))
        except ParityError as exc:
            why = str(exc).removeprefix("environment facts: ")
            tried.append((f"its service at {redact_url(endpoint)}", why))
    facts.update(agent_facts)
    if not facts:
        raise FactsUnavailableError(side, tried)
    return facts

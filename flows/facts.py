"""A workload's environment facts, whoever wrote it: its ``GET /v1/info`` if any, overlaid with its agent's.

The reference server answers ``/v1/info`` with its environment and its own identity (seed, pid, weights
digest). A user's service (``examples/byo``) or a training loop has no such endpoint (or one that means
something else), but every workload embeds the agent, and the agent's ``info`` carries the environment
facts (python, torch, cuda, GPU, driver, machine: ``snapshot/PROTOCOL.md``) from the core's collector.
Preflight and the parity phase read facts only through :func:`workload_facts`, so every workload gets the
same check.
"""

from __future__ import annotations

from typing import Any

from gpumigrate.errors import GpumigrateError, ParityError
from gpumigrate.parity.environment import fetch_info
from gpumigrate.snapshot.client import AgentClient

AGENT_TIMEOUT_S = 30.0


def workload_facts(endpoint: str | None, agent: str | None, *, side: str) -> dict[str, Any]:
    """The facts of one side (``side``: "source" or "target", for messages).

    ``endpoint``'s ``/v1/info`` (when it answers a JSON object) overlaid with the environment its agent at
    ``agent`` reports: the agent's facts are collected by gpumigrate's own collector, so they win over
    whatever a service's own info path says under the same names. Raises ParityError naming both attempts
    when neither answers.
    """
    facts: dict[str, Any] = {}
    tried: list[str] = []
    if endpoint:
        try:
            facts.update(fetch_info(endpoint))
        except ParityError as exc:
            tried.append(str(exc))
    if agent:
        try:
            with AgentClient(agent, timeout_s=AGENT_TIMEOUT_S) as client:
                facts.update(client.info().environment)
        except GpumigrateError as exc:
            tried.append(f"its agent at {agent}: {exc}")
    if not facts:
        raise ParityError(f"the {side}'s environment facts: {'; '.join(tried) or 'no endpoint and no agent address'}")
    return facts

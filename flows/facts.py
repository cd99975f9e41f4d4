"""A workload's environment facts, whoever wrote it: its ``GET /v1/info`` when it has one, else its agent.

The reference server answers ``/v1/info`` with its environment and its own identity (seed, pid, weights
digest). A user's service (``examples/byo``) or a training loop has no such endpoint, but every workload
embeds the agent, and the agent's ``info`` carries the same environment facts (python, torch, cuda, GPU,
driver, machine: ``snapshot/PROTOCOL.md``), collected by the same core collector. Preflight and the parity
phase read facts only through :func:`workload_facts`, so either kind of workload gets the same check.
"""

from __future__ import annotations

from typing import Any

from gpumigrate.errors import GpumigrateError, ParityError
from gpumigrate.parity.environment import fetch_info
from gpumigrate.snapshot.client import AgentClient

AGENT_TIMEOUT_S = 30.0


def workload_facts(endpoint: str | None, agent: str | None, *, side: str) -> dict[str, Any]:
    """The facts of one side (``side``: "source" or "target", for messages).

    ``endpoint``'s ``/v1/info`` when it answers a JSON object; otherwise the agent's environment at
    ``agent``. Raises ParityError naming both attempts when neither answers.
    """
    first: str | None = None
    if endpoint:
        try:
            return fetch_info(endpoint)
        except ParityError as exc:
            first = str(exc)
    if not agent:
        raise ParityError(f"the {side}'s environment facts: {first or 'no endpoint and no agent address'}")
    try:
        with AgentClient(agent, timeout_s=AGENT_TIMEOUT_S) as client:
            info = client.info()
    except GpumigrateError as exc:
        tried = f"{first}; " if first else ""
        raise ParityError(f"the {side}'s environment facts: {tried}its agent at {agent}: {exc}") from None
    return dict(info.environment)

"""Environment parity: the source's and the target's facts compared by the plan's policy, before traffic moves.

Facts come from the workload's ``GET /v1/info`` (:func:`fetch_info`) or from the probe run on a host
(``python -m gpumigrate.parity.probe``, :func:`run_probe`). The comparison itself is the core's one
policy engine (:mod:`gpumigrate.environment`, whose names this module re-exports): a difference in a
``must_match`` fact is a violation, and :meth:`EnvironmentReport.raise_if_forbidden` raises
:class:`EnvironmentParityError`, a policy denial (exit 2: nothing has moved yet in preflight).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from typing import Any

import httpx

from gpumigrate.environment import (
    DEFAULT_POLICY,
    EnvDifference,
    EnvironmentParityError,
    EnvironmentReport,
    normalize_facts,
)
from gpumigrate.environment import compare as check_environment
from gpumigrate.errors import ParityError
from gpumigrate.parity.urls import redact_url

__all__ = [
    "DEFAULT_POLICY",
    "EnvDifference",
    "EnvironmentParityError",
    "EnvironmentReport",
    "check_environment",
    "fetch_info",
    "normalize_facts",
    "run_probe",
]


def fetch_info(url: str, *, path: str = "/v1/info", timeout_s: float = 10.0) -> dict[str, Any]:
    """Facts from a running service's info endpoint. Raises ParityError when it does not answer."""
    where = redact_url(url.rstrip("/") + path)
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False) as client:
            resp = client.get(url.rstrip("/") + path)
    except httpx.HTTPError as exc:
        raise ParityError(f"environment facts: {where} did not answer: {type(exc).__name__}: {exc}") from None
    if resp.status_code != 200:
        raise ParityError(f"environment facts: {where} answered HTTP {resp.status_code}")
    try:
        body = resp.json()
    except ValueError:
        raise ParityError(f"environment facts: {where} did not return JSON") from None
    if not isinstance(body, dict):
        raise ParityError(f"environment facts: {where} did not return a JSON object")
    return body


def run_probe(command: Sequence[str], *, timeout_s: float = 120.0) -> dict[str, Any]:
    """Run the probe command on a host (e.g. ``[python, -m, gpumigrate.parity.probe]`` or via ssh).

    The last non-empty stdout line must be the JSON object the probe prints.
    """
    try:
        proc = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ParityError(f"environment probe {command[0]!r} failed to run: {exc}") from None
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
        raise ParityError(f"environment probe exited {proc.returncode}: {tail[0]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    try:
        facts = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        facts = None
    if not isinstance(facts, dict):
        raise ParityError("environment probe did not print a JSON object as its last line")
    return facts

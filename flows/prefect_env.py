"""Prefect's embedded default, set before Prefect is imported.

Without ``PREFECT_API_URL`` Prefect starts an ephemeral API server (SQLite under PREFECT_HOME) in a
subprocess for the life of this process; with it, flows report to that server (the UI, schedules and
workers need ``prefect server start``). Either way gpumigrate keeps Prefect's files project-local
(``./.prefect``, as the Makefile does) and never phones home.
"""

from __future__ import annotations

import os
from pathlib import Path

_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "GX_ANALYTICS_ENABLED": "false",
    # The first start of a fresh home applies all DB migrations: give it time on a busy 2-core box (a first
    # `gpumigrate migrate` in a clean shell took over 120 s there while other work loaded both cores).
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300",
}

# The CLI prints its own progress; Prefect's console lines (and the tracebacks it logs for a task that
# raised on purpose, e.g. a rollback) would bury it. Logs still reach the API and the UI.
_QUIET_CONSOLE = {
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "CRITICAL",
    "PREFECT_LOGGING_HANDLERS_CONSOLE_FLOW_RUNS_LEVEL": "CRITICAL",
    "PREFECT_LOGGING_HANDLERS_CONSOLE_TASK_RUNS_LEVEL": "CRITICAL",
}


def configure(*, quiet_console: bool = False) -> Path:
    """Fill in unset Prefect settings; return the PREFECT_HOME in use. Call before ``import prefect``."""
    home = os.environ.get("PREFECT_HOME") or str(Path.cwd() / ".prefect")
    os.environ["PREFECT_HOME"] = home
    for key, value in _DEFAULTS.items():
        os.environ.setdefault(key, value)
    if quiet_console and not os.environ.get("GPUMIGRATE_DEBUG"):
        for key, value in _QUIET_CONSOLE.items():
            os.environ.setdefault(key, value)
    return Path(home)


def using_server() -> bool:
    """True when flows report to a running Prefect server rather than the ephemeral one."""
    return bool(os.environ.get("PREFECT_API_URL"))

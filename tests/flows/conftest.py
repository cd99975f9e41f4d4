"""Fixtures for the flow tests: ONE Prefect test harness for the session, local hosts, a front door.

Prefect reads its settings when it is first imported, so the temporary PREFECT_HOME and an explicitly
empty PREFECT_API_URL are set here, before any test module imports the flows.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

_HOME = tempfile.mkdtemp(prefix="gm-prefect-home-")
atexit.register(shutil.rmtree, _HOME, True)
os.environ["PREFECT_HOME"] = _HOME
os.environ["PREFECT_API_URL"] = ""  # nothing leaks in from the developer's shell
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """The harness's API URL; CLI subprocesses get it as PREFECT_API_URL (the "with a server" path)."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield str(PREFECT_API_URL.value())

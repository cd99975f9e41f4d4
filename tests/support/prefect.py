"""Prefect's test server, started the same way by every folder that needs one, with a bound that holds on a loaded
machine and says what it waited for."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

# A fresh Prefect home migrates its database before /health answers: seconds on an idle machine, but over the 180 s
# this used to allow when other work loaded both cores (the flows' session fixture failed there).
START_TIMEOUT_S = 600


@contextlib.contextmanager
def harness() -> Iterator[None]:
    """``prefect_test_harness`` with :data:`START_TIMEOUT_S`; a start that runs out says so in our words."""
    from prefect.testing.utilities import prefect_test_harness

    try:
        cm = prefect_test_harness(server_startup_timeout=START_TIMEOUT_S)
        cm.__enter__()
    except RuntimeError as exc:
        raise RuntimeError(
            f"Prefect's test server did not answer /health within {START_TIMEOUT_S}s (its own words: {exc})"
        ) from None
    try:
        yield
    finally:
        cm.__exit__(None, None, None)

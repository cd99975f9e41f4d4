"""The freeze lease: a frozen source resumes by itself when its orchestrator stops renewing.

A freeze starts a lease of ``lease_s`` seconds (:meth:`Lease.start`); a renewal starts it again from now
(:meth:`Lease.extend`). A watchdog
thread calls ``on_expiry`` once the deadline passes without a renew. It does so through the
agent's command lock, so a command in progress when the lease runs out (a long ``final``)
completes first; the deadline is checked again under that lock, so a renew that arrived in the
meantime wins. A renewal itself never waits for that lock: an orchestrator renews from a second
connection while its ``final`` runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from gpumigrate.errors import SnapshotError

DEFAULT_LEASE_S = 60.0
MAX_LEASE_S = 86_400.0
log = logging.getLogger("gpumigrate.agent")


def lease_arg(value: Any, default: float = DEFAULT_LEASE_S) -> float:
    """A lease length in seconds: a number in (0, MAX_LEASE_S]; None gives ``default``."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_LEASE_S:
        raise SnapshotError(f"lease_s {value!r}: must be a number of seconds above 0 and at most {MAX_LEASE_S:g}")
    return float(value)


class Lease:
    def __init__(
        self,
        command_lock: AbstractContextManager[Any],
        on_expiry: Callable[[], None],
        *,
        what: str = "the freeze lease",
    ) -> None:
        self.what = what  # in the log line of an expiry
        self._command_lock = command_lock
        self._on_expiry = on_expiry
        self._cond = threading.Condition()
        self._deadline: float | None = None  # monotonic
        self.lease_s: float | None = None
        self.expiries = 0
        self.expired_at: float | None = None  # wall clock of the last expiry
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self, lease_s: float) -> None:
        with self._cond:
            self.lease_s = lease_s
            self._deadline = time.monotonic() + lease_s
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="gm-agent-lease", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def extend(self, lease_s: float | None) -> dict[str, Any]:
        with self._cond:
            if self._deadline is None:
                expired = (
                    f" (its lease ran out {time.time() - self.expired_at:.0f}s ago and it resumed)"
                    if self.expired_at is not None
                    else ""
                )
                raise SnapshotError(f"the workload is not frozen{expired}: nothing to renew")
            self.lease_s = lease_arg(lease_s, self.lease_s or DEFAULT_LEASE_S)
            self._deadline = time.monotonic() + self.lease_s
            self._cond.notify_all()
            return {"frozen": True, "lease_s": self.lease_s, "expires_in_s": self.lease_s}

    def clear(self) -> None:
        with self._cond:
            self._deadline = None
            self._cond.notify_all()

    def state(self) -> dict[str, Any] | None:
        with self._cond:
            if self._deadline is None:
                return None
            return {"lease_s": self.lease_s, "expires_in_s": max(0.0, self._deadline - time.monotonic())}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._deadline = None
            self._cond.notify_all()

    def _expired(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _watch(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._expired():
                    wait = None if self._deadline is None else self._deadline - time.monotonic()
                    self._cond.wait(wait)
                if self._closed:
                    return
            with self._command_lock:  # a command in progress finishes first
                with self._cond:
                    if not self._expired():
                        continue  # renewed or resumed meanwhile
                    self._deadline = None
                    self.expiries += 1
                    self.expired_at = time.time()
                    lease_s = self.lease_s
                log.warning("gpumigrate agent: %s (%gs) ran out without a renew; resuming", self.what, lease_s)
                try:
                    self._on_expiry()
                except Exception:  # the watchdog must survive a failing resume and keep guarding
                    log.exception("gpumigrate agent: resuming after the lease ran out failed")

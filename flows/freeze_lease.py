"""The freeze lease, kept: while a flow works on a frozen source, it renews the source's lease.

A source frozen under ``snapshot.freeze_lease_s`` resumes by itself when nobody renews the lease
(snapshot/lease.py), so a killed orchestrator costs at most one lease of frozen service. While the
orchestrator lives, a :class:`LeaseKeeper` renews it from its own connection: the lease can stay short
however long the final round, the restore or the training parity take.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from gpumigrate.errors import GpumigrateError
from gpumigrate.flows.context import RunContext
from gpumigrate.snapshot.client import AgentClient

_log = logging.getLogger("gpumigrate.flows.freeze_lease")


class LeaseKeeper:
    """Renews a frozen source's lease from its own connection every third of the lease, until stopped or
    refused (the source is no longer frozen: an undo resumed it, or the lease ran out)."""

    def __init__(self, address: str, lease_s: float) -> None:
        self.address, self.lease_s = address, lease_s
        self.renewals = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="freeze-lease")

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        every = max(0.05, self.lease_s / 3)
        with AgentClient(self.address, timeout_s=max(5.0, every)) as client:
            while not self._stop.wait(every):
                try:
                    if not client.renew(self.lease_s):
                        self.error = "the source is no longer frozen"
                        return
                    self.renewals += 1
                except GpumigrateError as exc:
                    self.error = str(exc)
                    _log.warning("freeze lease of %s not renewed: %s", self.address, exc)
                    return


_KEEPERS: dict[str, LeaseKeeper] = {}
_KEEPERS_LOCK = threading.Lock()


def keep_frozen(ctx: RunContext) -> None:
    """Keep the source's freeze alive while this process works on it (started again after a --resume)."""
    if not ctx.runtime.source_frozen:
        return
    with _KEEPERS_LOCK:
        keeper = _KEEPERS.get(ctx.migration.id)
        if keeper is None or not keeper.alive():
            address = ctx.need(ctx.plan.workload.agent, "the source agent")
            _KEEPERS[ctx.migration.id] = LeaseKeeper(address, ctx.plan.snapshot.freeze_lease_s).start()


def renewals(ctx: RunContext) -> int:
    """How often this process renewed the source's freeze lease so far (for the record)."""
    with _KEEPERS_LOCK:
        keeper = _KEEPERS.get(ctx.migration.id)
    return keeper.renewals if keeper is not None else 0


def release(ctx: RunContext) -> dict[str, Any]:
    """Stop renewing (the source then stays frozen until its lease runs out, unless told otherwise)."""
    with _KEEPERS_LOCK:
        keeper = _KEEPERS.pop(ctx.migration.id, None)
    if keeper is None:
        return {}
    keeper.stop()
    return {"renewals": keeper.renewals, "error": keeper.error}

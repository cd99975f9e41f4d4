"""The freeze lease, kept: while a flow works on a frozen source, it renews the source's lease.

A source frozen under ``snapshot.freeze_lease_s`` resumes by itself when nobody renews the lease
(snapshot/lease.py), so a killed orchestrator costs at most one lease of frozen service. While the
orchestrator lives, a :class:`LeaseKeeper` renews it through the snapshot backend (``SnapshotBackend.renew``,
on connections of its own): the lease can stay short however long the final round, the restore or the
training parity take. A backend whose freeze holds no lease (``leases`` False) needs no keeper.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from gpumigrate.errors import GpumigrateError
from gpumigrate.flows.context import RunContext
from gpumigrate.interfaces import SnapshotBackend

_log = logging.getLogger("gpumigrate.flows.freeze_lease")


class LeaseKeeper:
    """Renews a frozen source's lease every third of the lease, until stopped or refused (the source is no longer
    frozen: an undo resumed it, or the lease ran out). ``renew(lease_s)`` says whether the source is still frozen."""

    def __init__(self, renew: Callable[[float], bool], lease_s: float, *, what: str) -> None:
        self.renew, self.lease_s, self.what = renew, lease_s, what
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
        while not self._stop.wait(every):
            try:
                if not self.renew(self.lease_s):
                    self.error = "the source is no longer frozen"
                    return
                self.renewals += 1
            except GpumigrateError as exc:
                self.error = str(exc)
                _log.warning("freeze lease of %s not renewed: %s", self.what, exc)
                return


_KEEPERS: dict[str, LeaseKeeper] = {}
_KEEPERS_LOCK = threading.Lock()


def keep_frozen(ctx: RunContext, backend: SnapshotBackend | None = None) -> None:
    """Keep the source's freeze alive while this process works on it (started again after a --resume), and the hold of
    work in flight the source keeps for its hand-over (the agent renews both); nothing to keep where the source is
    neither frozen nor holding, or where its backend (``backend``, else the plan's) freezes without a lease."""
    if not (ctx.runtime.source_frozen or ctx.runtime.source_holds_work):
        return
    with _KEEPERS_LOCK:
        keeper = _KEEPERS.get(ctx.migration.id)
        if keeper is None or not keeper.alive():
            backend = backend or ctx.backend()
            if not backend.leases:
                return
            what = f"the source of {ctx.migration.id}"
            _KEEPERS[ctx.migration.id] = LeaseKeeper(backend.renew, ctx.plan.snapshot.freeze_lease_s, what=what).start()


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

"""Parking the workload at its safe point (``stepgate.py``) under a lease (``lease.py``), and letting it go.

``park`` shuts the gate and waits until no safe point is in flight, under a lease that the orchestrator
renews (an abandoned freeze resumes by itself); ``hold`` shuts it without waiting (a group freeze's first
move); ``advance_steps`` lets a parked training source take exactly N more steps and parks it again;
``unpark`` reopens the gate, after building a torn-down process group again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from gpumigrate.errors import SnapshotError
from gpumigrate.snapshot.engine.group import GroupControl
from gpumigrate.snapshot.engine.state import EngineState
from gpumigrate.snapshot.gchold import gc_held
from gpumigrate.snapshot.lease import Lease, lease_arg
from gpumigrate.snapshot.stepgate import SafePointGate

ADVANCE_TIMEOUT_S = 600.0


class Freezing:
    """The safe point's controls, run under the engine's command lock."""

    def __init__(
        self,
        gate: SafePointGate | None,
        state: EngineState,
        group: GroupControl,
        lock: threading.RLock,
        *,
        before_running: Callable[[], object] = lambda: None,
    ) -> None:
        self.gate = gate  # None: a workload without a safe point (a freeze only marks it frozen)
        self.state = state
        self.group = group
        self._lock = lock
        # run under the lock before a parked workload takes a step again (advance, unpark: a lease running out too)
        self.before_running = before_running
        self.lease = Lease(lock, self._unpark_locked)

    def park(self, lease_s: float | None = None, *, timeout_s: float = 60.0, at_step: int | None = None) -> None:
        """Park the workload at its safe point under a lease (``lease_s``, default 60 s): unless renewed, it
        resumes by itself when the lease runs out. Parking a parked workload renews.

        ``at_step``: a group freeze (after ``hold`` on every rank): first take the steps this rank lacks to have
        started ``at_step``. A rank of a group larger than one is parked only so."""
        lease = lease_arg(lease_s)
        if at_step is not None and (isinstance(at_step, bool) or not isinstance(at_step, int) or at_step < 0):
            raise SnapshotError(f"at_step {at_step!r}: must be a whole number of at least 0")
        with gc_held(), self._lock:
            if self.gate is not None and (not self.state.frozen or at_step is not None):
                self.group.require_alone_or_at_step(at_step)
                try:
                    self.gate.shut(timeout_s, at_step=at_step)
                except SnapshotError:
                    self.state.held = self.state.frozen = False  # the gate reopened: the workload runs on
                    self.lease.clear()
                    raise
            self.state.frozen, self.state.held = True, False
            self.lease.start(lease)

    def hold(self, lease_s: float | None = None) -> dict[str, Any]:
        """Shut the safe point to new steps without waiting for the one in flight (the first move of a group
        freeze), under a lease like a freeze. Returns the steps completed, in flight, started."""
        lease = lease_arg(lease_s)
        with self._lock:
            if self.gate is None:
                raise SnapshotError("hold needs a workload with a safe point (attach() gives one)")
            counts = self.gate.hold() if not self.state.frozen else self.gate.metrics()
            self.state.held = not self.state.frozen
            self.lease.start(lease)
            return {
                "steps": counts["steps"],
                "in_flight": counts["in_flight"],
                "started": counts["steps"] + counts["in_flight"],
                "frozen": self.state.frozen,
                "lease_s": lease,
            }

    def renew_lease(self, lease_s: float | None = None) -> dict[str, Any]:
        """Extend the freeze lease from now (never waits for a command in progress)."""
        return self.lease.extend(lease_s)

    def advance_steps(self, steps: int, *, timeout_s: float = ADVANCE_TIMEOUT_S) -> dict[str, Any]:
        """Let a parked source take exactly ``steps`` more safe points, then hold it parked again (lease
        restarted). Returns the step counter and the losses reported for those steps."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise SnapshotError(f"steps {steps!r}: must be a whole number of at least 1")
        with self._lock:
            if self.gate is None or not self.state.frozen:
                raise SnapshotError("advance needs a frozen workload with a safe point: send freeze first")
            if self.group.torn_down:
                raise SnapshotError("advance needs the process group: send rebuild first")
            self.before_running()
            try:
                losses = self.gate.let_through(steps, timeout_s)
            finally:
                self.lease.start(self.lease.lease_s or lease_arg(None))
            return {"steps": self.gate.steps, "losses": [[s, loss] for s, loss in losses]}

    def step_metrics(self, since: int = 0) -> dict[str, Any]:
        """Safe points completed (steps), the recent losses reported after step ``since``, the gate."""
        if self.gate is None:
            return {
                "steps": 0,
                "losses": [],
                "in_flight": 0,
                "held": 0,
                "frozen": self.state.frozen,
                "ready": self.state.ready,
                "retired": False,
            }
        return self.gate.metrics(since)

    def unpark(self) -> None:
        with self._lock:
            self._unpark_locked()

    def _unpark_locked(self) -> None:
        self.before_running()
        if self.group.torn_down:
            self.group.rebuild()  # the workload's next step needs its communicators
        self.lease.clear()
        if (self.state.frozen or self.state.held) and self.gate is not None:
            self.gate.reopen()
        self.state.frozen = self.state.held = False

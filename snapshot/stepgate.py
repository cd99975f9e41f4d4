"""The safe point: where a workload's state may be captured, between requests or training steps.

A workload wraps each request or step in ``enter()``/``leave()`` (the public SDK's
``Handle.safe_point()``). The engine's thread calls ``shut()`` (a freeze): it stops admitting new safe
points and returns once none is in flight, so nothing changes the tracked state while the final round
copies it; new ones wait (they are held, they do not fail) until ``reopen()``. ``let_through(n)`` lets
exactly ``n`` more through a shut gate and returns once they are done and the gate is shut again:
the orchestrator gets the source's next losses for the steps a restored target also runs.

The gate also counts completed safe points (``steps``: training steps, or requests served) and
keeps the last losses the workload reported with them; both travel in the image (``progress``).
A gate that is not ready (a target awaiting its restore) holds safe points like a frozen one. A retired
gate (``mark_retired()``: the source after a migration, its state zeroized) fails each request's safe point (one
with a timeout), and each one held when it retires, at once (503), for the workload will not serve again;
a training step's (no timeout) stays parked, as on a frozen gate, until the operator stops the job.

Ranks of one process group (``torch.distributed``) freeze together, in two moves, because a step
holds collectives: a rank parked while a peer is inside step k would leave that peer waiting in
the collective for ever. ``hold()`` shuts the gate without waiting and says how many safe points
this rank has *started*; once every rank is held, the orchestrator takes the highest count S and
``shut(at_step=S)`` lets each rank through exactly the steps it lacks to reach S, then waits until
none is in flight. Every rank ends parked after step S, and none is inside a collective.

Another kind of safe point (a token boundary inside an engine loop, say) is another class with the
engine's side of this one (``hold``, ``shut``, ``reopen``, ``let_through``, ``mark_retired``, ``metrics``,
``progress``/``set_progress``, ``steps``, ``set_ready``): the engine drives nothing else.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gpumigrate.errors import SnapshotError

HISTORY = 1024  # reported losses kept (and shipped in the image)
LATENCIES = 4096  # durations of the last completed safe points kept for the capture's pacing (``latencies``)
RETIRED = "retired: state zeroized"  # the reason a retired gate gives (readiness, refused safe points)


class SafePointUnavailable(SnapshotError):
    """A safe point waited longer than its timeout at a frozen or unready gate (answer 503 to it)."""


class SourceEnded(SystemExit):
    """Raised at a training loop's parked safe point once a retired source's lease ran out (``mark_retired(
    end_parked=True)``: the job trains on its migration's target now). A SystemExit with code 0: the loop's
    ``finally`` blocks run and the process ends, with no traceback."""

    def __init__(self) -> None:
        super().__init__(0)


class StepReport:
    """What a workload may say about the step it is in (``step.report(loss=...)``)."""

    __slots__ = ("loss",)

    def __init__(self) -> None:
        self.loss: float | None = None

    def report(self, *, loss: float) -> None:
        self.loss = float(loss)  # NaN and inf travel as reported (JSON NaN/Infinity)


class SafePointGate:
    def __init__(self, *, ready: bool = True, history: int = HISTORY) -> None:
        self._cond = threading.Condition()
        self._in_flight = 0
        self._waiting = 0
        self._frozen = False
        self._budget = 0  # safe points a frozen gate still admits (advance)
        self._ready = ready
        self._retired = False
        self._end_parked = False  # retired: a parked step ends the process once the gate reopens (lease ran out)
        self.steps = 0
        self._losses: deque[tuple[int, float]] = deque(maxlen=history)
        self._durations: deque[tuple[float, float]] = deque(maxlen=LATENCIES)  # (end, seconds), monotonic clock
        self._admitted: list[float] = []  # when each safe point in flight was admitted (monotonic), oldest first

    # ------------------------------------------------------------------ state
    @property
    def frozen(self) -> bool:
        return self._frozen

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def retired(self) -> bool:
        return self._retired

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def waiting(self) -> int:
        """Safe points held at the gate (frozen or not ready)."""
        return self._waiting

    def set_ready(self, ready: bool) -> None:
        """Raise or drop readiness; raised (a restore loaded state again), a retired gate serves again."""
        with self._cond:
            self._ready = ready
            self._retired = self._retired and not ready
            self._cond.notify_all()

    def mark_retired(self, *, end_parked: bool = False) -> None:
        """The workload's state is zeroized (it was migrated): unready for good, and every safe point, held
        ones included, fails at once instead of waiting out its timeout. Idempotent.

        ``end_parked``: a training loop's step parked here (a safe point without a timeout) ends the process
        (:class:`SourceEnded`) once the gate reopens, that is once the freeze lease ran out unrenewed."""
        with self._cond:
            self._retired = True
            self._ready = False
            self._end_parked = self._end_parked or end_parked
            self._cond.notify_all()

    def reason(self) -> str | None:
        """Why a safe point would wait (or, retired, fail) now, or None when it would pass."""
        if self._retired:
            return RETIRED
        if self._frozen:
            return "frozen"
        if not self._ready:
            return "awaiting restore"
        return None

    def readiness(self) -> tuple[int, dict[str, str]]:
        """The readiness answer (HTTP status, body) for a load balancer.

        A frozen process still takes requests: it holds them at the safe point and serves them on
        resume, so a freeze reads as ready ("held"). Read as unready, a freeze longer than the
        balancer's check interval would turn a pause of a single upstream (the source during its
        final round) into a burst of "no healthy upstream" errors. Only a process that cannot serve
        (awaiting its restore, zeroized) answers 503.
        """
        if self._retired:
            return 503, {"status": "retired", "reason": RETIRED}
        if not self._ready:
            return 503, {"status": "not ready", "reason": "awaiting restore"}
        if self._frozen:
            return 200, {"status": "held", "reason": "frozen"}
        return 200, {"status": "ready"}

    # ------------------------------------------------------------------ the workload's side
    def _admissible(self) -> bool:
        return self._ready and (not self._frozen or self._budget > 0)

    def enter(self, timeout_s: float | None = None) -> float:
        """Block while frozen or unready; SafePointUnavailable after ``timeout_s`` (None: wait on). Returns when it was
        admitted (``time.monotonic()``), which ``leave(began=...)`` takes. A safe point
        with a timeout (a service's request) fails at once when the gate is (or, while waiting, becomes)
        retired; one without (a training loop's step) stays parked: a wiped job must take no further step, and
        failing it would crash the user's loop, and with it the process the flow still talks to."""
        with self._cond:
            if not self._admissible():
                self._waiting += 1
                serves = timeout_s is not None
                try:
                    if serves:
                        self._refuse_retired()
                    if not self._cond.wait_for(
                        lambda: self._admissible() or (serves and self._retired) or self._ends(), timeout=timeout_s
                    ):
                        raise SafePointUnavailable(
                            f"waited {timeout_s:g}s at the safe point ({self.reason() or 'busy'})",
                            hint="the process is being migrated or is not restored yet; retry",
                        )
                    if serves:
                        self._refuse_retired()
                    elif self._ends():
                        sys.stderr.write(f"gpumigrate: this job was migrated and its source {RETIRED}: it ends\n")
                        raise SourceEnded
                finally:
                    self._waiting -= 1
            if self._frozen:
                self._budget -= 1
            self._in_flight += 1
            admitted = time.monotonic()
            self._admitted.append(admitted)
            return admitted

    def _ends(self) -> bool:
        """A retired source's parked step ends the process: its lease ran out (the gate reopened)."""
        return self._end_parked and self._retired and not self._frozen

    def _refuse_retired(self) -> None:
        if self._retired:
            raise SafePointUnavailable(
                f"this workload is {RETIRED}: it was migrated and its state wiped, so it serves no more",
                hint="send requests to the migration's target",
            )

    def leave(self, report: StepReport | None = None, *, completed: bool = True, began: float | None = None) -> None:
        """The end of a safe point; ``began`` (``time.monotonic()`` at its admission) records how long it took."""
        with self._cond:
            self._in_flight -= 1
            if began is not None and began in self._admitted:
                self._admitted.remove(began)
            elif self._admitted:
                self._admitted.pop(0)  # a caller that kept no admission time (one step at a time): the oldest
            if completed:
                if began is not None:
                    now = time.monotonic()
                    self._durations.append((now, now - began))
                self.steps += 1
                if report is not None and report.loss is not None:
                    self._losses.append((self.steps, report.loss))
            self._cond.notify_all()

    @contextmanager
    def safe_point(self, timeout_s: float | None = None) -> Iterator[StepReport]:
        began = self.enter(timeout_s)
        report = StepReport()
        completed = False
        try:
            yield report
            completed = True
        finally:
            self.leave(report, completed=completed, began=began)

    def latencies(self, since: float) -> list[float]:
        """How long the safe points that ended after ``since`` (``time.monotonic()``) took, from admission to end,
        oldest first: the source's own request latency, which a live capture round's pacing yields to
        (:class:`~gpumigrate.interfaces.LatencySignal`). A held wait at a frozen gate is not in it."""
        found: list[float] = []
        with self._cond:
            for end, seconds in reversed(self._durations):  # appended in order of their ends: newest first here
                if end <= since:
                    break
                found.append(seconds)
        found.reverse()
        return found

    def running_for(self, since: float) -> float:
        """How long the oldest safe point admitted after ``since`` (``time.monotonic()``) and still in flight has run,
        in seconds (0.0: none). An engine loop's step that a live round stalls ends late, or not within the round:
        the round's pacing reads this beside ``latencies``, so that such a step counts before it ends."""
        with self._cond:
            now = time.monotonic()
            return next((now - t for t in self._admitted if t > since), 0.0)

    # ------------------------------------------------------------------ the agent's side
    @property
    def started(self) -> int:
        """Safe points entered so far: completed ones plus those in flight."""
        return self.steps + self._in_flight

    def hold(self) -> dict[str, int]:
        """Shut the gate to new safe points without waiting for those in flight (the first move of a
        group freeze). Returns ``{"steps", "in_flight", "started"}`` as they stand once shut."""
        with self._cond:
            self._frozen = True
            self._budget = 0
            self._cond.notify_all()
            return {"steps": self.steps, "in_flight": self._in_flight, "started": self.started}

    def shut(self, timeout_s: float = 60.0, *, at_step: int | None = None) -> float:
        """Stop admitting safe points and wait until none is in flight; return the seconds waited.

        ``at_step``: first let through the safe points this gate lacks to have started ``at_step``
        (a group freeze; refused if it already started more). On timeout or refusal the gate reopens
        (the source keeps running) and SnapshotError is raised.
        """
        start = time.perf_counter()
        with self._cond:
            if at_step is not None and at_step < self.started:
                self._reopen()
                raise SnapshotError(
                    f"this rank already started step {self.started}, past the group's freeze step {at_step}; "
                    "freeze abandoned, the workload keeps running",
                    hint="hold every rank first, then freeze them all at the highest step any rank started",
                )
            self._frozen = True
            self._budget = 0 if at_step is None else at_step - self.started
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._budget == 0 and self._in_flight == 0, timeout=timeout_s):
                waiting = f"{self._in_flight} in flight" + (f", {self._budget} still to start" if self._budget else "")
                self._reopen()
                raise SnapshotError(
                    f"request(s) or step(s) not settled after {timeout_s:g}s ({waiting}); freeze abandoned, "
                    "the workload keeps running"
                )
        return time.perf_counter() - start

    def _reopen(self) -> None:
        self._frozen = False
        self._budget = 0
        self._cond.notify_all()

    def reopen(self) -> None:
        """Reopen the gate. Idempotent."""
        with self._cond:
            self._reopen()

    def let_through(self, steps: int, timeout_s: float) -> list[tuple[int, float]]:
        """Let exactly ``steps`` safe points through a frozen gate; return once they finished (the
        gate is frozen again by then). Returns the losses reported for them."""
        with self._cond:
            if not self._frozen:
                raise SnapshotError("advance needs a frozen workload: send freeze first")
            first = self.steps
            self._budget = steps
            self._cond.notify_all()
            done = self._cond.wait_for(lambda: self._budget == 0 and self._in_flight == 0, timeout=timeout_s)
            if not done:
                ran = self.steps - first
                self._budget = 0  # admit no more; a step still in flight finishes before the next freeze
                raise SnapshotError(
                    f"only {ran} of {steps} step(s) ran within {timeout_s:g}s (the loop ended or is slower); "
                    "the workload stays frozen"
                )
            return [(s, loss) for s, loss in self._losses if s > first]

    # ------------------------------------------------------------------ progress (travels in the image)
    def metrics(self, since: int = 0) -> dict[str, Any]:
        with self._cond:
            return {
                "steps": self.steps,
                "losses": [[s, loss] for s, loss in self._losses if s > since],
                "in_flight": self._in_flight,
                "held": self._waiting,
                "frozen": self._frozen,
                "ready": self._ready,
                "retired": self._retired,
            }

    def progress(self) -> dict[str, Any]:
        with self._cond:
            return {"steps": self.steps, "losses": [[s, loss] for s, loss in self._losses]}

    def set_progress(self, value: dict[str, Any]) -> None:
        with self._cond:
            self.steps = int(value["steps"])
            self._losses.clear()
            self._losses.extend((int(s), float(loss)) for s, loss in value["losses"])

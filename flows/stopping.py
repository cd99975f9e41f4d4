"""An orchestrator that stops when told: SIGTERM or SIGINT to ``gpumigrate migrate`` (a systemd stop, a CI cancel,
``timeout``, Ctrl-C).

The first signal is Prefect's Cancel in all but name: the flow's own path rolls back what needs it
(:mod:`flowrun`: ``TerminationSignal`` raised where the flow is, the undo in order, the audit records, the
result). A watchdog makes sure the process then exits within :data:`EXIT_WITHIN_S` whatever Prefect does:
a signal sent to the whole process group (``timeout``, systemd) kills Prefect's ephemeral API with us, and
Prefect's client retries a dead API for minutes. If the flow has not written the migration's result after
:data:`FLOW_GRACE_S`, the watchdog does the undo itself (every step is idempotent), writes the audit record
and the result, and exits with the result's code (a rollback still running at the promise, on a host too
loaded to keep it, gets :data:`OVERRUN_S` more before the process exits 1 and names `gpumigrate rollback`). A
second signal exits at once, code 128 + the signal's number, and leaves the migration as it stands for ``gpumigrate migrate --resume --id ID`` or ``gpumigrate
rollback ID`` (a frozen source also resumes by itself when its freeze's lease lapses).

Only the CLI's own run installs this (:func:`on_signals`); a flow run by a Prefect worker keeps Prefect's
handling, where the worker owns the process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, NoReturn

from prefect.exceptions import TerminationSignal

from gpumigrate import filelock
from gpumigrate.errors import EXIT_FAILURE
from gpumigrate.result import MigrationResult

EXIT_WITHIN_S = 10.0  # the promise: from the first signal to the process's end
OVERRUN_S = 30.0  # more time for a rollback still running at the promise (see Stopper._deadline)
FLOW_GRACE_S = 5.0  # the flow's own rollback gets this long to write the result before the watchdog acts
SIGNALS = (signal.SIGTERM, signal.SIGINT)
TERMINAL = ("completed", "rolled_back", "failed", "denied")
# Prefect's loggers that report, with a traceback each, what cannot reach its API, and the task or flow run the
# stop ended (its RunCancelled, raised through our phase code on purpose): after a signal to the process group its
# ephemeral API is gone by design, and the migration's own record (audit, result, summary) says what happened.
QUIET_AFTER_SIGNAL = ("prefect.events", "prefect._internal.concurrency", "prefect.task_runs", "prefect.flow_runs")

_active: Stopper | None = None


def active() -> Stopper | None:
    """The stopper of this process's migration, when the CLI installed one."""
    return _active


def reinstall() -> None:
    """Put the stopper's handlers back (Prefect's flow engine installs its own SIGTERM handler as a flow starts)."""
    stopper = _active
    if stopper is not None and threading.current_thread() is threading.main_thread():
        stopper.install()


def signal_name(signum: int) -> str:
    with contextlib.suppress(ValueError):
        return signal.Signals(signum).name
    return f"signal {signum}"


class Stopper:
    """The signal handlers and the watchdog of one migration run in this process."""

    def __init__(self, migration_id: str, report: Callable[[MigrationResult], None]) -> None:
        self.migration_id = migration_id
        self.report = report  # how the CLI shows a result (its summary, its JSON line): once, by whoever ends
        self.signum: int | None = None
        self.since: float | None = None  # monotonic time of the first signal
        self.code: int | None = None  # the exit code of the result the flow returned, once it did
        self.started_wall = time.time()  # a result written since is this run's
        self._lock = threading.Lock()
        self._owner: str | None = None  # who ends the run after a signal: "main" (settle_here) or "watchdog"
        self._previous: dict[int, Any] = {}

    @property
    def reason(self) -> str:
        name = signal_name(self.signum or signal.SIGTERM)
        return f"the orchestrator was told to stop ({name}): rolled back to keep the source serving"

    def install(self) -> None:
        for sig in SIGNALS:
            previous = signal.signal(sig, self._on_signal)
            self._previous.setdefault(sig, previous)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, previous)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.since is not None:
            if frame is not None and frame.f_code.co_name == "capture_sigterm":
                # Not a second signal: Prefect's flow engine re-sends ours to the handler it replaced (this one) when
                # the TerminationSignal we raised leaves the flow; it raises it on, and the caller settles the stop.
                return
            self._exit_at_once(signum)
        self.signum, self.since = signum, time.monotonic()
        for name in QUIET_AFTER_SIGNAL:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        _say(
            f"{signal_name(signum)}: rolling back, then exiting (within {EXIT_WITHIN_S:.0f} s; a second signal exits at once)"
        )
        threading.Thread(target=self._watch, name="gm-stop-watchdog", daemon=True).start()
        threading.Thread(target=self._deadline, name="gm-stop-deadline", daemon=True).start()
        stop = TerminationSignal(signal=signum)  # where the flow is: its Cancel path rolls back (flowrun.py)
        if filelock.defer(stop):  # not inside a state or audit lock: raised as it is let go (gpumigrate/filelock.py)
            return
        raise stop

    def _claim(self, owner: str) -> bool:
        """Whether ``owner`` ends the run (the first to claim it does; the other stands aside)."""
        with self._lock:
            if self._owner is None:
                self._owner = owner
            return self._owner == owner

    def finished(self, result: MigrationResult) -> None:
        """The main thread has the result and will show it; when the watchdog already ends the run, it waits for
        the watchdog to end the process instead."""
        self.code = result.exit_code
        if self.since is not None and not self._claim("main"):
            _wait_forever()

    def leave(self) -> None:
        """After a signal, the main thread has shown the result: end the process now, with its code, rather than
        wait on Prefect's teardown (its API may be gone)."""
        if self.since is not None and self.code is not None:
            _exit(self.code)

    def settle_here(self) -> MigrationResult:
        """The stop landed where the flow could not act on it (before or after its body): undo and record here."""
        if not self._claim("main"):
            _wait_forever()
        result = _undo_and_record(self.migration_id, self.reason, self.started_wall)
        self.code = result.exit_code
        return result

    def _watch(self) -> None:
        """Give the flow's own rollback its grace; then, whatever still holds the main thread, end the run here."""
        assert self.since is not None
        while time.monotonic() - self.since < FLOW_GRACE_S and self._owner is None:
            if _result_written(self.migration_id, self.started_wall):
                time.sleep(1.0)  # the flow wrote its result: the main thread shows it, unless Prefect holds it
                break
            time.sleep(0.05)
        if not self._claim("watchdog"):
            return
        if _result_written(self.migration_id, self.started_wall):
            result = _written(self.migration_id)
        else:  # the flow is stuck (a dead Prefect API, most often): the undo and the result, here
            result = _undo_and_record(self.migration_id, self.reason, self.started_wall)
        self.code = result.exit_code
        with contextlib.suppress(Exception):
            self.report(result)
        _exit(result.exit_code)

    def _deadline(self) -> None:
        """The promise, whatever blocks: at :data:`EXIT_WITHIN_S` the process ends, with the result if there is one.
        A rollback still running then (a host too loaded to keep the promise) gets :data:`OVERRUN_S` more: a source
        left half undone is worse than a late exit, and a second signal still ends the process at once."""
        assert self.since is not None
        time.sleep(max(0.0, self.since + EXIT_WITHIN_S - 0.4 - time.monotonic()))
        code = self._final_code()
        if code is None:
            _say(
                f"the rollback is still running {EXIT_WITHIN_S:.0f} s after the signal (a loaded host?): giving it up "
                f"to {OVERRUN_S:.0f} s more; a second signal exits now"
            )
        while code is None and time.monotonic() < self.since + EXIT_WITHIN_S + OVERRUN_S:
            time.sleep(0.25)
            code = self._final_code()
        if code is None:
            from gpumigrate.flows.undo import running_steps

            _say(
                f"the rollback did not finish within {EXIT_WITHIN_S + OVERRUN_S:.0f} s of the signal (undo steps still "
                f"running: {running_steps()}): exiting; finish it with `gpumigrate rollback {self.migration_id}`"
            )
            _exit(EXIT_FAILURE)
        if self._claim("deadline"):
            with contextlib.suppress(Exception):
                self.report(_written(self.migration_id))
        _exit(code)

    def _final_code(self) -> int | None:
        """The exit code of this run's result, once the flow or the watchdog has one."""
        if self.code is not None:
            return self.code
        return _written(self.migration_id).exit_code if _result_written(self.migration_id, self.started_wall) else None

    def _exit_at_once(self, signum: int) -> NoReturn:
        _say(
            f"second signal ({signal_name(signum)}): exiting now, leaving migration {self.migration_id} as it stands: "
            f"`gpumigrate rollback {self.migration_id}` or `gpumigrate migrate PLAN --resume --id {self.migration_id}`"
        )
        _exit(128 + signum)


def _undo_and_record(migration_id: str, reason: str, since_wall: float) -> MigrationResult:
    """The whole rollback and the migration's record of it, without Prefect: every step local or to our own parts."""
    from gpumigrate.flows.context import RunContext
    from gpumigrate.flows.events import emit
    from gpumigrate.flows.report import merge_result, write_outputs
    from gpumigrate.flows.undo import rolled_back_or_not, undo_all

    ctx = RunContext.load(migration_id)
    m = ctx.migration
    if _result_written(migration_id, since_wall):  # the flow got there first
        return _written(migration_id)
    with contextlib.suppress(Exception):  # as the flow's Cancel path records it (flowrun.record_cancel)
        m.request_rollback(reason)
        emit(m, "rollback.cancel", {"reason": reason[:300], "during": "the watchdog: the flow did not act in time"})
    undo_all(ctx, reason=reason)
    status, error = rolled_back_or_not(ctx, "rolled_back", f"rolled back: {reason}")
    m.update(status=status)
    merge_result(m, rollback={"triggered": True, "reason": reason[:300], "trigger": "cancel"})
    emit(m, f"migration.{status}", {"error": error[:500]})
    return write_outputs(m, status=status, error=error)


def _result_written(migration_id: str, since_wall: float) -> bool:
    """The migration's status is final and its result was written since ``since_wall`` (by this run)."""
    from gpumigrate.state import Migration

    with contextlib.suppress(Exception):
        m = Migration.open(migration_id)
        fresh = (m.artifacts / "result.json").stat().st_mtime >= since_wall
        return bool(fresh and m.read().get("status") in TERMINAL)
    return False


def _written(migration_id: str) -> MigrationResult:
    from gpumigrate.state import Migration

    return MigrationResult.model_validate_json((Migration.open(migration_id).artifacts / "result.json").read_text())


def _say(text: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(f"gpumigrate: {text}\n")
        sys.stderr.flush()


def _exit(code: int) -> NoReturn:
    """End the process now: Prefect's ephemeral API (if it still runs) first, then this process, streams flushed."""
    _stop_ephemeral_api()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _stop_ephemeral_api() -> None:
    """The ephemeral API server Prefect started for this process, if any (it would outlive an os._exit)."""
    with contextlib.suppress(Exception):
        from prefect.server.api.server import SubprocessASGIServer

        for server in list(getattr(SubprocessASGIServer, "_instances", {}).values()):
            proc = getattr(server, "server_process", None)
            if proc is not None and proc.poll() is None:
                proc.terminate()
                with contextlib.suppress(Exception):
                    proc.wait(timeout=2)


def _wait_forever() -> NoReturn:
    while True:
        time.sleep(60)


@contextlib.contextmanager
def on_signals(migration_id: str, report: Callable[[MigrationResult], None]) -> Iterator[Stopper]:
    """SIGTERM and SIGINT stop the migration ``migration_id`` run in this process as the module says."""
    global _active
    stopper = Stopper(migration_id, report)
    stopper.install()
    _active = stopper
    try:
        yield stopper
    finally:
        _active = None
        stopper.uninstall()

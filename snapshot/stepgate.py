"""A safe point between training steps: the loop calls ``checkpoint()`` after each step; ``freeze()``
(from the agent's thread) returns once the loop is parked there, and ``resume()`` lets it go on."""

from __future__ import annotations

import threading

from gpumigrate.errors import SnapshotError


class StepGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._want_freeze = False
        self._parked = False
        self.loop_running = False  # set by the loop owner while steps are being taken

    @property
    def frozen(self) -> bool:
        return self._parked

    def checkpoint(self) -> None:
        """Called by the training loop between steps; blocks while a freeze is requested."""
        with self._cond:
            if not self._want_freeze:
                return
            self._parked = True
            self._cond.notify_all()
            while self._want_freeze:
                self._cond.wait()
            self._parked = False
            self._cond.notify_all()

    def freeze(self, timeout_s: float = 60.0) -> None:
        with self._cond:
            self._want_freeze = True
            if not self.loop_running:
                self._parked = True  # no steps are running: nothing can change under us
                return
            if not self._cond.wait_for(lambda: self._parked or not self.loop_running, timeout_s):
                self._want_freeze = False
                self._cond.notify_all()
                raise SnapshotError(f"training did not reach a step boundary within {timeout_s:g} s; left running")
            self._parked = True

    def resume(self) -> None:
        with self._cond:
            self._want_freeze = False
            self._parked = False
            self._cond.notify_all()

    def stop_loop(self) -> None:
        """The loop ended (or did not start): a pending freeze no longer waits for it."""
        with self._cond:
            self.loop_running = False
            self._cond.notify_all()

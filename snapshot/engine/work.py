"""Work in flight that travels with the state: the workload's hooks at its safe point, and the hand-over.

A workload whose safe point lands in the middle of its clients' work (an engine loop between two decode
steps, with generations streaming) hands that work over instead of finishing it before a freeze. It
gives the engine an :class:`InFlightWork` (the public SDK's ``gpumigrate.agent.InFlight`` is a base
class with every hook): the engine ships what ``capture`` returns as JSON in every image (a blob region,
``work``), and on the target calls ``restore`` with the final image's value after the tensors are
loaded, before the workload reports ready.

On the source, the work in the final image is *sealed* once that image is committed: the workload
keeps it aside, neither advancing nor dropping it, while it serves new work. Then exactly one of:

* ``hand_over(target)``: the restored target runs it now (``handed_over``; the workload relays, say);
* ``take_back()``: a rollback, or no word from the orchestrator within the hold's lease: the
  workload goes on with it itself (``taken_back``).

The hold is a lease like a freeze's (``lease.py``): started with the freeze's length when the work is
sealed, renewed by ``renew`` while the orchestrator lives, and on expiry the work is taken back, so a
dead orchestrator never strands a client. Wire commands: snapshot/PROTOCOL.md ("Work in flight").
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from gpumigrate.errors import SnapshotError
from gpumigrate.snapshot import tracked as tr
from gpumigrate.snapshot.lease import Lease, lease_arg

REGION = "work"  # the blob region that carries the work's JSON


@runtime_checkable
class InFlightWork(Protocol):
    """The workload's hooks for work that travels at its safe point (``gpumigrate.agent.InFlight``)."""

    def capture(self, final: bool) -> Any:
        """The work in flight as a JSON value, at a safe point (``final``: the workload is frozen, the image is the
        one to restore; otherwise a live pre-copy round, whose value no target ever restores)."""

    def restore(self, state: Any) -> None:
        """Target: take over the work of the final image (its tensors are loaded; the workload is not ready yet)."""

    def sealed(self) -> None:
        """Source: the final image holds the work ``capture(final=True)`` returned; keep it aside, unadvanced."""

    def handed_over(self, target: str) -> None:
        """Source: the work set aside runs on the target now (``target``: its service URL)."""

    def taken_back(self) -> None:
        """Source: the work set aside goes on here (a rollback, or the hold's lease ran out)."""

    def figures(self) -> dict[str, Any]:
        """Small JSON figures for the orchestrator's view; ``in_flight`` (work served here) and ``relayed`` (work
        handed over whose clients this process still serves) are read by the flow."""


class WorkHold:
    """The engine's side: the ``work`` region, the sealed work's lease, hand-over and take-back."""

    def __init__(self, command_lock: threading.RLock, frozen: Callable[[], bool]) -> None:
        self.hooks: InFlightWork | None = None
        self._frozen = frozen
        self._lock = command_lock
        self._restored: Any = None  # the value the last load carried, restored when that load makes it ready
        self.state = "none"  # none | sealed | handed_over
        self.handed_over_to: str | None = None
        self.lease = Lease(command_lock, self._expired, what="the hold of the work in flight")
        self.expiries = 0

    def track(self, hooks: InFlightWork) -> tr.Item:
        """The blob item that carries ``hooks``' work; refuses a second set of hooks."""
        missing = [
            m
            for m in ("capture", "restore", "sealed", "handed_over", "taken_back", "figures")
            if not callable(getattr(hooks, m, None))
        ]
        if missing:
            raise TypeError(f"in-flight work hooks need the methods {', '.join(missing)} (gpumigrate.agent.InFlight)")
        if self.hooks is not None:
            raise SnapshotError("this agent already tracks in-flight work: one set of hooks per process")
        self.hooks = hooks

        def capture() -> Any:
            assert self.hooks is not None
            value = self.hooks.capture(self._frozen())
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise SnapshotError(
                    f"InFlight.capture returned a {type(value).__qualname__}: it must return a JSON value"
                ) from None
            return value

        def stash(value: Any) -> None:
            self._restored = value

        return tr.json_blob(REGION, capture, stash)

    @property
    def held(self) -> bool:
        return self.state == "sealed"

    # ------------------------------------------------------------------ source
    def seal(self, lease_s: float | None) -> None:
        """The final image is committed: the workload keeps its work aside under a lease (command lock held)."""
        if self.hooks is None:
            return
        self.hooks.sealed()
        self.state, self.handed_over_to = "sealed", None
        self.lease.start(lease_arg(lease_s))

    def renew(self, lease_s: float | None) -> dict[str, Any]:
        return self.lease.extend(lease_s)

    def hand_over(self, target: str) -> dict[str, Any]:
        """The sealed work runs on ``target`` now (command lock held). Idempotent for the same target."""
        if not isinstance(target, str) or not target.startswith(("http://", "https://")):
            raise SnapshotError(f"target {str(target)[:60]!r}: must be the target's service URL (http://HOST:PORT)")
        if self.hooks is None:
            return {"handed_over": False, "reason": "this workload hands no work over"}
        if self.state == "handed_over" and self.handed_over_to == target:
            return {"handed_over": True, "target": target, "figures": self.figures()}
        if self.state != "sealed":
            why = "it was taken back (a rollback, or the hold's lease ran out)" if self.expiries else "none is sealed"
            return {"handed_over": False, "reason": f"no work is held for a hand-over: {why}"}
        self.lease.clear()
        self.hooks.handed_over(target)
        self.state, self.handed_over_to = "handed_over", target
        return {"handed_over": True, "target": target, "figures": self.figures()}

    def take_back(self) -> dict[str, Any]:
        """The sealed work goes on here (command lock held). Idempotent; refused by nothing."""
        if self.hooks is None or self.state != "sealed":
            return {"taken_back": False, "state": self.state}
        self.lease.clear()
        self.hooks.taken_back()
        self.state = "none"
        return {"taken_back": True, "figures": self.figures()}

    def _expired(self) -> None:
        self.expiries += 1
        self.take_back()

    # ------------------------------------------------------------------ target
    def when_ready(self) -> None:
        """A load that makes the workload ready: the work its image carried is taken over first."""
        value, self._restored = self._restored, None
        if self.hooks is not None and value is not None:
            self.hooks.restore(value)

    # ------------------------------------------------------------------ both
    def figures(self) -> dict[str, Any]:
        if self.hooks is None:
            return {}
        got = self.hooks.figures()
        return {**(got if isinstance(got, dict) else {}), "held": self.held, "handed_over_to": self.handed_over_to}

    def close(self) -> None:
        self.lease.close()

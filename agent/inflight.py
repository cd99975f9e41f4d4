"""Work in flight that moves with the state: the hooks a server with a token-boundary safe point implements.

An engine loop that streams generations (an LLM server) cannot drain its requests before a freeze: a
2,000-token answer takes a minute. Its safe point is between two steps of the loop instead, and the
requests in flight travel: their cache rows as tracked tensors, everything else (tokens so far, sampler
state, stop conditions, the queue) as the JSON that :meth:`InFlight.capture` returns. Subclass
:class:`InFlight`, override what your server needs, and pass it to ``attach(..., in_flight=...)``;
README.md beside this file ("Work in flight") says when each hook runs and on which thread.
"""

from __future__ import annotations

from typing import Any


class InFlight:
    """Hooks for work in flight (``attach(..., in_flight=InFlightSubclass(...))``). Every hook runs on the agent's
    thread, one at a time. ``capture(final=True)`` and ``sealed`` run while the workload is frozen at its safe point
    (no step in flight, when the loop runs each step inside ``handle.safe_point()``); ``capture(final=False)``,
    ``handed_over``, ``taken_back``, ``restore`` and ``figures`` may run while the loop runs: synchronise with it.
    Each must return quickly: the final capture and the restore are on the downtime's clock."""

    def capture(self, final: bool) -> Any:
        """The work in flight as a JSON value (numbers, strings, lists, dicts, bools, None).

        ``final=True``: the workload is frozen at its safe point and this value rides the image the target
        restores; after the image is committed :meth:`sealed` follows. ``final=False``: a live pre-copy round
        while the workload runs; no target ever restores that value, so return something small."""
        return None

    def restore(self, state: Any) -> None:
        """Target: take over the work of the final image (``state``: what the source's ``capture(final=True)``
        returned). Tracked tensors are already restored in place; the workload reports ready after this returns."""

    def sealed(self) -> None:
        """Source: the committed image holds the work :meth:`capture` returned. Keep it aside, neither advancing nor
        dropping it, while serving new work; :meth:`handed_over` or :meth:`taken_back` comes next."""

    def handed_over(self, target: str) -> None:
        """Source: the restored target at ``target`` (its service URL) runs the work set aside now; relay its
        clients' streams from there (they are connected here) and free what the work held."""

    def taken_back(self) -> None:
        """Source: the work set aside goes on here, where it stopped (a rollback, or no hand-over came within the
        hold's lease)."""

    def figures(self) -> dict[str, Any]:
        """Small JSON figures shown while the migration runs. Two are read by gpumigrate: ``in_flight`` (work being
        served by this process) and ``relayed`` (work handed over that this process still relays to its clients:
        a rollback waits for these to end before it tears the target down)."""
        return {}

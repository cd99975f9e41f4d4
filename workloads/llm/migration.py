"""The engine's work in flight as the SDK moves it: the server's ``gpumigrate.agent.InFlight`` hooks.

The SDK calls these on its agent's thread (DESIGN.md, "Through gpumigrate migrate"):

* ``capture(final=True)``, the source frozen between two decode steps: the engine's whole travelling
  state (``Engine.export_state``: every request running, queued or arrived, with tokens, text, sampler
  and limits). A live pre-copy round gets a small marker instead: no target restores it, and
  serialising every prompt on each round would stall the engine's thread for nothing.
* ``sealed()``, once the image is committed: those requests are set aside, keeping their slots and
  state, while the engine serves what arrives next.
* ``handed_over(target)``: the target runs them now; their slots are freed, and each client's stream
  follows its request there (``handover.py``: the relay).
* ``taken_back()``: a rollback; they go on here where they stopped.
* ``restore(state)`` on the target, after the KV cache was restored in place and before the server
  reports ready: the engine imports the state and generates on; requests no relay claims within the
  claim timeout are cancelled (their clients left during the move).
"""

from __future__ import annotations

from typing import Any

import gpumigrate.agent as gm

from .engine import FORMAT, Engine
from .handover import Handover

LIVE = {"format": FORMAT, "live": True}  # what a live round carries: the requests travel in the final image only


class EngineWork(gm.InFlight):
    def __init__(self, engine: Engine, handover: Handover, streams: Any = None) -> None:
        self.engine = engine
        self.handover = handover
        self.streams = streams  # a callable giving the client streams open here (the server's count), or None
        self._captured: list[str] = []

    def capture(self, final: bool) -> Any:
        if not final:
            return LIVE
        plain, _ = self.engine.export_state()  # the KV cache travels as the tracked tensor state/kv
        self._captured = [r["id"] for r in plain["requests"]]
        return plain

    def sealed(self) -> None:
        self.engine.set_aside(self._captured)

    def handed_over(self, target: str) -> None:
        self.handover.moved_on(self.engine.let_go(), target)

    def taken_back(self) -> None:
        self.engine.put_back()

    def restore(self, state: Any) -> None:
        if not isinstance(state, dict) or not state.get("requests"):
            return  # a live round's marker, or nothing was in flight
        ids = self.engine.import_state(state, None)  # the cache is restored in place already
        self.handover.expect_claims(ids)

    def figures(self) -> dict[str, Any]:
        stats = self.engine.stats()
        generating = len(stats["running"]) + len(stats["queued"]) + len(stats["arrived"])
        out = {
            "in_flight": generating,
            "relayed": self.handover.relaying,
            "aside": len(stats["aside"]),
            "moved": self.handover.moved,
            "last_step_ms": stats["last_step_ms"],
        }
        if self.streams is not None:
            out["streams"] = int(self.streams())
        return out

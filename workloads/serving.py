"""The inference server's live objects, shared with the embedded snapshot agent.

:class:`ServingState` is the one handle the agent gets: the model (whose tensors it captures or
restores in place), the :class:`SafePoint` (which it freezes so no request is mid-forward while the
final copy runs), the ready flag (which it raises after a restore) and the current fault.
Thread-safe: HTTP handlers run in worker threads, the agent in its own.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from gpumigrate.errors import InvalidInputError, SnapshotError

FAULT_KINDS = ("none", "errors", "slow", "drift", "crash")


class SafePoint:
    """A gate between requests. Requests ``enter()``/``leave()`` it; ``freeze()`` waits for the
    in-flight ones to finish and then holds new ones back (they wait, they do not fail) until
    ``resume()``. A frozen server therefore looks slow, never broken, to its clients.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._in_flight = 0
        self._frozen = False
        self._waiting = 0

    @property
    def frozen(self) -> bool:
        return self._frozen

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def waiting(self) -> int:
        """Requests held at the gate by a freeze."""
        return self._waiting

    def enter(self, timeout_s: float | None = None) -> None:
        """Block while frozen; raise SnapshotError if still frozen after ``timeout_s``."""
        with self._cond:
            if self._frozen:
                self._waiting += 1
                try:
                    if not self._cond.wait_for(lambda: not self._frozen, timeout=timeout_s):
                        raise SnapshotError(f"request waited {timeout_s}s at a frozen safe point")
                finally:
                    self._waiting -= 1
            self._in_flight += 1

    def leave(self) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    @contextmanager
    def request(self, timeout_s: float | None = None) -> Iterator[None]:
        self.enter(timeout_s)
        try:
            yield
        finally:
            self.leave()

    def freeze(self, timeout_s: float = 30.0) -> float:
        """Stop admitting requests and wait until none is in flight. Returns seconds waited.

        On timeout the gate is reopened (the source keeps serving) and SnapshotError is raised.
        """
        start = time.perf_counter()
        with self._cond:
            self._frozen = True
            if not self._cond.wait_for(lambda: self._in_flight == 0, timeout=timeout_s):
                self._frozen = False
                self._cond.notify_all()
                raise SnapshotError(
                    f"{self._in_flight} request(s) still in flight after {timeout_s}s; freeze abandoned"
                )
        return time.perf_counter() - start

    def resume(self) -> None:
        """Reopen the gate. Idempotent."""
        with self._cond:
            self._frozen = False
            self._cond.notify_all()


@dataclass(frozen=True)
class Fault:
    kind: str = "none"
    rate: float = 1.0
    delay_ms: int = 0

    @classmethod
    def parse(cls, body: Any) -> Fault:
        if not isinstance(body, dict):
            raise InvalidInputError("fault body must be a JSON object")
        kind = body.get("kind", "none")
        if kind not in FAULT_KINDS:
            raise InvalidInputError(f"kind must be one of {', '.join(FAULT_KINDS)}; got {kind!r}")
        rate = body.get("rate", 1.0)
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate <= 1.0:
            raise InvalidInputError(f"rate must be a number in 0..1; got {rate!r}")
        delay = body.get("delay_ms", 0)
        if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay <= 60_000:
            raise InvalidInputError(f"delay_ms must be an integer in 0..60000; got {delay!r}")
        return cls(kind=kind, rate=float(rate), delay_ms=delay)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class ServingState:
    """The server's live objects, handed to the snapshot agent (``start_inference_agent(state, port)``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        name: str,
        model_id: str,
        ready: bool = True,
        meta: dict[str, Any] | None = None,
        fault_seed: int = 0,
    ) -> None:
        self.model = model
        self.name = name
        self.model_id = model_id
        self.meta = dict(meta or {})  # seed, size, dtype, device: what the agent records in the image
        self.safe_point = SafePoint()
        self._ready = threading.Event()
        if ready:
            self._ready.set()
        self._fault = Fault()
        self._rng = random.Random(fault_seed)
        self._rng_lock = threading.Lock()
        vocab = getattr(getattr(model, "cfg", None), "vocab", 260)
        # A fixed perturbation of the logits: large enough to change tokens and logprobs.
        self.drift_noise = torch.randn(vocab, generator=torch.Generator().manual_seed(1234)) * 3.0
        self.weights_version = 0  # bumped by mark_weights_changed(): lets caches of derived facts expire
        self._digest: str | None = None

    # readiness: the agent calls set_ready(True) after a restore, set_ready(False) before one
    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self.safe_point.frozen

    def set_ready(self, ready: bool) -> None:
        # Either way the weights are about to change or just did (restore, zeroize): derived facts expire.
        self.mark_weights_changed()
        if ready:
            self._ready.set()
        else:
            self._ready.clear()

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        return self._ready.wait(timeout_s)

    def mark_weights_changed(self) -> None:
        from gpumigrate.workloads.model import forget_decode_weights

        self.weights_version += 1
        self._digest = None
        forget_decode_weights(self.model)

    def weights_digest(self) -> str:
        from gpumigrate.workloads.model import weights_digest

        if self._digest is None:
            self._digest = weights_digest(self.model)
        return self._digest

    # faults
    @property
    def fault(self) -> Fault:
        return self._fault

    def set_fault(self, fault: Fault) -> None:
        self._fault = fault

    def fault_hits(self) -> bool:
        """Whether the current fault applies to this request (drawn with its rate)."""
        f = self._fault
        if f.kind == "none":
            return False
        if f.rate >= 1.0:
            return True
        with self._rng_lock:
            return self._rng.random() < f.rate

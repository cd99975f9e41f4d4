"""The inference server's live objects: the model, its safe point, and the current fault.

With the migration agent attached (``gpumigrate.agent.attach``, as any user's service would), the
safe point is the agent handle's: a freeze waits for requests in flight and holds new ones, and a
restore fills the model in place and raises ready. Without an agent (in-process tests) the state
keeps a gate of its own with the same behaviour. Thread-safe: HTTP handlers run in worker threads,
the agent in its own.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from gpumigrate.agent import Handle
from gpumigrate.errors import InvalidInputError
from gpumigrate.snapshot.stepgate import SafePointGate
from gpumigrate.workloads.model import TinyLM

FAULT_KINDS = ("none", "errors", "slow", "drift", "crash")


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
    """The server's live objects. ``handle``: the attached agent (its safe point is used); none: a gate of our own."""

    def __init__(
        self,
        model: TinyLM,
        *,
        name: str,
        model_id: str,
        ready: bool = True,
        meta: dict[str, Any] | None = None,
        fault_seed: int = 0,
        handle: Handle | None = None,
    ) -> None:
        self.model = model
        self.name = name
        self.model_id = model_id
        self.meta = dict(meta or {})  # seed, size, dtype, device
        self.handle = handle
        self.safe_point = handle.gate if handle is not None else SafePointGate(ready=ready)
        self._fault = Fault()
        self._rng = random.Random(fault_seed)
        self._rng_lock = threading.Lock()
        vocab = model.cfg.vocab
        # A fixed perturbation of the logits: large enough to change tokens and logprobs.
        self.drift_noise = torch.randn(vocab, generator=torch.Generator().manual_seed(1234)) * 3.0
        self._digest: tuple[int, str] | None = None  # (state version it was computed at, digest)
        self.mutable: torch.Tensor | None = None  # state each request changes (--mutable-mb), tracked by the agent

    @contextmanager
    def request(self, timeout_s: float) -> Iterator[None]:
        """One request at the safe point: held (up to ``timeout_s``, then Unavailable) while frozen or unready."""
        with self.handle.safe_point(timeout_s) if self.handle is not None else self.safe_point.safe_point(timeout_s):
            yield

    @property
    def ready(self) -> bool:
        """Weights loaded (not awaiting a restore, not zeroized) and not frozen."""
        return self.safe_point.reason() is None

    @property
    def loaded(self) -> bool:
        return self.safe_point.ready

    def reason(self) -> str | None:
        return self.safe_point.reason()

    def set_ready(self, ready: bool) -> None:
        """Raise or drop readiness by hand (in-process tests; the agent does it after a restore)."""
        self._digest = None  # whoever calls this has just changed the weights, or is about to
        self.safe_point.set_ready(ready)

    def weights_digest(self) -> str:
        from gpumigrate.workloads.model import weights_digest

        # A restore or zeroize changes the weights in place: the agent's state version says when.
        version = self.handle.engine.state_version if self.handle is not None else 0
        if self._digest is None or self._digest[0] != version:
            self._digest = (version, weights_digest(self.model))
        return self._digest[1]

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

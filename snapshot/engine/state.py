"""Where the engine stands: the status its parts share and ``info`` reports."""

from __future__ import annotations

from dataclasses import dataclass

from gpumigrate.interfaces import ImageRef


@dataclass
class EngineState:
    """What the engine's parts (capture, loading, freezing, zeroize) read and change, under the engine's lock."""

    frozen: bool = False  # parked and settled: no safe point in flight
    held: bool = False  # gate shut, safe points may still be in flight (a group freeze's first move)
    ready: bool | None = None  # None until a restore said either way
    rounds: int = 0  # capture rounds committed
    last_image: ImageRef | None = None  # the image last written or loaded here (the next round's parent)
    state_version: int = 0  # bumped when a restore or zeroize rewrote the tracked state in place
    fingerprint_collisions: int = 0  # chunks the final round's full hash caught changed under an unchanged fingerprint

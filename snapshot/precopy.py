"""When to stop pre-copying: dirty bytes fit the downtime budget, stopped shrinking, or rounds ran out.

Like QEMU's live migration: each round re-sends what the workload dirtied during the previous one.
The send rate is measured from the rounds themselves (dirty bytes / round seconds, the best seen),
so the predicted stop-and-copy time is ``dirty bytes of the last round / rate``. This is the one
rule: the migrate flow's snapshot phase and ``gpumigrate snapshot precopy --rounds`` both use it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gpumigrate.interfaces import Round, RoundStats

# A round must cut dirty bytes by at least this fraction to count as still converging.
SHRINK_FACTOR = 0.9


@dataclass
class Convergence:
    rounds: list[RoundStats] = field(default_factory=list)
    reason: str = ""
    predicted_downtime_ms: float | None = None
    rate_bytes_per_s: float | None = None
    images: list[str] = field(default_factory=list)  # image id of each round


def predict_ms(rounds: list[RoundStats]) -> tuple[float | None, float | None]:
    """(predicted stop-and-copy ms for the last round's dirty set, best observed bytes/s)."""
    rates = [r.bytes_dirty / r.seconds for r in rounds if r.seconds > 0 and r.bytes_dirty > 0]
    if not rounds:
        return None, None
    if not rates:
        return (0.0 if rounds[-1].bytes_dirty == 0 else None), None
    rate = max(rates)
    return rounds[-1].bytes_dirty / rate * 1000.0, rate


def converge(round_fn: Callable[[], Round], *, max_rounds: int, max_downtime_ms: float) -> Convergence:
    """Run ``round_fn`` (one pre-copy round) until the last dirty set can ship within ``max_downtime_ms``."""
    out = Convergence()
    if max_rounds <= 0:
        out.reason = "no pre-copy rounds allowed by the plan"
        return out
    while len(out.rounds) < max_rounds:
        done = round_fn()
        out.rounds.append(done.stats)
        out.images.append(done.image.id)
        out.predicted_downtime_ms, out.rate_bytes_per_s = predict_ms(out.rounds)
        last = out.rounds[-1]
        if last.bytes_dirty == 0 or (
            out.predicted_downtime_ms is not None
            and len(out.rounds) > 1
            and out.predicted_downtime_ms <= max_downtime_ms
        ):
            out.reason = f"dirty set fits the downtime budget ({last.bytes_dirty} bytes)"
            return out
        if len(out.rounds) >= 2 and last.bytes_dirty > out.rounds[-2].bytes_dirty * SHRINK_FACTOR:
            out.reason = f"dirty bytes stopped shrinking ({out.rounds[-2].bytes_dirty} -> {last.bytes_dirty})"
            return out
    out.reason = f"reached the plan's {max_rounds} pre-copy rounds"
    return out

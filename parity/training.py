"""Training parity: the target's next steps give the losses the source gives for the same steps.

The flow runs N steps on the source (or an unmigrated control) and the same N on the restored target,
then calls :func:`compare_losses`. Bit-exact by default (``parity.training`` atol = rtol = 0: the same
hardware and software give the same floats); a hardware change widens it in the plan. Judged by the
same rules and reported in the same files as output parity (``parity.json``, ``parity.html``), one
case per step, so a missing or extra step and a NaN are named like any other difference.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from gpumigrate.errors import InvalidInputError
from gpumigrate.parity.output import compare_outputs
from gpumigrate.parity.result import OutputParityResult
from gpumigrate.parity.rules import Rules
from gpumigrate.plan import TrainingParity

LOSS = "loss"


def _rows(losses: Sequence[float], side: str) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for step, loss in enumerate(losses):
        if isinstance(loss, bool) or not isinstance(loss, int | float):
            raise InvalidInputError(f"{side} loss of step {step} is {type(loss).__name__}, not a number")
        rows.append({"id": f"step-{step}", LOSS: float(loss)})
    return rows


def compare_losses(
    source: Sequence[float],
    target: Sequence[float],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    out_dir: str | Path | None = None,
    use_gx: bool = False,
) -> OutputParityResult:
    """Step i of the target against step i of the source: ``|s - t| <= atol + rtol * |s|`` (0, 0: equal floats;
    NaN only where the source has NaN too). A step the target did not run is a missing case."""
    started = time.perf_counter()
    rules = Rules(atol=atol, rtol=rtol, exact_fields=(), tolerant_fields=(LOSS,), required=True)
    src, tgt = _rows(source, "source"), _rows(target, "target")
    meta = {"kind": "training", "steps_source": len(src), "steps_target": len(tgt),
            "bit_exact": atol == 0 and rtol == 0}  # fmt: skip
    return compare_outputs(src, tgt, rules=rules, out_dir=out_dir, use_gx=use_gx, meta=meta, started=started)


def training_parity(
    source: Sequence[float], target: Sequence[float], policy: TrainingParity, *, out_dir: str | Path | None = None
) -> OutputParityResult:
    """:func:`compare_losses` with the plan's ``parity.training`` tolerances (the flow's call)."""
    return compare_losses(source, target, atol=policy.atol, rtol=policy.rtol, out_dir=out_dir)

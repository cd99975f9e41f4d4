"""Training parity: the target's next steps give the losses the source gives for the same steps.

The flow runs N steps on the source (or an unmigrated control) and the same N on the restored target,
then calls :func:`compare_losses`. Bit-exact by default (``parity.training`` atol = rtol = 0: the same
hardware and software give the same floats); a hardware change widens it in the plan. Judged by the
same rules and reported in the same files as output parity (``parity.json``, ``parity.html``), one
case per step (per rank and step for a workload of several ranks), so a missing or extra step and a NaN are named
like any other difference.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpumigrate.errors import InvalidInputError
from gpumigrate.parity.output import compare_outputs
from gpumigrate.parity.result import OutputParityResult
from gpumigrate.parity.rules import Rules
from gpumigrate.plan import TrainingParity

LOSS = "loss"


def _rows(losses: Sequence[tuple[str, float]], side: str) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for case, loss in losses:
        if isinstance(loss, bool) or not isinstance(loss, int | float):
            raise InvalidInputError(f"{side} loss of {case} is {type(loss).__name__}, not a number")
        rows.append({"id": case, LOSS: float(loss)})
    return rows


def _numbered(losses: Sequence[float]) -> list[tuple[str, float]]:
    return [(f"step-{i}", loss) for i, loss in enumerate(losses)]


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
    return compare_cases(_numbered(source), _numbered(target), atol=atol, rtol=rtol, out_dir=out_dir, use_gx=use_gx)


def compare_cases(
    source: Sequence[tuple[str, float]],
    target: Sequence[tuple[str, float]],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    out_dir: str | Path | None = None,
    use_gx: bool = False,
) -> OutputParityResult:
    """:func:`compare_losses` of named cases (``("rank1-step-42", loss)``): a case the target lacks is missing."""
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


def world_training_parity(
    source: Sequence[Mapping[int, float]],
    target: Sequence[Mapping[int, float]],
    steps: Sequence[int],
    policy: TrainingParity,
    *,
    out_dir: str | Path | None = None,
) -> OutputParityResult:
    """Every rank's losses for ``steps``: rank r's source losses (``{step: loss}``) against rank r's target
    losses, one case per rank and step (``rank<r>-step-<step>``); a world of ranks steps together, and each rank
    trains on its own shard of the data, so each rank's losses are its own."""
    if len(source) != len(target):
        raise InvalidInputError(f"the source reported losses of {len(source)} ranks, the target of {len(target)}")
    src = [(f"rank{r}-step-{s}", losses[s]) for r, losses in enumerate(source) for s in steps if s in losses]
    tgt = [(f"rank{r}-step-{s}", losses[s]) for r, losses in enumerate(target) for s in steps if s in losses]
    return compare_cases(src, tgt, atol=policy.atol, rtol=policy.rtol, out_dir=out_dir)

"""What preflight asks the running source before anything is provisioned: that it behaves as the migration needs.

The plan alone cannot show these (``gpumigrate plan validate`` checks what it can); found later, each cost a
target started and torn down, or a freeze and a rollback (issue 35). Each is exit 2 naming what to fix:

* a service's health path and ready path both answer 200 on the source (the launch contract: the flow starts a
  target once its health path answers, restores it, then waits on its ready path; the front door checks the ready
  path);
* one golden request to the source answers with every field ``parity.request.compare`` names (numbers where
  compared as numbers);
* a training loop reports its losses (``step.report``): the move is proved by them.

The image key is checked by the snapshot backend's own preflight check (the source's agent reads it).
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Real
from typing import Any

import httpx

from gpumigrate.errors import InvalidInputError, SnapshotError
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit
from gpumigrate.infra.launch import status_of
from gpumigrate.parity.output import load_golden
from gpumigrate.parity.request import ask, build_requests
from gpumigrate.parity.rules import ABSENT, field_value
from gpumigrate.parity.urls import redact_url
from gpumigrate.plan import FieldCheck
from gpumigrate.snapshot.errors import TrainingLoopError

PATH_TIMEOUT_S = 5.0
LOSS_WAIT_S = 15.0  # how long a training source may take to show a reported loss


def check_source(ctx: RunContext) -> dict[str, Any]:
    """Every check of the source that its workload kind calls for; what they found, for the phase's record."""
    if ctx.plan.workload.kind == "training":
        return check_training_losses(ctx)
    check_service_paths(ctx)
    return check_golden_answer(ctx)


def check_service_paths(ctx: RunContext) -> None:
    """The source's ``workload.health_path`` and ``workload.ready_path`` answer 200 (a frozen source's ready path
    answers 200 too: it holds requests)."""
    wl = ctx.plan.workload
    endpoint = ctx.need(wl.endpoint, "the source endpoint")
    rules = {
        "health_path": "answers 200 while the process lives, also on a target before its restore (the flow starts "
        "the target once it does); gpumigrate.agent.ReadinessMiddleware serves /healthz",
        "ready_path": "answers 200 while the service serves (the front door checks it, and the flow waits on it "
        "once the target is restored); ReadinessMiddleware serves /readyz",
    }
    for name, path in (("health_path", wl.health_path), ("ready_path", wl.ready_path)):
        code = status_of(endpoint, path=path, timeout_s=PATH_TIMEOUT_S)
        if code == 200:
            continue
        said = "did not answer" if code is None else f"answered HTTP {code}"
        raise InvalidInputError(
            f"the source's workload.{name} GET {redact_url(endpoint)}{path} {said}; nothing was moved",
            hint=f"workload.{name} must be the path that {rules[name]}"
            + (": the service has no such path" if code == 404 else ""),
        )


def check_golden_answer(ctx: RunContext) -> dict[str, Any]:
    """The first golden case, asked of the source as the parity phase will ask it: the answer holds every compared
    field. Returns the fields it saw."""
    plan = ctx.plan
    request, golden, endpoint = plan.parity.request, ctx.golden_inputs(), plan.workload.endpoint
    if request is None or golden is None or not endpoint:
        return {}
    case = load_golden(golden)[0]
    query = build_requests([case], request)[0]
    with httpx.Client(base_url=endpoint, timeout=request.timeout_s, trust_env=False) as client:
        answer, why = ask(client, query)
    asked = f"golden case {case.id} ({query.method} {query.path}) asked of the source at {redact_url(endpoint)}"
    if answer is None:
        raise InvalidInputError(
            f"{asked}: {why}; nothing was moved",
            hint="parity.request says how each golden input is asked (method, path, body): it must be a request "
            "the service answers with 200 and a JSON object",
        )
    wrong = [_problem(check, answer) for check in request.compare]
    problems = [p for p in wrong if p]
    if problems:
        raise InvalidInputError(
            f"{asked}: {'; '.join(problems)}; nothing was moved",
            hint=f"the answer's fields are {_fields(answer)}: name them in parity.request.compare (a dotted path "
            "such as data.0.embedding; kind numeric compares numbers within tolerances, exact compares JSON)",
        )
    emit(ctx.migration, "parity.request.checked", {"case": case.id, "fields": [c.field for c in request.compare]})
    return {"golden_answer": "has every compared field"}


def _problem(check: FieldCheck, answer: dict[str, Any]) -> str | None:
    value = field_value(answer, check.field)
    if value is ABSENT:
        return f"the answer has no field '{check.field}' (parity.request.compare names it)"
    if check.kind == "numeric" and not _numbers(value):
        return f"field '{check.field}' is compared as numeric, and the answer's is {_short(value)}"
    return None


def _numbers(value: Any) -> bool:
    """A number, or (nested) arrays of numbers: what a numeric comparison takes."""
    if isinstance(value, bool):
        return False
    if isinstance(value, Real):
        return True
    return isinstance(value, list) and bool(value) and all(_numbers(v) for v in value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _fields(answer: dict[str, Any], prefix: str = "", depth: int = 0) -> str:
    """The answer's field paths, as compare would name them (two levels deep, at most a dozen)."""
    names: list[str] = []
    for key, value in answer.items():
        name = f"{prefix}{key}"
        names.append(name)
        if depth == 0 and isinstance(value, dict):
            names += _fields(value, f"{name}.", 1).split(", ")
        elif depth == 0 and isinstance(value, list) and value and isinstance(value[0], dict):
            names += _fields(value[0], f"{name}.0.", 1).split(", ")
    return ", ".join(_first(names, 12))


def _first(names: Sequence[str], n: int) -> list[str]:
    return [*names[:n], "..."] if len(names) > n else list(names)


def check_training_losses(ctx: RunContext) -> dict[str, Any]:
    """The training source reports a loss for its steps (``step.report(loss=...)``): the parity phase proves the
    move by the losses of the next steps, and a loop that reports none trains on unseen until it ends. A loop
    that took no step within :data:`LOSS_WAIT_S` is not refused (a step may take longer): it is recorded."""
    try:
        seen = ctx.backend().wait_for_steps("source", since=0, count=1, timeout_s=LOSS_WAIT_S)
    except TrainingLoopError as exc:
        raise InvalidInputError(f"{exc.message}; nothing was moved", hint=exc.hint) from None
    except SnapshotError as exc:
        emit(ctx.migration, "training.losses.unseen", {"waited_s": LOSS_WAIT_S, "why": str(exc)[:300]})
        return {"source_losses": "none yet"}
    return {"source_losses": len(seen.losses), "source_steps": seen.steps}

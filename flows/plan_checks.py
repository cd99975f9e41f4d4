"""What a plan must satisfy beyond its schema before anything starts: the migrate flow's rules for a training job,
and golden inputs that load and fill the plan's request template.

``gpumigrate plan validate`` checks them as the flow's preflight does, so a mistake that the parity phase would
find after the source froze (a missing golden file, a placeholder a case cannot fill) is exit 2 before anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpumigrate.errors import PolicyDeniedError
from gpumigrate.parity.output import load_golden
from gpumigrate.parity.request import build_requests
from gpumigrate.plan import Plan


def check_inputs(plan: Plan, golden: Path | None) -> dict[str, Any]:
    """Everything the flow's preflight checks of the plan alone (``plan validate``): the training rules, for a
    training plan (the training flow's preflight runs them first), and :func:`check_golden`."""
    if plan.workload.kind == "training":
        training_rules(plan)
    return check_golden(plan, golden)


def check_golden(plan: Plan, golden: Path | None) -> dict[str, Any]:
    """The golden cases at ``golden`` (the plan's ``parity.golden_inputs`` resolved against its folder): each
    loads, and the request template fills from each; an InvalidInputError names the line or case. Returns what
    was checked."""
    if golden is None:
        return {"golden_cases": 0}
    cases = load_golden(golden)
    if plan.parity.request is not None:
        build_requests(cases, plan.parity.request)
    return {"golden_cases": len(cases)}


def training_rules(plan: Plan) -> None:
    """What a training plan must (not) say for this flow, beyond what the plan's schema checks (a job of
    several ranks, ``workload.ranks``, moves like one process: its ranks freeze together). A refusal is a PolicyDeniedError:
    exit 2, status denied, nothing provisioned."""
    wl = plan.workload
    if plan.snapshot.backend != "agent":
        raise _refused(
            f"snapshot.backend {plan.snapshot.backend}: a training job moves with the agent backend only (its "
            "freeze at a step boundary and the parity steps are agent commands); set snapshot.backend: agent"
        )
    if not wl.agent:
        raise _refused("workload.agent: a training job needs its agent's address, such as 127.0.0.1:7070")
    if "traffic" in plan.model_fields_set:
        raise _refused(
            "traffic: a training job has no clients to shift, so no ramp, gates or manual gate; remove the "
            "traffic section (the cut-over is the target's next steps matching the source's: parity.training)"
        )
    if plan.parity.golden_inputs is not None or plan.parity.request is not None:
        raise _refused(
            "parity.golden_inputs / parity.request: these ask a service; a training job's parity is "
            "parity.training (steps, atol, rtol): remove them"
        )


def _refused(message: str) -> PolicyDeniedError:
    return PolicyDeniedError("the migrate flow's rules for training", message)

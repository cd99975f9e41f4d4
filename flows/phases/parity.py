"""Parity: the target's environment by the plan's policy, then the golden inputs on source and target directly.

Both checks compare two real endpoints (the context refuses a target that is the source itself). The
facts come from each side's ``/v1/info`` or, for a service that has none, its agent (``flows/facts.py``);
the golden inputs are asked as the plan's ``parity.request`` says (method, path, body template) and the
fields it lists are compared as it says (``parity/request.py``). A failure is a ParityError: the flow
rolls back, and the source still serves.
"""

from __future__ import annotations

from typing import Any

from gpumigrate.environment import compare
from gpumigrate.errors import ParityError
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit
from gpumigrate.flows.facts import workload_facts
from gpumigrate.flows.report import merge_result
from gpumigrate.parity.output import run_output_parity

FAILURES_KEPT = 20


def run(ctx: RunContext) -> dict[str, Any]:
    m, plan = ctx.migration, ctx.plan
    src_url = ctx.need(plan.workload.endpoint, "the source endpoint")
    tgt_url = ctx.target_endpoint()
    source = workload_facts(src_url, plan.workload.agent, side="source")
    target = workload_facts(tgt_url, ctx.runtime.target_agent, side="target")
    env = compare(source, target, plan.parity.environment)
    emit(m, "parity.environment", {**env.to_dict(), "differences": env.differences()})
    if not env.passed:
        raise ParityError(f"target environment differs where the plan forbids it: {env.differences()}")
    golden = ctx.golden_inputs()
    if golden is None:
        emit(m, "parity.output", {"passed": None, "skipped": "plan.parity.golden_inputs is not set"})
        return {"environment": "match", "output": "skipped"}
    request = plan.parity.request
    res = run_output_parity(
        src_url,
        tgt_url,
        golden,
        atol=plan.parity.atol,
        rtol=plan.parity.rtol,
        out_dir=m.artifacts / "parity",
        request=request,
    )
    asked = f"{request.method} {request.path}" if request is not None else None
    emit(m, "parity.output", {**res.to_dict(), "request": asked, "failures": res.failures[:FAILURES_KEPT]})
    merge_result(m, parity=res.summary())
    if not res.passed:
        raise ParityError(f"output parity failed on {len(res.failures)} checks: {'; '.join(res.failures[:3])}")
    return {"environment": "match", "output": "passed", "cases": res.cases, "max_abs_err": res.max_abs_err}

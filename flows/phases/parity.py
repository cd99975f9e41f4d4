"""Parity: the target's environment by the plan's policy, then the golden inputs on source and target directly.

Both checks compare two real endpoints (the context refuses a target that is the source itself). A
failure is a ParityError: the flow rolls back, and the source still serves.
"""

from __future__ import annotations

from typing import Any

from gpumigrate.environment import compare
from gpumigrate.errors import ParityError
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit
from gpumigrate.flows.report import merge_result
from gpumigrate.parity.environment import fetch_info
from gpumigrate.parity.output import run_output_parity

FAILURES_KEPT = 20


def run(ctx: RunContext) -> dict[str, Any]:
    m, plan = ctx.migration, ctx.plan
    src_url = ctx.need(plan.workload.endpoint, "the source endpoint")
    tgt_url = ctx.target_endpoint()
    env = compare(fetch_info(src_url), fetch_info(tgt_url), plan.parity.environment)
    emit(m, "parity.environment", {**env.to_dict(), "differences": env.differences()})
    if not env.passed:
        raise ParityError(f"target environment differs where the plan forbids it: {env.differences()}")
    golden = ctx.golden_inputs()
    if golden is None:
        emit(m, "parity.output", {"passed": None, "skipped": "plan.parity.golden_inputs is not set"})
        return {"environment": "match", "output": "skipped"}
    res = run_output_parity(
        src_url, tgt_url, golden, atol=plan.parity.atol, rtol=plan.parity.rtol, out_dir=m.artifacts / "parity"
    )
    emit(m, "parity.output", {**res.to_dict(), "failures": res.failures[:FAILURES_KEPT]})
    merge_result(m, parity=res.summary())
    if not res.passed:
        raise ParityError(f"output parity failed on {len(res.failures)} checks: {'; '.join(res.failures[:3])}")
    return {"environment": "match", "output": "passed", "cases": res.cases, "max_abs_err": res.max_abs_err}

"""Parity: the target's environment by the plan's policy, then the workload's own outputs on source and target.

Both checks compare two real endpoints (the context refuses a target that is the source itself). The
facts come from each side's ``/v1/info`` or, for a workload that has none, its agent (``flows/facts.py``).
A service answers the golden inputs on both sides as the plan's ``parity.request`` says (method, path, body
template) and the fields it lists are compared as it says (``parity/request.py``). A training job proves
itself by its next steps: the frozen source takes ``parity.training.steps`` more steps (``advance``) and
the target, training on from the same cut, must report the same losses for them (``parity/training.py``).
A failure is a ParityError: the flow rolls back, and the source still serves (or trains on).
"""

from __future__ import annotations

from typing import Any

from gpumigrate.environment import compare
from gpumigrate.errors import ParityError
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit
from gpumigrate.flows.facts import FactsUnavailableError, workload_facts
from gpumigrate.flows.freeze_lease import keep_frozen, renewals
from gpumigrate.flows.phases.restore import STEPS_TIMEOUT_S, freeze_cut
from gpumigrate.flows.report import merge_result
from gpumigrate.interfaces import SnapshotBackend
from gpumigrate.parity.output import run_output_parity
from gpumigrate.parity.training import training_parity, world_training_parity
from gpumigrate.snapshot.errors import TrainingLoopError

FAILURES_KEPT = 20


def run(ctx: RunContext) -> dict[str, Any]:
    m, plan = ctx.migration, ctx.plan
    backend = ctx.backend()
    keep_frozen(ctx, backend)  # a training source is still frozen (a resumed migration renews it again)
    training = plan.workload.kind == "training"
    src_url = None if training else ctx.need(plan.workload.endpoint, "the source endpoint")
    tgt_url = None if training else ctx.target_endpoint()
    source = workload_facts(src_url, plan.workload.agent, side="source", backend=backend)
    try:
        target = workload_facts(tgt_url, ctx.runtime.target_agent, side="target", backend=backend)
    except FactsUnavailableError:
        if not training:
            raise
        # Its agent answered the restore a moment ago: a loop whose steps were behind it ended at once.
        raise TrainingLoopError(
            f"the target's training process ended, or closed its agent at {ctx.runtime.target_agent}, right after "
            "its restore, before it took a step to compare",
            hint="it may have trained to its end: give it steps to outlast the migration; its log says more",
        ) from None
    env = compare(source, target, plan.parity.environment)
    emit(m, "parity.environment", {**env.to_dict(), "differences": env.differences()})
    if not env.passed:
        raise ParityError(f"target environment differs where the plan forbids it: {env.differences()}")
    if training:
        return _training(ctx, backend)
    golden = ctx.golden_inputs()
    if golden is None or src_url is None or tgt_url is None:
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


def _training(ctx: RunContext, backend: SnapshotBackend) -> dict[str, Any]:
    """The source's next ``parity.training.steps`` losses after the cut against the target's for the same steps;
    for a workload of several ranks, every rank's against the same rank's."""
    m, policy = ctx.migration, ctx.plan.parity.training
    step, _ = freeze_cut(ctx)
    advanced = backend.advance(policy.steps, timeout_s=STEPS_TIMEOUT_S)  # the source is frozen again after them
    source = dict(advanced.losses)
    steps = sorted(s for s in source if s > step)[: policy.steps]
    if steps != list(range(step + 1, step + policy.steps + 1)):
        raise ParityError(f"the source's agent reported steps {steps} for the {policy.steps} after step {step}")
    seen = backend.wait_for_steps("target", since=step, count=policy.steps, timeout_s=STEPS_TIMEOUT_S)
    target = dict(seen.losses)
    out_dir = m.artifacts / "parity"
    if advanced.ranks:  # a world: each rank trains on its own shard, so each rank's losses are its own
        by_rank = [dict(r) for r in advanced.ranks], [dict(r) for r in seen.ranks]
        res = world_training_parity(*by_rank, steps, policy, out_dir=out_dir)
        ranks = [
            {"source": [s.get(x) for x in steps], "target": [t.get(x) for x in steps]}
            for s, t in zip(*by_rank, strict=True)
        ]
    else:
        res = training_parity([source[s] for s in steps], [target[s] for s in steps if s in target], policy,
                              out_dir=out_dir)  # fmt: skip
        ranks = []
    record = {**res.to_dict(), "steps": steps, "source": [source[s] for s in steps],
              "target": [target.get(s) for s in steps], "lease_renewals": renewals(ctx)}  # fmt: skip
    if ranks:
        record["ranks"] = ranks
    emit(m, "parity.training", record)
    merge_result(m, parity=res.summary())
    if not res.passed:
        raise ParityError(f"training parity failed after step {step}: {'; '.join(res.failures[:3])}")
    return {"environment": "match", "training": "passed", "steps": len(steps), "max_abs_err": res.max_abs_err}

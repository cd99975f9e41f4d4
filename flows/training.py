"""A training job through the migrate flow (``workload.kind: training``): the phases that differ from a service's.

The flow's phase order and transactions stay those of ``flows/migrate.py``; :func:`phase_for` swaps in
the training version of a phase where it differs:

* preflight: the plan's training rules first (:func:`check_plan`: exit 2, nothing provisioned), then
  the common checks;
* snapshot: pre-copy rounds while it trains, each round checked in the target's store and pre-loaded
  into the target (which stays unready; flows/preload.py, shared with a service's snapshot), so the
  final restore loads only the dirty set; then freeze at a step boundary under
  ``snapshot.freeze_lease_s``, which a :class:`LeaseKeeper` renews while the flow works on the frozen
  source (if this process dies, the source resumes by itself); then the final round.
  The source stays frozen (two copies of one job must never both train);
* restore: the target loads the final image and trains on; ``result.pause_ms`` is the time from the
  freeze to the target's first completed step after it;
* parity: environment facts through both agents, then the source takes N more steps (``advance``) and
  gives the losses the target must report for the same steps (``parity/training.py``);
* ramp: none (no clients to shift);
* finalize: the source's memory is zeroized and it stays parked at its safe point (``source.parked``):
  the job now trains on the target; the user stops the source process.

A failure before the cut-over rolls back as for a service: the target is torn down, the source resumes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from gpumigrate.environment import compare
from gpumigrate.errors import InvalidInputError, ParityError, SnapshotError
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit
from gpumigrate.flows.facts import workload_facts
from gpumigrate.flows.freeze_lease import keep_frozen, release, renewals
from gpumigrate.flows.phases import preflight as common_preflight
from gpumigrate.flows.plan_checks import training_rules
from gpumigrate.flows.preload import final_load, precopy_rounds
from gpumigrate.flows.report import merge_result
from gpumigrate.flows.undo import undo_source
from gpumigrate.parity.training import training_parity
from gpumigrate.snapshot.client import AgentClient, StepLosses
from gpumigrate.snapshot.lease import MAX_LEASE_S

Phase = Callable[[RunContext], dict[str, Any]]
_log = logging.getLogger("gpumigrate.flows.training")
STEPS_TIMEOUT_S = 600.0  # for the target's steps to show up (its first after the restore, the parity steps)
POLL_S = 0.01


# ----------------------------------------------------------------------------- the phases
def preflight(ctx: RunContext) -> dict[str, Any]:
    training_rules(ctx.plan)
    return common_preflight.run(ctx)


def snapshot(ctx: RunContext) -> dict[str, Any]:
    m, plan = ctx.migration, ctx.plan
    backend = ctx.backend()
    live = precopy_rounds(ctx, backend, max_rounds=plan.snapshot.precopy_rounds)  # each pre-loaded (flows/preload.py)
    conv = live.convergence
    frozen_at, t_freeze = time.time(), time.monotonic()
    backend.freeze(plan.snapshot.freeze_lease_s)
    ctx.update(source_frozen=True)
    try:
        keep_frozen(ctx)
        with AgentClient(ctx.need(plan.workload.agent, "the source agent")) as client:
            step = client.metrics().steps  # the step boundary it froze at
        image = backend.final()
        if image is None:  # check_plan admits the agent backend only, which always commits an image
            raise SnapshotError("the source's agent committed no final image")
    except BaseException:
        release(ctx)
        undo_source(ctx)
        raise
    ctx.update(image=image)
    emit(
        m,
        "image.committed",
        {
            "backend": backend.name,
            "image_id": image.id,
            "bytes_image": image.bytes_image,
            "bytes_sent": image.bytes_sent,
            "precopy_rounds": len(conv.rounds),
            "converged": conv.reason,
            "preloaded": len(live.preloads),
            "bytes_preloaded": live.bytes_preloaded,
            "freeze_step": step,
            "freeze_lease_s": plan.snapshot.freeze_lease_s,
        },
    )
    merge_result(m, bytes={"image": image.bytes_image, "stored": image.bytes_stored})
    return {
        "image_id": image.id,
        "precopy_rounds": len(conv.rounds),
        "preloaded": len(live.preloads),
        "freeze_step": step,
        "frozen_at": frozen_at,
        "frozen_ms": round((time.monotonic() - t_freeze) * 1000, 1),
        "bytes_image": image.bytes_image,
    }


def _cut(ctx: RunContext) -> tuple[int, float]:
    """The step the source froze at and when (epoch seconds), from the snapshot phase's record."""
    done = ctx.migration.phase("snapshot").get("result") or {}
    if "freeze_step" not in done or "frozen_at" not in done:
        raise InvalidInputError(f"migration {ctx.migration.id}: the snapshot phase has not recorded its freeze")
    return int(done["freeze_step"]), float(done["frozen_at"])


def _target_steps(address: str, since: int, count: int, timeout_s: float = STEPS_TIMEOUT_S) -> StepLosses:
    """Poll the target's agent until it reported ``count`` losses after step ``since``."""
    deadline = time.monotonic() + timeout_s
    with AgentClient(address, timeout_s=30) as client:
        while True:
            seen = client.metrics(since=since)
            if len(seen.losses) >= count:
                return seen
            if time.monotonic() > deadline:
                raise SnapshotError(
                    f"the target's agent at {address} reported {len(seen.losses)} of {count} steps after step "
                    f"{since} within {timeout_s:g} s: is the training loop running (safe_point, step.report)?"
                )
            time.sleep(POLL_S)


def restore(ctx: RunContext) -> dict[str, Any]:
    m = ctx.migration
    keep_frozen(ctx)
    image = ctx.need(ctx.runtime.image, "the final image")
    backend = ctx.backend()
    restored = backend.restore(image)
    step, frozen_at = _cut(ctx)
    target = ctx.need(ctx.runtime.target_agent, "the target agent")
    _target_steps(target, since=step, count=1)
    pause_ms = round((time.time() - frozen_at) * 1000, 1)
    merge_result(m, pause_ms=pause_ms)
    emit(
        m,
        "image.restored",
        {
            "backend": backend.name,
            "image_id": restored.image_id,
            "host": ctx.target_host().name,
            **final_load(ctx, backend, restored),
        },
    )
    emit(m, "training.resumed", {"on": "target", "after_step": step, "pause_ms": pause_ms})
    return {"image_id": image.id, "ready": True, "pause_ms": pause_ms, "chunks_loaded": restored.chunks_loaded}


def parity(ctx: RunContext) -> dict[str, Any]:
    m, plan = ctx.migration, ctx.plan
    keep_frozen(ctx)
    source_agent = ctx.need(plan.workload.agent, "the source agent")
    target_agent = ctx.need(ctx.runtime.target_agent, "the target agent")
    env = compare(
        workload_facts(None, source_agent, side="source"),
        workload_facts(None, target_agent, side="target"),
        plan.parity.environment,
    )
    emit(m, "parity.environment", {**env.to_dict(), "differences": env.differences()})
    if not env.passed:
        raise ParityError(f"target environment differs where the plan forbids it: {env.differences()}")
    step, _ = _cut(ctx)
    policy = plan.parity.training
    with AgentClient(source_agent, timeout_s=STEPS_TIMEOUT_S + 30) as client:
        advanced = client.advance(policy.steps, timeout_s=STEPS_TIMEOUT_S)  # frozen again after them
    source = dict(advanced.losses)
    steps = sorted(s for s in source if s > step)[: policy.steps]
    if steps != list(range(step + 1, step + policy.steps + 1)):
        raise ParityError(f"the source's agent reported steps {steps} for the {policy.steps} after step {step}")
    target = dict(_target_steps(target_agent, since=step, count=policy.steps).losses)
    res = training_parity(
        [source[s] for s in steps],
        [target[s] for s in steps if s in target],
        policy,
        out_dir=m.artifacts / "parity",
    )
    record = {**res.to_dict(), "steps": steps, "source": [source[s] for s in steps],
              "target": [target.get(s) for s in steps], "lease_renewals": renewals(ctx)}  # fmt: skip
    emit(m, "parity.training", record)
    merge_result(m, parity=res.summary())
    if not res.passed:
        raise ParityError(f"training parity failed after step {step}: {'; '.join(res.failures[:3])}")
    return {"environment": "match", "training": "passed", "steps": len(steps), "max_abs_err": res.max_abs_err}


def no_ramp(ctx: RunContext) -> dict[str, Any]:
    return {"skipped": "a training job has no clients to shift"}


def finalize(ctx: RunContext) -> dict[str, Any]:
    """The job trains on the target: the source is parked (never resumed), then its memory zeroized."""
    m = ctx.migration
    with AgentClient(ctx.need(ctx.plan.workload.agent, "the source agent")) as client:
        # First: parked for as long as a lease goes, so that no failure below lets it train beside the target.
        client.renew(MAX_LEASE_S)
    kept = release(ctx)
    emit(
        m,
        "source.parked",
        {"lease_renewals": kept.get("renewals"), "parked_s": MAX_LEASE_S,
         "note": "the job trains on the target now; stop the source process"},
    )  # fmt: skip
    emit(m, "source.zeroized", ctx.backend().retire())
    ctx.update(source_zeroized=True, source_retired=True, rollback_deadline=time.time())
    return {"source": "zeroized", "parked_s": MAX_LEASE_S}


_PHASES: dict[str, Phase] = {
    "preflight": preflight,
    "snapshot": snapshot,
    "restore": restore,
    "parity": parity,
    "ramp": no_ramp,
    "finalize": finalize,
}


def phase_for(ctx: RunContext, name: str, phase: Phase) -> Phase:
    """The phase to run: the training version of ``name`` for a training plan, else ``phase`` itself."""
    if ctx.plan.workload.kind != "training":
        return phase
    return _PHASES.get(name, phase)

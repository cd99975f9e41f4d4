"""The eight phases as plain functions: each calls the libraries, none re-implements them.

``phase(ctx) -> dict`` returns the small result kept in the state record. Facts later phases need
(the target host, the image id) go to ``ctx.put``. Undo functions (``undo_*``) are idempotent and
never raise: they run from Prefect ``on_rollback`` hooks, from the rollback flow and from the CLI.
Prefect is not imported here, so the CLI and tests can call every phase directly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Any

from gpumigrate.errors import ParityError, RolledBackError
from gpumigrate.flows import wiring
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit, notify
from gpumigrate.flows.report import build_result, merge_result, ramp_chart, write_report
from gpumigrate.result import MigrationResult
from gpumigrate.state import PHASES, Migration

_log = logging.getLogger("gpumigrate.flows")


# ----------------------------------------------------------------------------- preflight
def preflight(ctx: RunContext) -> dict[str, Any]:
    """Plan, residency of target and store, capacity/quota, environment parity where knowable now."""
    m, plan = ctx.migration, ctx.plan
    from gpumigrate.infra import get_provider, spec_from_plan
    from gpumigrate.infra.residency import validate_plan_residency

    decisions = validate_plan_residency(plan, record=m.record)
    spec = spec_from_plan(plan, migration_id=m.id)
    get_provider(plan.target.provider, **wiring.provider_options(plan.target.provider)).check_capacity(spec)
    emit(
        m, "infra.capacity.ok", {"provider": spec.provider, "region": spec.region, "instance_type": spec.instance_type}
    )
    source_info = wiring.service_info(plan.workload.endpoint) if plan.workload.endpoint else {}
    ctx.put(source_info=_facts(source_info))
    env = wiring.host_environment_parity(plan, source_info)
    report = env.pop("report", None)
    emit(m, "parity.environment.preflight", env)
    if report is not None:
        from gpumigrate.parity.environment import EnvironmentParityError

        raise EnvironmentParityError(report)  # a policy denial: exit 2, nothing provisioned
    return {
        "residency": "allow",
        "decisions": len(decisions),
        "target_host": spec.name,
        "environment": "match" if env.get("passed") else "deferred",
        "source_weights_digest": str(source_info.get("weights_digest", ""))[:64] or None,
    }


def _facts(info: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if isinstance(v, (str, int, float, bool, type(None)))}


# ----------------------------------------------------------------------------- provision
def provision(ctx: RunContext) -> dict[str, Any]:
    """Launch (or find) the target host and start the workload there, waiting for its state."""
    m, plan = ctx.migration, ctx.plan
    from gpumigrate.infra import get_provider, provision_host, spec_from_plan

    provider = get_provider(plan.target.provider, **wiring.provider_options(plan.target.provider, ctx))
    spec = spec_from_plan(plan, migration_id=m.id)
    host = provision_host(
        provider, spec, migration_id=m.id, allowed_jurisdictions=plan.data.allowed_jurisdictions, record=m.record
    )
    host = provider.wait_ready(host, timeout_s=300)
    ctx.put(target_host=asdict(host), target_torn_down=False)
    endpoints = wiring.start_target_workload(provider, host, ctx)
    ctx.put(**endpoints)
    # The target's own store: a copy of the image next to the target (pushed by the transfer phase).
    ctx.put(target_store=wiring.target_store_url(host, ctx.store_url()))
    return {
        "host": host.name,
        "provider": host.provider,
        "region": host.region,
        "endpoint": endpoints.get("target_endpoint"),
        "agent": endpoints.get("target_agent"),
    }


# ----------------------------------------------------------------------------- snapshot
def snapshot(ctx: RunContext) -> dict[str, Any]:
    """Live pre-copy rounds while the source serves, then freeze → final image → (inference) resume."""
    m, plan = ctx.migration, ctx.plan
    if plan.snapshot.backend != "agent":
        out = wiring.host_level_snapshot(ctx)
        emit(m, "image.committed", {"backend": plan.snapshot.backend, **out})
        return out
    agent = wiring.agent(plan.workload.agent, "source")
    store, key_ref = ctx.store_url(), ctx.key_ref()
    # The plan's transfer settings reach the writer inside the workload (the agent writes the image).
    options = {"compression": plan.transfer.compression, "parallelism": plan.transfer.parallelism}
    parent = ctx.get("image_id")  # a resumed migration dedups against what it already shipped
    rounds: list[dict[str, Any]] = []
    for i in range(plan.snapshot.precopy_rounds):
        r = agent.precopy(store, key_ref, parent, options)
        parent = r.get("image_id") or parent
        rounds.append(r)
        notify(m.id, "snapshot.precopy", {"round": i + 1, **r})
        if _precopy_converged(rounds, plan.snapshot.max_downtime_ms):
            break
    t_freeze = time.monotonic()
    agent.freeze()
    ctx.put(source_frozen=True)
    try:
        final = agent.final(store, key_ref, parent, options)
    except BaseException:
        undo_source(m.id)
        raise
    frozen_ms = (time.monotonic() - t_freeze) * 1000
    if plan.workload.kind == "inference":
        # Weights are read-only: the source serves on while the target is restored and ramped.
        agent.resume()
        ctx.put(source_frozen=False)
    image_id = final["image_id"]
    ctx.put(image_id=image_id, image=final)
    emit(
        m,
        "image.committed",
        {
            "image_id": image_id,
            "store": wiring.redact(store),
            "parent": parent,
            "bytes_image": final.get("bytes_image"),
            "bytes_sent": final.get("bytes_sent"),
            "precopy_rounds": len(rounds),
        },
    )
    merge_result(m, bytes={"image": final.get("bytes_image"), "stored": final.get("bytes_stored")})
    return {
        "image_id": image_id,
        "precopy_rounds": len(rounds),
        "frozen_ms": round(frozen_ms, 1),
        "bytes_image": final.get("bytes_image"),
    }


def _precopy_converged(rounds: list[dict[str, Any]], max_downtime_ms: float) -> bool:
    """Stop pre-copying when the last round's dirty set shipped within the downtime budget (the final
    round, frozen, ships about as much), or when rounds stop shrinking it (more would not help)."""
    last = rounds[-1]
    dirty = int(last.get("bytes_dirty") or 0)
    if dirty == 0:
        return True
    if len(rounds) < 2:
        return False
    fits = float(last.get("seconds") or 0) * 1000 <= max_downtime_ms
    return fits or dirty >= int(rounds[-2].get("bytes_dirty") or 0)


# ----------------------------------------------------------------------------- transfer
def transfer(ctx: RunContext) -> dict[str, Any]:
    """Push the image to the target's store (only missing chunks move), or verify it in place."""
    m, plan = ctx.migration, ctx.plan
    if plan.snapshot.backend == "cuda-driver":
        return {"skipped": "cuda-driver restores in place on the same host: no image moves"}
    image_id = ctx.need("image_id")
    src, dst = ctx.store_url(), ctx.get("target_store") or ctx.store_url()
    key = wiring.resolve_key(ctx.key_ref())
    if dst == src:
        wiring.verify_image(src, image_id, key)
        emit(m, "image.verified", {"image_id": image_id, "store": wiring.redact(src)})
        return {"image_id": image_id, "pushed": False, "bytes_sent": 0}
    from gpumigrate.flows.prefect_artifacts import Progress
    from gpumigrate.infra.residency import check_store

    # Residency at transfer time: the store the bytes land in, before any byte moves there.
    host = ctx.get("target_host") or {}
    check_store(
        dst,
        host.get("region") if dst.startswith("file://") else plan.transfer.store_region,
        plan.data.allowed_jurisdictions,
        target_provider=plan.target.provider,
        target_region=plan.target.region,
        record=m.record,
    )

    progress = Progress(f"transfer of image {image_id[:12]} to {ctx.get('target_host', {}).get('name')}")

    def on_progress(done: int, total: int) -> None:
        progress.update(100.0 * done / total if total else 100.0)
        notify(m.id, "transfer.progress", {"done": done, "total": total})

    stats = wiring.push_image(src, dst, image_id, key, parallelism=plan.transfer.parallelism, progress=on_progress)
    progress.update(100.0, force=True)
    emit(m, "image.transferred", {"image_id": image_id, "from": wiring.redact(src), "to": wiring.redact(dst), **stats})
    sent = (m.read().get("result", {}).get("bytes", {}).get("sent") or 0) + int(stats.get("bytes_sent") or 0)
    merge_result(m, bytes={"sent": sent})
    return {"image_id": image_id, "pushed": True, **{k: v for k, v in stats.items() if isinstance(v, (int, float))}}


# ----------------------------------------------------------------------------- restore
def restore(ctx: RunContext) -> dict[str, Any]:
    """Rebuild the state on the target from the verified image; wait until it reports ready."""
    m = ctx.migration
    if ctx.plan.snapshot.backend != "agent":
        out = wiring.host_level_restore(ctx)
        wiring.wait_ready(ctx.need("target_endpoint"), timeout_s=300)
        emit(m, "image.restored", {"backend": ctx.plan.snapshot.backend, "image_id": ctx.get("image_id"), **out})
        return out
    image_id = ctx.need("image_id")
    target = wiring.agent(ctx.need("target_agent"), "target")
    out = target.restore(
        ctx.get("target_store") or ctx.store_url(), image_id, ctx.key_ref(), dict(ctx.plan.parity.environment)
    )
    wiring.wait_ready(ctx.need("target_endpoint"), timeout_s=120)
    emit(
        m,
        "image.restored",
        {
            "image_id": image_id,
            "host": ctx.get("target_host", {}).get("name"),
            **{k: v for k, v in out.items() if isinstance(v, (str, int, float, bool))},
        },
    )
    return {"image_id": image_id, "ready": True}


# ----------------------------------------------------------------------------- parity
def parity(ctx: RunContext) -> dict[str, Any]:
    """Environment parity (policy from the plan), then golden inputs on source and target directly."""
    m, plan = ctx.migration, ctx.plan
    src_url, tgt_url = plan.workload.endpoint, ctx.need("target_endpoint")
    env = wiring.environment_parity(wiring.service_info(src_url), wiring.service_info(tgt_url), plan.parity.environment)
    emit(m, "parity.environment", env)
    if not env.get("passed", True):
        raise ParityError(f"target environment differs where the plan forbids it: {env.get('differences')}")
    golden = ctx.golden_inputs()
    if golden is None:
        emit(m, "parity.output", {"passed": None, "skipped": "plan.parity.golden_inputs is not set"})
        return {"environment": "match", "output": "skipped"}
    out = wiring.output_parity(
        src_url, tgt_url, golden, atol=plan.parity.atol, rtol=plan.parity.rtol, out_dir=m.artifacts / "parity"
    )
    emit(m, "parity.output", out)
    merge_result(m, parity={k: out.get(k) for k in ("passed", "cases", "max_abs_err")})
    if not out.get("passed"):
        raise ParityError(
            f"output parity failed on {len(out.get('failures', []))} checks: {'; '.join(out.get('failures', [])[:3])}"
        )
    return {
        "environment": "match",
        "output": "passed",
        "cases": out.get("cases"),
        "max_abs_err": out.get("max_abs_err"),
    }


# ----------------------------------------------------------------------------- ramp
def ramp(ctx: RunContext) -> dict[str, Any]:
    """Staged weights through Envoy, gated on live metrics and parity probes; rolls back on its own."""
    m = ctx.migration
    outcome = wiring.run_ramp(ctx)
    samples = outcome["samples"]
    ctx.put(ramp_samples=samples[-2000:])
    chart = ramp_chart(samples, m.artifacts / "ramp.png", title=f"migration {m.id}")
    if chart:
        merge_result(m, chart=str(chart))
    if outcome["status"] != "completed":
        reason = outcome.get("reason") or "a gate failed"
        kind = "manual" if outcome.get("trigger") == "manual" else "automatic"
        emit(
            m,
            f"rollback.{kind}",
            {
                "reason": reason[:300],
                "trigger": outcome.get("trigger"),
                "seconds_to_detect": outcome.get("seconds_to_detect"),
            },
        )
        raise RolledBackError(reason, seconds_to_detect=outcome.get("seconds_to_detect"))
    emit(m, "traffic.cutover", {"weight": 100})
    return {"stages": outcome.get("stages"), "intervals": len(samples)}


# ----------------------------------------------------------------------------- finalize
def finalize(ctx: RunContext) -> dict[str, Any]:
    """Keep the source warm through the rollback window (or zeroize it when the window is 0)."""
    m, plan = ctx.migration, ctx.plan
    window = plan.traffic.rollback_window_s
    deadline = time.time() + window
    ctx.put(rollback_deadline=deadline)
    if window <= 0:
        record = wiring.agent(plan.workload.agent, "source").zeroize()
        emit(m, "source.zeroized", {k: v for k, v in record.items() if isinstance(v, (str, int, float, bool))})
        ctx.put(source_zeroized=True, source_retired=True)
        return {"source": "zeroized"}
    emit(
        m,
        "source.kept_warm",
        {
            "until": deadline,
            "rollback_window_s": window,
            "note": f"`gpumigrate rollback {m.id}` works until then; "
            f"`gpumigrate retire {m.id}` zeroizes the source after it",
        },
    )
    return {"source": "warm", "rollback_window_s": window}


# ----------------------------------------------------------------------------- resume validity
def still_valid(ctx: RunContext, name: str) -> bool:
    """A completed phase is skipped on resume unless the world it left is gone (e.g. a dead target)."""
    if name in ("provision", "restore"):
        endpoint = ctx.get("target_endpoint")
        if not endpoint or not wiring.alive(endpoint):
            for later in PHASES[PHASES.index("provision") :]:
                if ctx.migration.phase(later).get("status") == "completed":
                    ctx.migration.set_phase(later, "pending")
            notify(ctx.migration.id, "phase.provision.invalid", {"reason": "target not answering"})
            return False
    return True


# ----------------------------------------------------------------------------- undo (never raises)
def _quietly(what: str, fn: Any, *args: Any, **kw: Any) -> Any:
    try:
        return fn(*args, **kw)
    except Exception as exc:  # undo must go on: log, record, continue
        _log.warning("undo step %s failed: %s", what, exc)
        return None


def failure_reason(m: Migration, default: str) -> str:
    """Why we are undoing: the failed phase's error, else the rollback request, else ``default``."""
    try:
        for name in PHASES:
            ph = m.phase(name)
            if ph.get("status") == "failed" and (ph.get("result") or {}).get("error"):
                return f"{name} failed: {ph['result']['error']}"[:300]
        req = m.rollback_requested()
        if req:
            return f"rollback requested by {req.get('actor')}: {req.get('reason')}"[:300]
    except Exception:
        pass
    return default


def undo_traffic(migration_id: str, *, reason: str) -> None:
    """All traffic back to the source in one update. Idempotent."""
    m = _quietly("open", Migration.open, migration_id)
    if m is None:
        return
    reason = failure_reason(m, reason)
    ctx = RunContext(m, _quietly("plan", _plan_of, m))
    done = _quietly("traffic", wiring.traffic_to_source, ctx, reason)
    if done:
        _quietly("record", emit, m, "traffic.rolled_back", {"reason": reason[:300], "weights": done})
        _quietly("state", m.set_phase, "ramp", "rolled_back")


def undo_source(migration_id: str) -> None:
    """Un-freeze the source agent if a snapshot left it frozen. Idempotent."""
    m = _quietly("open", Migration.open, migration_id)
    if m is None:
        return
    ctx = RunContext(m, _quietly("plan", _plan_of, m))
    if ctx.plan is None or not ctx.plan.workload.agent:
        return
    if _quietly("resume", lambda: wiring.agent(ctx.plan.workload.agent, "source").resume() or True):
        _quietly("state", ctx.put, source_frozen=False)
        _quietly("record", emit, m, "rollback.source_resumed", {})


def undo_target(migration_id: str, *, reason: str) -> None:
    """Traffic off the target (if any), then tear the target down, then make sure the source runs."""
    undo_traffic(migration_id, reason=reason)
    m = _quietly("open", Migration.open, migration_id)
    if m is None:
        return
    ctx = RunContext(m, _quietly("plan", _plan_of, m))
    reason = failure_reason(m, reason)
    if (
        ctx.get("target_host")
        and not ctx.get("target_torn_down")
        and _quietly("terminate", wiring.terminate_target, ctx)
    ):
        _quietly("state", ctx.put, target_torn_down=True)
        _quietly(
            "record",
            emit,
            m,
            "rollback.target_torn_down",
            {"host": ctx.get("target_host", {}).get("name"), "reason": reason},
        )
    for name in PHASES[PHASES.index("provision") :]:
        if _quietly("phase", m.phase, name) and m.phase(name).get("status") in ("completed", "running", "failed"):
            _quietly("state", m.set_phase, name, "rolled_back")
    undo_source(migration_id)


def undo_all(migration_id: str, *, reason: str) -> None:
    undo_target(migration_id, reason=reason)


def _plan_of(m: Migration) -> Any:
    from gpumigrate.plan import load_plan

    return load_plan(m.plan_path)


# ----------------------------------------------------------------------------- outputs
def write_outputs(ctx: RunContext, *, status: str, error: str | None) -> MigrationResult:
    """Report and result contract, written to the artifacts dir; the flow and the CLI both return it."""
    m = ctx.migration
    result = build_result(m, status=status, error=error)
    report = write_report(m, result)
    merge_result(m, report=str(report))
    result = build_result(m, status=status, error=error)
    write_report(m, result)
    from gpumigrate.atomic import atomic_write_json

    atomic_write_json(m.artifacts / "result.json", result.model_dump(mode="json"))
    return result

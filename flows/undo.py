"""Undo, in the order that keeps users served: traffic to the source first, then the target, then the source runs.

Every step is idempotent and never raises (a step that fails is logged and the next one still runs):
they run from the migrate flow's transaction hooks, from the rollback flow, after a failed final
snapshot, and from the CLI. Each records in the audit log what it did, once it took effect, and a step
that failed as failed (``traffic.rollback_failed``, ``transfer.receiver.stop_failed``,
``rollback.target_teardown_failed``, ``rollback.source_resume_failed``, with the error); the failed steps
stay in ``runtime.rollback_incomplete`` until an undo gets them done, and the migration is not "rolled back"
meanwhile (:func:`rolled_back_or_not`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit
from gpumigrate.flows.freeze_lease import release
from gpumigrate.infra.launch import answers
from gpumigrate.interfaces import Host
from gpumigrate.state import PHASES, Migration
from gpumigrate.traffic import frontdoor
from gpumigrate.traffic.frontdoor import traffic_to_source
from gpumigrate.traffic.state import StateStore

_log = logging.getLogger("gpumigrate.flows")
# Held by provision from creating the target host until the runtime records it, and by an undo while it reads the
# runtime's host: a stop's watchdog undoing from another thread then never misses a host created meanwhile.
HOST_RECORD = threading.Lock()
HOST_RECORD_WAIT_S = 5.0  # an undo waits this long for a provision in the middle of creating its host
T = TypeVar("T")
_running: dict[str, float] = {}  # the undo steps running now (any thread), with their monotonic start


def running_steps() -> str:
    """The undo steps running now and for how long, for a message that says what a late rollback waits on."""
    now = time.monotonic()
    return ", ".join(f"{what} (for {now - since:.1f} s)" for what, since in list(_running.items())) or "none"


def quietly(what: str, fn: Callable[[], T]) -> T | None:
    """Run one undo step; a failure is logged, never raised (the steps after it must still run)."""
    return attempt(what, fn)[0]


def attempt(what: str, fn: Callable[[], T]) -> tuple[T | None, str | None]:
    """Run one undo step: ``(its value, None)``, or ``(None, the error)`` when it failed (logged, never raised)."""
    _running[what] = time.monotonic()
    try:
        return fn(), None
    except Exception as exc:
        _log.warning("undo step %s failed: %s", what, exc)
        return None, f"{type(exc).__name__}: {exc}"[:300]
    finally:
        _running.pop(what, None)


def _note(ctx: RunContext, step: str, error: str | None) -> None:
    """Keep ``runtime.rollback_incomplete`` true to the last attempt of ``step`` (failed: its error; done: gone)."""

    def keep() -> None:
        pending = dict(ctx.runtime.rollback_incomplete)
        if error is None and step not in pending:
            return
        if error is None:
            pending.pop(step)
        else:
            pending[step] = error
        ctx.update(rollback_incomplete=pending)

    quietly("state", keep)


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


def undo_traffic(ctx: RunContext, *, reason: str) -> None:
    """All traffic back to the source in one update, if any ever went elsewhere."""
    m = ctx.migration
    reason = failure_reason(m, reason)
    weights, error = attempt("traffic", lambda: traffic_to_source(ctx.traffic_dir(), reason))
    _note(ctx, "traffic", error)
    if error is not None:
        quietly("record", lambda: emit(m, "traffic.rollback_failed", {"reason": reason[:300], "error": error}))
    elif weights:
        # Every Envoy runs it before the target goes: a target torn down first fails the clients still sent to it.
        # Written is not applied: the record says whether every Envoy confirmed it (else a control plane that
        # comes back applies it, and the traffic lease returns the split by itself).
        _, unapplied = attempt("applied", lambda: applied_everywhere(ctx))
        record: dict[str, object] = {"reason": reason[:300], "weights": weights, "applied": unapplied is None}
        if unapplied is not None:
            record["apply_error"] = unapplied
        quietly("record", lambda: emit(m, "traffic.rolled_back", record))
        quietly("state", lambda: m.set_phase("ramp", "rolled_back"))


def applied_everywhere(ctx: RunContext, timeout_s: float = 10) -> None:
    """Block until every Envoy of the front door runs the current desired state (at most ``timeout_s``)."""
    nodes = frontdoor.read(ctx.traffic_dir()).nodes
    if nodes:
        store = StateStore(ctx.traffic_dir())
        store.wait_applied(store.read().version, nodes, timeout_s=timeout_s)


def undo_source(ctx: RunContext) -> None:
    """The source runs again (a snapshot may have left it frozen), with the work in flight it held for a hand-over
    (a final image had sealed it). Idempotent; recorded once, by the undo that resumed a source the runtime knew
    frozen (a second undo of the same failure resumes nothing)."""
    rt = quietly("runtime", lambda: ctx.runtime)
    frozen = rt is None or rt.source_frozen
    backend, error = attempt("backend", ctx.backend)
    if backend is not None:
        _, error = attempt("resume", backend.resume)
    if error is None and backend is not None:
        quietly("state", lambda: ctx.update(source_frozen=False))
        if frozen:
            quietly("record", lambda: emit(ctx.migration, "rollback.source_resumed", {"backend": backend.name}))
    elif error is not None:
        # A source this migration did not leave frozen runs (or died) whatever the resume says: only a frozen one
        # keeps the rollback incomplete (its lease resumes it by itself at the latest).
        record = {"error": error, "frozen": frozen}
        quietly("record", lambda: emit(ctx.migration, "rollback.source_resume_failed", record))
    _note(ctx, "source", error if frozen else None)
    taken = quietly("take back", backend.take_back) if backend is not None else None
    if taken:
        quietly("record", lambda: emit(ctx.migration, "rollback.work_taken_back", {"figures": taken.get("figures")}))
    if taken is not None:
        quietly("state", lambda: ctx.update(source_holds_work=False))
        quietly("lease", lambda: release(ctx))


def drain_target(ctx: RunContext) -> dict[str, object] | None:
    """Before the target goes: the work in flight on it (its own streams, and those it continues for the source's
    relayed clients) ends first, for at most ``traffic.drain_s``. Nothing to wait for where the workload reports no
    work in flight (``SnapshotBackend.work``); ``None`` then."""
    backend = ctx.backend()
    deadline = time.monotonic() + ctx.plan.traffic.drain_s
    start = time.monotonic()
    target, source = backend.work("target"), backend.work("source")
    if not target:
        return None
    while int(target.get("in_flight") or 0) + int(source.get("relayed") or 0) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        target, source = backend.work("target"), backend.work("source")
    left = int(target.get("in_flight") or 0) + int(source.get("relayed") or 0)
    return {"seconds": round(time.monotonic() - start, 2), "left": left}


def undo_target(ctx: RunContext, *, reason: str) -> None:
    """The receiver the flow started there and what a restore started on the target stop, then the target
    host is torn down."""
    m = ctx.migration
    reason = failure_reason(m, reason)
    held = HOST_RECORD.acquire(timeout=HOST_RECORD_WAIT_S)
    try:
        rt = quietly("runtime", lambda: ctx.runtime)
        host = rt.target_host if rt is not None and not rt.target_torn_down else None
        if host is None and rt is not None and not rt.target_torn_down:
            host = quietly("find", lambda: _unrecorded_host(ctx))
    finally:
        if held:
            HOST_RECORD.release()
    if host is not None:
        drained = quietly("drain", lambda: drain_target(ctx))
        if drained is not None:
            quietly("record", lambda: emit(m, "rollback.target_drained", dict(drained)))
        _, error = attempt("receiver", lambda: _stop_receiver(ctx))
        _note(ctx, "receiver", error)
        if error is not None:
            quietly("record", lambda: emit(m, "transfer.receiver.stop_failed", {"host": host.name, "error": error}))
        backend = quietly("backend", ctx.backend)
        discarded = None if backend is None else attempt("discard", backend.discard)[1]
        _, error = attempt("terminate", lambda: ctx.provider().terminate(host))
        _note(ctx, "target", error)
        if error is None:
            quietly("state", lambda: ctx.update(target_torn_down=True))
            record = {"host": host.name, "reason": reason, "discarded": backend is not None and discarded is None}
            quietly("record", lambda: emit(m, "rollback.target_torn_down", record))
        else:
            record = {"host": host.name, "reason": reason, "error": error}
            quietly("record", lambda: emit(m, "rollback.target_teardown_failed", record))
    for name in PHASES[PHASES.index("provision") :]:
        quietly("state", partial(_mark_rolled_back, m, name))


def _unrecorded_host(ctx: RunContext) -> Host | None:
    """A target host the provision created but had not recorded yet (a stop signal between the two), found by the
    migration id its provider keeps with it; None when provision never ran or the provider keeps no such id."""
    from gpumigrate.infra.local import LocalProvider

    provider = ctx.provider()
    # Only the local provider lists its hosts with their migration; a cloud host created in that window is found by
    # its tags (`gpumigrate hosts`, `gc`), not here.
    if not isinstance(provider, LocalProvider) or ctx.migration.phase("provision").get("status") in (None, "pending"):
        return None
    mine = [h for h in provider.list_hosts() if (h.meta or {}).get("migration_id") == ctx.migration.id]
    return mine[0] if mine else None


def _stop_receiver(ctx: RunContext) -> None:
    # Imported here: the transfer engine's receiver is heavy, and `gpumigrate rollback` must act at once.
    from gpumigrate.flows import target_store

    target_store.stop_target_receiver(ctx)


def _mark_rolled_back(m: Migration, phase: str) -> None:
    if m.phase(phase).get("status") in ("completed", "running", "failed"):
        m.set_phase(phase, "rolled_back")


def undo_all(ctx: RunContext, *, reason: str) -> None:
    """Traffic to the source, the target torn down, the source running: the whole rollback, in that order.

    Not when the source itself is gone while the target serves: traffic sent back would fail every
    client and the torn-down target was the only process still serving (the fault matrix's "source
    killed during the ramp" cell). Then both stay as they are, and the audit says why."""
    lost = quietly("source check", lambda: source_lost_target_serves(ctx))
    if lost:
        quietly("state", lambda: ctx.update(rollback_refused=True))
        quietly(
            "record",
            lambda: emit(
                ctx.migration,
                "rollback.refused_source_lost",
                {"reason": failure_reason(ctx.migration, reason)[:300], "kept": "traffic and target as they are"},
            ),
        )
        return
    if quietly("runtime", lambda: ctx.runtime.rollback_refused):
        # An earlier undo refused while the source was gone; it answers now (restarted): this one goes ahead, and
        # the run may read "rolled back" again once its steps took effect.
        quietly("state", lambda: ctx.update(rollback_refused=False))
    undo_traffic(ctx, reason=reason)
    undo_target(ctx, reason=reason)
    undo_source(ctx)


NOT_ROLLED_BACK = (
    "not rolled back: the source no longer answers while the target serves, so the traffic and the target were "
    "kept as they are (audit: rollback.refused_source_lost); restart the source before a rollback"
)


def rolled_back_or_not(ctx: RunContext, status: str, error: str) -> tuple[str, str]:
    """``(status, error)`` after an undo: ``failed`` with :data:`NOT_ROLLED_BACK` where the undo refused, or with
    the steps that did not take effect (a run that reads "rolled back" tells its operator the source serves again
    and nothing of the migration is left, which is then not so)."""
    if status != "rolled_back":
        return status, error
    rt = ctx.runtime
    if rt.rollback_refused:
        return "failed", f"{error}; {NOT_ROLLED_BACK}"
    if rt.rollback_incomplete:
        steps = "; ".join(f"{step}: {why}" for step, why in rt.rollback_incomplete.items())
        # A source whose agent does not answer stays so however often the rollback asks (a killed workload): the
        # operator starts it again first, and the retry then finds it running.
        first = (
            "start the source workload again if it stopped (as it was launched, with the same control key), then "
            if "source" in rt.rollback_incomplete
            else ""
        )
        return "failed", (
            f"{error}; the rollback is incomplete ({steps}): {first}`gpumigrate rollback {ctx.migration.id}` tries "
            "the failed steps again"
        )
    return status, error


def source_lost_target_serves(ctx: RunContext) -> bool:
    """A restored inference target answers while the source does not (the source asked a few times).

    The source is asked whether it lives (its health path), the target whether it serves (its ready path): a
    target that was started but never restored lives and answers 503 there, and keeping it would leave a GPU
    host running that serves nobody (a resumed run whose source had stopped did, in a README walkthrough)."""
    plan, rt = ctx.plan, ctx.runtime
    if plan.workload.kind != "inference" or not plan.workload.endpoint or not rt.target_endpoint:
        return False
    if rt.target_torn_down or rt.source_zeroized:
        return False
    if answers(plan.workload.endpoint, path=plan.workload.health_path, timeout_s=2.0, tries=3):
        return False
    return answers(rt.target_endpoint, path=plan.workload.ready_path, timeout_s=2.0)

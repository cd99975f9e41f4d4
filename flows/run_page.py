"""What an operator decides on a migration's own run page in the Prefect UI: the form behind Resume.

The migrate flow pauses twice at most: at the manual gate (before any traffic moves) and after the
cut-over, for the whole rollback window. Each time the run page shows **Resume** with a form (the
models below: what to do, who is acting, why) and the flow watches for an answer: the form, Prefect's
**Cancel** (which means "roll back"), a rollback request made elsewhere (``gpumigrate rollback``, the
``rollback`` deployment), or its deadline.

Why not ``prefect.flow_runs.pause_flow_run``: it checks for the answer every whole second at best,
and the rollback must reach the source within 2 s of the click; and its timeout is also the server's,
whose pause-expiry service fails the run by itself at that moment, racing the flow that wanted to
carry on at its deadline (retire the source). So the pause is proposed here with Prefect's own state
and run-input helpers (the same form in the UI), the server's expiry is kept a margin behind our
deadline, and the flow run's state is read every :data:`POLL_S`.

What each answer does: at the gate (``manual_gate``), proceed starts the ramp and anything else rolls
back (the target torn down; no traffic ever moved). In the window (``hold_rollback_window``), roll back
puts every client back on the source in one update first, then tears the target down and records who
acted; retire now, or the window's end, retires the source.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, cast
from uuid import UUID

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import State
from prefect.context import FlowRunContext
from prefect.exceptions import TerminationSignal
from prefect.input import RunInput
from prefect.input.run_input import Keyset, keyset_from_paused_state
from prefect.states import Paused, Running
from prefect.utilities.engine import propose_state_sync
from pydantic import Field

from gpumigrate.errors import GpumigrateError, RolledBackError
from gpumigrate.flows import flowrun, prefect_artifacts
from gpumigrate.flows.context import RunContext
from gpumigrate.flows.events import emit
from gpumigrate.flows.report import build_result, merge_result, write_outputs
from gpumigrate.flows.retire import retire_source
from gpumigrate.flows.rollback import roll_back_here
from gpumigrate.flows.undo import undo_all, undo_traffic
from gpumigrate.result import MigrationResult

POLL_S = 0.2  # how often the paused flow reads its run's state: bounds the time from a click to the action
SERVER_MARGIN_S = 120  # the server's own pause expiry stays this far behind the flow's deadline

ActingAs = Field(
    min_length=1,
    max_length=200,
    title="Acting as",
    description="Who is deciding (your name or handle): the audit log records it beside the identity Prefect gives",
)


class GateDecision(RunInput):
    """The manual gate, before any traffic moves to the target."""

    action: Literal["proceed", "roll back"] = "proceed"
    acting_as: str = ActingAs
    reason: str = Field("", max_length=300, description="Why (recorded in the audit log)")


class WindowDecision(RunInput):
    """After the cut-over, while the source is kept warm: roll back to it, or retire it now."""

    action: Literal["roll back", "retire now"] = "roll back"
    acting_as: str = ActingAs
    reason: str = Field("", max_length=300, description="Why (recorded in the audit log)")


D = TypeVar("D", bound=RunInput)


@dataclass(frozen=True)
class Answer(Generic[D]):
    """How the wait ended: the form (``decision``), Cancel, a request from elsewhere, or the deadline."""

    how: Literal["form", "cancel", "request", "deadline"]
    decision: D | None = None
    request: dict[str, Any] | None = None


def wait_for_decision(
    form: type[D],
    *,
    key: str,
    deadline: float,
    request: Callable[[], dict[str, Any] | None],
    what: str,
    description: str,
) -> Answer[D]:
    """Pause this flow run with ``form`` behind Resume until an answer comes (``deadline``: epoch seconds).

    ``description`` (markdown) is shown above the form; ``what`` names the wait in the run's log.

    A Prefect Cancel may also arrive as SIGTERM (``TerminationSignal``) while this waits: the caller
    treats that as ``cancel`` too.
    """
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        raise RuntimeError("only a flow run can wait for a decision on its run page")
    run_id = ctx.flow_run.id
    paused: State[Any] = Paused(
        timeout_seconds=int(max(1.0, deadline - time.time())) + SERVER_MARGIN_S, reschedule=False, pause_key=key
    )
    keyset = keyset_from_paused_state(paused)
    paused.state_details.run_input_keyset = {str(k): v for k, v in keyset.items()}
    form = form.with_initial_data(description=description)
    log = get_run_logger()
    with get_client(sync_client=True) as client:
        state = propose_state_sync(client, paused, flow_run_id=run_id)
        if state.is_running():  # this pause was answered before (the run was retried): the answer stands
            return Answer("form", _load(form, keyset, run_id))
        if not state.is_paused():
            raise RuntimeError(f"the flow run could not pause for {what}: Prefect answered {state.type.value}")
        form.save(keyset, flow_run_id=run_id)
        log.info("waiting for %s: Resume on this run's page (or Cancel, which rolls back)", what)
        while True:
            current = client.read_flow_run(run_id).state
            if current is not None and current.is_running():
                return Answer("form", _load(form, keyset, run_id))
            if current is not None and (current.is_cancelling() or current.is_cancelled()):
                return Answer("cancel")
            asked = request()
            if asked:
                _carry_on(client, run_id)
                return Answer("request", request=asked)
            if time.time() >= deadline:
                _carry_on(client, run_id)
                return Answer("deadline")
            time.sleep(POLL_S)


def _load(form: type[D], keyset: Keyset, run_id: UUID) -> D:
    """The form's answer (``load`` dispatches to its sync body here: this is not a coroutine)."""
    return cast(D, form.load(keyset, flow_run_id=run_id))


def _carry_on(client: Any, run_id: UUID) -> None:
    """Leave the pause without the form (a request from elsewhere, the deadline): the run is Running again."""
    propose_state_sync(client, Running(message="resumed by the flow"), flow_run_id=run_id)


GATE_TEXT = (
    "The target is restored and answers like the source; no traffic has moved. **proceed** starts the ramp; "
    "**roll back** tears the target down (the source never stopped serving). Cancel also rolls back."
)
WINDOW_TEXT = (
    "The target serves all traffic; the source is kept warm until the rollback window ends, then retired. "
    "**roll back** puts 100% of traffic back on the source at once and tears the target down; **retire now** "
    "ends the window early. Cancel also rolls back."
)


def _decided(
    answer: Answer[Any], *, default: str, on_deadline: tuple[str, str | None, str, str]
) -> tuple[str, str | None, str, str]:
    """(action, actor, reason, trigger) from however the wait on the run page ended."""
    if answer.how == "form" and answer.decision is not None:
        d = answer.decision
        return str(d.action), str(d.acting_as).strip() or None, str(d.reason).strip() or default, "manual"
    if answer.how == "request" and answer.request:
        req = answer.request
        return "roll back", req.get("actor"), str(req.get("reason") or default), "manual"
    if answer.how == "cancel":
        return "roll back", None, flowrun.stop_reason(), "cancel"
    return on_deadline


def manual_gate(ctx: RunContext, *, timeout_s: int = 3600) -> None:
    """Pause before any traffic moves; the operator resumes with proceed or roll back (or Cancel)."""
    m = ctx.migration
    emit(m, "traffic.gate.waiting", {"timeout_s": timeout_s})
    m.update(status="paused")
    try:
        answer: Answer[GateDecision] = wait_for_decision(
            GateDecision,
            key=f"gate-{m.id}",
            deadline=time.time() + timeout_s,
            request=m.rollback_requested,
            what="the manual gate",
            description=GATE_TEXT,
        )
    except TerminationSignal:
        answer = Answer("cancel")
    m.update(status="running")
    timeout: tuple[str, str | None, str, str] = (
        "roll back",
        None,
        f"nobody answered the manual gate within {timeout_s}s",
        "gate-timeout",
    )
    action, actor, reason, trigger = _decided(answer, default="rolled back at the manual gate", on_deadline=timeout)
    emit(m, "traffic.gate.decided", {"action": action, "reason": reason[:300], "via": answer.how}, actor=actor)
    if action != "roll back":
        return
    if answer.how == "cancel":
        flowrun.record_cancel(m, reason, where="the manual gate")
    elif answer.how != "request":
        m.request_rollback(reason, actor=actor)
    merge_result(m, rollback={"trigger": trigger, "actor": actor})
    flowrun.surviving_cancel(lambda: undo_all(ctx, reason=reason))
    raise flowrun.RunCancelled(reason) if answer.how == "cancel" else RolledBackError(reason)


def hold_rollback_window(ctx: RunContext) -> MigrationResult:
    """After the cut-over: paused on the run's page until the rollback window ends (then the source is
    retired, as ``finalize`` does without a window), or until someone rolls back or retires now."""
    m = ctx.migration
    deadline = ctx.runtime.rollback_deadline or time.time()
    try:
        answer: Answer[WindowDecision] = wait_for_decision(
            WindowDecision,
            key=f"window-{m.id}",
            deadline=deadline,
            request=m.rollback_requested,
            what="the rollback window",
            description=WINDOW_TEXT,
        )
    except TerminationSignal:
        answer = Answer("cancel")
    window_over: tuple[str, str | None, str, str] = ("retire", None, "the rollback window ended", "window")
    action, actor, reason, trigger = _decided(
        answer, default="rolled back in the rollback window", on_deadline=window_over
    )
    emit(m, "rollback.window.decided", {"action": action, "reason": reason[:300], "via": answer.how}, actor=actor)
    if action == "roll back":
        # Every client back on the source first, in one update; the records and the rest of the undo after.
        flowrun.surviving_cancel(lambda: undo_traffic(ctx, reason=reason))
        if answer.how == "cancel":
            flowrun.record_cancel(m, reason, where="the rollback window")
        elif answer.how != "request":
            m.request_rollback(reason, actor=actor)
        out: list[MigrationResult] = []
        flowrun.surviving_cancel(
            lambda: out.append(roll_back_here(ctx, reason=reason, actor=actor, trigger=trigger, after="completed"))
        )
        m.update(window_hold=None)
        result = out[0] if out else build_result(m)
    else:
        m.update(window_hold=None)
        try:
            retire_source(m.id, force=answer.how == "form", actor=actor)
        except GpumigrateError as exc:  # the cut-over stands; the source waits for `gpumigrate retire`
            emit(m, "source.retire_failed", {"error": str(exc)[:300]})
        result = write_outputs(m, status="completed", error=None)
    prefect_artifacts.publish(m, result)
    return result


def hold_record(ctx: RunContext) -> dict[str, Any]:
    """``window_hold`` in the state record: which run waits on its page, until when (the rollback path reads it)."""
    return {"flow_run_id": flowrun.run_id(), "until": ctx.runtime.rollback_deadline}

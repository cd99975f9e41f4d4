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
from prefect.input import RunInput
from prefect.input.run_input import Keyset, keyset_from_paused_state
from prefect.states import Paused, Running
from prefect.utilities.engine import propose_state_sync
from pydantic import Field

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


def stop_reason() -> str:
    """Why this flow run's process was told to stop: Prefect's Cancel (which means roll back), or a SIGTERM."""
    ctx = FlowRunContext.get()
    try:
        if ctx is not None and ctx.flow_run is not None:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(ctx.flow_run.id).state
            if state is not None and (state.is_cancelling() or state.is_cancelled()):
                return "cancelled in Prefect (Cancel means roll back)"
    except Exception:  # the API is gone too: the signal is all we know
        pass
    return "the orchestrator was told to stop (SIGTERM): rolled back to keep the source serving"

"""The safe point: a freeze makes requests wait, never fail; readiness follows restore and freeze."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gpumigrate.errors import SnapshotError
from gpumigrate.snapshot.stepgate import SafePointGate
from gpumigrate.workloads.inference import start_in_thread
from gpumigrate.workloads.model import build_model, weights_digest
from gpumigrate.workloads.serving import Fault, ServingState


@pytest.fixture
def running():
    state = ServingState(build_model(0, "tiny"), name="inproc", model_id="tinylm-tiny-float32-s0")
    srv = start_in_thread(state, workers=4)
    yield srv
    srv.state.safe_point.reopen()
    srv.stop()


def _gen(url: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/generate", json={"prompt": prompt, "max_new_tokens": 4}, timeout=30)


def test_freeze_holds_requests_until_resume(running) -> None:
    sp = running.state.safe_point
    sp.shut(timeout_s=5)
    assert httpx.get(f"{running.url}/readyz").json()["status"] == "held"
    assert httpx.get(f"{running.url}/healthz").status_code == 200  # the event loop still answers
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_gen, running.url, f"p{i}") for i in range(4)]
        deadline = time.monotonic() + 10
        while sp.waiting < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sp.waiting == 4 and not any(f.done() for f in futures)
        # Environment facts still answer while every request worker waits at the gate.
        assert httpx.get(f"{running.url}/v1/info", timeout=10).json()["host"] == "inproc"
        sp.reopen()
        codes = [f.result(timeout=30).status_code for f in futures]
    assert codes == [200, 200, 200, 200]
    assert httpx.get(f"{running.url}/readyz").json()["status"] == "ready"


def test_freeze_waits_for_in_flight_request(running) -> None:
    running.state.set_fault(Fault(kind="slow", delay_ms=400))
    result: dict[str, int] = {}
    t = threading.Thread(target=lambda: result.update(code=_gen(running.url, "slow").status_code))
    t.start()
    sp = running.state.safe_point
    deadline = time.monotonic() + 10
    while sp.in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    sp.shut(timeout_s=10)
    assert sp.in_flight == 0  # the in-flight request finished before freeze returned
    t.join(10)
    assert result["code"] == 200
    sp.reopen()


def test_freeze_timeout_reopens_the_gate() -> None:
    sp = SafePointGate()
    sp.enter()
    with pytest.raises(SnapshotError, match="in flight"):
        sp.shut(timeout_s=0.1)
    assert not sp.frozen
    sp.leave()
    sp.enter(timeout_s=0.1)  # admitted at once: not frozen
    sp.leave()


def test_enter_times_out_while_frozen() -> None:
    sp = SafePointGate()
    sp.shut()
    with pytest.raises(SnapshotError, match="frozen"):
        sp.enter(timeout_s=0.05)
    sp.reopen()
    sp.reopen()  # idempotent


def test_restore_in_place_then_set_ready() -> None:
    """What the agent does on the target: copy weights into the unloaded model, then raise ready."""
    target = ServingState(build_model(0, "tiny", load_weights=False), name="t", model_id="m", ready=False)
    srv = start_in_thread(target)
    try:
        assert httpx.get(f"{srv.url}/readyz").status_code == 503
        assert _gen(srv.url, "x").status_code == 503
        source = build_model(0, "tiny")
        for name, tensor in target.model.state_dict().items():
            tensor.copy_(source.state_dict()[name])
        target.set_ready(True)
        assert httpx.get(f"{srv.url}/readyz").status_code == 200
        assert httpx.get(f"{srv.url}/v1/info").json()["weights_digest"] == weights_digest(source)
        assert _gen(srv.url, "x").status_code == 200
    finally:
        srv.stop()


def test_a_retired_source_says_so_and_refuses_requests_at_once(running) -> None:
    """After `retire` zeroized it: /readyz 503 "retired" (not "awaiting restore"), and a request fails with 503
    at once instead of waiting out the 30 s a target awaiting its restore holds it."""
    sp = running.state.safe_point
    sp.shut(timeout_s=5)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(_gen, running.url, "held")
        deadline = time.monotonic() + 10
        while sp.waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        sp.mark_retired()  # a request held by the freeze is refused too, not left to time out
        assert held.result(timeout=5).status_code == 503
    ready = httpx.get(f"{running.url}/readyz")
    assert ready.status_code == 503 and ready.json()["status"] == "retired"
    assert ready.json()["reason"] == "retired: state zeroized"
    t0 = time.monotonic()
    answer = _gen(running.url, "x")
    assert answer.status_code == 503 and time.monotonic() - t0 < 5
    assert "retired" in answer.text and "serves no more" in answer.text
    assert running.state.reason() == "retired: state zeroized" and sp.metrics()["retired"] is True
    sp.set_ready(True)  # a restore loaded state into it again: it serves again
    sp.reopen()
    assert _gen(running.url, "x").status_code == 200 and not sp.retired


def test_the_agents_zeroize_retires_its_safe_point() -> None:
    from gpumigrate.snapshot.engine import SnapshotEngine

    gate = SafePointGate()
    agent = SnapshotEngine(freezer=gate, set_ready=gate.set_ready)
    assert agent.zeroize()["verified"] is True
    assert gate.retired and gate.readiness() == (503, {"status": "retired", "reason": "retired: state zeroized"})
    with pytest.raises(SnapshotError, match="serves no more"):
        gate.enter(timeout_s=30)


def test_a_retired_gate_parks_a_training_step_instead_of_failing_it() -> None:
    """A training loop's safe point has no timeout: on a zeroized source it stays parked (no step on wiped state,
    and no exception that would end the user's loop and the process the flow still talks to)."""
    import threading

    gate = SafePointGate()
    gate.shut()
    outcome: list[str] = []

    def step() -> None:
        try:
            with gate.safe_point():
                outcome.append("stepped")
        except SnapshotError as exc:
            outcome.append(f"failed: {exc}")

    worker = threading.Thread(target=step, daemon=True)
    worker.start()
    gate.mark_retired()
    worker.join(0.3)
    assert worker.is_alive() and outcome == []  # parked, as on a frozen gate
    with pytest.raises(SnapshotError, match="serves no more"):
        gate.enter(timeout_s=5)  # a request fails at once
    gate.set_ready(True)  # only a restore that loads state again lets it on
    gate.reopen()
    worker.join(5)
    assert outcome == ["stepped"]

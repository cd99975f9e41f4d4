"""The public SDK in one process: its names, what attach() accepts, where it listens, in-place restore,
the safe point under concurrent requests, the ASGI middleware, and the Lightning callback."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

import gpumigrate.agent as gm
from gpumigrate.errors import SnapshotError
from gpumigrate.snapshot.client import AgentClient


def test_every_public_name() -> None:
    from gpumigrate.agent.lightning import MigrationCallback

    functions = {gm.attach, gm.awaiting_restore, gm.current}
    classes = {gm.Handle, gm.InFlight, gm.ReadinessMiddleware, gm.Step, gm.Unavailable, gm.AgentAddressError}
    assert {getattr(gm, name) for name in gm.__all__} == functions | classes  # the contract, nothing else
    assert all(callable(f) for f in functions) and all(isinstance(c, type) for c in classes)
    assert issubclass(gm.Unavailable, SnapshotError) and callable(MigrationCallback)
    handle = gm.attach(torch.nn.Linear(2, 2))
    assert isinstance(handle, gm.Handle) and gm.current() is handle
    assert handle.ready and not handle.frozen and handle.steps == 0 and handle.reason() is None
    assert handle.address.startswith("127.0.0.1:") and not handle.address.endswith(":0")
    with handle.safe_point() as step:
        assert isinstance(step, gm.Step)
        step.report(loss=0.25)
    assert handle.steps == 1
    handle.close()
    handle.close()  # idempotent
    assert gm.current() is None


def test_awaiting_restore_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gm.awaiting_restore() is False
    monkeypatch.setenv("GPUMIGRATE_AWAIT_RESTORE", "1")
    assert gm.awaiting_restore() is True
    handle = gm.attach({"w": torch.zeros(3)})
    assert not handle.ready and handle.reason() == "awaiting restore"


@pytest.mark.parametrize(
    ("obj", "kwargs", "message"),
    [
        (3, {}, "attach\\(\\) takes a torch.nn.Module .* or a dict\\[str, torch.Tensor\\]; got builtins.int"),
        ("model.bin", {}, "got builtins.str"),
        ([torch.zeros(2)], {}, "got builtins.list"),
        ({"w": [1.0, 2.0]}, {}, "not str -> torch.Tensor: 'w'"),
        (torch.zeros(2), {}, "got torch.Tensor"),
        (torch.nn.Linear(2, 2), {"optimizer": "adam"}, "takes a torch.optim.Optimizer"),
        (torch.nn.Linear(2, 2), {"lr_scheduler": "step"}, "lr_scheduler=...\\) takes a torch.optim.lr_scheduler"),
        (torch.nn.Linear(2, 2), {"lr_scheduler": []}, "lr_scheduler=...\\) takes .* got an empty list"),
        (torch.nn.Linear(2, 2), {"state": [1, 2]}, "state=...\\) takes a dict"),
        (torch.nn.Linear(2, 2), {"state": {"s": {1, 2}}}, "state\\['s'\\] is a set: values in state are"),
    ],
)
def test_attach_refuses_what_it_cannot_carry(obj: Any, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        gm.attach(obj, **kwargs)
    assert gm.current() is None  # nothing was started
    with pytest.raises(ValueError, match="not one of"):
        gm.attach(torch.nn.Linear(2, 2), name="optimizer")


def test_an_agent_address_in_use_names_the_address_and_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        monkeypatch.setenv("GPUMIGRATE_AGENT_ADDR", f"127.0.0.1:{port}")
        with pytest.raises(gm.AgentAddressError) as caught:
            gm.attach(torch.nn.Linear(2, 2))
    text = str(caught.value)
    assert f"127.0.0.1:{port} is already in use" in text and "GPUMIGRATE_AGENT_ADDR" in text
    assert caught.value.exit_code == 2 and gm.current() is None
    monkeypatch.setenv("GPUMIGRATE_AGENT_ADDR", "localhost")
    with pytest.raises(gm.AgentAddressError, match="GPUMIGRATE_AGENT_ADDR='localhost' is not HOST:PORT"):
        gm.attach(torch.nn.Linear(2, 2))


def test_only_one_agent_per_process() -> None:
    first = gm.attach(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match=f"already attached in this process \\(at {first.address}\\)"):
        gm.attach(torch.nn.Linear(2, 2))


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> float:
    x = torch.randn(8, 4, generator=gen)
    loss = torch.nn.functional.mse_loss(torch.nn.functional.dropout(model(x), 0.2), x[:, :2])
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def test_restore_updates_the_users_own_objects_in_place(
    store: tuple[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, key_ref = store
    torch.manual_seed(1)
    model, kv = torch.nn.Linear(4, 2), torch.arange(12, dtype=torch.float32).reshape(3, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = {"kv": kv, "step": 7, "names": ["a", "b"], "data": torch.Generator().manual_seed(3)}
    source = gm.attach(model, optimizer=opt, state=state)
    for _ in range(2):
        with source.safe_point():
            _train_step(model, opt, state["data"])
    with AgentClient(source.address) as c:
        c.call("freeze")
        image = c.call("final", store=url, key_ref=key_ref)["image"]["id"]
    source.close()
    expected_next = _train_step(model, opt, state["data"])  # what the source would do next

    monkeypatch.setenv("GPUMIGRATE_AWAIT_RESTORE", "1")
    model2 = torch.nn.Linear(4, 2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.01)
    state2 = {"kv": torch.zeros(3, 4), "step": 0, "stale": True, "data": torch.Generator()}
    refs = (model2.weight, state2["kv"], state2["data"], state2)
    target = gm.attach(model2, optimizer=opt2, state=state2)
    with AgentClient(target.address) as c:
        assert c.call("restore", store=url, image_id=image, key_ref=key_ref)["ready"]
    assert target.ready and target.steps == 2
    now = (model2.weight, state2["kv"], state2["data"], state2)
    assert all(a is b for a, b in zip(now, refs, strict=True))  # the very same objects the user holds
    assert torch.equal(state2["kv"], kv) and state2["step"] == 7 and state2["names"] == ["a", "b"]
    assert "stale" not in state2  # the dict holds exactly the source's values
    assert len(opt2.state) == 2  # Adam's moments arrived in the user's optimizer
    # The next step: the same batch (the data generator travelled), the same dropout mask (the global RNG
    # travelled), the same Adam moments: the loss the source had.
    assert _train_step(model2, opt2, state2["data"]) == expected_next


def test_a_workload_without_the_image_key_says_the_key_belongs_in_its_own_environment(
    store: tuple[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent seals the image in the workload's process: a key only in the shell that runs `migrate` is not
    enough, and the message says whose environment lacks it (a walkthrough read "not set" while it was set)."""
    url, key_ref = store
    monkeypatch.delenv(key_ref["env"])  # the workload started without it
    handle = gm.attach(torch.nn.Linear(2, 2))
    with AgentClient(handle.address) as c, pytest.raises(Exception) as caught:
        c.call("precopy", store=url, key_ref=key_ref)
    text = str(caught.value)
    assert f"environment variable {key_ref['env']} is not set or empty" in text
    assert f"the workload's agent (pid {os.getpid()}) cannot read the image key" in text
    assert "start it with the image key's variable set" in text


def _scheduled(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, list[Any]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)  # its best starts at inf
    return opt, [steps, plateau]


def test_lr_schedulers_travel_and_the_schedule_continues(
    store: tuple[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without its scheduler's state a moved job keeps the decayed LR but restarts the schedule: its next decay
    comes late, silently. The schedulers' positions travel and the target's next LRs are the source's."""
    url, key_ref = store
    torch.manual_seed(2)
    model = torch.nn.Linear(4, 2)
    opt, scheds = _scheduled(model)
    gen = torch.Generator().manual_seed(5)
    source = gm.attach(model, optimizer=opt, lr_scheduler=scheds)
    for _ in range(5):
        with source.safe_point():
            loss = _train_step(model, opt, gen)
            scheds[0].step()
            scheds[1].step(loss)
    with AgentClient(source.address) as c:
        assert {"lr_scheduler0", "lr_scheduler1"} <= {r.name for r in c.request_info().regions}
        c.call("freeze")
        image = c.call("final", store=url, key_ref=key_ref)["image"]["id"]
    source.close()

    def next_lrs(o: torch.optim.Optimizer, s: list[Any], g: torch.Generator) -> list[float]:
        lrs = []
        for _ in range(4):
            loss = _train_step(model if o is opt else model2, o, g)
            s[0].step()
            s[1].step(loss)
            lrs.append(o.param_groups[0]["lr"])
        return lrs

    before = [s.state_dict() for s in scheds]
    expected = next_lrs(opt, scheds, torch.Generator().manual_seed(9))

    monkeypatch.setenv("GPUMIGRATE_AWAIT_RESTORE", "1")
    model2 = torch.nn.Linear(4, 2)
    opt2, scheds2 = _scheduled(model2)
    target = gm.attach(model2, optimizer=opt2, lr_scheduler=scheds2)
    with AgentClient(target.address) as c:
        assert c.call("restore", store=url, image_id=image, key_ref=key_ref)["ready"]
    assert [s.state_dict() for s in scheds2] == before  # last_epoch, last LRs, the plateau's best and count
    assert scheds2[0].last_epoch == 5
    assert next_lrs(opt2, scheds2, torch.Generator().manual_seed(9)) == expected


def test_safe_point_freeze_waits_for_requests_in_flight_and_holds_new_ones() -> None:
    handle = gm.attach(torch.nn.Linear(2, 2))
    entered = threading.Barrier(4)
    release = threading.Event()
    done: list[str] = []

    def request(i: int) -> None:
        with handle.safe_point():
            if i < 3:
                entered.wait(10)
                release.wait(10)
            done.append(f"r{i}")

    first = [threading.Thread(target=request, args=(i,)) for i in range(3)]
    for t in first:
        t.start()
    entered.wait(10)  # three requests in flight
    with AgentClient(handle.address) as c:
        freezing = threading.Thread(target=lambda: c.call("freeze", lease_s=60))
        freezing.start()
        time.sleep(0.3)
        assert freezing.is_alive()  # a freeze waits for the requests in flight
        release.set()
        freezing.join(10)
        assert not freezing.is_alive() and sorted(done) == ["r0", "r1", "r2"] and handle.frozen
        late = [threading.Thread(target=request, args=(i,)) for i in range(3, 6)]
        for t in late:
            t.start()
        time.sleep(0.3)
        assert handle.gate.waiting == 3 and len(done) == 3 and handle.reason() == "frozen"  # held, not failed
        metrics = c.call("metrics")
        assert metrics["held"] == 3 and metrics["in_flight"] == 0 and metrics["steps"] == 3
        c.call("resume")
    for t in first + late:
        t.join(10)
    assert sorted(done) == [f"r{i}" for i in range(6)] and handle.steps == 6


def test_the_middleware_answers_readiness_and_turns_held_too_long_into_503(monkeypatch: pytest.MonkeyPatch) -> None:
    async def answer(request: Any) -> JSONResponse:
        def work() -> int:
            with gm.current().safe_point(timeout_s=0.3):
                return 42

        return JSONResponse({"answer": await run_in_threadpool(work)})

    app = Starlette(routes=[Route("/v1/answer", answer, methods=["POST"])])
    app.add_middleware(gm.ReadinessMiddleware)
    client = TestClient(app)
    assert client.get("/healthz").json() == {"status": "alive"}
    assert client.get("/readyz").status_code == 503 and client.get("/readyz").json()["reason"] == "agent not attached"
    monkeypatch.setenv("GPUMIGRATE_AWAIT_RESTORE", "1")
    handle = gm.attach(torch.nn.Linear(2, 2))
    assert client.get("/readyz").json() == {"status": "not ready", "reason": "awaiting restore"}
    r = client.post("/v1/answer")
    assert r.status_code == 503 and "awaiting restore" in r.json()["error"]
    handle.gate.set_ready(True)  # what a restore does
    assert client.get("/readyz").json() == {"status": "ready"} and client.post("/v1/answer").json() == {"answer": 42}
    with AgentClient(handle.address) as c:
        c.call("freeze")
        ready = client.get("/readyz")  # a freeze holds requests: ready to a balancer, with the reason
        assert ready.status_code == 200 and ready.json() == {"status": "held", "reason": "frozen"}
        assert client.get("/healthz").status_code == 200  # alive while frozen
        r = client.post("/v1/answer")
        assert r.status_code == 503 and "frozen" in r.json()["error"]
        c.call("resume")
    assert client.post("/v1/answer").status_code == 200


def test_a_zeroized_service_reads_retired_and_fails_requests_at_once() -> None:
    """After `retire` (the agent's zeroize): /readyz 503 "retired", never "awaiting restore", and a request
    gets its 503 at once instead of waiting out the service's 30 s safe-point timeout."""

    async def answer(request: Any) -> JSONResponse:
        def work() -> int:
            with gm.current().safe_point():  # the default wait of a service: 30 s
                return 42

        return JSONResponse({"answer": await run_in_threadpool(work)})

    app = Starlette(routes=[Route("/v1/answer", answer, methods=["POST"])])
    app.add_middleware(gm.ReadinessMiddleware)
    client = TestClient(app)
    handle = gm.attach(torch.nn.Linear(2, 2))
    assert client.post("/v1/answer").json() == {"answer": 42}
    with AgentClient(handle.address) as c:
        assert c.request_zeroize().verified
        assert c.call("metrics")["retired"] is True
    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json() == {"status": "retired", "reason": "retired: state zeroized"}
    assert not handle.ready and handle.reason() == "retired: state zeroized"
    t0 = time.monotonic()
    r = client.post("/v1/answer")
    assert r.status_code == 503 and "serves no more" in r.json()["error"] and time.monotonic() - t0 < 5


def test_the_lightning_callback_counts_optimizer_steps_and_reports_losses(tmp_path: Path) -> None:
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    from gpumigrate.agent.lightning import MigrationCallback

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(batch_idx))
            return torch.nn.functional.mse_loss(self.lin(x), x[:, :1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    seen: dict[str, Any] = {}

    class Probe(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            handle = gm.current()
            assert handle is not None
            with AgentClient(handle.address) as c:
                seen.update(metrics=c.call("metrics"), info=c.request_info())

    callback = MigrationCallback(state={"note": "x"})
    trainer = pl.Trainer(
        max_steps=3,
        accumulate_grad_batches=2,  # a step is an optimizer step: never split between two batches
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[callback, Probe()],
    )
    trainer.fit(Net(), DataLoader(range(8), batch_size=None))
    metrics, regions = seen["metrics"], {r.name for r in seen["info"].regions}
    assert metrics["steps"] == 3 and [s for s, _ in metrics["losses"]] == [1, 2, 3]
    assert {"model/lin.weight", "lightning", "state.plain", "rng/torch", "progress"} <= regions
    assert {"optimizer/state/0/momentum_buffer", "optimizer/state/1/momentum_buffer"} <= regions
    assert gm.current() is None  # closed at teardown

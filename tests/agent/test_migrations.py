"""Programs gpumigrate has never seen, each embedding the public SDK, migrated between two real
processes through the agent's authenticated control channel: pre-copy rounds (pre-loading the
target) under load, freeze, final, restore into a process started with GPUMIGRATE_AWAIT_RESTORE=1.

Services answer exactly like the source, with no failed request; training loops take the next
steps with the losses the source gives for the same steps and an unmigrated control run gives.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
Proc = Any  # tests/agent/conftest.py's Proc: a started program, its log, its agent address and URL
BYO = REPO / "examples" / "byo"
TRAIN = REPO / "examples" / "train"


class Load:
    """Requests against the source in a loop from two threads until stopped; every outcome counted."""

    def __init__(self, url: str, path: str, body: Callable[[int], dict[str, Any]]) -> None:
        self.url, self.path, self.body = url, path, body
        self.ok = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(2)]

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                try:
                    r = client.post(self.url + self.path, json=self.body(rng.randrange(1 << 30)))
                    if r.status_code == 200:
                        self.ok += 1
                    else:
                        self.failed.append(f"{r.status_code} {r.text[:100]}")
                except httpx.HTTPError as exc:
                    self.failed.append(repr(exc))

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)

    def wait_for(self, n: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while self.ok < n and time.monotonic() < deadline:
            time.sleep(0.05)


def precopy_and_freeze(src: Proc, dst: Proc, store: str, key_ref: dict[str, str], rounds: int = 2) -> None:
    """Live rounds, each pre-loaded into the target (which stays unready), then freeze the source."""
    with src.client() as s, dst.client() as d:
        for _ in range(rounds):
            image = s.call("precopy", store=store, key_ref=key_ref)["image"]["id"]
            assert d.call("restore", store=store, image_id=image, key_ref=key_ref, ready=False)["ready"] is False
        s.call("freeze", lease_s=120)


def final_and_restore(src: Proc, dst: Proc, store: str, key_ref: dict[str, str]) -> dict[str, Any]:
    with src.client() as s, dst.client() as d:
        final = s.call("final", store=store, key_ref=key_ref)
        restored = d.call("restore", store=store, image_id=final["image"]["id"], key_ref=key_ref)
    assert restored["ready"] is True
    return restored


def test_a_service_outside_the_package_migrates_under_load(spawn, store) -> None:
    src = spawn([str(HERE / "kv_service.py")], name="source", http=True)
    dst = spawn([str(HERE / "kv_service.py")], name="target", http=True, await_restore=True)
    src.wait_http("/readyz")
    dst.wait_http("/healthz")
    assert httpx.get(dst.url + "/readyz").json() == {"status": "not ready", "reason": "awaiting restore"}
    dst.wait_agent()
    inputs = [[random.Random(i).uniform(-1, 1) for _ in range(16)] for i in range(20)]
    expected = [httpx.post(src.url + "/v1/predict", json={"x": x}).json()["y"] for x in inputs]

    def body(n: int) -> dict[str, Any]:
        return {"x": inputs[n % len(inputs)]}

    with Load(src.url, "/v1/predict", body) as load:
        load.wait_for(50)
        precopy_and_freeze(src, dst, *store)
        assert httpx.get(src.url + "/readyz").json()["status"] == "held"
        at_freeze = httpx.get(src.url + "/v1/state").json()  # not a safe point: answers while frozen
        time.sleep(0.5)
        assert httpx.get(src.url + "/v1/state").json() == at_freeze  # nothing moves while frozen
        final_and_restore(src, dst, *store)
        assert httpx.get(dst.url + "/v1/state").json() == at_freeze  # the cache and counter travelled
        assert httpx.get(dst.url + "/readyz").status_code == 200
        with src.client() as s:
            s.call("resume")  # the held requests go on: slow for a moment, never failed
        load.wait_for(load.ok + 50)
    assert load.failed == [] and load.ok > 100
    for x, want in zip(inputs, expected, strict=True):
        assert httpx.post(dst.url + "/v1/predict", json={"x": x}).json()["y"] == want
    with dst.client() as d:
        info = d.request_info()
    assert {"model/0.weight", "state/cache", "state.plain", "rng/torch", "progress"} <= {r.name for r in info.regions}


def test_the_minilm_example_migrates_with_identical_embeddings(spawn, store) -> None:
    src = spawn([str(BYO / "service.py")], name="source", http=True, cwd=BYO)
    dst = spawn([str(BYO / "service.py")], name="target", http=True, cwd=BYO, await_restore=True)
    src.wait_http("/readyz", timeout_s=300)
    dst.wait_http("/healthz", timeout_s=300)
    dst.wait_agent()
    golden = [json.loads(line) for line in (BYO / "golden.jsonl").read_text().splitlines()]
    expected = [httpx.post(src.url + "/v1/embeddings", json={"text": g["text"]}).json()["embedding"] for g in golden]
    assert len(expected[0]) == 384
    assert httpx.post(dst.url + "/v1/embeddings", json={"text": "x"}, timeout=60).status_code == 503  # no weights

    with Load(src.url, "/v1/embeddings", lambda n: {"text": f"load {n}"}) as load:
        load.wait_for(10)
        precopy_and_freeze(src, dst, *store)
        restored = final_and_restore(src, dst, *store)
        with src.client() as s:
            s.call("resume")
        load.wait_for(load.ok + 10)
    assert load.failed == [] and load.ok >= 20
    assert restored["chunks_loaded"] < 10  # the pre-load had the weights: the final moved only what changed
    got = [httpx.post(dst.url + "/v1/embeddings", json={"text": g["text"]}).json()["embedding"] for g in golden]
    assert got == expected  # bit for bit


def _step_losses(proc: Proc) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in proc.events("step")}


def _wait_steps(proc: Proc, step: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while max(_step_losses(proc), default=0) < step:
        assert time.monotonic() < deadline, proc.text()[-3000:]
        time.sleep(0.1)


def _migrate_training(spawn, store, argv: list[str], env: dict[str, str]) -> None:
    """Source and target of one loop; the source is advanced by the steps the target takes next."""
    parity_steps = 4
    control = spawn(argv, name="control", env={**env, "STEP_DELAY_MS": "0"})
    src = spawn(argv, name="source", env={**env, "STEP_DELAY_MS": "150"})
    dst = spawn(argv, name="target", env={**env, "STEP_DELAY_MS": "0"}, await_restore=True)
    _wait_steps(src, 3)
    dst.wait_agent()
    precopy_and_freeze(src, dst, *store)
    with src.client() as s:
        cut = s.call("metrics")["steps"]
    final_and_restore(src, dst, *store)
    with src.client() as s:
        advanced = s.call("advance", steps=parity_steps)  # the source's losses for the target's next steps
        assert s.call("metrics")["frozen"] is True
    source_losses = {step: loss for step, loss in advanced["losses"]}
    assert sorted(source_losses) == list(range(cut + 1, cut + parity_steps + 1)) and advanced["steps"] == cut + 4
    _wait_steps(dst, cut + parity_steps)
    _wait_steps(control, cut + parity_steps)
    target, reference = _step_losses(dst), _step_losses(control)
    assert min(target) == cut + 1  # the target continued from the cut: it did not start over
    for step in range(cut + 1, cut + parity_steps + 1):
        assert target[step] == source_losses[step] == reference[step], step
    before_cut = {s: loss for s, loss in _step_losses(src).items() if s <= cut}
    assert before_cut == {s: reference[s] for s in range(1, cut + 1)}


def test_the_plain_pytorch_example_continues_with_identical_losses(spawn, store) -> None:
    _migrate_training(spawn, store, [str(TRAIN / "train.py")], {"STEPS": "60"})


@pytest.mark.slow
def test_a_lightning_loop_continues_with_identical_losses(spawn, store) -> None:
    _migrate_training(spawn, store, [str(HERE / "lightning_loop.py")], {"STEPS": "40"})

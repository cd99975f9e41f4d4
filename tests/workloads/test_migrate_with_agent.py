"""The workloads migrated by the real snapshot agent between two local hosts (LocalProvider).

Source and target run under their hosts' supervisors; the image goes through a real file store,
encrypted with a key that only the environment holds. What is checked is the workloads' side of
the contract: a restored inference target answers exactly like the source, and a restored
training job continues with the very losses an uninterrupted run produces.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest
import torch

from gpumigrate.infra.launch import service_url, wait_http
from gpumigrate.infra.local import LocalProvider
from gpumigrate.interfaces import HostSpec

client_mod = pytest.importorskip("gpumigrate.snapshot.client")
from gpumigrate.workloads.training import TrainingConfig, TrainingState, run_steps  # noqa: E402

KEY = {"env": "GM_WORKLOADS_TEST_KEY"}
GOLDEN = Path(__file__).resolve().parents[2] / "examples" / "golden" / "tiny-lm.jsonl"


@pytest.fixture
def hosts(gm_home: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(KEY["env"], os.urandom(32).hex())  # inherited by the hosts' supervisors
    provider = LocalProvider()
    a = provider.provision(HostSpec(name="wl-a", provider="local", region="local-a"), migration_id="wl")
    b = provider.provision(HostSpec(name="wl-b", provider="local", region="local-b"), migration_id="wl")
    yield provider, a, b, f"file://{gm_home}/store"
    provider.terminate(a)
    provider.terminate(b)


def agent(host, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client_mod.AgentClient(f"{host.address}:{host.ports['agent']}", timeout_s=120)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def events(log: str, kind: str) -> list[dict]:
    return [json.loads(line) for line in Path(log).read_text().splitlines() if line.startswith(f'{{"event": "{kind}"')]


def test_inference_target_answers_like_the_source(hosts, workload_launch) -> None:
    provider, a, b, store = hosts
    a = provider.bootstrap(a, workload_launch("inference", "--seed", "0"), timeout_s=120)
    b = provider.bootstrap(b, workload_launch("inference", "--seed", "0", await_restore=True), timeout_s=120)
    src, tgt = service_url(a), service_url(b)
    wait_http(src, path="/readyz", timeout_s=60)
    assert httpx.get(f"{tgt}/readyz").status_code == 503
    with agent(a) as ca, agent(b) as cb:
        ca.request_precopy(store, KEY)
        ca.request_freeze()
        image = ca.request_final(store, KEY).image
        restored = cb.request_restore(store, image.id, KEY)
        ca.request_resume()
    assert restored.ready is True
    assert httpx.get(f"{tgt}/readyz").status_code == 200
    assert httpx.get(f"{tgt}/v1/info").json()["weights_digest"] == httpx.get(f"{src}/v1/info").json()["weights_digest"]
    for case in [json.loads(line) for line in GOLDEN.read_text().splitlines()][:10]:
        body = {"prompt": case["prompt"], "max_new_tokens": case["max_new_tokens"]}
        s = httpx.post(f"{src}/v1/generate", json=body).json()
        t = httpx.post(f"{tgt}/v1/generate", json=body).json()
        assert (s["tokens"], s["logprobs"]) == (t["tokens"], t["logprobs"]), case["id"]
        assert (s["host"], t["host"]) == ("wl-a", "wl-b")


def test_training_continues_on_the_target_with_identical_losses(hosts, workload_launch) -> None:
    provider, a, b, store = hosts
    total = 16
    job = ("--steps", str(total), "--seed", "3")
    # The target first: the source's 16 steps must not all be over before the migration begins.
    b = provider.bootstrap(b, workload_launch("training", *job, await_restore=True), timeout_s=120)
    a = provider.bootstrap(a, workload_launch("training", *job, "--step-delay-ms", "150"), timeout_s=120)
    src, tgt = a.meta["workload"], b.meta["workload"]
    deadline = time.monotonic() + 120
    while len(events(src["log"], "step")) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    with agent(a) as ca, agent(b) as cb:
        ca.request_precopy(store, KEY)
        ca.request_freeze()
        image = ca.request_final(store, KEY).image
        cb.request_restore(store, image.id, KEY)
    provider.signal(a, src["pid"])  # the source stops at the cut-over, as a migration would
    deadline = time.monotonic() + 180
    while not events(tgt["log"], "done") and time.monotonic() < deadline:
        time.sleep(0.2)
    done = events(tgt["log"], "done")
    assert done, Path(tgt["log"]).read_text()[-2000:]
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the jobs run with --threads 1; the reference must too (bit-exact losses)
    try:
        reference = TrainingState.create(TrainingConfig(seed=3))
        expected = run_steps(reference, total)
    finally:
        torch.set_num_threads(before)
    src_steps, tgt_steps = events(src["log"], "step"), events(tgt["log"], "step")
    cut = src_steps[-1]["step"]
    assert [s["step"] for s in tgt_steps] == list(range(cut + 1, total + 1))
    assert [s["loss"] for s in src_steps] == expected[:cut]
    assert [s["loss"] for s in tgt_steps] == expected[cut:]
    assert done[0]["weights_digest"] == reference.weights_digest()

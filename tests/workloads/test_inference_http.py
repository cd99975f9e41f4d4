"""HTTP contract of the reference inference server, against real server processes."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

GOLDEN = Path(__file__).resolve().parents[2] / "examples" / "golden" / "tiny-lm.jsonl"


def golden_cases() -> list[dict]:
    return [json.loads(line) for line in GOLDEN.read_text().splitlines() if line.strip()]


def gen(url: str, prompt: str, n: int = 8) -> httpx.Response:
    return httpx.post(f"{url}/v1/generate", json={"prompt": prompt, "max_new_tokens": n}, timeout=30)


def test_golden_file_shape() -> None:
    cases = golden_cases()
    assert 20 <= len(cases) <= 40
    assert len({c["id"] for c in cases}) == len(cases)
    for c in cases:
        assert set(c) == {"id", "prompt", "max_new_tokens"} and 1 <= c["max_new_tokens"] <= 64


def test_same_seed_same_outputs_across_processes_and_thread_counts(server_factory, shared_server) -> None:
    other = server_factory("--seed", "0", "--threads", "2")
    info_a = httpx.get(f"{shared_server.url}/v1/info").json()
    info_b = httpx.get(f"{other.url}/v1/info").json()
    assert info_a["weights_digest"] == info_b["weights_digest"]
    assert info_b["num_threads"] == 2
    for case in golden_cases()[:12]:
        a = gen(shared_server.url, case["prompt"], case["max_new_tokens"]).json()
        b = gen(other.url, case["prompt"], case["max_new_tokens"]).json()
        assert a["tokens"] == b["tokens"], case["id"]
        assert all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(a["logprobs"], b["logprobs"], strict=True))


def test_generate_response_shape(shared_server) -> None:
    r = gen(shared_server.url, "Hello", 5)
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"tokens", "text", "logprobs", "model", "host"}
    assert len(body["tokens"]) == 5 and len(body["logprobs"]) == 5
    assert all(lp <= 0 for lp in body["logprobs"])
    assert body["host"] == "test" and body["model"] == "tinylm-tiny-float32-s0"
    default = httpx.post(f"{shared_server.url}/v1/generate", json={"prompt": "Hello"}).json()
    assert len(default["tokens"]) == 8


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_new_tokens": 8}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "x", "max_new_tokens": 65}, "max_new_tokens"),
        ({"prompt": "x", "max_new_tokens": "8"}, "max_new_tokens"),
        ({"prompt": "x", "temperature": 1}, "temperature"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_body_is_400_naming_the_field(shared_server, body, field) -> None:
    r = httpx.post(f"{shared_server.url}/v1/generate", json=body)
    assert r.status_code == 400
    assert field in r.json()["error"]


def test_invalid_json_is_400(shared_server) -> None:
    r = httpx.post(
        f"{shared_server.url}/v1/generate", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]


def test_info_reports_environment_without_secrets(server_factory, shared_server) -> None:
    os.environ["GPUMIGRATE_TEST_SECRET"] = "hunter2"
    try:
        srv = server_factory("--seed", "7")
    finally:
        del os.environ["GPUMIGRATE_TEST_SECRET"]
    info = httpx.get(f"{srv.url}/v1/info").json()
    assert info["seed"] == 7
    assert info["weights_digest"] != httpx.get(f"{shared_server.url}/v1/info").json()["weights_digest"]
    for key in (
        "torch",
        "lightning",
        "python",
        "device",
        "gpu_model",
        "num_threads",
        "weights_digest",
        "seed",
        "size",
        "dtype",
    ):
        assert key in info, key
    assert info["weights_digest"].startswith("blake3:")
    assert "hunter2" not in json.dumps(info)


def test_await_restore_is_alive_but_not_ready(server_factory) -> None:
    srv = server_factory("--await-restore", wait_ready=False)
    assert httpx.get(f"{srv.url}/healthz").status_code == 200
    r = httpx.get(f"{srv.url}/readyz")
    assert r.status_code == 503 and r.json()["reason"] == "awaiting restore"
    assert gen(srv.url, "hi").status_code == 503


def test_fault_route_exists_only_where_enabled(server_factory) -> None:
    plain = server_factory("--seed", "0", env={"GPUMIGRATE_ENABLE_FAULTS": ""})
    assert httpx.get(f"{plain.url}/admin/fault").status_code == 404
    assert httpx.post(f"{plain.url}/admin/fault", json={"kind": "crash"}).status_code == 404
    assert gen(plain.url, "still here").status_code == 200
    by_env = server_factory("--seed", "0", env={"GPUMIGRATE_ENABLE_FAULTS": "1"})
    assert httpx.get(f"{by_env.url}/admin/fault").json()["kind"] == "none"


def test_faults_then_graceful_sigterm(server_factory) -> None:
    srv = server_factory("--seed", "0", "--enable-faults")
    clean = gen(srv.url, "drift me").json()
    assert httpx.get(f"{srv.url}/admin/fault").json()["kind"] == "none"

    assert httpx.post(f"{srv.url}/admin/fault", json={"kind": "errors"}).json()["kind"] == "errors"
    assert {gen(srv.url, "x").status_code for _ in range(5)} == {500}

    httpx.post(f"{srv.url}/admin/fault", json={"kind": "errors", "rate": 0.5})
    codes = [gen(srv.url, "x").status_code for _ in range(60)]
    assert 0 < codes.count(500) < 60 and set(codes) == {200, 500}

    httpx.post(f"{srv.url}/admin/fault", json={"kind": "slow", "delay_ms": 300})
    t0 = time.perf_counter()
    assert gen(srv.url, "x").status_code == 200
    assert time.perf_counter() - t0 >= 0.3  # the injected delay is a lower bound, not a timing claim

    httpx.post(f"{srv.url}/admin/fault", json={"kind": "drift"})
    drifted = gen(srv.url, "drift me").json()
    assert drifted["logprobs"] != clean["logprobs"]

    httpx.post(f"{srv.url}/admin/fault", json={"kind": "none"})
    assert gen(srv.url, "drift me").json() == clean

    # Graceful shutdown on the same process: SIGTERM while a slow request is in flight.
    httpx.post(f"{srv.url}/admin/fault", json={"kind": "slow", "delay_ms": 800})
    result: dict[str, int] = {}
    t = threading.Thread(target=lambda: result.update(code=gen(srv.url, "slow one").status_code))
    t.start()
    time.sleep(0.3)  # let the request get in flight
    srv.proc.send_signal(signal.SIGTERM)
    t.join(15)
    assert result.get("code") == 200
    assert srv.proc.wait(timeout=15) == 0


@pytest.mark.parametrize(
    "body",
    [
        {"kind": "explode"},
        {"kind": "errors", "rate": 2},
        {"kind": "slow", "delay_ms": -1},
        {"kind": "slow", "delay_ms": 1.5},
    ],
)
def test_bad_fault_is_400(shared_server, body) -> None:
    r = httpx.post(f"{shared_server.url}/admin/fault", json=body)
    assert r.status_code == 400
    assert httpx.get(f"{shared_server.url}/admin/fault").json()["kind"] == "none"


def test_crash_fault_kills_the_process(server_factory) -> None:
    srv = server_factory("--seed", "0", "--enable-faults")
    assert httpx.post(f"{srv.url}/admin/fault", json={"kind": "crash"}).status_code == 200
    assert srv.proc.wait(timeout=10) == 17
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{srv.url}/healthz", timeout=2)

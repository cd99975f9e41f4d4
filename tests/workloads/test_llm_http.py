"""The LLM server as its users see it: a real process, the official openai client, OpenAI's formats."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from llm_support import LLMProc, engine_stats, start_llm_server, wait_for

MODEL = "llama-tiny-float32-s0"
SLOTS = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLMProc]:
    srv = start_llm_server("--slots", str(SLOTS), home=tmp_path_factory.mktemp("home"), key_hex=secrets.token_hex(32))
    yield srv
    assert srv.stop() == 0  # SIGTERM: finish what is in flight, exit 0


@pytest.fixture
def client(server: LLMProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="not-needed", max_retries=0, timeout=120)


def _stream(client: openai.OpenAI, **kw: Any) -> dict[str, Any]:
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text_chunks = [c for c in chunks if c.choices]
    return {
        "text": "".join(c.choices[0].text for c in text_chunks),
        "finish": text_chunks[-1].choices[0].finish_reason,
        "usage": chunks[-1].usage,
        "chunks": len(text_chunks),
        "ids": {c.id for c in chunks},
    }


def test_eight_concurrent_streams_of_200_tokens(client: openai.OpenAI) -> None:
    prompts = [f"Stream {i}: the tale of the {i}th lighthouse keeper." for i in range(8)]
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 200, "temperature": 0, "extra_body": {"ignore_eos": True}}
    with ThreadPoolExecutor(8) as pool:
        streams = list(pool.map(lambda p: _stream(client, prompt=p, **kw), prompts))
        wholes = list(pool.map(lambda p: client.completions.create(prompt=p, **kw), prompts))
    for prompt, s, whole in zip(prompts, streams, wholes, strict=True):
        assert s["finish"] == "length" and s["usage"].completion_tokens == 200 and s["chunks"] > 50
        assert s["usage"].prompt_tokens == len(prompt.encode()) + 1 and len(s["ids"]) == 1
        assert whole.choices[0].text == s["text"] and whole.usage is not None and whole.usage.completion_tokens == 200


def test_chat_streams_the_role_then_the_content(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0, stream=True)
    )
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    assert whole.choices[0].message.content == streamed and whole.choices[0].message.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_seeded_sampling_repeats_and_stop_sequences_end_the_text(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        out = client.completions.create(model=MODEL, prompt="Dice:", max_tokens=40, temperature=0.9, seed=seed)
        return out.choices[0].text

    assert sample(5) == sample(5) != sample(6)
    kw: dict[str, Any] = {
        "model": MODEL,
        "prompt": "Lists:",
        "max_tokens": 60,
        "temperature": 0.9,
        "seed": 11,
        "extra_body": {"ignore_eos": True},
    }
    full = client.completions.create(**kw).choices[0].text
    stop = next(full[i : i + 3] for i in range(20, 50) if full.find(full[i : i + 3]) == i)
    cut = client.completions.create(**kw, stop=[stop, "never appears"])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert _stream(client, stop=stop, **kw)["text"] == cut.choices[0].text


@pytest.mark.parametrize(
    ("kw", "param", "code"),
    [
        ({"max_tokens": -1}, "max_tokens", None),
        ({"model": "gpt-9"}, "model", "model_not_found"),
        ({"prompt": "x" * 600}, "prompt", "context_length_exceeded"),
        ({"max_tokens": 500, "prompt": "x" * 20}, "prompt", "context_length_exceeded"),
        ({"temperature": 3}, "temperature", None),
        ({"n": 2}, "n", None),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", None),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_input_gets_an_openai_400(
    client: openai.OpenAI, kw: dict[str, Any], param: str, code: str | None, stream: bool
) -> None:
    args: dict[str, Any] = {"model": MODEL, "prompt": "Hello", **kw}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**args, stream=stream)
    assert err.value.status_code == 400 and err.value.param == param and err.value.code == code
    assert isinstance(err.value.body, dict) and err.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[1, 2]",
        json.dumps({"model": MODEL, "prompt": "x", "bogus": 1}).encode(),
        json.dumps({"model": MODEL}).encode(),
    ],
)
def test_malformed_bodies_get_an_openai_400(server: LLMProc, body: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"} and r.json()["error"]["message"]


def test_a_client_that_disconnects_frees_its_slot(server: LLMProc) -> None:
    body = {
        "model": MODEL,
        "prompt": "Go on for ever",
        "max_tokens": 450,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        first = [next(line for line in lines if line.startswith("data: ")) for _ in range(3)]
        rid = json.loads(first[0][6:])["id"]
        assert any(r["id"] == rid for r in engine_stats(server.url)["running"])
    wait_for(
        lambda: (s := engine_stats(server.url))["free_slots"] == SLOTS and not s["running"],
        "the disconnected stream's slot to be free",
        60,
    )


def test_models_health_and_readiness(client: openai.OpenAI, server: LLMProc) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/healthz").status_code == 200
    assert httpx.get(server.url + "/readyz").json()["status"] == "ready"


def test_an_agent_address_in_use_exits_2(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "GPUMIGRATE_HOME": str(tmp_path), "GPUMIGRATE_CONTROL_KEY": secrets.token_hex(32)}
        argv = [sys.executable, "-m", "gpumigrate.workloads.llm", "--port", "0", "--agent-port", str(port)]
        bad = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and f"127.0.0.1:{port} is already in use" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_target_awaiting_its_restore_is_alive_but_not_ready(tmp_path: Path) -> None:
    env = {**os.environ, "GPUMIGRATE_HOME": str(tmp_path), "GPUMIGRATE_CONTROL_KEY": secrets.token_hex(32)}
    argv = [sys.executable, "-m", "gpumigrate.workloads.llm", "--port", "0", "--agent-port", "0", "--await-restore"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        url = f"http://127.0.0.1:{json.loads(proc.stdout.readline())['port']}"
        assert httpx.get(url + "/healthz", timeout=30).status_code == 200
        ready = httpx.get(url + "/readyz", timeout=30)
        assert ready.status_code == 503 and ready.json()["reason"] == "awaiting restore"
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and "awaiting restore" in r.json()["error"]["message"]
    finally:
        proc.terminate()
        assert proc.wait(60) == 0

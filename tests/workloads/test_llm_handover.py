"""Streams that survive a hand-over between two real server processes (the state moved by export/import).

The source's clients keep their connections; after the hand-over, the source relays what the target
generates. Every stream's text equals an unmigrated control run's, token for token. A client that
leaves during the hand-over has its request cancelled on the target; a request that arrives during
it is served by the target; a rollback leaves every stream on the source.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from llm_support import LLMProc, engine_stats, start_llm_servers, wait_for

from gpumigrate.workloads.llm import admin

MODEL = "llama-tiny-float32-s0"
TOKENS = 200


@dataclass
class Client:
    """One streaming client on its own thread."""

    url: str
    prompt: str
    params: dict[str, Any]
    leave_after: threading.Event | None = None  # set: stop reading and close the connection
    text: str = ""
    chunks: int = 0
    finish: str | None = None
    usage: Any = None
    request_id: str | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> Client:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        client = openai.OpenAI(base_url=self.url + "/v1", api_key="not-needed", max_retries=0, timeout=180)
        try:
            stream = client.completions.create(
                model=MODEL, prompt=self.prompt, stream=True, stream_options={"include_usage": True}, **self.params
            )
            for chunk in stream:
                self.request_id = chunk.id
                if chunk.usage is not None:
                    self.usage = chunk.usage
                if chunk.choices:
                    self.text += chunk.choices[0].text
                    self.chunks += 1
                    self.finish = chunk.choices[0].finish_reason or self.finish
                if self.leave_after is not None and self.chunks >= 10:
                    self.leave_after.wait(120)
                    stream.close()
                    return
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.done.set()


def _params(i: int) -> dict[str, Any]:
    sampled = {"temperature": 0.8, "seed": 100 + i} if i % 3 == 1 else {"temperature": 0}
    return {"max_tokens": TOKENS, "extra_body": {"ignore_eos": True}, **sampled}


PROMPTS = [f"Client {i} asks about harbour {i * 11}." for i in range(10)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LLMProc, LLMProc, bytes]]:
    """One source and one target for the module: the hand-over test, which moves the source's work, runs last."""
    tmp_path = tmp_path_factory.mktemp("pair")
    key = secrets.token_hex(32)
    source, target = start_llm_servers(
        [
            (("--manual-handover", "--name", "source"), tmp_path / "a"),
            (("--manual-handover", "--claim-timeout-s", "3", "--name", "target"), tmp_path / "b"),
        ],
        key_hex=key,
    )
    yield source, target, bytes.fromhex(key)
    for srv in (source, target):
        srv.stop()


def _command(url: str, key: bytes, command: str, **fields: Any) -> dict[str, Any]:
    r = httpx.post(url + admin.PATH, json=admin.sign(key, command, **fields), timeout=120)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _control(url: str, indexes: range) -> dict[int, str]:
    """The same requests on an unmigrated server, side by side (batch invariance: neighbours do not matter)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0, timeout=180)

    def one(i: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPTS[i], **_params(i)).choices[0].text

    with ThreadPoolExecutor(len(indexes)) as pool:
        return dict(zip(indexes, pool.map(one, indexes), strict=True))


def _all_streaming(clients: list[Client]) -> bool:
    for c in clients:
        if c.error is not None:
            raise AssertionError(f"a client failed: {c.error!r}")
    return all(c.chunks >= 10 for c in clients)


def test_a_rollback_keeps_every_stream_on_the_source(pair: tuple[LLMProc, LLMProc, bytes]) -> None:
    source, target, key = pair
    expected = _control(target.url, range(5))
    clients = [Client(source.url, PROMPTS[i], _params(i)).start() for i in range(4)]
    wait_for(lambda: _all_streaming(clients), "every stream to be under way on the source")
    _command(source.url, key, "export")
    late = Client(source.url, PROMPTS[4], _params(4)).start()
    _command(source.url, key, "resume")  # the migration gives up: the source goes on
    for i, c in enumerate([*clients, late]):
        assert c.done.wait(180) and c.error is None, f"client {i}: {c.error!r}"
        assert c.text == expected[i] and c.finish == "length"
    assert engine_stats(source.url)["moved_to"] is None


def test_the_continuation_endpoint_wants_the_control_key(pair: tuple[LLMProc, LLMProc, bytes]) -> None:
    source, target, key = pair
    from gpumigrate import control
    from gpumigrate.workloads.llm import handover

    wrong = control.sign_request(secrets.token_bytes(32), handover.CHANNEL, {"request_id": "x", "offset": 0})
    r = httpx.post(target.url + handover.PATH, json=wrong, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"
    r = httpx.post(target.url + handover.PATH, json={"request_id": "x", "offset": 0}, timeout=30)
    assert r.status_code == 401
    signed = control.sign_request(key, handover.CHANNEL, {"request_id": "cmpl-none", "offset": 0})
    assert httpx.post(target.url + handover.PATH, json=signed, timeout=30).status_code == 404
    r = httpx.post(source.url + admin.PATH, json=admin.sign(secrets.token_bytes(32), "export"), timeout=30)
    assert r.status_code == 401


def test_streams_continue_through_the_hand_over(pair: tuple[LLMProc, LLMProc, bytes]) -> None:
    source, target, key = pair
    expected = _control(target.url, range(9))  # the target serves the control run, then is idle again
    leave = threading.Event()
    clients = [Client(source.url, PROMPTS[i], _params(i), leave if i == 7 else None).start() for i in range(8)]
    wait_for(lambda: _all_streaming(clients), "every stream to be under way on the source")

    exported = _command(source.url, key, "export")  # sealed and paused between two decode steps
    assert {r["where"] for r in exported["state"]["requests"]} == {"running"}
    leave.set()  # client 7 leaves while the engine is stopped
    wait_for(lambda: clients[7].done.is_set(), "client 7 to close its stream")
    late = Client(source.url, PROMPTS[8], _params(8)).start()  # arrives during the hand-over: waits at the door
    steps_before = engine_stats(target.url)["steps"]
    imported = _command(target.url, key, "import", state=exported["state"], tensors=exported["tensors"])
    assert len(imported["requests"]) == 8
    _command(source.url, key, "hand_over", target=target.url)
    assert engine_stats(source.url)["moved_to"] == target.url

    for c in [*clients, late]:
        assert c.done.wait(180), "a stream did not end"
    for i, c in enumerate([*clients[:7], late]):
        i = 8 if c is late else i
        assert c.error is None, f"client {i}: {c.error!r}"
        assert c.text == expected[i], f"client {i}'s text differs from the control run's"
        assert c.finish == "length" and c.usage.completion_tokens == TOKENS
    assert len(clients[7].text) < len(expected[7])
    # The request whose client left is never claimed by a relay: the target cancels it and frees its slot.
    wait_for(lambda: not engine_stats(target.url)["running"], "the target's slots to be free", 60)
    assert engine_stats(source.url)["relaying"] == 0
    # The target generated the rest: at least as many steps as the request furthest from its end lacked.
    lacking = TOKENS - min(len(r["tokens"]) for r in exported["state"]["requests"])
    assert engine_stats(target.url)["steps"] - steps_before >= lacking > 0

"""Streams that survive a move between two real server processes, through the SDK's own capture and restore.

The test drives the two servers' agents as the migration's agent backend does (pre-copy into a file store, the
target pre-loaded, freeze, final round, resume, restore, hand-over). The source's clients keep their connections;
after the hand-over the source relays what the target generates. Every stream's text equals an unmigrated control
run's, token for token. A client that leaves during the freeze has its request cancelled on the target; a request
that arrives during the freeze is served by the target (it travels in the image), one that arrives after the final
image by the source; a rollback (take-back) leaves every stream on the source.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from llm_support import LLMProc, engine_stats, start_llm_servers, wait_for

from gpumigrate.snapshot.client import AgentClient
from gpumigrate.transfer import generate_key

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


IMAGE_KEY = {"env": "GM_TEST_IMAGE_KEY"}


@dataclass
class Pair:
    source: LLMProc
    target: LLMProc
    key: bytes
    store: str

    def stop(self) -> None:
        for srv in (self.source, self.target):
            srv.stop()


def _pair(tmp_path: Path) -> Pair:
    key = secrets.token_hex(32)
    source, target = start_llm_servers(
        [
            (("--name", "source"), tmp_path / "a"),
            (("--await-restore", "--claim-timeout-s", "3", "--name", "target"), tmp_path / "b"),
        ],
        key_hex=key,
        env={"GM_TEST_IMAGE_KEY": generate_key()},
    )
    return Pair(source, target, bytes.fromhex(key), f"file://{tmp_path / 'store'}")


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    p = _pair(tmp_path)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def control(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLMProc]:
    """An unmigrated server: the control run's answers."""
    (server,) = start_llm_servers([((), tmp_path_factory.mktemp("control"))], key_hex=secrets.token_hex(32))
    yield server
    server.stop()


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


def _freeze_and_capture(p: Pair, src: AgentClient, tgt: AgentClient) -> str:
    """One live round pre-loaded into the target, then the freeze and the final round (the work sealed): its image."""
    first = src.request_precopy(p.store, IMAGE_KEY)
    tgt.request_restore(p.store, first.image.id, IMAGE_KEY, ready=False)
    src.request_freeze(lease_s=120)
    return src.request_final(p.store, IMAGE_KEY).image.id


def test_streams_continue_through_the_hand_over(pair: Pair, control: LLMProc) -> None:
    expected = _control(control.url, range(10))
    leave = threading.Event()
    clients = [Client(pair.source.url, PROMPTS[i], _params(i), leave if i == 7 else None).start() for i in range(8)]
    wait_for(lambda: _all_streaming(clients), "every stream to be under way on the source")
    with AgentClient(pair.source.agent, key=pair.key) as src, AgentClient(pair.target.agent, key=pair.key) as tgt:
        src.request_freeze(lease_s=120)  # frozen between two decode steps: a request that arrives now waits inside
        during = Client(pair.source.url, PROMPTS[8], _params(8)).start()
        leave.set()  # client 7 leaves while the engine is stopped
        wait_for(lambda: clients[7].done.is_set(), "client 7 to close its stream")
        wait_for(lambda: len(engine_stats(pair.source.url)["arrived"]) == 1, "request 8 to arrive")
        image = _freeze_and_capture(pair, src, tgt)
        held = engine_stats(pair.source.url)["aside"]
        assert len(held) == 9  # 8 running (client 7's, cancelled, too) and request 8 in the inbox
        src.request_resume()  # the source serves new requests; its work waits aside for the hand-over
        after = Client(pair.source.url, PROMPTS[9], _params(9)).start()
        restored = tgt.request_restore(pair.store, image, IMAGE_KEY)
        assert restored.ready and restored.chunks_skipped > 0  # pre-loaded: only the final delta loads
        handed = src.request_hand_over(pair.target.url)
        assert handed["handed_over"] is True and handed["figures"]["moved"] == 9

    for c in [*clients, during, after]:
        assert c.done.wait(180), "a stream did not end"
    for i, c in enumerate([*clients[:7], during, after]):
        i = {id(during): 8, id(after): 9}.get(id(c), i)
        assert c.error is None, f"client {i}: {c.error!r}"
        assert c.text == expected[i], f"client {i}'s text differs from the control run's"
        assert c.finish == "length" and c.usage.completion_tokens == TOKENS
    assert len(clients[7].text) < len(expected[7])
    assert after.request_id not in held  # served by the source's own engine
    # The request whose client left is never claimed by a relay: the target cancels it and frees its slot.
    wait_for(lambda: not engine_stats(pair.target.url)["running"], "the target's slots to be free", 60)
    assert engine_stats(pair.source.url)["relaying"] == 0


def test_a_rollback_takes_every_stream_back_to_the_source(pair: Pair, control: LLMProc) -> None:
    expected = _control(control.url, range(5))
    clients = [Client(pair.source.url, PROMPTS[i], _params(i)).start() for i in range(4)]
    wait_for(lambda: _all_streaming(clients), "every stream to be under way on the source")
    with AgentClient(pair.source.agent, key=pair.key) as src, AgentClient(pair.target.agent, key=pair.key) as tgt:
        _freeze_and_capture(pair, src, tgt)
        late = Client(pair.source.url, PROMPTS[4], _params(4)).start()  # after the final image: the source's own
        src.request_resume()
        assert src.request_take_back()["taken_back"] is True  # the migration gives up before the hand-over
        assert src.request_hand_over(pair.target.url)["handed_over"] is False
    for i, c in enumerate([*clients, late]):
        assert c.done.wait(180) and c.error is None, f"client {i}: {c.error!r}"
        assert c.text == expected[i] and c.finish == "length"
    assert engine_stats(pair.source.url)["moved_to"] is None


def test_the_continuation_endpoint_wants_the_control_key(pair: Pair) -> None:
    from gpumigrate import control as ctl
    from gpumigrate.workloads.llm import handover

    target = pair.target
    wrong = ctl.sign_request(secrets.token_bytes(32), handover.CHANNEL, {"request_id": "x", "offset": 0})
    r = httpx.post(target.url + handover.PATH, json=wrong, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"
    r = httpx.post(target.url + handover.PATH, json={"request_id": "x", "offset": 0}, timeout=30)
    assert r.status_code == 401
    signed = ctl.sign_request(pair.key, handover.CHANNEL, {"request_id": "cmpl-none", "offset": 0})
    assert httpx.post(target.url + handover.PATH, json=signed, timeout=30).status_code == 404

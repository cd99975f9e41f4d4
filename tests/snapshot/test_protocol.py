"""The control protocol over a real TCP socket: framing, typed errors, and the client's mapping of them."""

from __future__ import annotations

import json
import socket

import pytest
import torch

from gpumigrate import control
from gpumigrate.agent.images import make_engine
from gpumigrate.errors import InvalidInputError, NotFoundError, SnapshotError
from gpumigrate.snapshot.client import AgentClient, parse_address
from gpumigrate.snapshot.errors import ImageMismatchError
from gpumigrate.snapshot.server import AgentServer, serve


@pytest.fixture
def served():
    agent = make_engine()
    agent.track_tensor("t", torch.arange(1000, dtype=torch.float32))
    server = serve(agent, 0)
    _servers[server.address] = server
    yield agent, server.address
    server.stop()
    agent.close()


def _raw(address: str, *lines: bytes) -> list[dict]:
    host, port = parse_address(address)
    with socket.create_connection((host, port), timeout=10) as s:
        f = s.makefile("rwb")
        for line in lines:
            f.write(line)
        f.flush()
        return [json.loads(f.readline()) for _ in lines]


_servers: dict[str, AgentServer] = {}


def _signed(key: bytes, audience: str, request: dict) -> tuple[bytes, str]:
    message = control.sign_request(key, "agent", request, audience=audience)
    return (json.dumps(message) + "\n").encode(), message["auth"]["nonce"]


def test_framing_and_typed_errors(served) -> None:
    _, address = served
    server = _servers[address]
    key = server.key  # the agent's own key, derived from the deployment's (gpumigrate/agent_keys.py)
    requests = [
        {"id": 1, "cmd": "ping"},
        {"id": 3, "cmd": "explode"},
        {"id": 4, "cmd": "precopy", "args": {"key_ref": {"env": "X"}}},
        {"id": 5, "cmd": "info"},
    ]
    signed = [_signed(key, server.identity.audience, r) for r in requests]
    raw = _raw(address, signed[0][0], b"not json\n", *(line for line, _ in signed[1:]))
    assert raw[1]["ok"] is False and "not JSON" in raw[1]["error"]["message"] and "auth" not in raw[1]
    assert raw[1]["error"]["type"] == "MalformedRequest"
    # Every reply to a signed request is signed, bound to that request's nonce.
    replies = [
        control.verify_reply(key, "agent", nonce, r) for (_, nonce), r in zip(signed, raw[:1] + raw[2:], strict=True)
    ]
    assert replies[0] == {"id": 1, "ok": True, "result": {"pong": True}}
    assert replies[1]["error"]["type"] == "SnapshotError" and "allowed are" in replies[1]["error"]["message"]
    assert "needs argument 'store'" in replies[2]["error"]["message"]
    assert replies[3]["id"] == 5 and replies[3]["result"]["bytes_total"] == 4000  # same connection, in order


def test_client_raises_the_matching_error_classes(served, key_env, store_url) -> None:
    agent, address = served
    with AgentClient(address) as c:
        with pytest.raises(SnapshotError, match="freeze first"):
            c.request_final(store_url, key_env)
        with pytest.raises(SnapshotError, match="never over the wire"):
            c.call("restore", store=store_url, image_id="x", key_ref={"key": "00"})
        c.request_freeze()
        image = c.request_final(store_url, key_env).image.id
        c.request_resume()
        with pytest.raises(NotFoundError):
            c.request_restore(store_url, "f" * 64, key_env)
    other = make_engine()
    other.track_tensor("t", torch.zeros(999))
    server = serve(other, 0)
    try:
        with (
            AgentClient(server.address) as c,
            pytest.raises(ImageMismatchError, match=r"\[1000\], model float32\[999\] .*allocate state that grows"),
        ):
            c.request_restore(store_url, image, key_env)
    finally:
        server.stop()
    with pytest.raises(InvalidInputError, match="HOST:PORT"):
        AgentClient("nowhere")

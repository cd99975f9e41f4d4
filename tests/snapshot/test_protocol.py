"""The control protocol over a real TCP socket: framing, typed errors, and the client's mapping of them."""

from __future__ import annotations

import json
import socket

import pytest
import torch

from gpumigrate.errors import InvalidInputError, NotFoundError, SnapshotError
from gpumigrate.snapshot.client import AgentClient, parse_address
from gpumigrate.snapshot.errors import ImageMismatchError
from gpumigrate.snapshot.server import serve
from gpumigrate.workloads.agent_hook import make_agent


@pytest.fixture
def served():
    agent = make_agent()
    agent.track_tensor("t", torch.arange(1000, dtype=torch.float32))
    server = serve(agent, 0)
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


def test_framing_and_typed_errors(served) -> None:
    _, address = served
    replies = _raw(
        address,
        b'{"id": 1, "cmd": "ping"}\n',
        b"not json\n",
        b'{"id": 3, "cmd": "explode"}\n',
        b'{"id": 4, "cmd": "precopy", "args": {"key_ref": {"env": "X"}}}\n',
        b'{"id": 5, "cmd": "info"}\n',
    )
    assert replies[0] == {"id": 1, "ok": True, "result": {"pong": True}}
    assert replies[1]["ok"] is False and "not JSON" in replies[1]["error"]["message"]
    assert replies[2]["error"]["type"] == "SnapshotError" and "allowed are" in replies[2]["error"]["message"]
    assert "needs argument 'store'" in replies[3]["error"]["message"]
    assert replies[4]["id"] == 5 and replies[4]["result"]["bytes_total"] == 4000  # same connection, in order


def test_client_raises_the_matching_error_classes(served, key_env, store_url) -> None:
    agent, address = served
    with AgentClient(address) as c:
        with pytest.raises(SnapshotError, match="freeze first"):
            c.final(store_url, key_env)
        with pytest.raises(SnapshotError, match="never over the wire"):
            c.call("restore", store=store_url, image_id="x", key_ref={"key": "00"})
        c.freeze()
        image = c.final(store_url, key_env).image.id
        c.resume()
        with pytest.raises(NotFoundError):
            c.restore(store_url, "f" * 64, key_env)
    other = make_agent()
    other.track_tensor("t", torch.zeros(999))
    server = serve(other, 0)
    try:
        with (
            AgentClient(server.address) as c,
            pytest.raises(ImageMismatchError, match=r"\[1000\], model float32\[999\]"),
        ):
            c.restore(store_url, image, key_env)
    finally:
        server.stop()
    with pytest.raises(InvalidInputError, match="HOST:PORT"):
        AgentClient("nowhere")

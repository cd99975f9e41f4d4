"""The agent's control channel authenticates every request and signs every reply (gpumigrate/CONTROL.md).

Each attack is tried over a real socket: nothing it asks for happens, and the agent records it
(counted; the last refusals in ``info``, without their arguments).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gpumigrate import agent_keys, control
from gpumigrate.agent.images import make_engine
from gpumigrate.snapshot.client import AgentClient, parse_address
from gpumigrate.snapshot.server import AgentServer, serve
from gpumigrate.snapshot.stepgate import SafePointGate

SECRET_ARG = "s3://attacker-bucket/exfil"


@pytest.fixture
def served() -> Iterator[tuple[Any, AgentServer, torch.Tensor]]:
    gate = SafePointGate()
    agent = make_engine(freezer=gate)
    weights = torch.arange(1, 1001, dtype=torch.float32)
    agent.track_tensor("w", weights)
    server = serve(agent, 0)
    yield agent, server, weights
    server.stop()
    agent.close()


def _send(address: str, message: dict[str, Any] | bytes) -> dict[str, Any]:
    host, port = parse_address(address)
    raw = message if isinstance(message, bytes) else (json.dumps(message) + "\n").encode()
    with socket.create_connection((host, port), timeout=10) as s:
        f = s.makefile("rwb")
        f.write(raw)
        f.flush()
        return json.loads(f.readline())


def _refused(reply: dict[str, Any], why: str) -> None:
    assert reply["ok"] is False and reply["error"]["type"] == "AuthError", reply
    assert why in reply["error"]["message"], reply
    assert "auth" not in reply  # a refusal is never signed: the caller cannot be trusted with a signature


def test_unauthenticated_commands_are_refused_and_recorded(served) -> None:
    agent, server, weights = served
    attacks = {
        "freeze": {},
        "zeroize": {},
        "restore": {"store": SECRET_ARG, "image_id": "0" * 64, "key_ref": {}},
        "precopy": {"store": SECRET_ARG, "key_ref": {}},
    }
    for cmd, args in attacks.items():
        _refused(_send(server.address, {"id": 1, "cmd": cmd, "args": args}), "no signature")
    assert not agent.frozen and torch.equal(weights, torch.arange(1, 1001, dtype=torch.float32))
    assert agent.rounds == 0 and agent.last_image is None  # nothing was shipped anywhere
    with AgentClient(server.address) as c:
        info = c.request_info()
    auth = info.auth
    assert auth["refused"] == 4 and [r["cmd"] for r in auth["last_refused"]] == list(attacks)
    assert all(r["peer"].startswith("127.0.0.1:") and "no signature" in r["reason"] for r in auth["last_refused"])
    assert SECRET_ARG not in json.dumps(dataclasses.asdict(info), default=str)  # refusals kept without arguments
    # The agent's own key, derived from the deployment's for its id: never the deployment's key itself.
    assert auth["key_id"] == control.key_id(agent_keys.agent_key(control.load_key(), auth["agent"]))
    assert auth["key_id"] != control.key_id(control.load_key()) and auth["epoch"] == server.identity.epoch


def test_forged_altered_replayed_stale_and_cross_channel_requests_are_refused(served) -> None:
    agent, server, _ = served
    key, aud = server.key, server.identity.audience
    other = bytes(32)
    forged = control.sign_request(other, "agent", {"id": 1, "cmd": "freeze"}, audience=aud)
    _refused(_send(server.address, forged), "bad signature")
    signed = control.sign_request(key, "agent", {"id": 2, "cmd": "ping"}, audience=aud)
    altered = {**signed, "cmd": "zeroize"}
    _refused(_send(server.address, altered), "bad signature")
    cross = control.sign_request(key, "receiver", {"id": 3, "cmd": "freeze"}, audience=aud)
    _refused(_send(server.address, cross), "bad signature")
    stale = control.sign_request(key, "agent", {"id": 4, "cmd": "freeze"}, audience=aud)
    stale["auth"] = {**stale["auth"], "ts": stale["auth"]["ts"] - 600}
    _refused(_send(server.address, stale), "timestamp")
    first = _send(server.address, signed)
    assert control.verify_reply(key, "agent", signed["auth"]["nonce"], first)["result"] == {"pong": True}
    _refused(_send(server.address, signed), "replayed")
    # Signed with the deployment's key itself, or naming no agent: both void (the agent holds its own key).
    _refused(
        _send(
            server.address, control.sign_request(control.load_key(), "agent", {"id": 5, "cmd": "freeze"}, audience=aud)
        ),
        "bad signature",
    )
    _refused(_send(server.address, control.sign_request(key, "agent", {"id": 6, "cmd": "freeze"})), "names no server")
    assert not agent.frozen
    assert server.auth_report()["refused"] == 7


def test_the_client_refuses_replies_it_cannot_verify(served) -> None:
    _, server, _ = served
    with pytest.raises(control.AuthError, match="refused 'ping'"):
        AgentClient(server.address, key=bytes(range(32))).call("ping")  # another key: the agent refuses it

    # An impostor on the agent's address: its hello unsigned, or signed with a key of its own; or a hello it
    # relays from the real agent, then a reply to the command that it makes up (unsigned, or signed by the
    # real agent's hello, which is another kind of message and never passes for a reply).
    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    impostor_key = bytes(32)

    def impostor() -> None:
        for how in ("unsigned", "own key", "relayed hello, hello as reply"):
            conn, _ = listener.accept()
            with conn, conn.makefile("rwb") as f:
                hello = json.loads(f.readline())
                answer: dict[str, Any] = {"id": 0, "ok": True, "result": {"agent": "agent-fake", "epoch": "0" * 16}}
                if how == "own key":
                    answer = control.sign_hello(impostor_key, "agent", hello["challenge"], answer)
                if how.startswith("relayed"):
                    answer = _send(server.address, hello)
                f.write((json.dumps(answer) + "\n").encode())
                f.flush()
                line = f.readline()
                if not line:
                    continue
                req = json.loads(line)
                forged = _send(server.address, {**hello, "challenge": req["auth"]["nonce"]})
                f.write((json.dumps({**forged, "id": req["id"]}) + "\n").encode())
                f.flush()

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    for _ in range(3):
        with AgentClient(address) as c, pytest.raises(control.AuthError):
            c.call("freeze")
    t.join(10)
    listener.close()


def test_cli_with_another_key_fails_with_one_line(served, cli_cmd, tmp_path, monkeypatch) -> None:
    _, server, _ = served
    keyfile = tmp_path / "other.key"
    keyfile.write_text("ab" * 32 + "\n")
    keyfile.chmod(0o600)
    out = subprocess.run(
        [*cli_cmd, "snapshot", "freeze", "--agent", server.address],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "GPUMIGRATE_CONTROL_KEY_FILE": str(keyfile)},
    )
    assert out.returncode != 0 and "refused 'freeze'" in out.stderr and "Traceback" not in out.stderr
    assert not served[0].frozen


def test_the_sdk_listens_on_loopback_by_default(monkeypatch) -> None:
    from gpumigrate.agent.handle import agent_address

    monkeypatch.delenv("GPUMIGRATE_AGENT_ADDR", raising=False)
    assert agent_address() == ("127.0.0.1", 7070)

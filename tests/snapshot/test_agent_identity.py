"""Each agent its own identity and key (gpumigrate/agent_keys.py, CONTROL.md): attacks by someone who holds no
key but watches loopback traffic, and by a target that holds its own agent key only.

Two real agents over real sockets, one deployment key; the orchestrator's requests pass through a capturing
relay (``tests/support/relay.py``), and what it caught is replayed where it must be void.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gpumigrate import agent_keys, control
from gpumigrate.agent.images import make_engine
from gpumigrate.snapshot.client import AgentClient
from gpumigrate.snapshot.server import AgentServer, serve
from gpumigrate.snapshot.stepgate import SafePointGate
from tests.support.relay import Relay, send_lines


def _agent(**kw: Any) -> tuple[Any, AgentServer, torch.Tensor]:
    engine = make_engine(freezer=SafePointGate())
    weights = torch.arange(1, 1001, dtype=torch.float32)
    engine.track_tensor("w", weights)
    return engine, serve(engine, 0, **kw), weights


@pytest.fixture
def pair(gm_home: Path) -> Iterator[dict[str, Any]]:
    """A source (the deployment's key, the user's way) and a target started with its agent key file only."""
    root = control.load_key(create=True)
    key_file = agent_keys.write_agent_key_file(gm_home / "t.key", root, agent_keys.target_agent_id("m-1"))
    agent, key = agent_keys.read_agent_key_file(key_file)
    src_engine, src, src_w = _agent()
    tgt_engine, tgt, tgt_w = _agent(identity=agent_keys.AgentIdentity(agent, key))
    relay = Relay(src.address)
    yield {"src": src, "tgt": tgt, "src_engine": src_engine, "tgt_engine": tgt_engine, "relay": relay, "tgt_w": tgt_w}
    relay.close()
    for server, engine in ((src, src_engine), (tgt, tgt_engine)):
        server.stop()
        engine.close()


def _refusal(reply: dict[str, Any], why: str) -> None:
    assert reply["ok"] is False and reply["error"]["type"] == "AuthError" and "auth" not in reply, reply
    assert why in reply["error"]["message"], reply


def test_a_captured_freeze_and_zeroize_are_void_at_another_agent(pair: dict[str, Any]) -> None:
    src, tgt, relay = pair["src"], pair["tgt"], pair["relay"]
    with AgentClient(relay.address) as orchestrator:  # the orchestrator's own traffic to the source, watched
        orchestrator.request_freeze(lease_s=30)
        orchestrator.request_resume()
        orchestrator.request_zeroize()
    caught = relay.requests("freeze") + relay.requests("zeroize")
    assert len(caught) == 2
    for line in caught:
        _refusal(send_lines(tgt.address, line)[0], f"is for '{src.identity.agent}', not this server")
        _refusal(send_lines(src.address, line)[0], "replayed")
    assert not pair["tgt_engine"].frozen
    assert torch.equal(pair["tgt_w"], torch.arange(1, 1001, dtype=torch.float32))  # the target kept its memory
    assert tgt.auth_report()["refused"] == 2


def test_a_target_cannot_answer_or_ask_as_its_source(pair: dict[str, Any]) -> None:
    src, tgt = pair["src"], pair["tgt"]
    # Toward the orchestrator: at the source's address, an agent with a target's id is refused (the target holds
    # its own key, so it can only sign as itself).
    with AgentClient(tgt.address, source=True) as c, pytest.raises(control.AuthError, match="a migration's target"):
        c.call("ping")
    with AgentClient(tgt.address, agent="agent-of-the-source") as c, pytest.raises(control.AuthError, match="not"):
        c.call("ping")
    # Toward the source: its key signs nothing the source accepts.
    forged = control.sign_request(tgt.key, "agent", {"id": 1, "cmd": "freeze"}, audience=src.identity.audience)
    _refusal(send_lines(src.address, (json.dumps(forged) + "\n").encode())[0], "bad signature")
    assert not pair["src_engine"].frozen
    # The orchestrator pins the target it started, and reaches it.
    with AgentClient(tgt.address, agent=tgt.identity.agent) as c:
        assert c.call("ping") == {"pong": True}


def test_a_lend_grant_opens_lend_only_and_only_for_the_agent_it_was_sealed_to(pair: dict[str, Any]) -> None:
    src, tgt = pair["src"], pair["tgt"]
    with AgentClient(tgt.address) as orchestrator:
        grant = orchestrator.lend_grant(src.address)
    assert grant["source"] == src.identity.audience
    label = agent_keys.grant_label(grant["source"], tgt.identity.agent)
    lend_key = agent_keys.unseal(tgt.key, label, grant["sealed"])
    assert lend_key == src.lend_key
    assert agent_keys.unseal(src.key, label, grant["sealed"]) == b""  # sealed to the target's key, no other
    with AgentClient(src.address, lend_key=lend_key) as granted:
        for cmd in ("freeze", "zeroize", "ping", "info"):
            with pytest.raises(control.AuthError, match="opens lend only"):
                granted.call(cmd)
        with pytest.raises(Exception, match="landing"):  # lend itself is let through, to its argument checks
            granted.call("lend", runs=[["w", 0, 1]], chunk_size=4096)
    assert not pair["src_engine"].frozen


def test_agent_key_files_and_ids_are_checked(gm_home: Path) -> None:
    from gpumigrate.errors import InvalidInputError

    root = bytes(range(32))
    path = agent_keys.write_agent_key_file(gm_home / "a.key", root, "job")
    assert path.stat().st_mode & 0o777 == 0o600
    agent, key = agent_keys.read_agent_key_file(path)
    assert (agent, key) == ("job", agent_keys.agent_key(root, "job"))
    assert agent_keys.AgentIdentity("job", key).rank(1).key == agent_keys.agent_key(root, "job/r1")
    assert agent_keys.agent_key(root, "job") != agent_keys.agent_key(root, "jo") != root
    path.chmod(0o644)
    with pytest.raises(InvalidInputError, match="readable by others"):
        agent_keys.read_agent_key_file(path)
    for bad in ("", "a b", "../x", "x/" * 5 + "x", "-x", "x" * 65):
        with pytest.raises(InvalidInputError, match="not an agent id"):
            agent_keys.check_id(bad)

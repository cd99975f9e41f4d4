"""The control channels' signatures (gpumigrate/control.py, spec in gpumigrate/CONTROL.md)."""

from __future__ import annotations

import os
import stat

import pytest

from gpumigrate import control
from gpumigrate.errors import InvalidInputError

KEY = bytes(range(32))


def test_a_signed_request_verifies_once_and_its_reply_binds_to_it() -> None:
    guard = control.ReplayGuard()
    msg = control.sign_request(KEY, "agent", {"id": 1, "cmd": "freeze", "args": {}})
    body, nonce = control.verify_request(KEY, "agent", msg, guard)
    assert body == {"id": 1, "cmd": "freeze", "args": {}}
    with pytest.raises(control.AuthError, match="replayed"):
        control.verify_request(KEY, "agent", msg, guard)
    reply = control.sign_reply(KEY, "agent", nonce, {"id": 1, "ok": True})
    assert control.verify_reply(KEY, "agent", nonce, reply) == {"id": 1, "ok": True}
    with pytest.raises(control.AuthError):
        control.verify_reply(KEY, "agent", "another-request", reply)


@pytest.mark.parametrize(
    "tamper",
    [
        lambda m: m.pop("auth"),
        lambda m: m.__setitem__("cmd", "zeroize"),
        lambda m: m["auth"].__setitem__("mac", "0" * 64),
        lambda m: m["auth"].__setitem__("ts", m["auth"]["ts"] - 3600),
        lambda m: m["auth"].__setitem__("v", 2),
        lambda m: m.__setitem__("auth", "x"),
    ],
)
def test_unsigned_altered_stale_or_malformed_requests_are_refused(tamper) -> None:
    msg = control.sign_request(KEY, "agent", {"id": 1, "cmd": "freeze", "args": {}})
    tamper(msg)
    with pytest.raises(control.AuthError):
        control.verify_request(KEY, "agent", msg, control.ReplayGuard())


def test_a_request_for_one_channel_or_key_is_void_elsewhere() -> None:
    msg = control.sign_request(KEY, "agent", {"cmd": "list"})
    with pytest.raises(control.AuthError):
        control.verify_request(KEY, "receiver", msg, control.ReplayGuard())
    with pytest.raises(control.AuthError, match="different control key"):
        control.verify_request(bytes(32), "agent", msg, control.ReplayGuard())


def test_the_default_key_is_created_private_once_and_shared(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GPUMIGRATE_HOME", str(tmp_path))
    monkeypatch.delenv(control.KEY_ENV, raising=False)
    monkeypatch.delenv(control.KEY_FILE_ENV, raising=False)
    with pytest.raises(InvalidInputError, match="no control key"):
        control.load_key()
    first = control.load_key(create=True)
    assert control.load_key() == first and len(first) == 32
    path = tmp_path / "control.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert control.key_reference() == {"file": str(path)}
    os.chmod(path, 0o644)
    with pytest.raises(InvalidInputError, match="readable by others"):
        control.load_key()


def test_key_references_resolve_and_bad_keys_name_the_problem(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MY_KEY", KEY.hex())
    assert control.load_key({"env": "MY_KEY"}) == KEY
    assert control.reference_env({"env": "MY_KEY"}) == {control.KEY_ENV: KEY.hex()}
    monkeypatch.setenv("MY_KEY", "not hex")
    with pytest.raises(InvalidInputError, match="not hex"):
        control.load_key({"env": "MY_KEY"})
    monkeypatch.setenv("MY_KEY", "abcd")
    with pytest.raises(InvalidInputError, match="at least 16"):
        control.load_key({"env": "MY_KEY"})
    with pytest.raises(InvalidInputError, match="not set"):
        control.load_key({"env": "UNSET_KEY_VARIABLE"})
    assert control.key_id(KEY) != control.key_id(bytes(32)) and KEY.hex() not in control.key_id(KEY)

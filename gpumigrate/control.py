"""Authenticated control channels: HMAC-signed requests and replies, with replay protection.

Every control channel of gpumigrate (the snapshot agent inside a workload, the image receiver on a
target, host actions) carries JSON objects. The caller signs each request with the deployment's
*control key*; the server verifies the signature, the timestamp (within ``MAX_SKEW_S``) and that
the nonce was not seen before, and signs its reply bound to the request's nonce, so neither side
accepts a message forged, altered, replayed or meant for another channel. The wire format is
specified in ``gpumigrate/CONTROL.md``.

Why our own HMAC scheme rather than mutual TLS: the channels are line-delimited JSON over plain
TCP between processes that already share a secret by reference (env var or file), and HMAC keeps
the agent inside a user's process free of certificate management. Confidentiality of the payload
is not needed on these channels: they carry commands and identifiers, never keys or tensor bytes
(images are AEAD-sealed by the transfer engine).

The key is never sent and never logged; :func:`key_id` names it by a short digest.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpumigrate.errors import GpumigrateError, InvalidInputError
from gpumigrate.settings import state_root

KEY_ENV = "GPUMIGRATE_CONTROL_KEY"  # the key itself, 64 hex digits (for processes started with it)
KEY_FILE_ENV = "GPUMIGRATE_CONTROL_KEY_FILE"  # a file holding the key (hex, one line)
DEFAULT_KEY_FILE = "control.key"  # under the state root; made 0600 on first use
MAX_SKEW_S = 60.0
VERSION = 1
_DOMAIN = b"gpumigrate-control-v1\n"
KEY_BYTES = 32


class AuthError(GpumigrateError):
    """A control message failed authentication (no signature, wrong key, stale, replayed)."""


# ----------------------------------------------------------------------------- keys
def _parse_key(text: str, where: str) -> bytes:
    raw = text.strip()
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        raise InvalidInputError(f"the control key in {where} is not hex: write {KEY_BYTES * 2} hex digits") from None
    if len(key) < 16:
        raise InvalidInputError(f"the control key in {where} is {len(key)} bytes: at least 16 are needed (32 advised)")
    return key


def default_key_file() -> Path:
    return state_root() / DEFAULT_KEY_FILE


def load_key(ref: Mapping[str, str] | None = None, *, create: bool = False) -> bytes:
    """The control key from its reference: ``{"env": NAME}`` or ``{"file": PATH}``.

    Without a reference: ``$GPUMIGRATE_CONTROL_KEY``, else the file ``$GPUMIGRATE_CONTROL_KEY_FILE``,
    else ``<state root>/control.key`` — created (0600, atomically) when ``create`` is true, so that a
    workload and the orchestrator sharing one state root share one key with no set-up.
    """
    if ref:
        if ref.get("env"):
            name = ref["env"]
            value = os.environ.get(name)
            if not value:
                raise InvalidInputError(f"the control key's environment variable {name} is not set")
            return _parse_key(value, f"${name}")
        if ref.get("file"):
            return _read_key_file(Path(ref["file"]))
        raise InvalidInputError('a control key reference is {"env": NAME} or {"file": PATH}')
    if os.environ.get(KEY_ENV):
        return _parse_key(os.environ[KEY_ENV], f"${KEY_ENV}")
    if os.environ.get(KEY_FILE_ENV):
        return _read_key_file(Path(os.environ[KEY_FILE_ENV]))
    path = default_key_file()
    if not path.exists() and create:
        _create_key_file(path)
    return _read_key_file(path)


def key_reference(ref: Mapping[str, str] | None = None) -> dict[str, str]:
    """How a process we start finds the same key: a reference, never the key (for its environment)."""
    if ref:
        return dict(ref)
    if os.environ.get(KEY_ENV):
        return {"env": KEY_ENV}
    if os.environ.get(KEY_FILE_ENV):
        return {"file": os.environ[KEY_FILE_ENV]}
    return {"file": str(default_key_file())}


def reference_env(ref: Mapping[str, str]) -> dict[str, str]:
    """Environment variables that make a child process resolve ``ref`` (the env var's value is inherited)."""
    if ref.get("file"):
        return {KEY_FILE_ENV: ref["file"]}
    if ref.get("env") and ref["env"] != KEY_ENV and os.environ.get(ref["env"]):
        # The child reads KEY_ENV; it inherits the named variable's value only through its own environment.
        return {KEY_ENV: os.environ[ref["env"]]}
    return {}


def _read_key_file(path: Path) -> bytes:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InvalidInputError(
            f"no control key at {path}: write {KEY_BYTES * 2} hex digits there (mode 600), "
            f"or set {KEY_ENV} or {KEY_FILE_ENV}"
        ) from None
    except OSError as exc:
        raise InvalidInputError(f"cannot read the control key {path}: {exc.strerror}") from None
    mode = path.stat().st_mode & 0o077
    if mode:
        raise InvalidInputError(f"the control key {path} is readable by others (mode {oct(mode)}): chmod 600 it")
    return _parse_key(text, str(path))


def _create_key_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, (secrets.token_hex(KEY_BYTES) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # never replaces a key another process created first
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


def key_id(key: bytes) -> str:
    """A short public name for a key (which key, without revealing it)."""
    return hashlib.blake2b(key, digest_size=6, person=b"gm-keyid").hexdigest()


# ----------------------------------------------------------------------------- messages
def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str).encode()


def _mac(key: bytes, channel: str, kind: str, ts: float, nonce: str, body: Mapping[str, Any], bound: str = "") -> str:
    msg = _DOMAIN + f"{channel}\n{kind}\n{ts!r}\n{nonce}\n{bound}\n".encode() + _canonical(body)
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def sign_request(key: bytes, channel: str, body: Mapping[str, Any], *, audience: str = "") -> dict[str, Any]:
    """``body`` plus an ``auth`` member: ``{"v", "ts", "nonce", "mac"}``, and ``"aud"`` when the request is for
    one server only (``audience``: its identity, e.g. an agent's ``id#epoch``), which the MAC then covers."""
    ts, nonce = time.time(), secrets.token_hex(16)
    auth: dict[str, Any] = {"v": VERSION, "ts": ts, "nonce": nonce}
    if audience:
        auth["aud"] = audience
    auth["mac"] = _mac(key, channel, "req", ts, nonce, body, bound=audience)
    return {**body, "auth": auth}


def sign_reply(key: bytes, channel: str, request_nonce: str, body: Mapping[str, Any]) -> dict[str, Any]:
    ts, nonce = time.time(), secrets.token_hex(16)
    mac = _mac(key, channel, "rep", ts, nonce, body, bound=request_nonce)
    return {**body, "auth": {"v": VERSION, "ts": ts, "nonce": nonce, "mac": mac}}


def _split(message: Mapping[str, Any]) -> tuple[dict[str, Any], Mapping[str, Any]]:
    auth = message.get("auth")
    if not isinstance(auth, Mapping):
        raise AuthError("unauthenticated: the message carries no signature (auth)")
    ts, nonce, mac = auth.get("ts"), auth.get("nonce"), auth.get("mac")
    if (
        auth.get("v") != VERSION
        or isinstance(ts, bool)
        or not isinstance(ts, int | float)
        or not math.isfinite(ts)
        or not isinstance(nonce, str)
        or not 16 <= len(nonce) <= 128
        or not isinstance(mac, str)
        or len(mac) != 64
    ):
        raise AuthError("unauthenticated: malformed signature")
    return {k: v for k, v in message.items() if k != "auth"}, auth


class ReplayGuard:
    """Nonces seen within the skew window; a nonce seen twice is a replay. Thread-safe, bounded."""

    def __init__(self, window_s: float = MAX_SKEW_S, max_entries: int = 200_000) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def check_and_add(self, nonce: str, now: float) -> None:
        with self._lock:
            if len(self._seen) > self.max_entries // 2:
                cutoff = now - 2 * self.window_s
                self._seen = {n: t for n, t in self._seen.items() if t >= cutoff}
            if nonce in self._seen:
                raise AuthError("unauthenticated: replayed request")
            if len(self._seen) >= self.max_entries:
                raise AuthError("busy: too many requests inside the replay window")
            self._seen[nonce] = now


def _audience_mismatch(named: str, mine: str) -> str:
    """Why a request named for ``named`` is void here (``mine``): another server, or an earlier start of this one."""
    if named.partition("#")[0] == mine.partition("#")[0]:
        return (
            "unauthenticated: the request is for an earlier start of this server (its epoch differs): "
            "a replay from before a restart"
        )
    return f"unauthenticated: the request is for {named.partition('#')[0][:80]!r}, not this server ({mine.partition('#')[0]})"


def verify_request(
    key: bytes, channel: str, message: Mapping[str, Any], guard: ReplayGuard, *, audience: str | None = None
) -> tuple[dict[str, Any], str]:
    """Check a signed request; return (body without ``auth``, the request's nonce). Raises AuthError.

    ``audience``: this server's identity; the request must name it (``auth.aud``) or it is refused, so a
    request captured on its way to one server is void on every other, and on this one after a restart."""
    body, auth = _split(message)
    named = auth.get("aud", "")
    if audience is not None:
        if not isinstance(named, str) or not named:
            raise AuthError("unauthenticated: the request names no server (auth.aud): sign it for this one")
        if named != audience:
            raise AuthError(_audience_mismatch(named, audience))
    elif named:
        raise AuthError("unauthenticated: the request names a server (auth.aud), and this channel has no identity")
    now = time.time()
    if abs(now - float(auth["ts"])) > guard.window_s:
        raise AuthError(f"unauthenticated: the request's timestamp is more than {guard.window_s:.0f}s off this clock")
    expected = _mac(key, channel, "req", float(auth["ts"]), str(auth["nonce"]), body, bound=str(named))
    if not hmac.compare_digest(expected, str(auth["mac"])):
        raise AuthError("unauthenticated: bad signature (a different control key, or an altered request)")
    guard.check_and_add(str(auth["nonce"]), now)
    return body, str(auth["nonce"])


def sign_hello(key: bytes, channel: str, challenge: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """A server's answer to a client's ``hello`` (who it is), signed and bound to the client's challenge. Its own
    kind ("hello"), so it can never pass for the reply to a command."""
    ts, nonce = time.time(), secrets.token_hex(16)
    mac = _mac(key, channel, "hello", ts, nonce, body, bound=challenge)
    return {**body, "auth": {"v": VERSION, "ts": ts, "nonce": nonce, "mac": mac}}


def verify_hello(key: bytes, channel: str, challenge: str, message: Mapping[str, Any]) -> dict[str, Any]:
    """Check a server's ``hello`` answer to ``challenge``; return its body. Raises AuthError."""
    body, auth = _split(message)
    expected = _mac(key, channel, "hello", float(auth["ts"]), str(auth["nonce"]), body, bound=challenge)
    if not hmac.compare_digest(expected, str(auth["mac"])):
        raise AuthError("the server's hello failed authentication: it does not hold the key of the identity it claims")
    return body


class RefusalLog:
    """Refusals logged at most ``burst`` lines per ``window_s``; the rest counted and summed up in one line when
    the next window opens. A peer that sends junk as fast as it can grows the log by a few lines a window, not by
    a line per junk line (the counters keep the true numbers). Thread-safe."""

    def __init__(self, logger: logging.Logger, *, burst: int = 10, window_s: float = 10.0) -> None:
        self.logger = logger
        self.burst = burst
        self.window_s = window_s
        self._lock = threading.Lock()
        self._window_start = -math.inf
        self._logged = 0
        self._suppressed = 0

    def warning(self, fmt: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._window_start >= self.window_s:
                suppressed, self._suppressed = self._suppressed, 0
                self._window_start, self._logged = now, 0
                if suppressed:
                    self.logger.warning(
                        "%d more refusals were not logged in the last %.0fs (rate limit)", suppressed, self.window_s
                    )
            if self._logged >= self.burst:
                self._suppressed += 1
                return
            self._logged += 1
        self.logger.warning(fmt, *args)


def verify_reply(key: bytes, channel: str, request_nonce: str, message: Mapping[str, Any]) -> dict[str, Any]:
    """Check a signed reply to the request whose nonce is ``request_nonce``; return its body."""
    body, auth = _split(message)
    expected = _mac(key, channel, "rep", float(auth["ts"]), str(auth["nonce"]), body, bound=request_nonce)
    if not hmac.compare_digest(expected, str(auth["mac"])):
        raise AuthError("the reply failed authentication: a different control key on the server, or an altered reply")
    return body

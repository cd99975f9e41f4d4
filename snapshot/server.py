"""The workload's side of the agent's control address: line-delimited JSON over TCP (see PROTOCOL.md).

One request per line, one response line per request, in order, on any number of connections.
Commands run one at a time inside the engine (its lock); ``ping``, ``renew`` and ``metrics`` answer
while a long command runs on another connection. Errors come back typed, never as tracebacks. What
each command does is ``server_commands.py``; the orchestrator's side is ``client.py``.

Every request must be signed with this agent's own key (``gpumigrate.agent_keys``, channel ``agent``) and
name this agent and its epoch (``id#epoch``); every reply is signed, bound to the request it answers. A
client learns who is there with an unsigned ``hello`` whose answer is signed and bound to the client's
challenge. A target's ``lend`` to its source is signed with the lend key the orchestrator granted it
(``grant`` in ``auth``), which opens ``lend`` and nothing else. A request that fails authentication, and
any line that is not a request at all (not UTF-8, not JSON, too deep, too long), is refused with a typed
answer and nothing done, counted, logged (at most a few lines per window: ``control.RefusalLog``) and kept
(without its arguments) among the last refusals that ``info`` shows; its reply is unsigned, so a client
without the key learns nothing it could trust.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socketserver
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from gpumigrate import agent_keys, control
from gpumigrate.errors import GpumigrateError, SnapshotError
from gpumigrate.snapshot.engine import SnapshotEngine
from gpumigrate.snapshot.gchold import gc_held
from gpumigrate.snapshot.server_commands import dispatch, key_ref_arg

MAX_LINE = 1 << 20
CHANNEL = "agent"
REFUSALS_KEPT = 20
GC_HELD_TO_REPLY = frozenset(
    {"freeze", "final", "confirmed", "lend", "restore", "ready", "hand_over"}
)  # commands whose reply is on the downtime's clock
GRANTED = frozenset({"lend"})  # what a lend key opens: a target asking its source for the bytes of a fill
MALFORMED = "MalformedRequest"
LINE_RULES = "a request is one line of UTF-8 JSON: an object, at most 1 MiB, nested at most 64 deep"
MAX_DEPTH = 64
log = logging.getLogger("gpumigrate.agent")


def _error(rid: Any, kind: str, message: str, hint: str | None = None) -> dict[str, Any]:
    return {"id": rid, "ok": False, "error": {"type": kind, "message": message, "hint": hint}}


def _echo_id(rid: Any) -> Any:
    """A refused request's id, echoed only when it is a small scalar (a refusal never carries a peer's payload)."""
    if isinstance(rid, bool) or rid is None:
        return None
    if isinstance(rid, int) and abs(rid) < 1 << 63:
        return rid
    return rid if isinstance(rid, str) and len(rid) <= 64 and rid.isprintable() else None


def _too_deep(line: bytes) -> bool:
    """More than MAX_DEPTH brackets open at once (counted outside strings): refused before the parser recurses."""
    depth, in_string, escaped = 0, False, False
    for byte in line:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            if depth > MAX_DEPTH:
                return True
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return False


def parse_line(line: bytes) -> dict[str, Any]:
    """One request line as a JSON object, or ValueError naming what is wrong with it (never anything else)."""
    if not line.endswith(b"\n") and len(line) >= MAX_LINE:
        raise ValueError("the line is longer than 1 MiB")
    if b"\x00" in line:
        raise ValueError("the line holds a NUL byte")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"the line is not UTF-8 (byte {exc.start})") from None
    if _too_deep(line):
        raise ValueError(f"the JSON nests deeper than {MAX_DEPTH}")
    try:
        req = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc.msg} at column {exc.colno}") from None
    except (ValueError, RecursionError) as exc:  # an integer past Python's digit limit, a pathological document
        raise ValueError(f"not JSON this agent reads: {str(exc)[:120]}") from None
    if not isinstance(req, dict):
        raise ValueError("a request is a JSON object")
    return req


class _Handler(socketserver.StreamRequestHandler):
    server: AgentServer

    def handle(self) -> None:
        while True:
            line = self.rfile.readline(MAX_LINE)
            if not line:
                return
            reply, nonce, body, key = self._answer(line)
            # The downtime's commands (a source's freeze, final round and lend; a target's restore) keep the cyclic
            # collector off (gchold.py) until their reply is out: the collection that their allocations made due (a
            # full one at times) runs after the reply, not before it.
            with gc_held() if body is not None and body.get("cmd") in GC_HELD_TO_REPLY else contextlib.nullcontext():
                if body is not None:
                    reply = self._run(reply["id"], body, granted=key is not self.server.key)
                if nonce is not None and key is not None:  # authenticated: the reply is signed, bound to the request
                    reply = control.sign_reply(key, CHANNEL, nonce, reply)
                self.wfile.write((json.dumps(reply, default=str) + "\n").encode())
                self.wfile.flush()
            if not line.endswith(b"\n"):  # the rest of an overlong line would read as more lines: hang up instead
                return

    def _answer(self, line: bytes) -> tuple[dict[str, Any], str | None, Mapping[str, Any] | None, bytes | None]:
        """(reply, nonce, body, key): a refusal's reply and no body; a hello's signed answer; or the request's id (in
        a reply to fill), its authenticated body and the key it was signed with (this agent's, or its lend key)."""
        server = self.server
        try:
            req = parse_line(line)
        except ValueError as exc:
            server.refuse(self.client_address, None, f"malformed line: {exc}")
            return _error(None, MALFORMED, f"{exc}: {LINE_RULES}"), None, None, None
        rid = _echo_id(req.get("id"))
        auth = req.get("auth")
        if req.get("cmd") == "hello" and auth is None:
            return self._hello(rid, req), None, None, None
        granted = isinstance(auth, Mapping) and auth.get("grant") is True
        key = server.lend_key if granted else server.key
        try:
            body, nonce = control.verify_request(key, CHANNEL, req, server.guard, audience=server.identity.audience)
            if granted and body.get("cmd") not in GRANTED:
                raise control.AuthError(f"unauthenticated: a lend key opens {', '.join(sorted(GRANTED))} only")
        except control.AuthError as exc:
            server.refuse(self.client_address, req.get("cmd"), exc.message)
            return (
                _error(rid, "AuthError", exc.message, "sign requests with the workload's control key"),
                None,
                None,
                None,
            )
        except Exception as exc:  # noqa: BLE001 - a body no canonical form can be made of: malformed, typed
            server.refuse(self.client_address, None, f"malformed request: {type(exc).__name__}")
            return _error(rid, MALFORMED, f"the request cannot be read: {LINE_RULES}"), None, None, None
        return {"id": rid}, nonce, body, key

    def _hello(self, rid: Any, req: Mapping[str, Any]) -> dict[str, Any]:
        """Who this agent is, signed and bound to the client's challenge (with the lend key for ``grant``)."""
        challenge = req.get("challenge")
        if not isinstance(challenge, str) or not 32 <= len(challenge) <= 128 or not challenge.isalnum():
            self.server.refuse(self.client_address, "hello", "malformed hello: no challenge of 32 to 128 letters")
            return _error(rid, MALFORMED, "hello needs a challenge: 32 to 128 letters or digits, fresh each time")
        key = self.server.lend_key if req.get("grant") is True else self.server.key
        body = {
            "id": rid,
            "ok": True,
            "result": {"agent": self.server.identity.agent, "epoch": self.server.identity.epoch},
        }
        return control.sign_hello(key, CHANNEL, challenge, body)

    def _run(self, rid: Any, req: Mapping[str, Any], *, granted: bool = False) -> dict[str, Any]:
        reply: dict[str, Any]
        try:
            args = req.get("args") or {}
            if not isinstance(args, Mapping):
                raise SnapshotError("args must be a JSON object")
            server = self.server
            result = dispatch(
                server.engine,
                str(req.get("cmd")),
                args,
                identity=server.identity,
                auth=server.auth_report,
                lend_key=server.lend_key if granted else None,
            )
            reply = {"id": rid, "ok": True, "result": result}
        except GpumigrateError as exc:
            reply = _error(rid, type(exc).__name__, exc.message, exc.hint)
        except Exception as exc:  # an engine bug must not kill the workload's control thread
            reply = _error(rid, "SnapshotError", f"agent failed: {type(exc).__name__}: {exc}")
        return reply


class AgentServer(socketserver.ThreadingTCPServer):
    """The control server of one engine, in the workload's process (a daemon thread per connection)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        engine: SnapshotEngine,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        key: bytes | None = None,
        identity: agent_keys.AgentIdentity | None = None,
    ) -> None:
        # The key first: a workload without one must not listen at all. ``key``: the deployment's control key, this
        # agent's own derived from it; ``identity``: this agent's own (an agent key file's); neither: loaded.
        if identity is None:
            identity = agent_keys.identity_from_root(key) if key is not None else agent_keys.load_identity(create=True)
        self.identity = identity
        self.key = identity.key  # this agent's own key: never the deployment's
        self.lend_key = identity.lend_key()
        self.guard = control.ReplayGuard()
        self.refusals = 0
        self._last_refusals: deque[dict[str, Any]] = deque(maxlen=REFUSALS_KEPT)
        self._refusal_lock = threading.Lock()
        self._log = control.RefusalLog(log)
        super().__init__((host, port), _Handler)
        self.engine = engine
        self._thread: threading.Thread | None = None

    def refuse(self, peer: Any, cmd: Any, reason: str) -> None:
        """Count and keep a refused request: when, from where, which command, why (never its arguments)."""
        name = cmd if isinstance(cmd, str) and cmd.isidentifier() and len(cmd) <= 32 else None
        record = {"at": time.time(), "peer": f"{peer[0]}:{peer[1]}" if peer else None, "cmd": name, "reason": reason}
        with self._refusal_lock:
            self.refusals += 1
            self._last_refusals.append(record)
        self._log.warning("gpumigrate agent: refused %s from %s: %s", name or "a request", record["peer"], reason)

    def auth_report(self) -> dict[str, Any]:
        with self._refusal_lock:
            return {
                "agent": self.identity.agent,
                "epoch": self.identity.epoch,
                "key_id": control.key_id(self.key),
                "refused": self.refusals,
                "last_refused": list(self._last_refusals),
            }

    @property
    def address(self) -> str:
        host, port = self.socket.getsockname()[:2]  # where it listens (an IP and a port: no bytes)
        return f"{host}:{port}"

    def start(self) -> AgentServer:
        self._thread = threading.Thread(target=self.serve_forever, name="gm-agent", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def serve(
    engine: SnapshotEngine,
    port: int = 0,
    host: str = "127.0.0.1",
    *,
    key: bytes | None = None,
    identity: agent_keys.AgentIdentity | None = None,
) -> AgentServer:
    """Start the control server in a daemon thread; ``port=0`` picks a free port (see ``.address``).

    ``key``: the deployment's control key (this agent's own is derived from it); ``identity``: this agent's own
    identity and key; neither: ``gpumigrate.agent_keys.load_identity(create=True)``.
    """
    return AgentServer(engine, host, port, key=key, identity=identity).start()


__all__ = ["AgentServer", "key_ref_arg", "serve"]

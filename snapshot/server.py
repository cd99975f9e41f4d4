"""The workload's side of the agent's control address: line-delimited JSON over TCP (see PROTOCOL.md).

One request per line, one response line per request, in order, on any number of connections.
Commands run one at a time inside the engine (its lock); ``ping``, ``renew`` and ``metrics`` answer
while a long command runs on another connection. Errors come back typed, never as tracebacks. What
each command does is ``server_commands.py``; the orchestrator's side is ``client.py``.

Every request must be signed with the control key (``gpumigrate.control``, channel ``agent``) and
every reply is signed, bound to the request it answers. A request that fails authentication is
refused with nothing done, counted, logged and kept (without its arguments) among the last
refusals that ``info`` shows; its reply is unsigned, so a client without the key learns nothing
it could trust.
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

from gpumigrate import control
from gpumigrate.errors import GpumigrateError, SnapshotError
from gpumigrate.snapshot.engine import SnapshotEngine
from gpumigrate.snapshot.gchold import gc_held
from gpumigrate.snapshot.server_commands import dispatch, key_ref_arg

MAX_LINE = 1 << 20
CHANNEL = "agent"
REFUSALS_KEPT = 20
GC_HELD_TO_REPLY = frozenset(
    {"freeze", "final", "lend", "restore", "hand_over"}
)  # commands whose reply is on the downtime's clock
log = logging.getLogger("gpumigrate.agent")


def _error(rid: Any, kind: str, message: str, hint: str | None = None) -> dict[str, Any]:
    return {"id": rid, "ok": False, "error": {"type": kind, "message": message, "hint": hint}}


class _Handler(socketserver.StreamRequestHandler):
    server: AgentServer

    def handle(self) -> None:
        while True:
            line = self.rfile.readline(MAX_LINE)
            if not line:
                return
            reply, nonce, body = self._answer(line)
            # The downtime's commands (a source's freeze, final round and lend; a target's restore) keep the cyclic
            # collector off (gchold.py) until their reply is out: the collection that their allocations made due (a
            # full one at times) runs after the reply, not before it.
            with gc_held() if body is not None and body.get("cmd") in GC_HELD_TO_REPLY else contextlib.nullcontext():
                if body is not None:
                    reply = self._run(reply["id"], body)
                if nonce is not None:  # authenticated: the reply is signed, bound to the request
                    reply = control.sign_reply(self.server.key, CHANNEL, nonce, reply)
                self.wfile.write((json.dumps(reply, default=str) + "\n").encode())
                self.wfile.flush()

    def _answer(self, line: bytes) -> tuple[dict[str, Any], str | None, Mapping[str, Any] | None]:
        """(reply, nonce, body): a refusal's reply and no body, or the request's id (in a reply to fill) and its
        authenticated body."""
        try:
            req = json.loads(line)
        except json.JSONDecodeError as exc:
            self.server.refuse(self.client_address, None, "request is not JSON")
            return _error(None, "AuthError", f"request is not JSON: {exc.msg}"), None, None
        if not isinstance(req, dict):
            self.server.refuse(self.client_address, None, "request is not a JSON object")
            return _error(None, "AuthError", "a request is a JSON object"), None, None
        rid = req.get("id")
        try:
            body, nonce = control.verify_request(self.server.key, CHANNEL, req, self.server.guard)
        except control.AuthError as exc:
            self.server.refuse(self.client_address, req.get("cmd"), exc.message)
            return _error(rid, "AuthError", exc.message, "sign requests with the workload's control key"), None, None
        return {"id": rid}, nonce, body

    def _run(self, rid: Any, req: Mapping[str, Any]) -> dict[str, Any]:
        reply: dict[str, Any]
        try:
            args = req.get("args") or {}
            if not isinstance(args, Mapping):
                raise SnapshotError("args must be a JSON object")
            server = self.server
            result = dispatch(server.engine, str(req.get("cmd")), args, key=server.key, auth=server.auth_report)
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
        self, engine: SnapshotEngine, host: str = "127.0.0.1", port: int = 0, *, key: bytes | None = None
    ) -> None:
        # The key first: a workload without one must not listen at all.
        self.key = key if key is not None else control.load_key(None, create=True)
        self.guard = control.ReplayGuard()
        self.refusals = 0
        self._last_refusals: deque[dict[str, Any]] = deque(maxlen=REFUSALS_KEPT)
        self._refusal_lock = threading.Lock()
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
        log.warning("gpumigrate agent: refused %s from %s: %s", name or "a request", record["peer"], reason)

    def auth_report(self) -> dict[str, Any]:
        with self._refusal_lock:
            return {
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


def serve(engine: SnapshotEngine, port: int = 0, host: str = "127.0.0.1", *, key: bytes | None = None) -> AgentServer:
    """Start the control server in a daemon thread; ``port=0`` picks a free port (see ``.address``).

    ``key``: the control key; by default ``gpumigrate.control.load_key(None, create=True)``.
    """
    return AgentServer(engine, host, port, key=key).start()


__all__ = ["AgentServer", "key_ref_arg", "serve"]

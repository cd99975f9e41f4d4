"""The agent's control address: line-delimited JSON over TCP (see PROTOCOL.md).

One request per line, one response line per request, in order, on any number of connections.
Commands run one at a time inside the agent (its lock); ``ping``, ``renew`` and ``metrics`` answer
while a long command runs on another connection. Errors come back typed, never as tracebacks.

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
from collections.abc import Callable, Mapping
from typing import Any

from gpumigrate import control
from gpumigrate.errors import GpumigrateError, SnapshotError
from gpumigrate.snapshot.agent import Agent
from gpumigrate.snapshot.client import parse_address
from gpumigrate.snapshot.fill import runs_arg
from gpumigrate.snapshot.gchold import gc_held

MAX_LINE = 1 << 20
MAX_CHUNK_SIZE = 256 << 20  # the transfer engine's largest chunk
CHANNEL = "agent"
REFUSALS_KEPT = 20
GC_HELD_TO_REPLY = frozenset({"freeze", "final", "lend", "restore"})  # commands whose reply is on the downtime's clock
log = logging.getLogger("gpumigrate.agent")


def key_ref_arg(value: Any) -> dict[str, str]:
    """Accept only a key *reference*: {"env": NAME} or {"file": PATH}, or nothing (an unencrypted store).

    Anything else, a key itself in particular, is refused before any image is touched.
    """
    if value is None or value == {}:
        return {}
    if (
        not isinstance(value, Mapping)
        or set(value) not in ({"env"}, {"file"})
        or not all(isinstance(v, str) for v in value.values())
    ):
        raise SnapshotError(
            'key_ref must be {"env": VARIABLE} or {"file": PATH}: the agent resolves keys locally, never over the wire'
        )
    return dict(value)


WRITER_COMPRESSION = ("auto", "none", "zstd", "byteplane")


def writer_options_arg(value: Any) -> dict[str, Any]:
    """How the image is written: ``{"compression": one of WRITER_COMPRESSION, "parallelism": 1..64}``."""
    if value in (None, {}):
        return {}
    if not isinstance(value, Mapping) or set(value) - {"compression", "parallelism"}:
        raise SnapshotError('options must be {"compression": ..., "parallelism": ...} and nothing else')
    out: dict[str, Any] = {}
    if "compression" in value:
        if value["compression"] not in WRITER_COMPRESSION:
            raise SnapshotError(
                f"options.compression {value['compression']!r}: allowed are {', '.join(WRITER_COMPRESSION)}"
            )
        out["compression"] = value["compression"]
    if "parallelism" in value:
        p = value["parallelism"]
        if not isinstance(p, int) or isinstance(p, bool) or not 1 <= p <= 64:
            raise SnapshotError(f"options.parallelism {p!r}: must be a whole number from 1 to 64")
        out["parallelism"] = p
    return out


def _steps_arg(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
        raise SnapshotError(f"steps {value!r}: must be a whole number from 1 to 1000000")
    return value


def _seconds_arg(name: str, value: Any, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 86_400:
        raise SnapshotError(f"{name} {value!r}: must be a number of seconds above 0 and at most 86400")
    return float(value)


def _freeze(agent: Agent, args: Mapping[str, Any]) -> dict[str, Any]:
    timeout_s = _seconds_arg("timeout_s", args.get("timeout_s"), 60)
    agent.freeze(args.get("lease_s"), timeout_s=timeout_s, at_step=args.get("at_step"))
    steps = agent.freezer.steps if agent.freezer is not None else 0
    return {"frozen": True, "lease_s": agent.lease.lease_s, "steps": steps}


def _rank_arg(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 16:
        raise SnapshotError(f"rank {value!r}: must be a whole number from 0")
    return value


def _address_arg(name: str, value: Any) -> str:
    """An agent's or a landing's ``host:port`` (``source`` of ``restore``, ``landing`` of ``lend``)."""
    if not isinstance(value, str):
        raise SnapshotError(f"{name} {str(value)[:40]!r}: must be HOST:PORT")
    parse_address(value)
    return value


def _chunk_size_arg(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 8 <= value <= MAX_CHUNK_SIZE or value % 8:
        raise SnapshotError(f"chunk_size {value!r}: must be a multiple of 8 bytes up to {MAX_CHUNK_SIZE}")
    return value


def _compose(agent: Agent, args: Mapping[str, Any]) -> dict[str, Any]:
    images, ranks, step = args["images"], args["ranks"], args.get("step")
    if not isinstance(images, list) or not images or not all(isinstance(i, str) for i in images):
        raise SnapshotError("images must be a non-empty list of image ids, rank 0's first")
    if not isinstance(ranks, list) or not all(isinstance(r, Mapping) for r in ranks):
        raise SnapshotError("ranks must be a list of objects, one per rank (each rank's info().rank)")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise SnapshotError(f"step {step!r}: must be a whole number")
    return agent.compose_world(str(args["store"]), key_ref_arg(args.get("key_ref")), images, ranks, step=step)


def _resume(agent: Agent) -> dict[str, Any]:
    agent.resume()
    return {"frozen": False}


def _dispatch(server: AgentServer, cmd: str, args: Mapping[str, Any]) -> Any:
    agent = server.agent
    handlers: dict[str, Callable[[], Any]] = {
        "ping": lambda: {"pong": True},
        "info": lambda: {**agent.info(), "auth": server.auth_report()},
        "precopy": lambda: agent.precopy_to(
            str(args["store"]),
            key_ref_arg(args.get("key_ref")),
            args.get("parent"),
            options=writer_options_arg(args.get("options")),
        ),
        "freeze": lambda: _freeze(agent, args),
        "hold": lambda: agent.hold(args.get("lease_s")),
        "teardown": agent.teardown,
        "rebuild": agent.rebuild,
        "compose": lambda: _compose(agent, args),
        "renew": lambda: agent.renew(args.get("lease_s")),
        "advance": lambda: agent.advance(
            _steps_arg(args.get("steps")), timeout_s=_seconds_arg("timeout_s", args.get("timeout_s"), 600)
        ),
        "metrics": lambda: agent.metrics(int(args.get("since") or 0)),
        "final": lambda: agent.final_to(
            str(args["store"]),
            key_ref_arg(args.get("key_ref")),
            args.get("parent"),
            options=writer_options_arg(args.get("options")),
        ),
        "resume": lambda: _resume(agent),
        "restore": lambda: agent.restore_from(
            str(args["store"]),
            str(args["image_id"]),
            key_ref_arg(args.get("key_ref")),
            policy=args.get("policy"),
            ready=bool(args.get("ready", True)),
            rank=_rank_arg(args.get("rank")),
            source=None if args.get("source") is None else _address_arg("source", args["source"]),
            control_key=server.key,
        ),
        "lend": lambda: agent.lend_to(
            _address_arg("landing", args["landing"]),
            runs_arg(args["runs"]),
            _chunk_size_arg(args["chunk_size"]),
            control_key=server.key,
            tolerate=bool(args.get("tolerate", False)),
        ),
        "zeroize": agent.zeroize,
    }
    handler = handlers.get(cmd)
    if handler is None:
        raise SnapshotError(f"unknown command {cmd!r}: allowed are {', '.join(sorted(handlers))}")
    try:
        return handler()
    except KeyError as exc:
        raise SnapshotError(f"command {cmd!r} needs argument {exc.args[0]!r}") from None


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
            result = _dispatch(self.server, str(req.get("cmd")), args)
            reply = {"id": rid, "ok": True, "result": result}
        except GpumigrateError as exc:
            reply = _error(rid, type(exc).__name__, exc.message, exc.hint)
        except Exception as exc:  # an agent bug must not kill the workload's control thread
            reply = _error(rid, "SnapshotError", f"agent failed: {type(exc).__name__}: {exc}")
        return reply


class AgentServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, agent: Agent, host: str = "127.0.0.1", port: int = 0, *, key: bytes | None = None) -> None:
        # The key first: a workload without one must not listen at all.
        self.key = key if key is not None else control.load_key(None, create=True)
        self.guard = control.ReplayGuard()
        self.refusals = 0
        self._last_refusals: deque[dict[str, Any]] = deque(maxlen=REFUSALS_KEPT)
        self._refusal_lock = threading.Lock()
        super().__init__((host, port), _Handler)
        self.agent = agent
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


def serve(agent: Agent, port: int = 0, host: str = "127.0.0.1", *, key: bytes | None = None) -> AgentServer:
    """Start the control server in a daemon thread; ``port=0`` picks a free port (see ``.address``).

    ``key``: the control key; by default ``gpumigrate.control.load_key(None, create=True)``.
    """
    return AgentServer(agent, host, port, key=key).start()

"""The agent's control address: line-delimited JSON over TCP (see PROTOCOL.md).

One request per line, one response line per request, in order, on any number of connections.
Commands run one at a time inside the agent (its lock); ``ping`` and ``info`` answer while a long
command runs on another connection. Errors come back typed, never as tracebacks.
"""

from __future__ import annotations

import json
import socketserver
import threading
from collections.abc import Callable, Mapping
from typing import Any

from gpumigrate.errors import GpumigrateError, SnapshotError
from gpumigrate.snapshot.agent import Agent

MAX_LINE = 1 << 20


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


def _dispatch(agent: Agent, cmd: str, args: Mapping[str, Any]) -> Any:
    handlers: dict[str, Callable[[], Any]] = {
        "ping": lambda: {"pong": True},
        "info": agent.info,
        "precopy": lambda: agent.precopy_to(
            str(args["store"]),
            key_ref_arg(args.get("key_ref")),
            args.get("parent"),
            options=writer_options_arg(args.get("options")),
        ),
        "freeze": lambda: (agent.freeze(), {"frozen": True})[1],
        "final": lambda: agent.final_to(
            str(args["store"]),
            key_ref_arg(args.get("key_ref")),
            args.get("parent"),
            options=writer_options_arg(args.get("options")),
        ),
        "resume": lambda: (agent.resume(), {"frozen": False})[1],
        "restore": lambda: agent.restore_from(
            str(args["store"]),
            str(args["image_id"]),
            key_ref_arg(args.get("key_ref")),
            policy=args.get("policy"),
            ready=bool(args.get("ready", True)),
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


class _Handler(socketserver.StreamRequestHandler):
    server: AgentServer

    def handle(self) -> None:
        while True:
            line = self.rfile.readline(MAX_LINE)
            if not line:
                return
            reply: dict[str, Any]
            rid = None
            try:
                req = json.loads(line)
                rid = req.get("id")
                result = _dispatch(self.server.agent, str(req.get("cmd")), req.get("args") or {})
                reply = {"id": rid, "ok": True, "result": result}
            except GpumigrateError as exc:
                reply = {
                    "id": rid,
                    "ok": False,
                    "error": {"type": type(exc).__name__, "message": exc.message, "hint": exc.hint},
                }
            except json.JSONDecodeError as exc:
                reply = {
                    "id": rid,
                    "ok": False,
                    "error": {"type": "SnapshotError", "message": f"request is not JSON: {exc.msg}", "hint": None},
                }
            except Exception as exc:  # an agent bug must not kill the workload's control thread
                reply = {
                    "id": rid,
                    "ok": False,
                    "error": {
                        "type": "SnapshotError",
                        "message": f"agent failed: {type(exc).__name__}: {exc}",
                        "hint": None,
                    },
                }
            self.wfile.write((json.dumps(reply, default=str) + "\n").encode())
            self.wfile.flush()


class AgentServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, agent: Agent, host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__((host, port), _Handler)
        self.agent = agent
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        host, port = self.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> AgentServer:
        self._thread = threading.Thread(target=self.serve_forever, name="gm-agent", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def serve(agent: Agent, port: int = 0, host: str = "127.0.0.1") -> AgentServer:
    """Start the control server in a daemon thread; ``port=0`` picks a free port (see ``.address``)."""
    return AgentServer(agent, host, port).start()

"""A capturing TCP relay: what an outsider who can watch loopback traffic sees of a line-delimited channel.

``Relay(upstream)`` listens on loopback, forwards every connection to ``upstream`` (``host:port``) and both
ways back, and keeps every line a client sent (``lines``). Tests put it between an orchestrator and an agent,
then replay what it caught where it should be refused.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from typing import Any


class Relay:
    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.lines: list[bytes] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.upstream, timeout=30)
            except OSError:
                conn.close()
                continue
            threading.Thread(target=self._pump, args=(conn, up, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, conn, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        buf = b""
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if record:
                    buf += data
                    *whole, buf = buf.split(b"\n")
                    self.lines.extend(line + b"\n" for line in whole)
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def requests(self, cmd: str) -> list[bytes]:
        """The signed requests for ``cmd`` it caught, as sent (one line each)."""
        out = []
        for line in self.lines:
            with contextlib.suppress(ValueError):
                msg = json.loads(line)
                if isinstance(msg, dict) and msg.get("cmd") == cmd and "auth" in msg:
                    out.append(line)
        return out

    def close(self) -> None:
        self._closed = True
        self._listener.close()


def send_lines(address: str, *lines: bytes, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Send ``lines`` on one new connection to ``address``; the JSON answer to each."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s, s.makefile("rwb") as f:
        for line in lines:
            f.write(line)
        f.flush()
        return [json.loads(f.readline()) for _ in lines]

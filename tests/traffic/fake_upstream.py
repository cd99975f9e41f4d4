"""A tiny stdlib stand-in for the reference inference server, with the same endpoints.

Used where the real server would cost too much CPU (the 2-core machine runs several engineers'
suites at once). Run: ``python fake_upstream.py --port P --name NAME``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_fault = {"kind": "none", "rate": 0.0, "delay_ms": 0}
_lock = threading.Lock()


def _tokens(prompt: str, n: int, drift: bool) -> list[int]:
    digest = hashlib.sha256(prompt.encode()).digest()
    toks = [b % 100 for b in digest[: max(1, min(n, 32))]]
    return [t + 1 for t in toks] if drift else toks


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # one response = header + body writes; no 40 ms delayed-ACK stall
    server_name = "fake"

    def log_message(self, *args: object) -> None:  # quiet: tests read results, not logs
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        if self.path in ("/healthz", "/readyz"):
            self._send(200, {"ok": True})
        elif self.path == "/v1/headers":  # what reached the workload, for the front door's header tests
            self._send(200, {"host": self.server_name, "headers": {k.lower(): v for k, v in self.headers.items()}})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path == "/admin/fault":
            with _lock:
                _fault.update(
                    {
                        "kind": body.get("kind", "none"),
                        "rate": float(body.get("rate", 1.0)),
                        "delay_ms": int(body.get("delay_ms", 0)),
                    }
                )
            self._send(200, dict(_fault))
            return
        if self.path != "/v1/generate":
            self._send(404, {"error": "not found"})
            return
        kind, rate, delay = _fault["kind"], _fault["rate"], _fault["delay_ms"]
        hit = kind != "none" and random.random() < rate
        if hit and kind == "crash":
            os._exit(17)  # die mid-request, like the reference server's crash fault
        if hit and kind == "errors":
            self._send(500, {"error": "injected"})
            return
        if hit and kind == "slow":
            time.sleep(delay / 1000)
        toks = _tokens(str(body.get("prompt", "")), int(body.get("max_new_tokens", 4)), hit and kind == "drift")
        self._send(
            200,
            {
                "tokens": toks,
                "text": " ".join(map(str, toks)),
                "logprobs": [-0.5] * len(toks),
                "model": "fake",
                "host": self.server_name,
            },
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", default="fake")
    args = ap.parse_args()
    Handler.server_name = args.name
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()

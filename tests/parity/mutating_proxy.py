"""A real HTTP proxy process for parity tests: forwards to an inference server and damages its answers.

Run: ``python mutating_proxy.py --upstream http://127.0.0.1:P`` prints ``{"port": N}`` once listening.
``POST /proxy/mode {"mode": M, "match": "substring of the prompt"}`` picks the damage for matching
prompts (empty match: every prompt). Modes: none, nan (logprobs[0] = NaN), inf (logprobs[0] = +Inf),
truncate (drop the last token and logprob), error (HTTP 500), drop_logprobs (remove the field).
Stands in for a target whose numerics broke, which the reference server cannot be told to do.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODES = ("none", "nan", "inf", "truncate", "error", "drop_logprobs")
_mode: dict[str, str] = {"mode": "none", "match": ""}
_lock = threading.Lock()


def _damage(body: dict[str, Any], mode: str) -> dict[str, Any] | None:
    if mode == "nan":
        body["logprobs"][0] = float("nan")
    elif mode == "inf":
        body["logprobs"][0] = float("inf")
    elif mode == "truncate":
        body["tokens"] = body["tokens"][:-1]
        body["logprobs"] = body["logprobs"][:-1]
    elif mode == "drop_logprobs":
        body.pop("logprobs", None)
    elif mode == "error":
        return None
    return body


class Handler(BaseHTTPRequestHandler):
    upstream = ""

    def log_message(self, *args: Any) -> None:  # quiet: tests read stdout for the port line
        pass

    def _send(self, code: int, payload: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _forward(self, method: str, body: bytes | None) -> tuple[int, bytes]:
        req = urllib.request.Request(self.upstream + self.path, data=body, method=method,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def do_GET(self) -> None:
        self._send(*self._forward("GET", None))

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/proxy/mode":
            req = json.loads(raw or b"{}")
            if req.get("mode") not in MODES:
                self._send(400, b'{"error": "unknown mode"}')
                return
            with _lock:
                _mode.update(mode=req["mode"], match=req.get("match", ""))
            self._send(200, json.dumps(_mode).encode())
            return
        code, payload = self._forward("POST", raw)
        with _lock:
            mode, match = _mode["mode"], _mode["match"]
        prompt = json.loads(raw or b"{}").get("prompt", "")
        if code == 200 and self.path == "/v1/generate" and mode != "none" and match in prompt:
            damaged = _damage(json.loads(payload), mode)
            if damaged is None:
                self._send(500, b'{"error": "injected by the test proxy"}')
                return
            payload = json.dumps(damaged).encode()  # json writes NaN/Infinity, as a broken server would
        self._send(code, payload)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    Handler.upstream = args.upstream.rstrip("/")
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(json.dumps({"port": server.server_address[1]}), flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

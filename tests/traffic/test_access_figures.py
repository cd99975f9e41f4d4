"""The one downtime figure (issue 35, finding 6): the client-visible stall, measured at the front door from Envoy's
access log, against what an open-loop load generator saw of the same stall from the client's side.

The upstream holds every request for a while, as a frozen source holds requests at its safe point (answering its
readiness path 200 meanwhile, as the SDK's does); a real Envoy and control plane (FrontDoor) stand in front of it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gpumigrate.traffic import access_log
from gpumigrate.traffic.frontdoor import FrontDoor, read
from gpumigrate.traffic.loadgen import LoadProcess

FREEZE_S = 1.2


class Holding:
    """An upstream whose answers wait while it is frozen (``freeze()``/``resume()``), as a safe point does."""

    def __init__(self) -> None:
        self.running = threading.Event()
        self.running.set()
        running = self.running

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != "/readyz":
                    running.wait()
                body = json.dumps({"ok": True}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer  # noqa: N815

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def door(tmp_path: Path, envoy_binary: str) -> Iterator[tuple[FrontDoor, Holding]]:
    upstream = Holding()
    door = FrontDoor.start(tmp_path / "door", source_host="127.0.0.1", source_port=upstream.port, node_id="stall")
    try:
        yield door, upstream
    finally:
        door.stop()
        upstream.running.set()
        upstream.server.shutdown()


def test_the_front_doors_stall_is_what_the_clients_saw_and_every_request_is_counted(
    door: tuple[FrontDoor, Holding],
) -> None:
    front, upstream = door
    [log] = read(front.state_dir).access_logs
    assert log == str(front.envoy.access_log_path)
    before = access_log.mark(log)
    load = LoadProcess(front.url + "/v1/x", rps=40, seconds=6, body={"q": 1}, keep_records=True)
    try:
        time.sleep(2.5)  # the baseline: answers before the freeze (the load runs on its own clock)
        froze_at = time.time()
        upstream.running.clear()
        time.sleep(FREEZE_S)
        upstream.running.set()
        resumed_at = time.time()
    finally:
        report = load.wait(timeout_s=120)
    end = time.time()
    deadline = time.monotonic() + 30
    while len(access_log.read_since(before)) < report.total:  # Envoy flushes its log every FLUSH_MS
        assert time.monotonic() < deadline, "Envoy never wrote every request to its access log"
        time.sleep(0.05)
    requests = access_log.read_since(before)

    found = access_log.figures(requests, froze_at=froze_at, resumed_at=resumed_at, end=end)
    client = report.stall_between(froze_at, resumed_at, baseline_before=froze_at)
    assert report.failed == 0 and client is not None
    # A freeze that held every client: the figure is what they waited, not the 0 ms of "no failed answer".
    assert 0.8 * FREEZE_S * 1000 < found["stall_ms"] < FREEZE_S * 1000 + 500, found
    # Measured at the front door, it is what the clients saw of it, less only their own overhead: a load generator on
    # a busy host adds its own scheduling delays to every latency it measures (hundreds of ms at a load of 10).
    assert client > 0.8 * FREEZE_S * 1000 and found["stall_ms"] <= client + 50, (found, client)
    # Every request through the front door is counted: all of them from before the freeze to the end here.
    everything = access_log.figures(requests, froze_at=report.started_at or 0.0, resumed_at=resumed_at, end=end)
    assert everything["requests"] == report.total and everything["failed"] == 0
    assert found["in_freeze"] > 1  # the requests held then


def test_a_rotated_log_is_followed_from_the_mark(tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    line = {"start": "100.000", "ms": 5, "code": 200, "flags": "-", "upstream": "source"}
    log.write_text(json.dumps(line) + "\n")
    at = access_log.mark(log)
    with log.open("a") as fh:
        fh.write(json.dumps({**line, "start": "101.000"}) + "\n")
    (tmp_path / "access.log").replace(tmp_path / "access.log.1")  # rotated, as access_log.rotate does
    log.write_text(json.dumps({**line, "start": "102.000", "code": 503}) + "\n" + '{"start": "10')  # a torn write
    got = access_log.read_since(at)
    assert [(r.start, r.failed) for r in got] == [(101.0, False), (102.0, True)]

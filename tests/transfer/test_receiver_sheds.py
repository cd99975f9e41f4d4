"""A receiver under clients that never authenticate, and under a sender that repeats itself: slow handshakes are
shed at a deadline on the whole of it, unauthenticated clients have a cap of their own (real senders still get
in), refusals are counted and logged at a bounded rate, and a manifest sent again costs no quota again."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

from gpumigrate.transfer import pack_paths, push, serve_stream
from gpumigrate.transfer.receiver.host import read_receiver_info
from gpumigrate.transfer.stores import open_store
from gpumigrate.transfer.stores.wire import HELLO, MAGIC, REQUEST

KEY_ENV = "GM_TEST_IMAGE_KEY"
SLOW_CLIENTS = 64
TRICKLE_S = 0.5  # one byte this often: each read is prompt, so only a deadline on the whole handshake ends it


def _packed(tmp_path: Path, key: bytes, name: str, mib: int) -> tuple[str, str]:
    src = tmp_path / name
    src.mkdir()
    (src / "f").write_bytes(os.urandom(mib << 20))
    local = f"file://{tmp_path / 'local'}"
    return local, pack_paths([src], local, key=key).id


class SlowClient(threading.Thread):
    """Completes TLS (cheap), then sends a HELLO frame's header one byte every TRICKLE_S seconds; notes when the
    receiver closes the connection."""

    def __init__(self, host: str, port: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.host, self.port, self.stop = host, port, stop
        self.connected = threading.Event()
        self.closed = threading.Event()

    def run(self) -> None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        try:
            sock = ctx.wrap_socket(socket.create_connection((self.host, self.port), timeout=30))
        except OSError:  # shed before its handshake finished
            self.connected.set()
            self.closed.set()
            return
        self.connected.set()
        header = REQUEST.pack(MAGIC, HELLO, bytes(32), 100)
        with sock:
            for i in range(10_000):
                if self.stop.is_set():
                    return
                try:
                    sock.send(header[i % len(header) : i % len(header) + 1])
                    sock.settimeout(TRICKLE_S)
                    if sock.recv(1) == b"":
                        break
                except TimeoutError:
                    continue  # still open: trickle on
                except (OSError, ssl.SSLError):
                    break
        self.closed.set()


def test_slow_unauthenticated_clients_are_shed_while_a_real_push_gets_through(
    cli_cmd: list[str], gm_home: Path, tmp_path: Path, key: bytes
) -> None:
    env = {**os.environ, KEY_ENV: key.hex()}  # GPUMIGRATE_HOME (gm_home): the control key both sides share
    state = tmp_path / "recv"
    started = subprocess.run(
        [*cli_cmd, "image", "receive", "--detach", "--state-dir", str(state), "--key-env", KEY_ENV]
        + ["--handshake-timeout", "2", "--max-unauthenticated", "32"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode == 0, started.stderr
    info = read_receiver_info(state)
    stop = threading.Event()
    clients = [SlowClient(info.host, info.port, stop) for _ in range(SLOW_CLIENTS)]
    try:
        for c in clients:
            c.start()
        for c in clients:
            assert c.connected.wait(30), "a slow client's TLS handshake did not finish within 30 s"
        local, image_id = _packed(tmp_path, key, "in", 3)
        stats = push(local, info.url, image_id, key=key)  # a real sender, while the slow ones hold their sockets
        assert stats.chunks_sent == stats.chunks_total > 0
        deadline = time.monotonic() + 30
        for c in clients:
            c.closed.wait(max(0.0, deadline - time.monotonic()))
        still_open = sum(not c.closed.is_set() for c in clients)
        assert still_open == 0, f"{still_open} slow clients were still connected 30 s later (deadline: 2 s)"
    finally:
        stop.set()
        stopped = subprocess.run(
            [*cli_cmd, "image", "receive-stop", "--state-dir", str(state)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert stopped.returncode == 0, stopped.stderr
    summary = json.loads(stopped.stdout.splitlines()[-1])
    shed = summary["connections_shed"]
    assert shed.get("handshake_deadline", 0) >= 1 and shed.get("unauthenticated_cap", 0) >= 1, shed
    assert sum(shed.values()) >= SLOW_CLIENTS and summary["images"] == [image_id]
    logged = [line for line in (state / "receiver.log").read_text().splitlines() if "shed the connection" in line]
    assert 0 < len(logged) < SLOW_CLIENTS / 2  # counted every time, logged at a bounded rate


def test_receiver_limits_are_checked_before_it_starts(cli_cmd: list[str], gm_home: Path, tmp_path: Path) -> None:
    res = subprocess.run(
        [*cli_cmd, "image", "receive", "--state-dir", str(tmp_path), "--no-key", "--max-clients", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "--max-clients" in res.stderr and "Traceback" not in res.stderr


def test_a_manifest_sent_again_and_again_reserves_its_quota_once(gm_home: Path, tmp_path: Path, key: bytes) -> None:
    local, first = _packed(tmp_path, key, "a", 2)
    _, second = _packed(tmp_path, key, "b", 2)
    src = open_store(local)
    sizes = src.list_chunks()
    manifest = src.get_manifest(first)
    need = sum(sizes.values()) + len(manifest) + len(src.get_manifest(second))
    quota = need + 64 * len(manifest)  # room for both images, and for far fewer than 111 extra manifests
    receiver = serve_stream("127.0.0.1:0", f"file://{tmp_path / 'dst'}", key=key, quota_bytes=quota)
    try:
        push(local, receiver.url, first, key=key)
        held = receiver.stats()["bytes_stored"]
        sender = open_store(receiver.url)
        try:
            for _ in range(111):
                sender.put_manifest(first, manifest)
        finally:
            sender.close()
        assert receiver.stats()["bytes_stored"] == held
        push(local, receiver.url, second, key=key)  # still fits: the repeats cost nothing
        assert receiver.stats()["images"].count(second) == 1
    finally:
        receiver.close()


def test_one_manifest_sent_by_many_connections_at_once_is_counted_once(
    gm_home: Path, tmp_path: Path, key: bytes
) -> None:
    local, image_id = _packed(tmp_path, key, "a", 1)
    manifest = open_store(local).get_manifest(image_id)
    with serve_stream("127.0.0.1:0", f"file://{tmp_path / 'dst'}", key=key) as receiver:
        push(local, receiver.url, image_id, key=key)
        held = receiver.stats()["bytes_stored"]

        def resend() -> None:
            sender = open_store(receiver.url)
            try:
                for _ in range(5):
                    sender.put_manifest(image_id, manifest)
            finally:
                sender.close()

        workers = [threading.Thread(target=resend) for _ in range(8)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert receiver.stats()["bytes_stored"] == held

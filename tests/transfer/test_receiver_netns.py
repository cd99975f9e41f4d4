"""Receivers between two local hosts, each in its own network namespace (root + ip netns; skipped elsewhere).

Host "src" pushes with the real CLI; host "dst" runs the receiver the way a flow starts one
(``receiver_argv`` through the provider), and reads the image back from the receiver's directory.
nixl:// runs with UCX over TCP between the namespaces (UCX_TLS=tcp), as between two hosts.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from transfer_helpers import bf16_weights

from gpumigrate.errors import TransferError
from gpumigrate.infra import netns as netns_lib
from gpumigrate.infra.local import LocalProvider
from gpumigrate.interfaces import Host, HostSpec
from gpumigrate.transfer import ReceiverOptions, pack_paths, read_receiver_info, receiver_argv, stop_receiver, verify
from gpumigrate.transfer.stores.file import file_root

_ok, _why = netns_lib.available()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not _ok, reason=f"network namespaces unavailable: {_why}")]

KEY_ENV = "GM_TEST_IMAGE_KEY"
SCHEMES = ["stream", "nixl"]


@pytest.fixture
def hosts(gm_home: Path) -> Iterator[tuple[LocalProvider, Host, Host]]:
    provider = LocalProvider(netns=True, rate="1gbit")
    src = provider.provision(HostSpec(name="src", provider="local", region="local"), migration_id="t")
    dst = provider.provision(HostSpec(name="dst", provider="local", region="local"), migration_id="t")
    try:
        yield provider, src, dst
    finally:
        for host in provider.list_hosts():
            provider.terminate(host)


@pytest.fixture
def image_key(monkeypatch: pytest.MonkeyPatch) -> bytes:
    key = os.urandom(32)
    monkeypatch.setenv(KEY_ENV, key.hex())
    return key


def _image(tmp_path: Path, key: bytes, mib: int = 12) -> tuple[str, str, Path]:
    """A real image: bf16 weights and a few files, packed into a file:// store. (store, id, files)."""
    files = tmp_path / "model"
    files.mkdir()
    (files / "weights.bin").write_bytes(bf16_weights(mib << 19).tobytes())
    (files / "config.json").write_text(json.dumps({"layers": 4, "dtype": "bfloat16"}))
    (files / "tokenizer.txt").write_bytes(os.urandom(2 << 20))
    store = f"file://{tmp_path / 'source-store'}"
    return store, pack_paths([files], store, key=key, dtype="bfloat16").id, files


def _start_receiver(provider: LocalProvider, host: Host, state: Path, scheme: str) -> dict:
    options = ReceiverOptions(
        listen=f"{host.address}:{host.ports['stream']}",
        nixl=scheme == "nixl",
        nixl_transports="tcp" if scheme == "nixl" else None,
    )
    argv = receiver_argv(state, options, key_ref={"env": KEY_ENV})
    proc = provider.spawn(host, argv, env={KEY_ENV: os.environ[KEY_ENV]}, name="receiver")
    deadline = time.monotonic() + 60
    while True:
        try:
            info = read_receiver_info(state, timeout_s=0.2, pid=proc["pid"])
            if info.state == "running" and info.pid == proc["pid"]:
                break
        except TransferError:
            pass
        exited = [c for c in provider.processes(host) if c["pid"] == proc["pid"] and c["returncode"] is not None]
        if exited or time.monotonic() > deadline:
            raise AssertionError(Path(proc["log"]).read_text())
    return {"pid": proc["pid"], "log": proc["log"], "url": info.url, "store": info.store}


def _url(recv: dict, scheme: str) -> str:
    """The receiver's pinned URL; for nixl://, UCX over TCP and every chunk through NIXL (none inline)."""
    return recv["url"] + ("&transports=tcp&inline=0" if scheme == "nixl" else "")


def _spawn(provider: LocalProvider, host: Host, args: list[str], module: bool = True) -> dict:
    """Start the gpumigrate CLI (or a script) on a host, in a process of its own."""
    argv = [sys.executable, *(["-m", "gpumigrate", *args, "--json", "-q"] if module else args)]
    return provider.spawn(host, argv, env={KEY_ENV: os.environ[KEY_ENV]}, name="cli")


def _wait(provider: LocalProvider, host: Host, proc: dict, timeout_s: float = 120) -> tuple[int, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = [c for c in provider.processes(host) if c["pid"] == proc["pid"] and c["returncode"] is not None]
        if done:
            return int(done[0]["returncode"]), Path(proc["log"]).read_text()
        time.sleep(0.1)
    raise AssertionError(f"{proc} did not finish: {Path(proc['log']).read_text()}")


def _run_on(provider: LocalProvider, host: Host, args: list[str], module: bool = True) -> dict:
    """Run the gpumigrate CLI (or a script) on a host; return its last JSON line."""
    code, text = _wait(provider, host, _spawn(provider, host, args, module))
    assert code == 0, text
    return json.loads(text.strip().splitlines()[-1])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_push_between_hosts_then_verify_and_restore_read_on_the_target(
    hosts: tuple[LocalProvider, Host, Host], tmp_path: Path, image_key: bytes, scheme: str
) -> None:
    provider, src, dst = hosts
    store, image_id, files = _image(tmp_path, image_key)
    state = Path(dst.workdir or tmp_path) / "receiver"
    recv = _start_receiver(provider, dst, state, scheme)
    assert recv["url"].startswith(f"{scheme}://{dst.address}:") and "?fingerprint=sha256:" in recv["url"]
    url = _url(recv, scheme)
    pushed = _run_on(provider, src, ["image", "push", f"{store}#{image_id}", url, "--key-env", KEY_ENV])
    assert pushed["chunks_sent"] == pushed["chunks_total"] > 3
    # the target reads the received image from the receiver's directory, as a file:// store
    target = f"{recv['store']}#{image_id}"
    assert _run_on(provider, dst, ["image", "verify", target, "--key-env", KEY_ENV])["ok"]
    out = Path(dst.workdir or tmp_path) / "restored"
    _run_on(provider, dst, ["image", "unpack", target, str(out), "--key-env", KEY_ENV])
    for f in files.iterdir():
        assert (out / files.name / f.name).read_bytes() == f.read_bytes()
    final = stop_receiver(state)
    assert final.state == "stopped"
    assert final.stats["chunks_received"] == pushed["chunks_sent"] and final.stats["chunks_rejected"] == 0
    assert final.stats["images"] == [image_id]
    assert final.stats["chunks_via_nixl"] == (pushed["chunks_sent"] if scheme == "nixl" else 0)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_damaged_chunk_is_detected_and_sent_again(
    hosts: tuple[LocalProvider, Host, Host], tmp_path: Path, image_key: bytes, scheme: str
) -> None:
    provider, src, dst = hosts
    store, image_id, _ = _image(tmp_path, image_key, mib=6)
    victim = sorted(json.loads((file_root(store) / "manifests" / image_id).read_bytes())["body"]["objects"])[0]
    state = Path(dst.workdir or tmp_path) / "receiver"
    recv = _start_receiver(provider, dst, state, scheme)
    script = str(Path(__file__).with_name("transfer_damaging_push.py"))
    stats = _run_on(provider, src, [script, store, image_id, _url(recv, scheme), victim], module=False)
    assert stats["damaged_reads"] == 1
    assert stats["chunks_resent_invalid"] == 1 and stats["chunks_sent"] == stats["chunks_total"] + 1
    assert verify(recv["store"], image_id, key=image_key).chunks_total == stats["chunks_total"]
    final = stop_receiver(state)
    assert final.stats["chunks_rejected"] == 1  # detected where it landed, never stored


def _stored(state: Path) -> int:
    chunks = state / "store" / "chunks"
    return sum(1 for p in chunks.rglob("*") if p.is_file() and not p.name.startswith(".")) if chunks.exists() else 0


@pytest.mark.parametrize("scheme", SCHEMES)
def test_receiver_killed_mid_transfer_then_resume_moves_only_missing_chunks(
    hosts: tuple[LocalProvider, Host, Host], tmp_path: Path, image_key: bytes, scheme: str
) -> None:
    provider, src, dst = hosts
    store, image_id, _ = _image(tmp_path, image_key, mib=16)
    state = Path(dst.workdir or tmp_path) / "receiver"
    recv = _start_receiver(provider, dst, state, scheme)
    url = _url(recv, scheme)
    image = f"{store}#{image_id}"
    slow = _spawn(provider, src, ["image", "push", image, url, "--key-env", KEY_ENV, "-j", "2", "--rate-limit", "3MB"])
    deadline = time.monotonic() + 60
    while _stored(state) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    provider.signal(dst, recv["pid"], signal.SIGKILL)
    code, text = _wait(provider, src, slow)
    assert code == 1 and "receiver" in text and "Traceback" not in text  # a clean transfer error
    assert not (state / "store" / "manifests").exists()  # the image is not there: no manifest
    # One chunk left behind comes back damaged (what a crash can leave): it must not be trusted.
    left = sorted(p for p in (state / "store" / "chunks").rglob("*") if p.is_file() and not p.name.startswith("."))
    damaged = bytearray(left[0].read_bytes())
    damaged[len(damaged) // 2] ^= 1
    left[0].write_bytes(damaged)
    recv = _start_receiver(provider, dst, state, scheme)
    resumed = _run_on(provider, src, ["image", "push", image, _url(recv, scheme), "--key-env", KEY_ENV])
    assert resumed["chunks_skipped"] == len(left) - 1 >= 2  # what survived, verified again by the new receiver
    assert resumed["chunks_sent"] == resumed["chunks_total"] - resumed["chunks_skipped"]
    assert verify(recv["store"], image_id, key=image_key).chunks_total == resumed["chunks_total"]
    final = stop_receiver(state)
    assert final.stats["chunks_present"] == len(left) - 1 and final.stats["chunks_discarded"] == 1


def test_wrong_pinned_fingerprint_is_refused_before_any_byte_moves(
    hosts: tuple[LocalProvider, Host, Host], tmp_path: Path, image_key: bytes
) -> None:
    provider, src, dst = hosts
    store, image_id, _ = _image(tmp_path, image_key, mib=2)
    state = Path(dst.workdir or tmp_path) / "receiver"
    recv = _start_receiver(provider, dst, state, "stream")
    wrong = recv["url"].split("?")[0] + "?fingerprint=sha256:" + "ab" * 32
    push_args = ["image", "push", f"{store}#{image_id}", wrong, "--key-env", KEY_ENV]
    code, text = _wait(provider, src, _spawn(provider, src, push_args))
    assert code == 2 and "not the pinned" in text and "Traceback" not in text
    final = stop_receiver(state)
    assert final.stats["clients"] == 1  # only stop_receiver's own connection: the refused push sent no request
    assert final.stats["chunks_received"] == 0 and final.stats["refusals"] == 0
    assert _stored(state) == 0


def _raw(address: tuple[str, int], frame: bytes) -> tuple[int | None, bytes, bool]:
    """Send one frame over a fresh TLS connection: (status, body, closed afterwards); status None when
    the receiver closed the connection before its reply could be read (it refuses an oversized frame
    from an unauthenticated client before reading it, so the client may see a reset)."""
    import socket
    import ssl

    from gpumigrate.transfer.stores.wire import REPLY

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(address, timeout=10) as raw, ctx.wrap_socket(raw) as sock:
        head = b""
        try:
            sock.sendall(frame)
            while len(head) < REPLY.size:
                more = sock.recv(REPLY.size - len(head))
                if not more:
                    return None, b"", True
                head += more
        except (ConnectionError, ssl.SSLError):
            return None, b"", True
        status, length = REPLY.unpack(head)
        body = b""
        while len(body) < length:
            body += sock.recv(length - len(body))
        sock.settimeout(2)
        try:
            closed = sock.recv(1) == b""
        except TimeoutError:
            closed = False  # still open: an authenticated connection waits for the next request
        except (ConnectionError, ssl.SSLError):
            closed = True
        return status, body, closed


def test_an_unauthenticated_client_gets_nothing(
    hosts: tuple[LocalProvider, Host, Host], tmp_path: Path, image_key: bytes
) -> None:
    from gpumigrate import control
    from gpumigrate.transfer.format.chunkobj import Sealer, chunk_id_of
    from gpumigrate.transfer.stores.wire import (
        DENIED,
        FLUSH,
        GET_MANIFEST,
        HAS_CHUNK,
        HELLO,
        LIST_CHUNKS,
        LIST_MANIFESTS,
        MAGIC,
        NIXL_OPEN,
        NO_ID,
        PUT_CHUNK,
        PUT_MANIFEST,
        REQUEST,
        SHUTDOWN,
        hello_request,
    )

    provider, src, dst = hosts
    store, image_id, _ = _image(tmp_path, image_key, mib=2)
    state = Path(dst.workdir or tmp_path) / "receiver"
    recv = _start_receiver(provider, dst, state, "nixl")
    _run_on(provider, src, ["image", "push", f"{store}#{image_id}", _url(recv, "nixl"), "--key-env", KEY_ENV])
    held = sorted(p.name for p in (state / "store" / "chunks").rglob("*") if p.is_file())
    address = (dst.address, int(recv["url"].split("?")[0].rsplit(":", 1)[1]))
    fingerprint = recv["url"].split("sha256:")[1]
    plain = os.urandom(1 << 16)
    cid = chunk_id_of(plain)
    blob = bytes(Sealer(image_key).seal(cid, 0, len(plain), plain))  # a valid chunk: only the client is wrong

    def frame(kind: int, ident: bytes = NO_ID, payload: bytes = b"") -> bytes:
        return REQUEST.pack(MAGIC, kind, ident, len(payload)) + payload

    attempts = {
        "listing": frame(LIST_CHUNKS),
        "images": frame(LIST_MANIFESTS),
        "manifest": frame(GET_MANIFEST, bytes.fromhex(image_id)),
        "chunk": frame(HAS_CHUNK, bytes.fromhex(held[0])),
        "write": frame(PUT_CHUNK, bytes.fromhex(cid), blob),
        "manifest write": frame(PUT_MANIFEST, bytes.fromhex(image_id), b"{}"),
        "flush": frame(FLUSH),
        "nixl slots": frame(NIXL_OPEN, payload=b"{}"),
        "shutdown": frame(SHUTDOWN),
        "hello with another key": frame(HELLO, payload=json.dumps(hello_request(os.urandom(32), fingerprint)).encode()),
        "hello for another certificate": frame(
            HELLO, payload=json.dumps(hello_request(control.load_key(), "cd" * 32)).encode()
        ),
        "unsigned hello": frame(HELLO, payload=b'{"op": "hello", "version": 2}'),
    }
    for what, data in attempts.items():
        status, body, closed = _raw(address, data)
        assert status in (DENIED, None) and closed, what
        assert image_id not in body.decode(errors="replace") and held[0] not in body.decode(errors="replace"), what
    replayed = json.dumps(hello_request(control.load_key(), fingerprint)).encode()
    assert _raw(address, frame(HELLO, payload=replayed))[0] == 0  # the genuine one, once
    assert _raw(address, frame(HELLO, payload=replayed))[0] == DENIED  # the same bytes again: a replay
    assert sorted(p.name for p in (state / "store" / "chunks").rglob("*") if p.is_file()) == held  # nothing written
    final = stop_receiver(state)  # still serving: the refusals did not stop it
    assert final.state == "stopped" and final.stats["refusals"] == len(attempts) + 1


def test_nixl_missing_or_failing_to_load_names_the_package_and_stream_still_works(
    hosts: tuple[LocalProvider, Host, Host], tmp_path: Path, image_key: bytes
) -> None:
    provider, src, dst = hosts
    store, image_id, _ = _image(tmp_path, image_key, mib=2)
    broken = tmp_path / "broken-site" / "nixl_cu13"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(
        "raise OSError('libucp.so.0: cannot open shared object file: No such file or directory')\n"
    )
    env = {KEY_ENV: os.environ[KEY_ENV], "PYTHONPATH": str(broken.parent)}
    cli = [sys.executable, "-m", "gpumigrate"]
    recv_nixl = provider.spawn(
        dst, [*cli, "image", "receive", "--state-dir", str(tmp_path / "r1"), "--nixl", "--key-env", KEY_ENV], env=env
    )
    code, text = _wait(provider, dst, recv_nixl)
    assert code == 2 and "nixl-cu13" in text and "failed to load" in text and "Traceback" not in text
    state = Path(dst.workdir or tmp_path) / "receiver"
    recv = _start_receiver(provider, dst, state, "stream")
    nixl_url = recv["url"].replace("stream://", "nixl://", 1)
    pushed = provider.spawn(
        src, [*cli, "image", "push", f"{store}#{image_id}", nixl_url, "--key-env", KEY_ENV], env=env
    )
    code, text = _wait(provider, src, pushed)
    assert code == 2 and "nixl-cu13" in text and "use stream://" in text
    ok = provider.spawn(
        src, [*cli, "image", "push", f"{store}#{image_id}", recv["url"], "--key-env", KEY_ENV, "--json"], env=env
    )
    code, text = _wait(provider, src, ok)
    assert code == 0, text
    assert json.loads(text.strip().splitlines()[-1])["chunks_sent"] > 0
    assert verify(recv["store"], image_id, key=image_key)


def test_unsigned_image_is_refused_by_the_receiver_and_the_target(
    hosts: tuple[LocalProvider, Host, Host], tmp_path: Path, image_key: bytes
) -> None:
    provider, src, dst = hosts
    files = tmp_path / "plain"
    files.mkdir()
    (files / "data").write_bytes(os.urandom(1 << 20))
    store = f"file://{tmp_path / 'unsigned'}"
    image_id = pack_paths([files], store, key=None).id  # alg none: anyone who can write a store can make one
    state = Path(dst.workdir or tmp_path) / "receiver"
    argv = receiver_argv(state, ReceiverOptions(listen=f"{dst.address}:{dst.ports['stream']}"), key_ref=None)
    proc = provider.spawn(dst, argv, name="receiver")
    info = read_receiver_info(state, timeout_s=60, pid=proc["pid"])
    code, text = _wait(
        provider, src, _spawn(provider, src, ["image", "push", f"{store}#{image_id}", info.url, "--no-key"])
    )
    assert code != 0 and "unsigned" in text
    assert not (state / "store" / "manifests").exists()
    stop_receiver(state)
    # where a developer allows it on both sides, it lands; a target without the flag still refuses to read it
    dev = {"GPUMIGRATE_ALLOW_UNSIGNED_IMAGES": "1"}
    proc = provider.spawn(dst, argv, env=dev, name="receiver")
    info = read_receiver_info(state, timeout_s=60, pid=proc["pid"])
    pushing = provider.spawn(
        src, [sys.executable, "-m", "gpumigrate", "image", "push", f"{store}#{image_id}", info.url, "--no-key"], env=dev
    )
    assert _wait(provider, src, pushing)[0] == 0
    target = f"{info.store}#{image_id}"
    code, text = _wait(provider, dst, _spawn(provider, dst, ["image", "verify", target, "--no-key"]))
    assert code == 2 and "GPUMIGRATE_ALLOW_UNSIGNED_IMAGES" in text
    stop_receiver(state)

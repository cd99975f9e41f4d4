"""A receiver on a target host: its state directory, the detached process, the address file, stopping it.

A flow starts one on the target (``receiver_argv`` is the command to run there, through the
host's provider; ``start_receiver`` runs it detached on this machine), reads the address and the
certificate fingerprint from ``receiver.json`` (``read_receiver_info``), pushes to the pinned URL,
lets the target verify and restore from ``store/``, then stops it (``stop_receiver``: an
authenticated SHUTDOWN, which works across hosts; a signal where the process is local).

State directory (TRANSPORTS.md, "A receiver on a host")::

    <state_dir>/receiver.json   written atomically once listening; rewritten with the final counts on a clean stop
    <state_dir>/store/          the file:// store that verify and restore read
    <state_dir>/receiver.log    the detached process's output
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumigrate.atomic import atomic_write_json
from gpumigrate.errors import GpumigrateError, InvalidInputError, TransferError
from gpumigrate.transfer.receiver.admission import ReceiverLimits
from gpumigrate.transfer.receiver.server import Receiver, serve_stream

INFO_FILE = "receiver.json"
STORE_DIR = "store"
LOG_FILE = "receiver.log"
INFO_FORMAT = 1


@dataclass(frozen=True)
class ReceiverInfo:
    """What ``receiver.json`` says: where to push (``url``, certificate pinned) and where the image lands."""

    url: str
    fingerprint: str
    host: str
    port: int
    store: str
    pid: int
    state: str  # "running" or "stopped"
    nixl: bool
    stats: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> ReceiverInfo:
        return cls(
            url=str(doc["url"]),
            fingerprint=str(doc["fingerprint"]),
            host=str(doc["host"]),
            port=int(doc["port"]),
            store=str(doc["store"]),
            pid=int(doc["pid"]),
            state=str(doc["state"]),
            nixl=bool(doc.get("nixl")),
            stats=dict(doc.get("stats") or {}),
        )


def store_url(state_dir: str | Path) -> str:
    return f"file://{Path(state_dir).resolve() / STORE_DIR}"


@dataclass(frozen=True)
class ReceiverOptions:
    """How a receiver listens and what it takes (the flags of ``gpumigrate image receive``)."""

    listen: str = "127.0.0.1:0"  # host:port; port 0 picks one; loopback unless the caller names an address
    advertise: str | None = None  # the host name senders use when ``listen`` is a wildcard
    quota_bytes: int | None = None
    nixl: bool = False  # also land nixl:// WRITEs
    nixl_transports: str | None = None  # UCX_TLS for NIXL, e.g. "tcp"
    limits: ReceiverLimits = field(default_factory=ReceiverLimits)  # the handshake's deadline, connection caps

    def flags(self) -> list[str]:
        out = ["--listen", self.listen]
        if self.advertise:
            out += ["--advertise", self.advertise]
        if self.quota_bytes is not None:
            out += ["--quota", str(int(self.quota_bytes))]
        if self.nixl:
            out += ["--nixl"]
        if self.nixl_transports:
            out += ["--nixl-transports", self.nixl_transports]
        if self.limits != ReceiverLimits():
            out += ["--handshake-timeout", f"{self.limits.handshake_timeout_s:g}"]
            out += ["--max-unauthenticated", str(self.limits.max_unauthenticated)]
            out += ["--max-clients", str(self.limits.max_clients)]
        return out


def receiver_argv(
    state_dir: str | Path, options: ReceiverOptions, *, key_ref: Mapping[str, str] | None, python: str | None = None
) -> list[str]:
    """The command that runs a receiver in the foreground on a host (its provider starts it there).

    ``key_ref`` names the image key (``{"env": NAME}`` or ``{"file": PATH}``; None: unencrypted
    images only); the control key reaches the process by reference, through its environment
    (``gpumigrate.control.reference_env``), never in argv.
    """
    argv = [python or sys.executable, "-m", "gpumigrate", "image", "receive", "--state-dir", str(state_dir)]
    if key_ref and key_ref.get("env"):
        argv += ["--key-env", key_ref["env"]]
    elif key_ref and key_ref.get("file"):
        argv += ["--key-file", key_ref["file"]]
    else:
        argv += ["--no-key"]
    return argv + options.flags()


def _info_doc(receiver: Receiver, state: str) -> dict[str, Any]:
    return {
        "format": INFO_FORMAT,
        "state": state,
        "pid": os.getpid(),
        "url": receiver.url,
        "fingerprint": f"sha256:{receiver.fingerprint}",
        "host": receiver.public_host,
        "port": receiver.port,
        "store": receiver.store.url,
        "nixl": receiver.landing is not None,
        "started": time.time(),
        "stats": receiver.stats() if state == "stopped" else {},
    }


def run_receiver(
    state_dir: str | Path | None,
    options: ReceiverOptions,
    *,
    key: bytes | None,
    store: str | None = None,
    on_ready: Callable[[dict[str, Any]], None] | None = None,
    exit_after: int = 0,
) -> dict[str, Any]:
    """Serve in the foreground until SIGTERM/SIGINT, an authenticated SHUTDOWN or (``exit_after`` > 0)
    that many images arrived; return the final counts.

    With ``state_dir`` the store defaults to ``<state_dir>/store`` and ``receiver.json`` is written
    there; ``on_ready(info_doc)`` is called once the receiver listens.
    """
    if state_dir is None and store is None:
        raise InvalidInputError("a receiver needs a state directory (--state-dir) or a store (--store)")
    root = Path(state_dir).resolve() if state_dir is not None else None
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
        store = store or store_url(root)
    assert store is not None  # a state directory, or a store, as checked above
    receiver = serve_stream(
        options.listen,
        store,
        key=key,
        quota_bytes=options.quota_bytes,
        nixl=options.nixl,
        nixl_transports=options.nixl_transports,
        advertise=options.advertise,
        limits=options.limits,
    )
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: receiver.stop_requested.set())
    try:
        doc = _info_doc(receiver, "running")
        if root is not None:
            atomic_write_json(root / INFO_FILE, doc)
        if on_ready is not None:
            on_ready(doc)
        while not receiver.stop_requested.wait(0.2):
            if exit_after and len(receiver.manifests) >= exit_after:
                break
    finally:
        receiver.close()
    final = _info_doc(receiver, "stopped")
    if root is not None:
        atomic_write_json(root / INFO_FILE, final)
    return dict(final["stats"])


def read_receiver_info(state_dir: str | Path, *, timeout_s: float = 0.0, pid: int | None = None) -> ReceiverInfo:
    """The receiver's ``receiver.json``, waiting up to ``timeout_s`` for a running one (of ``pid`` if given)."""
    path = Path(state_dir) / INFO_FILE
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            info = ReceiverInfo.from_json(json.loads(path.read_text()))
            if info.state == "running" and (pid is None or info.pid == pid):
                return info
            if timeout_s <= 0:
                return info
        if time.monotonic() >= deadline:
            raise TransferError(f"no running receiver in {state_dir} (no {INFO_FILE} written within {timeout_s}s)")
        time.sleep(0.05)


def start_receiver(
    state_dir: str | Path,
    options: ReceiverOptions,
    *,
    key_ref: Mapping[str, str] | None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
) -> ReceiverInfo:
    """Run a receiver detached on this machine (its own session, output in ``receiver.log``) and wait until it listens."""
    root = Path(state_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    argv = receiver_argv(root, options, key_ref=key_ref)
    with open(root / LOG_FILE, "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # outlives the command that started it; stopped by stop_receiver
            env={**os.environ, **(env or {})},
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (root / LOG_FILE).read_text(errors="replace").strip().splitlines()[-3:]
            raise TransferError(f"the receiver exited at start (code {proc.returncode}): {' | '.join(tail)}")
        with contextlib.suppress(TransferError):
            return read_receiver_info(root, timeout_s=0.2, pid=proc.pid)
    proc.kill()
    raise TransferError(f"the receiver did not start listening within {timeout_s}s (log: {root / LOG_FILE})")


def _ours(pid: int, root: Path) -> bool:
    """True while ``pid`` runs a receiver of this state directory (checked on its command line, so a
    recycled pid, or a pid named by a receiver on another host, is never signalled)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0]:  # our own child that exited: reaped, gone
            return False
    return b"receive" in argv and str(root).encode() in argv


def stop_receiver(state_dir: str | Path, *, control_key: bytes | None = None, timeout_s: float = 30.0) -> ReceiverInfo:
    """Stop the receiver of ``state_dir``: an authenticated SHUTDOWN (it flushes its store first, and works
    across hosts), then SIGTERM if its process runs on this machine and has not exited. Returns the final
    ``receiver.json`` (``state`` is "stopped" after a clean stop)."""
    from gpumigrate.transfer.stores.stream import StreamStore

    root = Path(state_dir).resolve()
    info = read_receiver_info(root)
    if info.state != "running":
        return info
    sender = None
    try:
        sender = StreamStore("stream://" + info.url.split("://", 1)[1], connections=1, control_key=control_key)
        sender.shutdown_receiver()
    except GpumigrateError:
        pass  # gone already, or unreachable: the signal below covers a process on this machine
    finally:
        if sender is not None:
            sender.close()
    deadline = time.monotonic() + timeout_s
    while _ours(info.pid, root) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _ours(info.pid, root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(info.pid, signal.SIGTERM)
        while _ours(info.pid, root) and time.monotonic() < deadline + 10:
            time.sleep(0.05)
    return read_receiver_info(root)

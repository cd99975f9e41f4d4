"""The detached front door: the one a user starts (``gpumigrate frontdoor up``), which outlives the command.

:func:`start_detached` starts one process, ``python -m gpumigrate.traffic.supervisor``, in its own session, which
runs the control plane (so the traffic lease is watched even when the orchestrator dies) and Envoy as its children,
starts either again when it dies (:mod:`gpumigrate.traffic.supervisor`), and on SIGTERM stops both and removes
``frontdoor.json`` (its format: :mod:`gpumigrate.traffic.frontdoor`); :func:`door_status` and :func:`stop_detached`
find it again from the state directory. A pid is signalled only while its command line names that directory.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpumigrate.errors import InvalidInputError, TrafficError
from gpumigrate.traffic import access_control
from gpumigrate.traffic.frontdoor import (
    ANY_WORKLOAD,
    DEFAULT_HEALTH_PATH,
    DEFAULT_LISTEN,
    FRONTDOOR,
    LOG,
    SOURCE,
    DoorInfo,
    check,
    parse_listen,
    read,
    same_hostport,
)
from gpumigrate.traffic.state import StateStore


def _ours(pid: int | None, state_dir: Path) -> bool:
    """Whether ``pid`` runs and is this door's: its command line names the state directory (a reused pid does not)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read()
        with open(f"/proc/{pid}/stat") as fh:
            zombie = fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False
    return not zombie and str(state_dir.resolve()).encode() in argv


def _stop_process(pid: int, state_dir: Path, *, group: bool, grace_s: float) -> bool:
    """SIGTERM (its process group when ``group``), SIGKILL after ``grace_s``; only a process that is ours."""
    if not _ours(pid, state_dir):
        return False
    send = os.killpg if group else os.kill
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            send(pid, sig)
        deadline = time.monotonic() + grace_s
        while _ours(pid, state_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _ours(pid, state_dir):
            return True
    return not _ours(pid, state_dir)


def _port_free(host: str, port: int) -> bool:
    if port == 0:
        return True
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Envoy binds: a TIME_WAIT does not count
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def start_detached(
    state_dir: Path,
    *,
    source_host: str,
    source_port: int,
    health_path: str = DEFAULT_HEALTH_PATH,
    listen: str = DEFAULT_LISTEN,
    node_id: str = "gpumigrate-envoy",
    timeout_s: float = 60.0,
) -> tuple[DoorInfo, bool]:
    """Start the detached front door of ``state_dir`` (it outlives this process); ``(door, started)``.

    A door already up there for the same source is returned as is (``started`` False); one for another
    source is refused (exit 2), as is a listen address in use. Fails with the door's log when it does not
    come up; nothing is left running then.
    """
    listen_host, listen_port = parse_listen(listen)
    state_dir = state_dir.resolve()
    wanted = f"http://{f'[{source_host}]' if ':' in source_host else source_host}:{source_port}"
    running = _running(state_dir)
    if running is not None:
        if same_hostport(running.source, wanted):
            return running, False
        which = "" if state_dir.name == ANY_WORKLOAD else f" --workload {state_dir.name}"
        raise InvalidInputError(
            f"a front door is up in {state_dir} for source {running.source}: stop it first "
            f"(`gpumigrate frontdoor down{which}`) to front {wanted}"
        )
    stop_detached(state_dir)  # what a door that died left behind (its Envoy, its frontdoor.json)
    if not _port_free(listen_host, listen_port):
        raise InvalidInputError(f"cannot listen on {listen}: the address is in use (choose another with --listen)")
    access_control.private_dir(state_dir)
    argv = [sys.executable, "-m", "gpumigrate.traffic.supervisor", "--state-dir", str(state_dir),
            "--source", f"{source_host}:{source_port}", "--health-path", health_path, "--listen", listen,
            "--node-id", node_id]  # fmt: skip
    with os.fdopen(access_control.open_private_log(state_dir / LOG), "ab") as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(TrafficError):
            door = read(state_dir)
            if door.processes.get("frontdoor") == proc.pid:
                return door, True
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                _stop_process(proc.pid, state_dir, group=False, grace_s=5)
            proc.wait(timeout=30)
            raise TrafficError(f"the front door did not come up; its log ({state_dir / LOG}):\n{_tail(state_dir)}")
        time.sleep(0.05)


def _tail(state_dir: Path, lines: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n".join((state_dir / LOG).read_text(errors="replace").splitlines()[-lines:])
    return ""


def _running(state_dir: Path) -> DoorInfo | None:
    """The detached door of ``state_dir`` whose own process still runs, or None."""
    try:
        door = read(state_dir)
    except TrafficError:
        return None
    return door if _ours(door.processes.get("frontdoor"), state_dir) else None


def door_status(state_dir: Path) -> dict[str, Any]:
    """What is up in ``state_dir``: the door's processes, whether Envoy answers, the weights and the lease."""
    try:
        door = read(state_dir)
    except TrafficError:
        return {"state_dir": str(state_dir), "up": False}
    try:
        check(state_dir)
        live = True
    except TrafficError:
        live = False
    store = StateStore(state_dir)
    desired = store.read() if store.exists() else None
    lease = None
    with contextlib.suppress(TrafficError):
        lease = store.lease()
    return {
        "state_dir": str(state_dir),
        "up": live,
        "source": door.source,
        "listener": door.listener,
        "admin_urls": door.admin_urls,
        "processes": {name: {"pid": pid, "running": _ours(pid, state_dir)} for name, pid in door.processes.items()},
        "weights": desired.weights if desired else None,
        "health_path": desired.upstreams[SOURCE].health_path if desired and SOURCE in desired.upstreams else None,
        "rolled_back": desired.rolled_back if desired else None,
        "lease": lease.to_json() if lease is not None else None,
    }


def stop_detached(state_dir: Path) -> list[str]:
    """Stop the detached door of ``state_dir`` (its process first: it stops Envoy and removes
    ``frontdoor.json``; then whatever it could not). Returns what was stopped. Idempotent."""
    state_dir = state_dir.resolve()
    try:
        door = read(state_dir)
    except TrafficError:
        return []
    stopped = [name for name in ("frontdoor", "envoy", "control-plane") if _stop_process(
        door.processes.get(name, 0), state_dir, group=name != "frontdoor", grace_s=10)]  # fmt: skip
    if door.processes:  # a door started by a process of its own (not a demo's or a test's in-process one)
        (state_dir / FRONTDOOR).unlink(missing_ok=True)
    return stopped

"""The supervisor of one local host: the process that *is* the host.

    python -m gpumigrate.infra.supervisor --name local-a --workdir DIR --socket NAME [--parent-fd FD] [--netns NS]

It runs the host's processes (each in its own process group, inside the host's network namespace
if it has one) and guarantees none outlives the host:

* every child is started with ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` from this single-threaded
  process, so if the supervisor dies, even by SIGKILL, the kernel kills its children;
* in attached mode (``--parent-fd``) the supervisor holds the read end of a pipe whose write end
  only the launching process holds; EOF means that process is gone (however it died, whichever
  thread started us), and the supervisor shuts the host down: children, then the namespace;
* what it started is written to ``DIR/supervisor.json`` (atomic), so a reaper can finish the job
  after a SIGKILL of the supervisor itself (see ``infra/local.py``).

Control: an abstract Unix socket (no path length limit, nothing to delete), one JSON request per
connection, one JSON reply; only the same uid may connect. Protocol in ``infra/LOCAL.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from gpumigrate.atomic import atomic_write_json

PR_SET_PDEATHSIG = 1
CLONE_NEWNET = 0x40000000
CLONE_NEWNS, MS_REC, MS_SLAVE, MNT_DETACH = 0x00020000, 0x4000, 0x80000, 2
MARKER_ENV = "GPUMIGRATE_LOCAL_HOST_TOKEN"  # in every child's environment: lets a reaper prove ownership


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def child_preexec(supervisor_pid: int, netns_path: str | None) -> Callable[[], None]:
    """Runs in the forked child before exec: own process group, die with the supervisor, enter the netns."""

    def preexec() -> None:
        os.setsid()
        libc = _libc()
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != supervisor_pid:  # the supervisor died before prctl took effect
            os._exit(1)
        if netns_path:
            fd = os.open(netns_path, os.O_RDONLY)
            if libc.setns(fd, CLONE_NEWNET) != 0:
                os._exit(126)
            os.close(fd)
            # As `ip netns exec` does: a private /sys that lists this namespace's interfaces (sysfs shows
            # the namespace of whoever mounted it; UCX, used by NIXL, finds network devices there).
            if libc.unshare(CLONE_NEWNS) == 0 and libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None) == 0:
                libc.umount2(b"/sys", MNT_DETACH)
                libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None)
            else:
                os.write(2, f"DEBUGNS unshare/mount failed errno {ctypes.get_errno()}\n".encode())

    return preexec


# ----------------------------------------------------------------- used by the provider (infra/local.py)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False


def owned_by(pid: int, token: str) -> bool:
    """Whether ``pid`` carries this host's marker: never kill a recycled pid that is someone else's."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return f"{MARKER_ENV}={token}".encode() in fh.read().split(b"\0")
    except OSError:
        return False


def kill_owned(pid: int, token: str) -> None:
    if pid_alive(pid) and owned_by(pid, token):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def last_words(workdir: str | Path, limit: int = 300) -> str:
    """The last line a host's supervisor wrote to its log (why it stopped, or the end of its traceback)."""
    with contextlib.suppress(OSError):
        lines = (Path(workdir) / "supervisor.log").read_text(errors="replace").strip().splitlines()
        return lines[-1][-limit:] if lines else "its log is empty"
    return "no log"


def call_supervisor(sock_name: str, request: Mapping[str, Any], timeout_s: float = 10.0) -> dict[str, Any]:
    """One request to a host's supervisor over its abstract Unix socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect("\0" + sock_name)
        s.sendall((json.dumps(dict(request)) + "\n").encode())
        buf = b""
        while not buf.endswith(b"\n"):
            part = s.recv(65536)
            if not part:
                break
            buf += part
    reply: dict[str, Any] = json.loads(buf)
    return reply


# ----------------------------------------------------------------- the supervisor process


class Supervisor:
    def __init__(self, name: str, workdir: Path, sock_name: str, parent_fd: int | None, netns: str | None) -> None:
        self.name = name
        self.workdir = workdir
        self.sock_name = sock_name
        self.parent_fd = parent_fd
        self.netns = netns
        self.token = os.environ.get(MARKER_ENV, "")
        self.children: dict[int, dict[str, Any]] = {}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.stopping = False
        self.stop_reason = "unknown"  # written to the log when the host goes down: local.py quotes it
        self.sel = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + sock_name)
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, "listen")
        if parent_fd is not None:
            self.sel.register(parent_fd, selectors.EVENT_READ, "parent")
        (workdir / "logs").mkdir(parents=True, exist_ok=True)
        self._save()

    def _save(self) -> None:
        atomic_write_json(
            self.workdir / "supervisor.json",
            {"pid": os.getpid(), "name": self.name, "netns": self.netns, "children": list(self.children.values())},
        )

    # ------------------------------------------------------------------ requests
    def spawn(self, req: dict[str, Any]) -> dict[str, Any]:
        argv = req.get("argv")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            return {"ok": False, "error": "argv must be a non-empty list of strings"}
        cwd = req.get("cwd") or str(self.workdir)
        if not isinstance(cwd, str) or not Path(cwd).is_dir():
            return {"ok": False, "error": f"cwd {cwd!r} is not a directory on host {self.name}"}
        label = str(req.get("name") or Path(argv[0]).name)
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
        env[MARKER_ENV] = self.token
        log_path = self.workdir / "logs" / f"{label}-{int(time.time() * 1000)}.log"
        netns_path = f"/var/run/netns/{self.netns}" if self.netns else None
        with open(log_path, "ab") as log:
            try:
                proc = subprocess.Popen(
                    argv,
                    cwd=cwd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=child_preexec(os.getpid(), netns_path),  # single-threaded process: preexec is safe
                    close_fds=True,
                )
            # A preexec that failed too (SubprocessError): that request fails, never the host and what runs on it.
            except (OSError, subprocess.SubprocessError) as exc:
                return {"ok": False, "error": f"cannot start {argv[0]!r}: {exc}"}
        self.procs[proc.pid] = proc
        self.children[proc.pid] = {
            "pid": proc.pid,
            "name": label,
            "argv": argv,
            "log": str(log_path),
            "started": time.time(),
            "returncode": None,
            "ends_host": bool(req.get("ends_host")),
        }
        self._save()
        return {"ok": True, "pid": proc.pid, "log": str(log_path)}

    def signal_child(self, req: dict[str, Any]) -> dict[str, Any]:
        pid, sig = req.get("pid"), int(req.get("sig", signal.SIGTERM))
        if pid not in self.procs:
            return {"ok": False, "error": f"pid {pid!r} is not a process of host {self.name}"}
        if self.procs[pid].poll() is None:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass
        return {"ok": True}

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        self.reap()
        if op == "ping":
            return {"ok": True, "pid": os.getpid(), "name": self.name, "netns": self.netns}
        if op == "spawn":
            return self.spawn(req)
        if op == "signal":
            return self.signal_child(req)
        if op == "list":
            return {"ok": True, "children": list(self.children.values())}
        if op == "shutdown":
            self.stopping, self.stop_reason = True, "asked to shut down (its host was terminated)"
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}; allowed: ping, spawn, signal, list, shutdown"}

    def _serve_client(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _, uid, _ = struct.unpack("3i", creds)
            if uid != os.getuid():
                conn.sendall(b'{"ok": false, "error": "permission denied"}\n')
                return
            buf = b""
            while not buf.endswith(b"\n"):
                part = conn.recv(65536)
                if not part:
                    break
                buf += part
            try:
                req = json.loads(buf or b"{}")
                reply = self.handle(req if isinstance(req, dict) else {})
            except ValueError as exc:
                reply = {"ok": False, "error": f"bad request: {exc}"}
            conn.sendall((json.dumps(reply) + "\n").encode())
        except OSError:
            pass
        finally:
            conn.close()

    # ------------------------------------------------------------------ lifecycle
    def reap(self) -> None:
        changed = False
        for pid, proc in self.procs.items():
            rc = proc.poll()
            if rc is not None and self.children[pid]["returncode"] is None:
                self.children[pid]["returncode"] = rc
                changed = True
                if self.children[pid].get("ends_host"):
                    # the host's work is done (a training job that finished): no idle host
                    self.stopping, self.stop_reason = True, f"its process {pid} ended (the host's job)"
        if changed:
            self._save()

    def run(self) -> None:
        while not self.stopping:
            for key, _ in self.sel.select(timeout=0.5):
                if key.data == "listen":
                    try:
                        conn, _ = self.listener.accept()
                    except BlockingIOError:
                        continue
                    conn.setblocking(True)
                    self._serve_client(conn)
                elif key.data == "parent" and self.parent_fd is not None and not os.read(self.parent_fd, 4096):
                    # EOF: the launching process is gone, however it died
                    self.stopping, self.stop_reason = True, "the process that launched it is gone (its pipe closed)"
            self.reap()
        self.shutdown()

    def shutdown(self, grace_s: float = 5.0) -> None:
        """SIGTERM every child's group, SIGKILL what is left after ``grace_s``, drop the namespace."""
        self.sel.close()
        self.listener.close()
        live = [p for p in self.procs.values() if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs.values():
            try:  # the group too: grandchildren outlive a leader that already exited
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if p.poll() is None:
                p.wait(timeout=5)
        self.reap()
        if self.netns:
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, check=False)
        self._save()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpumigrate.infra.supervisor")
    p.add_argument("--name", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--socket", required=True, help="abstract Unix socket name")
    p.add_argument("--parent-fd", type=int, default=None, help="exit when this pipe reaches EOF")
    p.add_argument("--netns", default=None, help="network namespace to run children in (deleted on exit)")
    args = p.parse_args(argv)
    sup = Supervisor(args.name, Path(args.workdir), args.socket, args.parent_fd, args.netns)

    def on_term(signum: int, frame: FrameType | None) -> None:
        sup.stopping, sup.stop_reason = True, f"signal {signal.Signals(signum).name}"

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    print(json.dumps({"event": "supervising", "pid": os.getpid(), "name": args.name}), flush=True)
    sup.run()
    print(json.dumps({"event": "stopped", "pid": os.getpid(), "reason": sup.stop_reason}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The detached front door's supervisor: Envoy and the control plane as its children, each started again when
it dies, so that a dead Envoy costs its restart time, not an operator's page.

``gpumigrate frontdoor up`` starts this process (``python -m gpumigrate.traffic.supervisor``, in its own
session; :func:`gpumigrate.traffic.detached.start_detached`). It runs

* the xDS control plane as a child process (``python -m gpumigrate.traffic.xds``) on its private socket (a
  path derived from the state directory, ``access_control.py``): a restarted one listens where Envoy's bootstrap
  points, proves nodes with the same ``xds.key``, reads the same state directory (the last weights and
  clusters, the traffic lease) and Envoy, which retries its ADS stream every second at most, takes its
  configuration from it again;
* Envoy as a child process, started again on the same ports and node id, so the control plane sends it the
  current state before it serves (its listeners are static, its routes and clusters come over ADS).

Liveness is read from the processes and from the control plane, never from Envoy's admin interface (which need
not be a TCP port): a child that exited is started again within :data:`SUPERVISE_S`; an Envoy whose process
lives but that the running control plane has not seen connected for :data:`ENVOY_UNSEEN_S` (hung, or cut off
from it) is killed and started again. Restarts are logged (``<state dir>/frontdoor.log``) and counted in
``frontdoor.json`` (``restarts``). SIGTERM stops both children and removes ``frontdoor.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpumigrate.errors import TrafficError
from gpumigrate.traffic import access_control
from gpumigrate.traffic.envoy import Envoy
from gpumigrate.traffic.frontdoor import DEFAULT_HEALTH_PATH, DEFAULT_LISTEN, SOURCE, FrontDoor, parse_listen
from gpumigrate.traffic.state import DesiredState, StateStore, Upstream

SUPERVISE_S = 0.2  # how often the children are looked at: bounds the time from a death to its restart
ENVOY_UNSEEN_S = 30.0  # an Envoy process the control plane has not seen connected this long is started again
PLANE_START_S = 60.0  # for a control plane to print that it listens (a Python start on a loaded machine)
log = logging.getLogger("gpumigrate.traffic.supervisor")


class PlaneProcess:
    """The control plane as a child process, on its private socket (never TCP: ``access_control.py``)."""

    def __init__(self, state_dir: Path, *, log_path: Path) -> None:
        self.state_dir = state_dir
        self.log_path = log_path
        self.port: int | None = None  # no TCP port: Envoy's bootstrap points at the socket
        self.socket_path = access_control.xds_socket(state_dir)
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0  # epoch seconds of the running one's start: what it saw is newer than this

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> PlaneProcess:
        """Start it and wait until it listens (it prints ``listening SOCKET``); a refusal raises TrafficError."""
        self.started_at = time.time()
        argv = [sys.executable, "-m", "gpumigrate.traffic.xds", "--state-dir", str(self.state_dir)]
        with os.fdopen(access_control.open_private_log(self.log_path), "ab") as err:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        self.proc = proc
        line = _first_line(proc, PLANE_START_S)
        if not line.startswith("listening "):
            self.stop()
            raise TrafficError(
                f"the control plane did not say it listens on {self.socket_path} within {PLANE_START_S:g}s "
                f"(it said {line!r}; its log: {self.log_path})"
            )
        self.socket_path = Path(line.split(maxsplit=1)[1])
        return self

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
                break
        if proc.stdout is not None:
            proc.stdout.close()


def _first_line(proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    """The first line ``proc`` prints, or '' once it exited or ``timeout_s`` passed."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=0.2):
                return proc.stdout.readline().decode(errors="replace").strip()
            if proc.poll() is not None:
                return ""
    return ""


class Supervisor:
    """One front door's Envoy and control plane, each started again when it dies (see the module's docstring)."""

    def __init__(
        self,
        state_dir: Path,
        *,
        source_host: str,
        source_port: int,
        health_path: str = DEFAULT_HEALTH_PATH,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        node_id: str = "gpumigrate-envoy",
    ) -> None:
        self.state_dir = state_dir
        self.store = StateStore(state_dir)
        self.source = Upstream(SOURCE, source_host, source_port, health_path=health_path)
        self.plane = PlaneProcess(state_dir, log_path=state_dir / "control-plane.log")
        self.envoy = Envoy(state_dir / "envoy", state_dir=state_dir, node_id=node_id, listen_host=listen_host,
                           listen_port=listen_port or None)  # fmt: skip
        self.door: FrontDoor | None = None
        self.restarts = {"envoy": 0, "control-plane": 0}
        self._unseen_since: float | None = None  # since when the running control plane has not seen Envoy
        self._down_since: dict[str, float] = {}  # a restarted child, until it serves again

    def start(self, *, ready_timeout_s: float = 60.0) -> Supervisor:
        """The source at 100%, the control plane, then Envoy; returns once Envoy runs the configuration."""
        access_control.private_dir(self.state_dir)
        self.store.init(DesiredState(upstreams={SOURCE: self.source}, weights={SOURCE: 100.0}))
        self.plane.start()
        try:
            self.envoy.spawn()
            self.store.wait_applied(self.store.version(), [self.envoy.node_id], timeout_s=ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.door = FrontDoor(self.state_dir, self.plane, self.envoy, detached=True)
        self._write_info()
        return self

    def _write_info(self) -> None:
        if self.door is not None:
            self.door.write_info(processes={"control-plane": self.plane.pid}, restarts=dict(self.restarts))

    def envoy_seen(self) -> bool:
        """The running control plane has Envoy connected: it wrote so after it started."""
        status = self.store.status(self.envoy.node_id)
        return bool(status.get("connected")) and float(status.get("updated") or 0) >= self.plane.started_at

    def check(self) -> list[str]:
        """One look at both children; starts again whichever is dead (or an Envoy hung). Returns which."""
        restarted: list[str] = []
        if not self.plane.alive():
            code = self.plane.proc.returncode if self.plane.proc is not None else None
            log.warning("control plane exited (%s): starting it again on %s", code, self.plane.socket_path)
            try:
                self.plane.start()
            except TrafficError as exc:  # Envoy keeps its last configuration meanwhile; the next look tries again
                log.error("%s", exc)
                return restarted
            restarted.append("control-plane")
            self._unseen_since = None
        envoy = self.envoy.proc
        if envoy is None or envoy.poll() is not None:
            log.warning("envoy exited (%s): starting it again", envoy.returncode if envoy is not None else None)
            restarted.append(self._restart_envoy())
        elif self._unseen_for() > ENVOY_UNSEEN_S:
            log.warning("envoy (pid %d) runs but the control plane has not seen it for %.0fs: starting it again",
                        envoy.pid, ENVOY_UNSEEN_S)  # fmt: skip
            restarted.append(self._restart_envoy())
        for name in restarted:
            self.restarts[name] += 1
            self._down_since.setdefault(name, time.monotonic())
        if restarted:
            self._write_info()
        if self._down_since and self.envoy_seen():
            for name, since in self._down_since.items():
                log.info("%s serves again %.1fs after it was found dead", name, time.monotonic() - since)
            self._down_since.clear()
        return restarted

    def _unseen_for(self) -> float:
        if self.envoy_seen():
            self._unseen_since = None
            return 0.0
        if self._unseen_since is None:
            self._unseen_since = time.monotonic()
        return time.monotonic() - self._unseen_since

    def _restart_envoy(self) -> str:
        self.envoy.stop()
        self._unseen_since = None  # a new process gets the whole window to connect
        try:
            self.envoy.spawn()
        except OSError as exc:  # the next look tries again
            log.error("envoy could not be started again: %s", exc)
        return "envoy"

    def run(self, done: threading.Event) -> None:
        """Supervise until ``done`` is set."""
        while not done.wait(SUPERVISE_S):
            try:
                self.check()
                if self.door is not None:
                    self.door.rotate_access_log()  # bounded: rotated once large (traffic/access_log.py)
            except Exception:  # a look that failed must not end the supervision of a door that serves
                log.exception("supervision pass failed")

    def stop(self) -> None:
        for part in (self.envoy, self.plane):
            with contextlib.suppress(Exception):
                part.stop()
        if self.door is not None:
            with contextlib.suppress(OSError):
                (self.state_dir / "frontdoor.json").unlink(missing_ok=True)


def serve(state_dir: Path, *, source: str, health_path: str, listen: str, node_id: str) -> None:
    """The detached front door's process: supervise until SIGTERM/SIGINT, then stop both children."""
    source_host, source_port = parse_listen(source)
    listen_host, listen_port = parse_listen(listen)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    sup = Supervisor(state_dir, source_host=source_host, source_port=source_port, health_path=health_path,
                     listen_host=listen_host, listen_port=listen_port, node_id=node_id)  # fmt: skip
    sup.start()
    log.info("front door up: listener %s, source %s, control plane on %s", sup.envoy.url, source, sup.plane.socket_path)
    try:
        sup.run(done)
    finally:
        sup.stop()
        log.info("front door stopped")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m gpumigrate.traffic.supervisor", description=serve.__doc__)
    ap.add_argument("--state-dir", required=True, type=Path)
    ap.add_argument("--source", required=True, help="host:port of the source service")
    ap.add_argument("--health-path", default=DEFAULT_HEALTH_PATH)
    ap.add_argument("--listen", default=DEFAULT_LISTEN)
    ap.add_argument("--node-id", default="gpumigrate-envoy")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    serve(args.state_dir, source=args.source, health_path=args.health_path, listen=args.listen, node_id=args.node_id)


if __name__ == "__main__":
    main()

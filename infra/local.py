"""The local provider: "hosts" are supervised process groups on this machine.

Each host has a work directory ``hosts_dir()/<name>/`` holding ``host.json`` (the registry entry,
written atomically), its supervisor's ``supervisor.json`` and ``logs/``; its own ports on loopback;
and optionally its own network namespace with a shaped veth link (``netns=True``, root only).
Formats and the supervisor protocol: ``infra/LOCAL.md``.

No orphans: see ``infra/supervisor.py``. Attached hosts (the default; tests, flows) die with the
process that provisioned them; detached hosts (``gpumigrate hosts up``) live until
``gpumigrate hosts down``. :meth:`LocalProvider.reap_stale` (run by provision, list and down)
finishes the cleanup for any host whose supervisor is gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpumigrate import settings
from gpumigrate.atomic import atomic_write_json
from gpumigrate.errors import CapacityError, InvalidInputError, NotFoundError, ProviderError
from gpumigrate.filelock import FileLock
from gpumigrate.infra import netns as netns_lib
from gpumigrate.infra import residency
from gpumigrate.infra.launch import is_up, last_lines, render_for, wait_until_up
from gpumigrate.infra.supervisor import MARKER_ENV, call_supervisor, kill_owned, last_words, owned_by, pid_alive
from gpumigrate.interfaces import Host, HostSpec, Jurisdiction
from gpumigrate.launch import WorkloadLaunch

PORT_NAMES = ("service", "agent", "stream", "admin", "metrics")
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")
# Write ends of the attach pipes, per host workdir: they must live exactly as long as this process.
_ATTACH_PIPES: dict[str, int] = {}
_SUPERVISORS: dict[str, subprocess.Popen[bytes]] = {}


def _free_ports(n: int, exclude: set[int]) -> list[int]:
    ports: list[int] = []
    holders = []
    while len(ports) < n:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        holders.append(s)  # held until all are picked, so the kernel cannot hand one out twice
        port = s.getsockname()[1]
        if port not in exclude:
            ports.append(port)
    for s in holders:
        s.close()
    return ports


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2]
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port_block(count: int, host: str = "127.0.0.1", exclude: set[int] | None = None) -> int:
    """A port P such that P..P+count-1 are free now: the agents of a workload of ``count`` ranks (rank r's at P + r).

    Chosen below the kernel's ephemeral range: the ports stay free only until the ranks bind them, and in that gap
    every outgoing connection (gloo's pairs, torchrun's store, HTTP clients) takes an ephemeral port; one of ours
    taken so would fail a world's start now and then."""
    low, _ = _ephemeral_range()
    floor = 10000 if low > 10000 + count else 1024
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(floor, max(floor + 1, low - count))
        if exclude and any(p in exclude for p in range(base, base + count)):
            continue
        held: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise CapacityError(f"no {count} consecutive free ports on {host}")


def _ports_held(rec: Mapping[str, Any]) -> list[int]:
    """The ports a host's record holds: its named ports and its block of agent ports."""
    ports = dict(rec.get("ports") or {})
    agent = ports.get("agent")
    block = range(agent, agent + int(rec.get("agents") or 1)) if isinstance(agent, int) else range(0)
    return [*ports.values(), *block]


class LocalProvider:
    """Implements :class:`gpumigrate.interfaces.Provider` with processes on this machine."""

    name = "local"

    def __init__(
        self,
        *,
        netns: bool = False,
        rate: str | None = None,
        delay: str | None = None,
        attached: bool = True,
        max_hosts: int = 32,
        min_free_mb: int = 256,
    ) -> None:
        if netns:
            ok, why = netns_lib.available()
            if not ok:
                raise ProviderError(f"network namespaces are not available here ({why}); run without --netns")
        netns_lib.validate_shaping(rate, delay)
        if (rate or delay) and not netns:
            raise InvalidInputError("rate/delay shape a host's veth link: they need netns=True (--netns)")
        self.use_netns = netns
        self.rate, self.delay = rate, delay
        self.attached = attached
        self.max_hosts = max_hosts
        self.min_free_mb = min_free_mb

    # ------------------------------------------------------------------ registry
    @staticmethod
    def root() -> Path:
        return settings.hosts_dir()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root().mkdir(parents=True, exist_ok=True)
        with FileLock(self.root() / ".lock"):  # a stop signal cannot leave it held (gpumigrate/filelock.py)
            yield

    def _records(self) -> list[dict[str, Any]]:
        out = []
        for path in sorted(self.root().glob("*/host.json")):
            with contextlib.suppress(OSError, ValueError):
                out.append(json.loads(path.read_text()))
        return out

    def _record(self, name: str) -> dict[str, Any] | None:
        path = self.root() / name / "host.json"
        try:
            rec: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return rec

    @staticmethod
    def _alive(rec: Mapping[str, Any]) -> bool:
        """The supervisor runs, and is ours: a recycled pid (after a reboot, say) does not count."""
        sup = rec.get("supervisor") or {}
        pid = sup.get("pid")
        return isinstance(pid, int) and pid_alive(pid) and owned_by(pid, rec.get("token", ""))

    @staticmethod
    def to_host(rec: Mapping[str, Any]) -> Host:
        return Host(
            name=rec["name"],
            provider="local",
            region=rec["region"],
            address=rec["address"],
            instance_id=f"local-{rec['supervisor']['pid']}",
            zone=rec.get("zone"),
            ports=dict(rec["ports"]),
            workdir=rec["workdir"],
            meta={
                "migration_id": rec.get("migration_id"),
                "supervisor_pid": rec["supervisor"]["pid"],
                "attached": rec["supervisor"]["attached"],
                "netns": (rec.get("netns") or {}).get("ns"),
            },
        )

    def list_hosts(self) -> list[Host]:
        self.reap_stale()
        return [self.to_host(r) for r in self._records()]

    def get(self, name: str) -> Host:
        return self.to_host(self._require(name))

    # ------------------------------------------------------------------ Provider protocol
    def check_capacity(self, spec: HostSpec) -> None:
        if not _NAME.match(spec.name):
            raise InvalidInputError(f"local host name {spec.name!r}: use 1-40 of a-z, 0-9 and '-'")
        gpus = _local_gpu_count()
        if spec.gpu_count > gpus:
            raise CapacityError(
                f"this machine has {gpus} GPU(s); host {spec.name} asks for {spec.gpu_count}", region=spec.region
            )
        free_mb = _mem_available_mb()
        if free_mb < self.min_free_mb:
            raise CapacityError(
                f"only {free_mb} MB of memory free; a local host needs {self.min_free_mb} MB", region=spec.region
            )
        live = [r for r in self._records() if self._alive(r) and r["name"] != spec.name]
        if len(live) >= self.max_hosts:
            raise CapacityError(f"{len(live)} local hosts are up, the limit is {self.max_hosts}", region=spec.region)

    def provision(self, spec: HostSpec, *, migration_id: str | None = None) -> Host:
        """Start the host's supervisor (and namespace). Idempotent per (name, migration id)."""
        self.check_capacity(spec)
        with self._locked():
            self._reap_stale_locked()
            rec = self._record(spec.name)
            if rec is not None and self._alive(rec):
                owner = rec.get("migration_id")
                if owner in (None, migration_id):  # ours, or brought up by hand (`hosts up`): adopt it
                    return self.to_host(rec)
                raise ProviderError(f"local host {spec.name!r} is in use by migration {owner}; pick another name")
            return self.to_host(self._launch(spec, migration_id))

    def wait_ready(self, host: Host, *, timeout_s: float = 600) -> Host:
        rec = self._require(host.name)
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(OSError, ValueError):
                if call_supervisor(rec["supervisor"]["socket"], {"op": "ping"}, timeout_s=5).get("ok"):
                    return self.to_host(rec)
            if time.monotonic() > deadline or not self._alive(rec):
                raise ProviderError(
                    f"local host {host.name} did not answer within {timeout_s}s (log: {rec['workdir']}/supervisor.log)"
                )
            time.sleep(0.05)

    def terminate(self, host: Host | str) -> None:
        name = host if isinstance(host, str) else host.name
        with self._locked():
            rec = self._record(name)
            if rec is not None:
                self._teardown(rec)

    def jurisdiction(self, region: str) -> Jurisdiction:
        return residency.jurisdiction("local", region)

    def price(self, spec: HostSpec) -> float:
        return 0.0

    def bootstrap(self, host: Host, launch: WorkloadLaunch, *, timeout_s: float) -> Host:
        """Start the workload under the host's supervisor and wait until it answers (infra/launch.py).

        Idempotent: a workload already answering on the host (a retried provision) is not started again.
        The returned host's ``meta["workload"]`` holds the process's pid and log.
        """
        if is_up(host, launch):
            return host
        rendered = render_for(host, launch)
        proc = self.spawn(host, rendered.argv, env=rendered.env, cwd=rendered.cwd, name="workload",
                          ends_host=launch.ends_host)  # fmt: skip

        def exited() -> str | None:
            mine = [c for c in self._children(host) if c.get("pid") == proc["pid"]]
            if not mine or mine[0].get("returncode") is None:
                return None
            return f"exit code {mine[0]['returncode']}; its last lines ({proc['log']}):\n{last_lines(proc['log'])}"

        wait_until_up(host, launch, timeout_s=timeout_s, exited=exited)
        return replace(host, meta={**host.meta, "workload": {"pid": proc["pid"], "log": proc["log"]}})

    # ------------------------------------------------------------------ processes on a host
    def spawn(
        self,
        host: Host | str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        name: str | None = None,
        cwd: str | None = None,
        ends_host: bool = False,
    ) -> dict[str, Any]:
        """Run ``argv`` on the host (in its namespace if any) under its supervisor: ``{"pid", "log"}``.

        The child's environment gets ``GPUMIGRATE_HOST_NAME``, ``GPUMIGRATE_HOST_ADDRESS``,
        ``GPUMIGRATE_PORT_<NAME>`` for each of the host's ports, and this process's state root as
        ``GPUMIGRATE_HOME`` (the child runs in ``cwd``, default the host's work directory, where a relative
        default would point elsewhere: the workload and the orchestrator share the control key there).
        ``ends_host``: the host goes down once this process exits (its supervisor shuts it down).
        """
        rec = self._require(host if isinstance(host, str) else host.name)
        full_env = {"GPUMIGRATE_HOST_NAME": rec["name"], "GPUMIGRATE_HOST_ADDRESS": rec["address"]}
        full_env["GPUMIGRATE_HOME"] = str(settings.state_root())
        full_env.update({f"GPUMIGRATE_PORT_{k.upper()}": str(v) for k, v in rec["ports"].items()})
        full_env.update(env or {})
        request = {"op": "spawn", "argv": list(argv), "env": full_env, "name": name, "cwd": cwd, "ends_host": ends_host}
        reply = call_supervisor(rec["supervisor"]["socket"], request)
        if not reply.get("ok"):
            raise ProviderError(f"cannot start {argv[0]!r} on local host {rec['name']}: {reply.get('error')}")
        return {"pid": reply["pid"], "log": reply["log"]}

    def signal(self, host: Host | str, pid: int, sig: int = signal.SIGTERM) -> None:
        rec = self._require(host if isinstance(host, str) else host.name)
        reply = call_supervisor(rec["supervisor"]["socket"], {"op": "signal", "pid": pid, "sig": int(sig)})
        if not reply.get("ok"):
            raise ProviderError(str(reply.get("error")))

    def owns(self, name: str, pid: int) -> bool:
        """Whether ``pid`` is a process of the local host ``name`` (it carries the host's marker), that host up."""
        rec = self._record(name)
        return rec is not None and self._alive(rec) and owned_by(pid, rec.get("token", ""))

    def processes(self, host: Host | str) -> list[dict[str, Any]]:
        rec = self._require(host if isinstance(host, str) else host.name)
        children: list[dict[str, Any]] = call_supervisor(rec["supervisor"]["socket"], {"op": "list"})["children"]
        return children

    def _children(self, host: Host) -> list[dict[str, Any]]:
        """The host's processes, from its supervisor, or from the file it left once it shut down (``ends_host``)."""
        try:
            return self.processes(host)
        except (OSError, ValueError, NotFoundError):
            with contextlib.suppress(OSError, ValueError):
                saved = json.loads((Path(host.workdir or "") / "supervisor.json").read_text())
                return list(saved.get("children") or [])
            return []

    # ------------------------------------------------------------------ internals
    def _require(self, name: str) -> dict[str, Any]:
        rec = self._record(name)
        if rec is None or not self._alive(rec):
            # A record whose supervisor ended says why it ended (its log's last line): a host gone mid-migration.
            why = "" if rec is None else f" (its supervisor ended: {last_words(rec['workdir'])})"
            raise NotFoundError(f"no local host named {name!r} is up{why}; see `gpumigrate hosts list`")
        return rec

    def _launch(self, spec: HostSpec, migration_id: str | None) -> dict[str, Any]:
        workdir = self.root() / spec.name
        workdir.mkdir(parents=True, exist_ok=True)
        taken = {p for r in self._records() for p in _ports_held(r)}
        ports = dict(zip(PORT_NAMES, _free_ports(len(PORT_NAMES), taken), strict=True))
        agents = spec.launch.ranks if spec.launch is not None else 1
        if agents > 1:  # rank r's agent listens on the agent port + r: a block of them, none another host's
            ports["agent"] = free_port_block(agents, exclude=taken | set(ports.values()))
        token = secrets.token_hex(8)
        host_id = hashlib.sha256(str(workdir.resolve()).encode()).hexdigest()[:8]
        link = None
        if self.use_netns:
            index = min(set(range(1, 255)) - netns_lib.used_indexes(), default=None)
            if index is None:
                raise CapacityError("all 254 local network namespace subnets are in use")
            netns_lib.destroy(f"gm-{host_id}", f"gmh{host_id}")  # a leftover of a crashed run with this workdir
            link = netns_lib.create(host_id, index, rate=self.rate, delay=self.delay)
        sock_name = f"gpumigrate-sup-{token}"
        argv = [
            sys.executable,
            "-m",
            "gpumigrate.infra.supervisor",
            "--name",
            spec.name,
            "--workdir",
            str(workdir),
            "--socket",
            sock_name,
        ]
        if link:
            argv += ["--netns", link.ns]
        read_fd = write_fd = None
        if self.attached:
            read_fd, write_fd = os.pipe()
            argv += ["--parent-fd", str(read_fd)]
        rec: dict[str, Any] = {
            "format": 1,
            "name": spec.name,
            "provider": "local",
            "region": spec.region,
            "zone": spec.zone,
            "address": link.ns_ip if link else "127.0.0.1",
            "ports": ports,
            "agents": agents,  # the agent ports: ports["agent"] .. + agents - 1
            "workdir": str(workdir),
            "migration_id": migration_id,
            "created": time.time(),
            "token": token,
            "netns": None
            if link is None
            else {
                "ns": link.ns,
                "host_if": link.host_if,
                "host_ip": link.host_ip,
                "ip": link.ns_ip,
                "rate": link.rate,
                "delay": link.delay,
            },
        }
        try:
            with open(workdir / "supervisor.log", "ab") as log:
                proc = subprocess.Popen(
                    argv,
                    pass_fds=(read_fd,) if read_fd is not None else (),
                    start_new_session=True,  # not in the terminal's group: Ctrl-C reaches the CLI only
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, MARKER_ENV: token},
                )
        except BaseException:
            if link:
                netns_lib.destroy(link.ns, link.host_if)
            raise
        finally:
            if read_fd is not None:
                os.close(read_fd)
        if write_fd is not None:
            _ATTACH_PIPES[str(workdir)] = write_fd
        _SUPERVISORS[str(workdir)] = proc
        rec["supervisor"] = {"pid": proc.pid, "socket": sock_name, "attached": self.attached}
        try:
            atomic_write_json(workdir / "host.json", rec)
            self.wait_ready(self.to_host(rec), timeout_s=60)
        except BaseException:  # never ready, or interrupted (a stop signal): no half-launched host stays behind
            with contextlib.suppress(Exception):
                self._teardown(rec)
            raise
        return rec

    def _teardown(self, rec: Mapping[str, Any]) -> None:
        """Supervisor shutdown, then kill any leftover we own, drop the namespace, drop the entry."""
        sup, token, workdir = rec.get("supervisor") or {}, rec.get("token", ""), rec["workdir"]
        pid = sup.get("pid")
        if pid and pid_alive(pid):
            with contextlib.suppress(OSError, ValueError):
                call_supervisor(sup["socket"], {"op": "shutdown"}, timeout_s=5)
            deadline = time.monotonic() + 15
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if pid_alive(pid):
                kill_owned(pid, token)  # its children die with it (PDEATHSIG)
        proc = _SUPERVISORS.pop(workdir, None)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        write_fd = _ATTACH_PIPES.pop(workdir, None)
        if write_fd is not None:
            os.close(write_fd)
        with contextlib.suppress(OSError, ValueError):
            for child in json.loads((Path(workdir) / "supervisor.json").read_text()).get("children", []):
                kill_owned(child["pid"], token)
        link = rec.get("netns")
        if link:
            netns_lib.destroy(link["ns"], link.get("host_if"))
        with contextlib.suppress(FileNotFoundError):
            (Path(workdir) / "host.json").unlink()

    def reap_stale(self) -> list[str]:
        """Finish the cleanup of hosts whose supervisor is gone; return their names."""
        if not self.root().exists():
            return []
        with self._locked():
            return self._reap_stale_locked()

    def _reap_stale_locked(self) -> list[str]:
        stale = [r for r in self._records() if not self._alive(r)]
        for rec in stale:
            self._teardown(rec)
        return [r["name"] for r in stale]


def _local_gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU ")) if out.returncode == 0 else 0


def _mem_available_mb() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return 0

"""Start a reference workload of N ranks on this machine, as its plan's ``workload.launch`` would.

One torchrun per world (``--standalone``: its own rendezvous on a free port), the environment
contract for rank 0's agent address (rank r's agent on its port + r), stdout and stderr of every
rank in one log. Used by tests and ``bench/e2e_ranks.py``; ``stop()`` kills its ranks and torchrun.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumigrate.infra.local import free_port_block
from gpumigrate.launch import AGENT_ADDR_ENV, AWAIT_RESTORE_ENV, WorkloadLaunch
from gpumigrate.plan import Workload


def torchrun_argv(module: str, ranks: int, args: Sequence[str], *, python: str = sys.executable) -> list[str]:
    """The launch a plan gives: ``{python} -m torch.distributed.run --standalone --nproc-per-node N -m module ...``."""
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m", module, *args]


def free_ports(count: int, host: str = "127.0.0.1") -> int:
    """A port P such that P..P+count-1 are free now (the ranks' agents take them in order): the local provider's."""
    return free_port_block(count, host)


@dataclass
class LocalWorld:
    """A started world: its torchrun process (leader of its own process group), log and agent addresses."""

    popen: subprocess.Popen[bytes]
    log: Path
    agents: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def events(self, kind: str | None = None, rank: int | None = None) -> list[dict[str, Any]]:
        out = []
        for line in self.text().splitlines():
            if not line.startswith("{"):
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if (kind is None or event.get("event") == kind) and (rank is None or event.get("rank") == rank):
                out.append(event)
        return out

    def losses(self, rank: int) -> dict[int, float]:
        return {e["step"]: e["loss"] for e in self.events("step", rank)}

    def wait_event(self, kind: str, *, timeout_s: float = 180.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.events(kind)
            if found:
                return found[0]
            if self.popen.poll() is not None:
                raise RuntimeError(f"the world exited ({self.popen.returncode}):\n{self.text()[-3000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"no {kind!r} event within {timeout_s:.0f}s:\n{self.text()[-3000:]}")

    def wait_steps(self, step: int, *, timeout_s: float = 240.0) -> None:
        """Until every rank reported ``step``."""
        deadline = time.monotonic() + timeout_s
        while any(max(self.losses(r), default=0) < step for r in range(len(self.agents))):
            if time.monotonic() > deadline or self.popen.poll() is not None:
                raise TimeoutError(f"the ranks did not reach step {step}:\n{self.text()[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        """Kill the ranks, then torchrun. The ranks run in sessions of their own (torchrun starts
        them so), and outlive a killed torchrun: they are found as its children first."""
        for pid in [*_children(self.popen.pid), self.popen.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(timeout=30)


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it ended meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def start_world(
    module: str,
    ranks: int,
    args: Sequence[str],
    *,
    log: Path,
    await_restore: bool = False,
    env: dict[str, str] | None = None,
    host: str = "127.0.0.1",
) -> LocalWorld:
    """Start ``module`` as a world of ``ranks`` with the environment contract of a gpumigrate target."""
    base = free_ports(ranks, host)
    contract = {AGENT_ADDR_ENV: f"{host}:{base}", "OMP_NUM_THREADS": "1", **(env or {})}
    if await_restore:
        contract[AWAIT_RESTORE_ENV] = "1"
    return spawn(torchrun_argv(module, ranks, args), contract, ranks=ranks, log=log)


def start_plan_launch(
    workload: Workload,
    plan_dir: Path,
    *,
    log: Path,
    await_restore: bool = False,
    host: str = "127.0.0.1",
    env: dict[str, str] | None = None,
) -> tuple[LocalWorld, int]:
    """Start a plan's ``workload.launch`` as the flow would on a local host (its placeholders filled
    with free ports, ``workload.ranks`` agents from the agent port on), with ``env`` over this process's
    environment (the user's shell: the image key's variable, say); returns the world and its service port."""
    base = free_ports(workload.ranks, host)
    service = free_ports(1, host)
    launch = WorkloadLaunch.from_plan(workload, plan_dir=plan_dir, await_restore=await_restore)
    rendered = launch.render(host=host, agent_port=base, service_port=service, python=sys.executable, name="local")
    argv, cwd = rendered.argv, rendered.cwd
    return spawn(argv, {**(env or {}), **rendered.env}, ranks=workload.ranks, log=log, cwd=cwd), service


def spawn(argv: Sequence[str], env: dict[str, str], *, ranks: int, log: Path, cwd: str | None = None) -> LocalWorld:
    """Run ``argv`` (a torchrun of ``ranks``) with ``env`` over this process's environment, in a session
    of its own; rank r's agent is expected at ``env[GPUMIGRATE_AGENT_ADDR]``'s port + r."""
    host, _, port = env[AGENT_ADDR_ENV].rpartition(":")
    inherited = {k: v for k, v in os.environ.items() if k != AWAIT_RESTORE_ENV}
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            list(argv), stdout=out, stderr=subprocess.STDOUT, env={**inherited, **env}, cwd=cwd, start_new_session=True
        )
    return LocalWorld(popen, log, [f"{host}:{int(port) + r}" for r in range(ranks)], dict(env))

"""How gpumigrate starts a workload on a target: the plan's ``workload.launch`` plus the env contract.

The plan names the program (argv, env, cwd, with placeholders); gpumigrate adds its side of the
contract that the public SDK (``gpumigrate.agent``) reads in the user's process:

``GPUMIGRATE_AGENT_ADDR``
    host:port where the agent's control server listens (the target's agent port).
``GPUMIGRATE_AWAIT_RESTORE``
    ``1``: the process was started to receive a migrated state (``awaiting_restore()`` is True).
``GPUMIGRATE_CONTROL_KEY_FILE`` / ``GPUMIGRATE_CONTROL_KEY``
    the control key's reference (gpumigrate/CONTROL.md); never the key in argv.
``CUDA_VISIBLE_DEVICES``
    only where the plan maps ranks to GPUs (``target.rank_gpus``): the target's GPUs in rank order, so a
    program that puts each rank on its local rank's device (torchrun's convention) runs rank r on GPU
    ``rank_gpus[r]``.

A workload of N ranks (``workload.ranks``) is one launch too: the command starts every rank of the host
(``torchrun --nproc-per-node N``, or the workload's own launcher), and rank r's agent listens on the agent
port + r, so the host keeps N agent ports from it free (``ranks``).

A :class:`WorkloadLaunch` is built once by the flow from the plan and handed to the provider, which
renders it with the host's own address and ports (:meth:`WorkloadLaunch.render`): a local host
spawns the result, a cloud host puts it in its user data / startup script. Pure data, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

AGENT_ADDR_ENV = "GPUMIGRATE_AGENT_ADDR"
AWAIT_RESTORE_ENV = "GPUMIGRATE_AWAIT_RESTORE"
VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class RenderedLaunch:
    """A launch with every placeholder filled: what a host runs."""

    argv: list[str]
    env: dict[str, str]
    cwd: str | None


@dataclass(frozen=True)
class WorkloadLaunch:
    """The plan's launch template plus the environment gpumigrate adds (never secrets: references only)."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None  # absolute, or relative to plan_dir
    ready_timeout_s: float = 300.0
    health_path: str = "/healthz"
    ready_path: str = "/readyz"
    contract_env: Mapping[str, str] = field(default_factory=dict)  # AWAIT_RESTORE, control key reference, ...
    plan_dir: str = "."
    ends_host: bool = False  # a local host goes down once this process exits (a training job: its work is done)
    ranks: int = 1  # the processes the command starts, each with an agent on the agent port + its rank
    gpus: tuple[int, ...] = ()  # rank r's GPU of the host (CUDA_VISIBLE_DEVICES in rank order); () leaves it be

    @classmethod
    def from_plan(
        cls,
        workload: Any,
        *,
        plan_dir: str | Path,
        await_restore: bool,
        contract_env: Mapping[str, str] | None = None,
        gpus: tuple[int, ...] = (),
    ) -> WorkloadLaunch:
        """``workload`` is the plan's ``workload`` section (``gpumigrate.plan.Workload``) with a launch; ``gpus``
        the target's ``rank_gpus``."""
        launch = workload.launch
        if launch is None:
            raise ValueError("the plan has no workload.launch")
        env = dict(contract_env or {})
        if await_restore:
            env[AWAIT_RESTORE_ENV] = "1"
        if gpus:
            env[VISIBLE_DEVICES_ENV] = ",".join(str(g) for g in gpus)
        return cls(
            argv=tuple(launch.argv),
            env=dict(launch.env),
            cwd=launch.cwd,
            ready_timeout_s=float(launch.ready_timeout_s),
            health_path=workload.health_path,
            ready_path=workload.ready_path,
            contract_env=env,
            plan_dir=str(plan_dir),
            ranks=int(getattr(workload, "ranks", 1)),
            gpus=tuple(gpus),
        )

    def render(
        self, *, host: str, agent_port: int, service_port: int | None, python: str, name: str, bind: str | None = None
    ) -> RenderedLaunch:
        """Fill the placeholders for one host. ``host`` is where others reach it, ``bind`` where it listens
        (default: the same address)."""
        bind_addr = bind or host
        values = {
            "host": bind_addr,
            "service_port": "" if service_port is None else str(service_port),
            "agent_port": str(agent_port),
            "agent_addr": f"{bind_addr}:{agent_port}",
            "python": python,
            "plan_dir": self.plan_dir,
            "name": name,
        }
        argv = [a.format(**values) for a in self.argv]
        env = {k: v.format(**values) for k, v in self.env.items()}
        env.update(self.contract_env)
        env[AGENT_ADDR_ENV] = values["agent_addr"]
        cwd = None
        if self.cwd is not None:
            cwd_text = self.cwd.format(**values)
            cwd = cwd_text if Path(cwd_text).is_absolute() else str(Path(self.plan_dir) / cwd_text)
        return RenderedLaunch(argv=argv, env=env, cwd=cwd)

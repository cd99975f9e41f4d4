"""Start the reference workloads on a local host (``gpumigrate.infra.local.LocalProvider``).

Used by the demo, flows, tests and benchmarks: the process runs under the host's supervisor (in its
namespace if it has one), on the host's ``service`` port, with the agent on its ``agent`` port. Like
gpumigrate's own launcher, it hands the workload the environment contract (``contract_env``), not
flags: the workloads read it through the public SDK.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import httpx

from gpumigrate.errors import ProviderError
from gpumigrate.interfaces import Host
from gpumigrate.launch import AGENT_ADDR_ENV, AWAIT_RESTORE_ENV


def contract_env(host: Host, *, await_restore: bool = False) -> dict[str, str]:
    """The agent on the host's ``agent`` port at its address; ``await_restore``: a restore target."""
    env = {AGENT_ADDR_ENV: f"{host.address}:{host.ports['agent']}"}
    if await_restore:
        env[AWAIT_RESTORE_ENV] = "1"
    return env


def inference_argv(
    host: Host,
    *,
    seed: int = 0,
    size: str = "tiny",
    dtype: str = "float32",
    device: str = "cpu",
    threads: int = 1,
    extra: tuple[str, ...] = (),
) -> list[str]:
    argv = [sys.executable, "-m", "gpumigrate.workloads.inference", "--host", host.address]
    argv += ["--port", str(host.ports["service"]), "--name", host.name, "--seed", str(seed), "--size", size]
    argv += ["--dtype", dtype, "--device", device, "--threads", str(threads)]
    return argv + list(extra)


def wait_http(url: str, *, timeout_s: float = 60.0, log: str | None = None) -> None:
    """Poll ``url`` until it answers 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise ProviderError(f"{url} did not answer 200 within {timeout_s}s" + (f" (log: {log})" if log else ""))


def start_inference(
    provider: Any, host: Host, *, timeout_s: float = 60.0, await_restore: bool = False, **options: Any
) -> dict[str, Any]:
    """Spawn the inference server on ``host`` and wait until it is up (ready, or alive when awaiting restore).

    Returns ``{"pid", "log", "url", "agent_port"}``. Options: see :func:`inference_argv`.
    """
    env = contract_env(host, await_restore=await_restore)
    proc = provider.spawn(host, inference_argv(host, **options), env=env, name="inference")
    url = f"http://{host.address}:{host.ports['service']}"
    wait_http(url + ("/healthz" if await_restore else "/readyz"), timeout_s=timeout_s, log=proc["log"])
    return {**proc, "url": url, "agent_port": host.ports["agent"]}


def start_training(
    provider: Any,
    host: Host,
    *,
    steps: int,
    seed: int = 0,
    await_restore: bool = False,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Spawn the training job on ``host`` (agent on the host's ``agent`` port): ``{"pid", "log"}``."""
    argv = [sys.executable, "-m", "gpumigrate.workloads.training", "--steps", str(steps), "--seed", str(seed)]
    argv += ["--host", host.address, "--name", host.name, *extra]
    return provider.spawn(host, argv, env=contract_env(host, await_restore=await_restore), name="training")

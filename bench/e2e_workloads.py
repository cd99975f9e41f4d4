"""The two processes of ``bench/e2e.py`` and what it asks them: the source and the target as a migration starts
them (the one launcher, ``LocalProvider.bootstrap``, from a ``WorkloadLaunch``), their agents' rounds and restores
as the plan's transfer section bounds them (:class:`Run`), and the stop-and-copy, timed step by step, once or again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gpumigrate.infra.launch import service_url
from gpumigrate.infra.local import LocalProvider
from gpumigrate.interfaces import Host, HostSpec
from gpumigrate.launch import AWAIT_RESTORE_ENV, WorkloadLaunch
from gpumigrate.settings import state_root
from gpumigrate.snapshot.client import AgentClient
from gpumigrate.snapshot.gchold import gc_held

KEY_ENV = "GM_E2E_IMAGE_KEY"
PROMPT = {"prompt": "The quick brown fox", "max_new_tokens": 4}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the two processes
@dataclass
class Workload:
    """A workload started by the one launcher (``LocalProvider.bootstrap`` from a ``WorkloadLaunch``) on
    a local host, as a migration starts its target: its host, HTTP address and agent client."""

    host: Host
    url: str
    agent: AgentClient
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=120, trust_env=False))

    @property
    def pid(self) -> int:
        return int(self.host.meta["workload"]["pid"])

    def info(self) -> dict[str, Any]:
        return dict(self.http.get(f"{self.url}/v1/info").json())

    def generate(self) -> dict[str, Any]:
        r = self.http.post(f"{self.url}/v1/generate", json=PROMPT)
        r.raise_for_status()
        return dict(r.json())

    def ready(self) -> bool:
        return self.http.get(f"{self.url}/readyz").status_code == 200

    def close(self) -> None:
        self.agent.close()
        self.http.close()


def workload_launch(args: argparse.Namespace, env: dict[str, str], *, await_restore: bool) -> WorkloadLaunch:
    """The reference server as a plan's ``workload.launch`` would name it, placeholders and all."""
    argv = ("{python}", "-m", "gpumigrate.workloads.inference", "--host", "{host}", "--port", "{service_port}")
    model = ("--params-mb", str(args.params_mb), "--device", args.device, "--dtype", "bfloat16")
    more = ("--mutable-mb", str(args.mutable_mb), "--threads", "2", "--name", "{name}")
    contract = {"GPUMIGRATE_HOME": str(state_root())}
    if await_restore:
        contract[AWAIT_RESTORE_ENV] = "1"
    return WorkloadLaunch(
        argv=(*argv, *model, *more), env=env, contract_env=contract, ready_timeout_s=args.start_timeout
    )


def provision(provider: LocalProvider, name: str) -> Host:
    host = provider.provision(HostSpec(name=name, provider="local", region="local"), migration_id="e2e")
    return provider.wait_ready(host, timeout_s=60)


def bootstrap(provider: LocalProvider, host: Host, launch: WorkloadLaunch) -> Workload:
    """Start the workload through the launcher; return once it serves its health path and its agent answers."""
    host = provider.bootstrap(host, launch, timeout_s=launch.ready_timeout_s)
    agent = AgentClient(f"{host.address}:{host.ports['agent']}")
    deadline = time.monotonic() + launch.ready_timeout_s
    while True:
        try:
            agent.call("ping")
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    return Workload(host, service_url(host), agent)


# --------------------------------------------------------------------------- the agents' calls
@dataclass
class Run:
    """One ``STORE:CODEC[:source]`` migration's moving parts."""

    args: argparse.Namespace
    store: str
    key_ref: dict[str, str]
    options: dict[str, Any]
    fill: dict[str, str] = field(default_factory=dict)  # restore's "source" where the target fills from it
    _grant: dict[str, str] | None = None  # the target's grant to ask the source to lend (snapshot/client.py)

    def precopy(self, source: Workload) -> dict[str, Any]:
        return dict(source.agent.call("precopy", store=self.store, key_ref=self.key_ref, options=self.options))

    def preload(self, target: Workload, image: str, *, ready: bool = False) -> dict[str, Any]:
        fill: dict[str, Any] = dict(self.fill)
        if "source" in fill:  # the source's lend key sealed to the target's agent, asked once (the flow does too)
            if self._grant is None:
                self._grant = target.agent.lend_grant(fill["source"])
            fill["grant"] = self._grant
        return dict(
            target.agent.call("restore", store=self.store, image_id=image, key_ref=self.key_ref, ready=ready, **fill)
        )


def stop_and_copy(run: Run, source: Workload, target: Workload) -> dict[str, Any]:
    """Freeze → final round → the pre-loaded target's restore → ready: the downtime, step by step."""
    with gc_held():  # the orchestrator's own collector pauses would be downtime too (snapshot/gchold.py)
        t_freeze = time.perf_counter()
        source.agent.call("freeze")
        t_frozen = time.perf_counter()
        final = source.agent.call("final", store=run.store, key_ref=run.key_ref, options=run.options)
        t_final = time.perf_counter()
        done = run.preload(target, final["image"]["id"], ready=True)
        t_ready = time.perf_counter()
    return {
        "ms": round((t_ready - t_freeze) * 1000, 1),
        "t_ready": t_ready,
        "freeze_ms": round((t_frozen - t_freeze) * 1000, 1),
        "final_ms": round((t_final - t_frozen) * 1000, 1),
        "restore_ms": round((t_ready - t_final) * 1000, 1),
        "final_stats": final["stats"],
        # where the final call's time went in the source's agent (its round's phases), and the rest of the call:
        # the control channel (request and reply, signed and checked) and the orchestrator
        "final_agent_phases": final["stats"].get("phases"),
        "final_outside_agent_ms": round((t_final - t_frozen - float(final["stats"]["seconds"])) * 1000, 1),
        "restore_outside_agent_ms": round((t_ready - t_final - float(done["seconds"])) * 1000, 1),
        "restore_chunks_loaded": done["chunks_loaded"],
        "restore_bytes_loaded": done["bytes_loaded"],
        "restore_from_source": done.get("from_source"),
        "restore_agent_phases": done.get("phases"),
        "includes": "freeze (request safe point) → final round (fingerprint all, ship the dirty set: the mutable "
        "state, beside the BLAKE3 confirmation of the rest; commit) → target restore of the changed chunks → "
        "ready; two processes, agent calls over TCP. final_agent_phases / restore_agent_phases: the agents' own "
        "steps; *_outside_agent_ms: the rest of each call (control channel, JSON, signatures)",
    }


def stop_and_copy_again(run: Run, source: Workload, target: Workload) -> dict[str, Any]:
    """Another stop-and-copy on the same pair, as the first one came: the source serves on and changes its state,
    round k (pre-loaded into the target, which a ready restore left with nothing pre-loaded: all of it again),
    round k+1 (its delta pre-loaded), then freeze, final, restore; bit-identical or an error."""
    source.generate()
    run.preload(target, run.precopy(source)["image"]["id"])
    source.generate()
    run.preload(target, run.precopy(source)["image"]["id"])
    source.generate()
    done = stop_and_copy(run, source, target)
    if source.info().get("mutable_digest") != target.info().get("mutable_digest"):
        raise RuntimeError("a repeated stop-and-copy left the target's mutable state unlike the source's")
    source.agent.call("resume")
    return done


def roles_of(**workloads: Workload | None) -> dict[int, str]:
    roles: dict[int, str] = {}
    for name, w in workloads.items():
        with contextlib.suppress(KeyError, TypeError, ValueError):  # a workload that never started has no pid
            if w is not None:
                roles[w.pid] = name
    return roles


def read_stages(path: Path, roles: dict[int, str]) -> list[dict[str, Any]]:
    """The agents' stage totals (one line per direct capture or restore, warm-up probes included), in order, each
    named by the process's role in this run."""
    found: list[dict[str, Any]] = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return found
    for line in lines:
        entry = json.loads(line)
        found.append({"role": roles.get(entry.get("pid"), "other"), "what": entry.get("what"), **entry["stages"]})
    return found


def wait_warm(workload: Workload, timeout_s: float = 900.0) -> float:
    """Seconds until the workload's agent no longer reports ``warming`` (the SDK's background kernel compiles)."""
    t0 = time.perf_counter()
    while workload.agent.call("info").get("warming") and time.perf_counter() - t0 < timeout_s:
        time.sleep(0.2)
    return round(time.perf_counter() - t0, 2)


# --------------------------------------------------------------------------- report

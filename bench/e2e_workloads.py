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
from concurrent.futures import ThreadPoolExecutor
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
    confirm: str = "later"  # the final round's confirm: "later" (beside the target's restore) or "wait"
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
    """Freeze → final round → the pre-loaded target's restore → ready: the downtime, step by step.

    With ``--confirm later`` (the default) the final round returns once its dirty set is shipped while it still
    confirms its cold chunks (snapshot/cutover.py): the target restores that image unready while the source is
    asked for its verdict, then reports ready (``ready``), or restores the follow-up image the verdict names.
    ``--confirm wait``: the final round confirms everything before it returns, the target restores with ready."""
    asking = ThreadPoolExecutor(max_workers=1, thread_name_prefix="e2e-verdict")  # made before the clock starts
    later = run.confirm == "later"
    with gc_held(), asking:  # the orchestrator's own collector pauses would be downtime too (snapshot/gchold.py)
        t_freeze = time.perf_counter()
        source.agent.call("freeze")
        t_frozen = time.perf_counter()
        final = source.agent.call(
            "final",
            store=run.store,
            key_ref=run.key_ref,
            options=run.options,
            **({"confirm": "later"} if later else {}),
        )
        t_final = time.perf_counter()
        image = final["image"]["id"]
        pending = final.get("confirmation") == "pending"
        verdict: dict[str, Any] | None = None
        follow_up: dict[str, Any] | None = None
        readied: dict[str, Any] | None = None
        if pending:
            asked = asking.submit(source.agent.call, "confirmed", image_id=image)
            done = run.preload(target, image, ready=False)
            t_loaded = time.perf_counter()
            verdict = asked.result()
            t_verdict = time.perf_counter()
            if verdict["follow_up"]:  # a chunk the confirmation caught: its image holds it, the rest is loaded
                follow_up = run.preload(target, verdict["image"]["id"], ready=True)
            else:
                readied = dict(target.agent.call("ready", image_id=image))
        else:
            done = run.preload(target, image, ready=True)
            t_loaded = t_verdict = time.perf_counter()
        t_ready = time.perf_counter()
    out: dict[str, Any] = {
        "ms": round((t_ready - t_freeze) * 1000, 1),
        "t_ready": t_ready,
        "confirm": run.confirm,
        "freeze_ms": round((t_frozen - t_freeze) * 1000, 1),
        "final_ms": round((t_final - t_frozen) * 1000, 1),
        "restore_ms": round((t_loaded - t_final) * 1000, 1),
        # the source's verdict beyond the target's restore (asked at the restore's start), then the target's ready
        # (or the follow-up's restore)
        "verdict_wait_ms": round((t_verdict - t_loaded) * 1000, 1),
        "ready_ms": round((t_ready - t_verdict) * 1000, 1),
        "final_stats": final["stats"],
        "final_confirmation": final.get("confirmation"),
        # where the final call's time went in the source's agent (its round's phases), and the rest of the call:
        # the control channel (request and reply, signed and checked) and the orchestrator
        "final_agent_phases": final["stats"].get("phases"),
        "final_outside_agent_ms": round((t_final - t_frozen - float(final["stats"]["seconds"])) * 1000, 1),
        "restore_outside_agent_ms": round((t_loaded - t_final - float(done["seconds"])) * 1000, 1),
        "restore_chunks_loaded": done["chunks_loaded"],
        "restore_bytes_loaded": done["bytes_loaded"],
        "restore_from_source": done.get("from_source"),
        "restore_agent_phases": done.get("phases"),
        "includes": "freeze (request safe point) → final round (its dirty set: the mutable state the last round "
        "changed, hashed first and shipped beside the BLAKE3 confirmation of the rest; commit; with confirm later "
        "it returns before that confirmation ends) → target restore of the changed chunks (unready with confirm "
        "later, beside the source's verdict) → ready (the target's ready, or the follow-up image's restore); two "
        "processes, agent calls over TCP. final_agent_phases / restore_agent_phases: the agents' own steps; "
        "*_outside_agent_ms: the rest of each call (control channel, JSON, signatures); verdict: the source's "
        "confirmation after the final returned (waited: the source agent's wait for it)",
    }
    if verdict is not None:
        out["verdict"] = {k: verdict[k] for k in ("caught", "chunks_confirmed", "follow_up", "waited", "phases")}
    if readied is not None:
        out["ready_agent_ms"] = round(float(readied["seconds"]) * 1000, 2)
    if follow_up is not None:
        out["follow_up_chunks_loaded"] = follow_up["chunks_loaded"]
        out["follow_up_agent_phases"] = follow_up.get("phases")
    return out


def stop_and_copy_again(run: Run, source: Workload, target: Workload) -> dict[str, Any]:
    """Another stop-and-copy on the same pair, as the first one came: the source serves on and changes its state,
    round k (pre-loaded into the target, which a ready restore left with nothing pre-loaded: all of it again),
    round k+1 (its delta pre-loaded), then freeze, final, restore (and the verdict, ready); bit-identical or an
    error."""
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

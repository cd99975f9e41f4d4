"""End-to-end migration benchmark: the product path between two processes, beside its baselines.

    python bench/e2e.py --json [--gb 16] [--mutable-mb 256] [--chunk-mb N] [--device cuda]
                        [--runs shm:auto,disk:auto,shm:cpu] [--root DIR] [--out FILE]

Source: the reference inference server (``--params-mb``, ``--device``, bf16, ``--mutable-mb``: state
that every request changes) with its embedded agent. Target: the same server awaiting a restore. Both
start the way a migration starts a workload: a ``WorkloadLaunch`` (argv with placeholders, the env
contract: ``GPUMIGRATE_AWAIT_RESTORE=1`` for the target) handed to the one launcher,
``LocalProvider.bootstrap``, on a local host of its own (supervised processes; ``GPUMIGRATE_HOME``
defaults to a directory under ``--root``). Everything moves through the real
agent control channel and the transfer engine into a ``file://`` store (tmpfs and a disk directory),
the way the migrate flow runs its snapshot, transfer and restore phases with a pre-loaded target:

  1. the target starts while pre-copy round 1 writes the full image (capture figure);
  2. the target pre-loads round 1 (``restore``, ``ready: false``: restore figure);
  3. requests dirty the source's mutable state; round 2 ships the delta; the target pre-loads it;
  4. requests dirty it again; freeze → final → target restore(ready) is the downtime;
  5. the target's weights and mutable digests and its answer must equal the source's.

Before the migration the bench waits until the source's agent no longer reports ``warming`` (the SDK's
one-time kernel compiles at attach: a source serves for a while before it moves) and reports the wait
(``source_warmup_wait_s``); the target's wait (``target_warmup_wait_s``) counts in the total migration
time. ``STORE:CODEC:source`` runs fill the target from the source's memory (``transfer.restore_from:
source``) instead of reading the store; the image is still written.

Each run is one ``STORE:CODEC`` pair: ``shm`` (/dev/shm) or ``disk`` (``--root``), and ``auto``
(the GPU codec where nvCOMP and a GPU are present) or ``cpu`` (``GPUMIGRATE_GPU_CODEC=0``).
Baselines from the same run: a safetensors cold load in a fresh process (load, and with start-up),
``torch.save``/``torch.load`` through a file in the same store directory, the CUDA driver checkpoint
of the source process, and the pinned device→host line rate. The last stdout line is one JSON
object; every figure says what it includes. Each run also holds ``direct_stages_s``: the agents' own
stage totals (``gpumigrate.stageclock.STAGES``, seconds summed over threads) per capture and restore, by role.
``--target-after-capture`` starts the target after round 1 instead of during it: a diagnostic that
shows the capture without the target's start-up beside it. ``--smoke`` runs a small CPU migration and
exits 1 unless the state came back bit-identical (CI runs it; it asserts no timings).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from benchlib import gbps, pinned_d2h_GBps

from gpumigrate import control
from gpumigrate.agent.warmup import GPU_CHUNK_SIZE
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


# --------------------------------------------------------------------------- one migration
def migrate(args: argparse.Namespace, store_dir: Path, codec: str, restore_from: str = "store") -> dict[str, Any]:
    """Source → image in ``store_dir`` → pre-loaded target → stop-and-copy → ready, timed and checked.

    ``restore_from="source"``: the target's loads copy the source's tensors out of its memory (``transfer.restore_from:
    source``, snapshot/fill.py), each chunk checked against the image; the image is still written."""
    shutil.rmtree(store_dir, ignore_errors=True)
    store = f"file://{store_dir}"
    env = {"GPUMIGRATE_GPU_CODEC": "0" if codec == "cpu" else "1"}
    if args.chunk_mb:  # else the SDK's own choice (agent/warmup.py: 32 MiB for state on a GPU, 4 MiB in host memory)
        env["GPUMIGRATE_SNAPSHOT_CHUNK_MB"] = str(args.chunk_mb)
    # Both agents' direct paths log their stage totals per capture and restore (transfer/direct_writer.py, direct_reader.py); they go into
    # this run's JSON, by role (where a migration's threads spend their time, beside the figures they explain).
    stages_log = store_dir.parent / f"{store_dir.name}-stages.jsonl"
    stages_log.parent.mkdir(parents=True, exist_ok=True)
    stages_log.unlink(missing_ok=True)
    env["GPUMIGRATE_STAGES_LOG"] = str(stages_log)
    key_ref = {"env": KEY_ENV}  # the key itself is in this process's environment, inherited by the hosts
    options = {"compression": "auto", "parallelism": args.workers}
    provider = LocalProvider()
    hosts = [provision(provider, "e2e-source"), provision(provider, "e2e-target")]
    source: Workload | None = None
    target: Workload | None = None
    out: dict[str, Any] = {"store": store, "codec": codec, "restore_from": restore_from}
    out["target_starts"] = "after the capture" if args.target_after_capture else "during the capture"
    try:
        t0 = time.perf_counter()
        source = bootstrap(provider, hosts[0], workload_launch(args, env, await_restore=False))
        out["source_start_s"] = round(time.perf_counter() - t0, 2)
        # A source serves for a while before it moves: its SDK's one-time warm-up (kernel compiles, which a
        # fresh host's empty caches make long) is over by then. Waited for here, and reported, not timed below.
        out["source_warmup_wait_s"] = wait_warm(source)
        source.generate()  # warm: the first request compiles/allocates what later ones reuse
        # The target starts (through the launcher, as the provision phase starts it) while round 1 runs.
        t_migration = time.perf_counter()
        with ThreadPoolExecutor(1) as starter:
            if args.target_after_capture:  # a diagnostic: the capture alone on the host, the total made longer
                t0 = time.perf_counter()
                round1 = source.agent.call("precopy", store=store, key_ref=key_ref, options=options)
                capture_s = time.perf_counter() - t0
                target = bootstrap(provider, hosts[1], workload_launch(args, env, await_restore=True))
            else:
                starting = starter.submit(bootstrap, provider, hosts[1], workload_launch(args, env, await_restore=True))
                t0 = time.perf_counter()
                round1 = source.agent.call("precopy", store=store, key_ref=key_ref, options=options)
                capture_s = time.perf_counter() - t0
                target = starting.result()
        out["target_start_s"] = round(time.perf_counter() - t_migration, 2)
        out["target_warmup_wait_s"] = wait_warm(target)  # inside the total migration time
        image_bytes = int(round1["image"]["bytes_image"])
        out["capture"] = {
            "bytes": image_bytes,
            "stored_bytes": int(round1["image"]["bytes_sent"]),
            "stored_fraction": round(int(round1["image"]["bytes_sent"]) / max(1, image_bytes), 4),
            "seconds": round(capture_s, 3),
            "GBps": gbps(image_bytes, capture_s),
            "agent_seconds": round(float(round1["stats"]["seconds"]), 3),
            "agent_phases": round1["stats"].get("phases"),
            "includes": "pre-copy round 1 of the live source (all chunks): fingerprint, stage, device BLAKE3, codec "
            "(GPU planes where nvCOMP is present, else the CPU byte-plane coder), AES-256-GCM, file:// store writes, "
            "signed manifest; timed at the orchestrator around the agent call, "
            + (
                "before the target starts (--target-after-capture)"
                if args.target_after_capture
                else "while the target starts"
            ),
        }
        fill = {"source": source.agent.address} if restore_from == "source" else {}
        t0 = time.perf_counter()
        pre1 = target.agent.call(
            "restore", store=store, image_id=round1["image"]["id"], key_ref=key_ref, ready=False, **fill
        )
        restore_s = time.perf_counter() - t0
        out["restore"] = {
            "bytes": int(pre1["bytes_loaded"]),
            "seconds": round(restore_s, 3),
            "GBps": gbps(int(pre1["bytes_loaded"]), restore_s),
            "agent_seconds": round(float(pre1["seconds"]), 3),
            "includes": "pre-load of round 1 into the cold target: manifest signature, store reads, AES-256-GCM open, "
            "decode (GPU or CPU), host→device copies, BLAKE3 of every chunk where it landed; timed around the call"
            if not fill
            else "pre-load of round 1 into the cold target, filled from the source's memory: manifest signature, "
            "the source's lend over the agent channel (CUDA IPC handles on a GPU, NIXL READs for host memory), the "
            "copy, BLAKE3 of every chunk where it landed against the manifest (blobs read from the store); timed "
            "around the call",
            "from_source": pre1.get("from_source"),
            "agent_phases": pre1.get("phases"),
        }
        source.generate()
        round2 = source.agent.call("precopy", store=store, key_ref=key_ref, options=options)
        pre2 = target.agent.call(
            "restore", store=store, image_id=round2["image"]["id"], key_ref=key_ref, ready=False, **fill
        )
        out["round2"] = {"stats": round2["stats"], "preload_seconds": round(float(pre2["seconds"]), 4)}
        source.generate()  # the mutable state is dirty again: the final round ships it
        with gc_held():  # the orchestrator's own collector pauses would be downtime too (snapshot/gchold.py)
            t_freeze = time.perf_counter()
            source.agent.call("freeze")
            t_frozen = time.perf_counter()
            final = source.agent.call("final", store=store, key_ref=key_ref, options=options)
            t_final = time.perf_counter()
            done = target.agent.call(
                "restore", store=store, image_id=final["image"]["id"], key_ref=key_ref, ready=True, **fill
            )
            t_ready = time.perf_counter()
        out["total_migration_s"] = round(t_ready - t_migration, 3)
        out["downtime"] = {
            "ms": round((t_ready - t_freeze) * 1000, 1),
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
        out["target_ready_endpoint"] = target.ready()
        src_info, dst_info = source.info(), target.info()
        out["bit_identical"] = {
            "weights": src_info["weights_digest"] == dst_info["weights_digest"],
            "mutable": src_info.get("mutable_digest") == dst_info.get("mutable_digest") is not None,
        }
        source.agent.call("resume")
        out["same_answer"] = source.generate()["tokens"] == target.generate()["tokens"]
        out["image_files_bytes"] = sum(p.stat().st_size for p in store_dir.rglob("*") if p.is_file())
        if args.device.startswith("cuda") and args.driver and codec == "auto" and "shm" in str(store_dir):
            target.close()
            provider.terminate(hosts[1])  # its GPU memory is free for the driver's copy
            target = None
            out["driver_checkpoint_of_source"] = driver_checkpoint(source.pid, image_bytes)
    finally:
        roles = _roles(source=source, target=target)
        for w in (target, source):
            if w is not None:
                w.close()
        for host in hosts:
            provider.terminate(host)
    out["direct_stages_s"] = read_stages(stages_log, roles)
    return out


def _roles(**workloads: Workload | None) -> dict[int, str]:
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


def driver_checkpoint(pid: int, nbytes: int) -> dict[str, Any]:
    """The CUDA driver's own checkpoint and restore of the source process (to/from host memory)."""
    try:
        from gpumigrate.snapshot import cuda_driver

        proc = cuda_driver.CudaProcess(pid)
        proc.lock(timeout_ms=10_000)
        proc.checkpoint()
        proc.restore_memory()
        proc.unlock()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "bytes_tracked_state": nbytes,
        "checkpoint_s": round(proc.timing.checkpoint_s, 3),
        "restore_s": round(proc.timing.restore_s, 3),
        "checkpoint_GBps_of_state": gbps(nbytes, proc.timing.checkpoint_s),
        "restore_GBps_of_state": gbps(nbytes, proc.timing.restore_s),
        "includes": "cuCheckpointProcessCheckpoint/Restore of the whole source process (all its device memory, "
        "driver-managed host copy); GB/s counted over the same tracked bytes as the agent's figures",
    }


# --------------------------------------------------------------------------- baselines
SAVE = r"""
import json, sys, time, torch
from gpumigrate.workloads.model import build_model
params_mb, device, st_path, pt_path = float(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
state = {k: v.contiguous() for k, v in build_model(0, dtype="bfloat16", device=device, params_mb=params_mb).state_dict().items()}
n = sum(v.numel() * v.element_size() for v in state.values())
out = {"bytes": n}
try:
    import safetensors.torch as st
    t = time.perf_counter(); st.save_file(state, st_path); out["safetensors_save_s"] = time.perf_counter() - t
except ImportError:
    out["safetensors_save_s"] = None
t = time.perf_counter(); torch.save(state, pt_path); out["torch_save_s"] = time.perf_counter() - t
print(json.dumps(out), flush=True)
"""

LOAD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
kind, path, device = sys.argv[1], sys.argv[2], sys.argv[3]
if device.startswith("cuda"):
    torch.zeros(1, device=device)  # CUDA context: part of a cold start, kept out of the load figure
t1 = time.perf_counter()
if kind == "safetensors":
    import safetensors.torch as st
    state = st.load_file(path, device=device)
else:
    state = {k: v.to(device) for k, v in torch.load(path, map_location="cpu", mmap=False).items()}
if device.startswith("cuda"):
    torch.cuda.synchronize()
t2 = time.perf_counter()
print(json.dumps({"load_s": t2 - t1, "in_process_s": t2 - t0, "tensors": len(state)}), flush=True)
"""


def baselines(args: argparse.Namespace, where: Path) -> dict[str, Any]:
    """Files written by a process that built the same model; each loaded by a fresh process."""
    where.mkdir(parents=True, exist_ok=True)
    st_path, pt_path = where / "weights.safetensors", where / "weights.pt"
    saved = json.loads(
        subprocess.run(
            [sys.executable, "-c", SAVE, str(args.params_mb), args.device, str(st_path), str(pt_path)],
            check=True,
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    n = int(saved["bytes"])
    out: dict[str, Any] = {"bytes": n, "where": str(where)}
    for kind, path in (("safetensors", st_path), ("torch_load", pt_path)):
        if kind == "safetensors" and saved["safetensors_save_s"] is None:
            out[kind] = {"not_run": "safetensors is not installed here"}
            continue
        t0 = time.perf_counter()
        run = subprocess.run(
            [sys.executable, "-c", LOAD, kind, str(path), args.device], check=True, capture_output=True, text=True
        )
        total = time.perf_counter() - t0
        got = json.loads(run.stdout.strip().splitlines()[-1])
        out[kind] = {
            "load_s": round(got["load_s"], 3),
            "load_GBps": gbps(n, got["load_s"]),
            "cold_start_s": round(total, 3),
            "includes": "a fresh process: interpreter + torch import + CUDA context (cold_start_s only), then the "
            "file read from the same directory as the image and copied to the device",
        }
    out["safetensors_save_s"] = round(saved["safetensors_save_s"], 3) if saved["safetensors_save_s"] else None
    out["torch_save_GBps"] = gbps(n, saved["torch_save_s"])
    out["torch_save_includes"] = "torch.save of the state dict (device→pageable host copy included) to a file"
    st_path.unlink(missing_ok=True)
    pt_path.unlink(missing_ok=True)
    return out


def line_rate(device: str) -> float | None:
    import torch

    if not device.startswith("cuda"):
        return None
    return pinned_d2h_GBps(torch.empty(1 << 28, dtype=torch.uint8, device=device).random_())


# --------------------------------------------------------------------------- report
def ratios(out: dict[str, Any]) -> dict[str, Any]:
    base = out.get("baselines") or {}
    cold = (base.get("safetensors") or {}) if "load_s" in (base.get("safetensors") or {}) else None
    line = out.get("line_rate_pinned_d2h_GBps")
    rows = {}
    for name, run in out["runs"].items():
        if "error" in run:
            continue
        row: dict[str, Any] = {
            "capture_GBps": run["capture"]["GBps"],
            "restore_GBps": run["restore"]["GBps"],
            "downtime_ms": run["downtime"]["ms"],
            "total_migration_s": run["total_migration_s"],
        }
        if cold:
            row["restore_vs_safetensors_load"] = round(run["restore"]["GBps"] / cold["load_GBps"], 2)
            row["total_vs_cold_start"] = round(run["total_migration_s"] / cold["cold_start_s"], 2)
        if line:
            row["capture_vs_line_rate"] = round(run["capture"]["GBps"] / line, 2)
            row["restore_vs_line_rate"] = round(run["restore"]["GBps"] / line, 2)
        rows[name] = row
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="(always on) print the result as JSON on the last line")
    p.add_argument("--gb", type=float, default=None, help="model weights in GiB (default 16 on a GPU, 0.03 on CPU)")
    p.add_argument("--mutable-mb", type=float, default=None, help="state each request changes (256 on a GPU)")
    p.add_argument("--chunk-mb", type=int, default=None, help="capture chunk size (default: the SDK's own choice)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda where available)")
    p.add_argument(
        "--runs",
        default="shm:auto,disk:auto,shm:cpu",
        help="STORE:CODEC[:source] runs, comma-separated (:source fills the target from the source's memory)",
    )
    p.add_argument("--root", default=None, help="disk directory for the 'disk' store and logs (default: a temp dir)")
    p.add_argument("--workers", type=int, default=None, help="writer parallelism option (default: cores)")
    p.add_argument("--no-driver", dest="driver", action="store_false", help="skip the CUDA driver checkpoint")
    p.add_argument("--no-baselines", dest="baselines", action="store_false")
    p.add_argument("--smoke", action="store_true", help="small CPU run; exit 1 unless the state is bit-identical")
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument(
        "--target-after-capture",
        action="store_true",
        help="start the target after round 1's capture instead of during it (the flow's way): a diagnostic that "
        "separates the capture's own speed from the target's start-up beside it; the total migration time grows",
    )
    args = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    if args.smoke:
        args.device, args.runs, args.driver, args.baselines = "cpu", "disk:auto,disk:auto:source", False, False
    args.device = args.device or ("cuda" if cuda else "cpu")
    gpu = args.device.startswith("cuda")
    args.gb = args.gb if args.gb is not None else (16.0 if gpu else 0.03)
    args.params_mb = round(args.gb * 1024, 3)
    args.mutable_mb = args.mutable_mb if args.mutable_mb is not None else (256 if gpu else 2)
    args.workers = args.workers or min(64, os.cpu_count() or 2)
    from gpumigrate import transfer

    os.environ[KEY_ENV] = transfer.generate_key()  # the hosts' supervisors inherit it; the agents resolve it
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="gm-e2e-"))
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("GPUMIGRATE_HOME", str(root / "home"))  # the local hosts, their logs, the control key
    control.load_key(None, create=True)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() and not args.smoke else root
    out: dict[str, Any] = {
        "bench": "e2e",
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "weights_GiB": args.gb,
        "mutable_MiB": args.mutable_mb,
        "chunk_MiB": args.chunk_mb
        or (f"{GPU_CHUNK_SIZE >> 20} (the SDK's default for GPU state)" if gpu else "4 (the SDK's default)"),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "runs": {},
    }
    if gpu:
        out["line_rate_pinned_d2h_GBps"] = line_rate(args.device)
    try:
        for spec in args.runs.split(","):
            where, codec, *fill = spec.split(":")
            base = shm / f"gm-e2e-{os.getpid()}" if where == "shm" else root / "disk"
            log(f"migration {spec} ...")
            try:
                out["runs"][spec] = migrate(args, base / "store", codec, "source" if fill == ["source"] else "store")
            except Exception as exc:
                out["runs"][spec] = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                shutil.rmtree(base, ignore_errors=True)
            if args.out:  # partial results survive a run cut short
                Path(args.out).write_text(json.dumps(out) + "\n")
        if args.baselines:
            log("baselines ...")
            try:
                out["baselines"] = baselines(args, shm / f"gm-e2e-base-{os.getpid()}")
            except Exception as exc:
                out["baselines"] = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                shutil.rmtree(shm / f"gm-e2e-base-{os.getpid()}", ignore_errors=True)
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    out["summary"] = ratios(out)
    text = json.dumps(out)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    if args.smoke:
        return 0 if smoke_ok(out["runs"]) else 1
    return 0


def smoke_ok(runs: dict[str, Any]) -> bool:
    """The smoke's verdict: every run bit-identical, answering like the source and ready; the dirty state moved in
    the final round (less than all of it in the second round); the filled run pulled chunks from the source."""
    for spec, run in runs.items():
        ok = (
            "error" not in run
            and all(run["bit_identical"].values())
            and run["same_answer"]
            and run["target_ready_endpoint"]
            and run["downtime"]["restore_chunks_loaded"] >= 1
            and run["round2"]["stats"]["chunks_dirty"] < run["round2"]["stats"]["chunks_total"]
        )
        if ok and spec.endswith(":source"):
            pulled = run["restore"]["from_source"]
            ok = (
                pulled["way"] == "pull"
                and pulled["chunks"] > 0
                and run["downtime"]["restore_from_source"]["chunks"] >= 1
            )
        if not ok:
            log(f"smoke: run {spec} is wrong: {json.dumps(run)[:2000]}")
            return False
    return len(runs) > 0


if __name__ == "__main__":
    sys.exit(main())

"""The parts of ``bench/e2e.py`` beside the migration itself: its baselines, the load on the source, the disk's rate.

* Baselines from the same run: a safetensors (and ``torch.load``) cold start of the same weights in a fresh
  process, the pinned device→host line rate, the CUDA driver's checkpoint of the source process.
* The source's clients: its capacity (closed loop, :func:`capacity`), then an open-loop load at a fraction of it
  (:class:`SourceLoad`, the project's own generator in its own process) whose requests are cut into windows by
  the moments the migration marks (before, each pre-copy round, the downtime, after): p50, p99 and throughput each.
* The store's device: a plain sequential write and read of the image's size beside it (:func:`disk_rate`: ``fio``
  where installed, else ``dd``, both with direct I/O), what a disk store's capture and restore are compared with.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from benchlib import gbps, pinned_d2h_GBps

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
if pt_path != "-":
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


def baselines(params_mb: float, device: str, where: Path, *, torch_load: bool) -> dict[str, Any]:
    """Files written by a process that built the same model; each loaded by a fresh process."""
    where.mkdir(parents=True, exist_ok=True)
    st_path, pt_path = where / "weights.safetensors", where / "weights.pt"
    argv = [sys.executable, "-c", SAVE, str(params_mb), device, str(st_path), str(pt_path) if torch_load else "-"]
    saved = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    n = int(saved["bytes"])
    out: dict[str, Any] = {"bytes": n, "where": str(where)}
    for kind, path in (("safetensors", st_path), ("torch_load", pt_path)):
        if kind == "safetensors" and saved["safetensors_save_s"] is None:
            out[kind] = {"not_run": "safetensors is not installed here"}
            continue
        if kind == "torch_load" and not torch_load:
            continue
        t0 = time.perf_counter()
        run = subprocess.run([sys.executable, "-c", LOAD, kind, str(path), device], check=True, capture_output=True)
        total = time.perf_counter() - t0
        got = json.loads(run.stdout.decode().strip().splitlines()[-1])
        out[kind] = {
            "load_s": round(got["load_s"], 3),
            "load_GBps": gbps(n, got["load_s"]),
            "cold_start_s": round(total, 3),
            "includes": "a fresh process: interpreter + torch import + CUDA context (cold_start_s only), then the "
            "file read from the same directory as the image and copied to the device",
        }
    out["safetensors_save_s"] = round(saved["safetensors_save_s"], 3) if saved["safetensors_save_s"] else None
    if torch_load:
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


# --------------------------------------------------------------------------- the source's clients
def capacity(url: str, body: dict[str, Any], *, clients: int = 4, seconds: float = 3.0) -> dict[str, Any]:
    """The source's throughput with ``clients`` requests always in flight (a closed loop: as fast as it answers)."""
    done: list[float] = []
    stop = time.monotonic() + seconds
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(timeout=60, trust_env=False) as http:
            while time.monotonic() < stop:
                t0 = time.monotonic()
                if http.post(url, json=body).status_code == 200:
                    with lock:
                        done.append(time.monotonic() - t0)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    return {
        "rps": round(len(done) / elapsed, 2),
        "clients": clients,
        "seconds": round(elapsed, 2),
        "p50_ms": round(statistics.median(done) * 1000, 2) if done else None,
        "includes": "closed loop: each client sends its next request when the last one answered",
    }


class SourceLoad:
    """An open-loop load on the source (``gpumigrate.traffic.loadgen`` in its own process, every request's start
    and latency kept); :meth:`mark` notes when the migration reaches each point, :meth:`windows` cuts the
    requests there."""

    def __init__(self, url: str, body: dict[str, Any], rps: float, *, longest_s: float = 3600.0) -> None:
        from gpumigrate.traffic.loadgen import LoadProcess

        self.rps = rps
        self.proc = LoadProcess(url, rps=rps, seconds=longest_s, body=body, keep_records=True)
        self.marks: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        self.marks.append((name, time.time()))

    def stop(self) -> dict[str, Any]:
        self.proc.stop()
        report = self.proc.wait(timeout_s=120)
        return {"offered_rps": self.rps, "errors": report.errors, "windows": self.windows(report)}

    def windows(self, report: Any) -> dict[str, Any]:
        """p50/p99 of the requests that *started* in each window (latency counts from the scheduled start: an open
        loop's queueing is in it), and throughput as the requests that *completed* in it per second."""
        base = report.started_at or 0.0
        rows = report.records or []
        out: dict[str, Any] = {}
        for (name, t_from), (_, t_to) in zip(self.marks, self.marks[1:], strict=False):
            if name.startswith("_"):
                continue
            a, b = t_from - base, t_to - base
            started = sorted(r[1] for r in rows if r[2] and a <= r[0] < b)
            completed = sum(1 for r in rows if r[2] and a <= r[0] + r[1] / 1000 < b)
            failed = sum(1 for r in rows if not r[2] and a <= r[0] < b)
            out[name] = {
                "seconds": round(b - a, 3),
                "requests": len(started),
                "failed": failed,
                "p50_ms": _pct(started, 0.5),
                "p99_ms": _pct(started, 0.99),
                "throughput_rps": round(completed / (b - a), 2) if b > a else None,
            }
        return out


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(round(q * (len(values) - 1))))], 2)


def load_ratios(windows: dict[str, Any]) -> dict[str, Any]:
    """The issue's two figures: p99 during round 1 over p99 before, throughput during the pre-copy over before."""
    before = windows.get("before") or {}
    out: dict[str, Any] = {}
    for name in ("round1", "round2"):
        during = windows.get(name) or {}
        if before.get("p99_ms") and during.get("p99_ms") is not None:
            out[f"{name}_p99_vs_before"] = round(during["p99_ms"] / before["p99_ms"], 3)
        if before.get("throughput_rps") and during.get("throughput_rps") is not None:
            out[f"{name}_throughput_vs_before"] = round(during["throughput_rps"] / before["throughput_rps"], 3)
    return out


# --------------------------------------------------------------------------- the store's device
def disk_rate(directory: Path, nbytes: int) -> dict[str, Any]:
    """A plain sequential write, then read, of ``nbytes`` in ``directory`` with direct I/O (32 MiB blocks): ``fio``
    where installed (random buffers, fsync at the end), else ``dd`` (zeros, ``conv=fsync``); wall-clock timed."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "gm-disk-rate.bin"
    block = 32 << 20
    count = max(1, -(-nbytes // block))
    size = count * block
    if shutil.which("fio"):
        common = ["fio", "--name=seq", f"--filename={path}", f"--size={size}", f"--bs={block}", "--direct=1"]
        common += ["--ioengine=psync", "--numjobs=1", "--output-format=json"]
        steps = {"write": [*common, "--rw=write", "--refill_buffers", "--end_fsync=1"], "read": [*common, "--rw=read"]}
        tool = "fio (psync, 1 job, 32 MiB blocks, O_DIRECT; the write with random buffers and a final fsync)"
    else:
        steps = {
            "write": ["dd", "if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}", "oflag=direct"]
            + ["conv=fsync", "status=none"],
            "read": ["dd", f"if={path}", "of=/dev/null", f"bs={block}", "iflag=direct", "status=none"],
        }
        tool = "dd (32 MiB blocks; write: zeros, oflag=direct, conv=fsync; read: iflag=direct)"
    out: dict[str, Any] = {"bytes": size, "where": str(directory), "tool": tool}
    try:
        for what, argv in steps.items():
            t0 = time.perf_counter()
            subprocess.run(argv, check=True, capture_output=True)
            seconds = time.perf_counter() - t0
            out[f"{what}_s"] = round(seconds, 3)
            out[f"{what}_GBps"] = gbps(size, seconds)
    except (OSError, subprocess.CalledProcessError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        path.unlink(missing_ok=True)
    return out


# --------------------------------------------------------------------------- where a target's start goes
def start_timeline(launched: float, serving: float, timeline: dict[str, Any], warm_over: float) -> dict[str, Any]:
    """The target's start, from its launch (epoch seconds): until its process existed, until the SDK's attach (the
    interpreter, imports, CUDA context, the model built), until it served (the agent and the HTTP server up, as the
    launcher saw it), and until the SDK's warm-up ended; with the warm-up's own steps."""
    points = [("process", timeline.get("process_start")), ("attach", timeline.get("attach"))]
    points += [("serving", serving), ("warm", warm_over)]
    out: dict[str, Any] = {}
    last = launched
    for name, at in points:
        if at is None:
            continue
        out[f"to_{name}_s"] = round(float(at) - last, 3)
        last = float(at)
    out["warm_steps_s"] = timeline.get("warm_steps") or {}
    return out

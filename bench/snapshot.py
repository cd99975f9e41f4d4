"""Snapshot benchmark: the agent's capture/restore against the CUDA driver checkpoint, in one run.

    python bench/snapshot.py --json [--gb 16] [--mutable-mb 256] [--chunk-mb 16] [--workers N]

On a GPU host (default 16 GB of bf16 tensors) it measures, side by side:
  * driver checkpoint/restore (cuCheckpointProcess* on a child process holding the same tensors),
  * agent capture to host memory (frozen stop-and-copy path, and the live pre-copy path),
  * agent restore into pre-allocated device tensors,
  * on-device dirty fingerprinting (fused compiled kernel and eager),
  * stop-and-copy downtime (freeze → target ready) for a 16 GB-weights + 256 MB-mutable workload.
Without a GPU the same code runs on CPU tensors at a small size (default 0.25 GB) and the driver
baseline is reported as not run. The last stdout line is one JSON object; every figure names what it
includes. The sink is tests/support/memimage.py (host memory, BLAKE3 chunk ids, HMAC-signed
manifest): no compression, no encryption, no network.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from benchlib import gbps, pinned_d2h_GBps

from gpumigrate.snapshot.chunks import byte_view, fingerprint_chunks
from gpumigrate.snapshot.engine import SnapshotEngine
from gpumigrate.transfer import devhash
from gpumigrate.transfer.direct import HASH_BATCH as DEVICE_HASH_BATCH

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test helpers' in-memory store
from tests.support.memimage import MemoryStore  # noqa: E402

KEY = b"bench-key-not-secret-0123456789ab"
TENSOR_MB = 256


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_tensors(total_bytes: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """bf16 weights ~ N(0, 0.02) in 256 MB tensors (real-looking data, never zeros)."""
    g = torch.Generator(device=device).manual_seed(seed)
    per = TENSOR_MB << 20
    out = {}
    for i in range(max(1, total_bytes // per)):
        t = torch.empty(per // 2, dtype=torch.bfloat16, device=device)
        t.normal_(0.0, 0.02, generator=g)
        out[f"w{i:03d}"] = t
    return out


# --------------------------------------------------------------------------- driver baseline
CHILD = r"""
import json, sys, torch
total, seed = int(sys.argv[1]), int(sys.argv[2])
dev = torch.device("cuda:0")
g = torch.Generator(device=dev).manual_seed(seed)
per = 256 << 20
ts = []
for _ in range(max(1, total // per)):
    t = torch.empty(per // 2, dtype=torch.bfloat16, device=dev)
    t.normal_(0.0, 0.02, generator=g)
    ts.append(t)
def digest():
    return [int(t.view(torch.int32).sum().item()) for t in ts]
torch.cuda.synchronize()
print(json.dumps({"ready": True, "digest": digest()}), flush=True)
sys.stdin.readline()
print(json.dumps({"digest": digest()}), flush=True)
"""


def driver_baseline(total_bytes: int, seed: int) -> dict[str, Any]:
    from gpumigrate.snapshot import cuda_driver

    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(total_bytes), str(seed)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        first = json.loads(child.stdout.readline())
        proc = cuda_driver.CudaProcess(child.pid)
        states = [proc.state()]
        t0 = time.perf_counter()
        proc.lock(timeout_ms=10_000)
        proc.checkpoint()
        t1 = time.perf_counter()
        states.append(proc.state())
        proc.restore_memory()
        t2 = time.perf_counter()
        proc.unlock()
        t3 = time.perf_counter()
        states.append(proc.state())
        child.stdin.write("verify\n")
        child.stdin.flush()
        after = json.loads(child.stdout.readline())
        child.wait(60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    return {
        "bytes": total_bytes,
        "lock_s": round(proc.timing.lock_s, 4),
        "checkpoint_s": round(proc.timing.checkpoint_s, 3),
        "restore_s": round(proc.timing.restore_s, 3),
        "unlock_s": round(proc.timing.unlock_s, 4),
        "suspend_total_s": round(t1 - t0, 3),
        "resume_total_s": round(t3 - t1, 3),
        "checkpoint_GBps": gbps(total_bytes, proc.timing.checkpoint_s),
        "restore_GBps": gbps(total_bytes, t2 - t1),
        "states": states,
        "data_verified": first["digest"] == after["digest"],
        "includes": "cuCheckpointProcessCheckpoint/Restore of a child process holding the same tensors (to/from host memory, driver-managed)",
    }


# --------------------------------------------------------------------------- agent figures
def fingerprint_rate(tensors: dict[str, torch.Tensor], chunk: int, device: torch.device, fused: bool) -> dict[str, Any]:
    views = [byte_view(t) for t in tensors.values()]
    total = sum(v.numel() for v in views)
    times = []
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        fps = [fingerprint_chunks(v, chunk, fused=fused) for v in views]
        torch.cat(fps).cpu()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times[1:])
    return {"bytes": total, "seconds_median": round(med, 5), "GBps": gbps(total, med)}


def agent_capture(
    tensors: dict[str, torch.Tensor],
    chunk: int,
    workers: int,
    arena: torch.Tensor,
    *,
    frozen: bool,
    hash_chunks: bool,
    repeat: int = 3,
) -> tuple[dict[str, Any], MemoryStore, str]:
    agent = SnapshotEngine(workers=workers)
    agent.track_tensors("weights", tensors)
    if frozen:
        agent.park()
    warm = SnapshotEngine(workers=workers)  # allocate rings/streams and compile kernels outside the timing
    warm.track_tensors("warm", {k: v for k, v in list(tensors.items())[:1]})
    warm.capture_round(MemoryStore().writer(KEY, chunk_size=chunk))
    agent._pipelines = warm._pipelines
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    runs = []
    for _ in range(repeat):  # each run a fresh image in the same arena
        store = MemoryStore(arena=arena)
        agent.forget_shipped()
        writer = store.writer(KEY, chunk_size=chunk, hash_chunks=hash_chunks)
        t0 = time.perf_counter()
        stats = agent.capture_round(writer).stats
        runs.append(time.perf_counter() - t0)
    dt = statistics.median(runs)
    return (
        {
            "bytes": total,
            "seconds_median": round(dt, 4),
            "GBps": gbps(total, dt),
            "GBps_runs": [gbps(total, r) for r in runs],
            "chunks": stats.chunks_dirty,
        },
        store,
        agent.last_image.id,
    )


def agent_restore(
    tensors: dict[str, torch.Tensor],
    store: MemoryStore,
    image: str,
    workers: int,
    *,
    verify: bool = True,
    repeat: int = 3,
) -> dict[str, Any]:
    targets = {k: torch.zeros_like(v) for k, v in tensors.items()}
    runs = []
    for _ in range(repeat):
        for t in targets.values():
            t.zero_()
        agent = SnapshotEngine(workers=workers)
        agent.track_tensors("weights", targets)
        sync(next(iter(tensors.values())).device)
        t0 = time.perf_counter()
        reader = store.reader(image, KEY, verify_chunks=verify)
        res = agent.load(reader)
        runs.append(time.perf_counter() - t0)
        agent.close()
    ok = all(torch.equal(targets[k], v) for k, v in tensors.items())
    del targets
    dt = statistics.median(runs)
    n = res["bytes_loaded"]
    return {
        "bytes": n,
        "seconds_median": round(dt, 4),
        "GBps": gbps(n, dt),
        "GBps_runs": [gbps(n, r) for r in runs],
        "bit_identical": ok,
    }


def torch_save_baseline(tensors: dict[str, torch.Tensor], limit_bytes: int) -> dict[str, Any]:
    """The usual way: torch.save of the tensors into host memory, torch.load + copy_ back."""
    import io

    subset, n = {}, 0
    for k, v in tensors.items():
        if n + v.numel() * v.element_size() > limit_bytes and subset:
            break
        subset[k] = v
        n += v.numel() * v.element_size()
    dev = next(iter(tensors.values())).device
    buf = io.BytesIO()
    sync(dev)
    t0 = time.perf_counter()
    torch.save(subset, buf)
    t1 = time.perf_counter()
    buf.seek(0)
    loaded = torch.load(buf, map_location="cpu")
    targets = {k: torch.empty_like(v) for k, v in subset.items()}
    for k, t in targets.items():
        t.copy_(loaded[k])
    sync(dev)
    t3 = time.perf_counter()
    ok = all(torch.equal(targets[k], v) for k, v in subset.items())
    return {
        "bytes": n,
        "save_GBps": gbps(n, t1 - t0),
        "load_GBps": gbps(n, t3 - t1),
        "bit_identical": ok,
        "includes": "torch.save of the tensors into a BytesIO (device→pageable host copy included); load = torch.load "
        "+ copy_ into pre-allocated tensors on the source device",
    }


class Gate:
    """A request safe point: the serving thread holds it per request; freeze takes it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held = False

    def shut(self) -> None:
        self.lock.acquire()
        self.held = True

    def reopen(self) -> None:
        if self.held:
            self.held = False
            self.lock.release()


def downtime(
    weights: dict[str, torch.Tensor],
    mutable_bytes: int,
    chunk: int,
    workers: int,
    device: torch.device,
    arena: torch.Tensor,
) -> dict[str, Any]:
    kv = torch.zeros(mutable_bytes // 2, dtype=torch.bfloat16, device=device)
    gate = Gate()
    stop = threading.Event()
    served = [0]

    def serve() -> None:  # mutates the whole mutable state once per "request"
        while not stop.is_set():
            with gate.lock:
                kv.view(torch.int16).add_(1)  # raw increments: every element changes every request
                sync(device)
                served[0] += 1
            time.sleep(0.001)

    src = SnapshotEngine(workers=workers, freezer=gate)
    src.track_tensors("weights", weights)
    src.track_tensor("kv", kv)
    dst_w = {k: torch.empty_like(v) for k, v in weights.items()}
    dst_kv = torch.empty_like(kv)
    ready: list[float] = []
    dst = SnapshotEngine(workers=workers, set_ready=lambda r: ready.append(time.perf_counter()) if r else None)
    dst.track_tensors("weights", dst_w)
    dst.track_tensor("kv", dst_kv)
    store = MemoryStore(arena=arena)
    th = threading.Thread(target=serve, daemon=True)
    th.start()
    rounds = []
    try:
        for _ in range(3):  # live pre-copy while serving; the target pre-loads each round
            st = src.capture_round(store.writer(KEY, chunk_size=chunk)).stats
            dst.load(store.reader(src.last_image.id, KEY), ready=False)
            rounds.append(
                {"chunks_dirty": st.chunks_dirty, "bytes_dirty": st.bytes_dirty, "seconds": round(st.seconds, 4)}
            )
        t0 = time.perf_counter()
        src.park()
        t1 = time.perf_counter()
        ref = src.capture_final(store.writer(KEY, chunk_size=chunk)).image
        t2 = time.perf_counter()
        res = dst.load(store.reader(ref.id, KEY))
        t3 = ready[-1] if ready else time.perf_counter()
        ok = torch.equal(dst_kv, kv) and all(torch.equal(dst_w[k], v) for k, v in weights.items())  # before resume
    finally:
        src.unpark()
        stop.set()
        th.join(10)
    return {
        "weights_bytes": sum(t.numel() * t.element_size() for t in weights.values()),
        "mutable_bytes": mutable_bytes,
        "downtime_ms": round((t3 - t0) * 1000, 2),
        "freeze_ms": round((t1 - t0) * 1000, 2),
        "final_ms": round((t2 - t1) * 1000, 2),
        "restore_ms": round((t3 - t2) * 1000, 2),
        "final_bytes": res["bytes_loaded"],
        "precopy_rounds": rounds,
        "requests_served_during_precopy": served[0],
        "bit_identical": ok,
        "includes": "freeze at a request safe point → fingerprint all chunks on device → ship dirty chunks (D2H, BLAKE3, in-memory "
        "store) → verify (HMAC manifest, BLAKE3 per chunk) and load dirty chunks into the target's pre-allocated "
        "tensors (H2D) → target ready; source and target in one process on one GPU (same-host), no network",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="(always on) print the result as JSON on the last line")
    p.add_argument("--gb", type=float, default=None, help="tensor bytes in GB (default 16 on GPU, 0.25 on CPU)")
    p.add_argument("--mutable-mb", type=int, default=None, help="mutable state for the downtime figure (256 on GPU)")
    p.add_argument("--chunk-mb", type=int, default=16)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--skip-driver", action="store_true")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    gb = args.gb if args.gb is not None else (16.0 if cuda else 0.25)
    total = int(gb * (1 << 30)) // (TENSOR_MB << 20) * (TENSOR_MB << 20) or (TENSOR_MB << 20)
    mutable = (args.mutable_mb if args.mutable_mb is not None else (256 if cuda else 32)) << 20
    chunk = args.chunk_mb << 20
    workers = args.workers or max(2, min(16, (os.cpu_count() or 2) - 1))
    if cuda and devhash.available(device):
        devhash.warm(device)  # compile the hash kernels outside every timing, as a target does at start
    out: dict[str, Any] = {
        "bench": "snapshot",
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "workers": workers,
        "chunk_bytes": chunk,
        "tensor_bytes": total,
    }
    if cuda and not args.skip_driver:
        log("driver baseline ...")
        try:
            out["driver"] = driver_baseline(total, seed=1)
        except Exception as exc:
            out["driver"] = {"error": f"{type(exc).__name__}: {exc}"}
    else:
        out["driver"] = {"not_run": "no CUDA GPU here" if not cuda else "--skip-driver"}
    log("allocating tensors ...")
    tensors = make_tensors(total, device, seed=1)
    if cuda:
        out["line_rate_pinned_d2h_GBps"] = pinned_d2h_GBps(byte_view(next(iter(tensors.values())))[: 1 << 28])
    log("fingerprint ...")
    out["fingerprint_fused"] = fingerprint_rate(tensors, chunk, device, fused=True)
    out["fingerprint_eager"] = fingerprint_rate(tensors, chunk, device, fused=False)
    one = byte_view(next(iter(tensors.values())))
    out["fingerprint_fused_equals_eager"] = bool(
        torch.equal(fingerprint_chunks(one, chunk), fingerprint_chunks(one, chunk, fused=False))
    )
    out["fingerprint_fused"]["includes"] = (
        "read every chunk in device memory once, one int64 per chunk back to the host"
    )
    if cuda and devhash.available(device):
        views = [v for t in tensors.values() for v in byte_view(t).split(chunk)]
        runs = []
        for _ in range(3):
            sync(device)
            t0 = time.perf_counter()
            for i in range(0, len(views), DEVICE_HASH_BATCH):
                devhash.blake3_device(views[i : i + DEVICE_HASH_BATCH])
            sync(device)
            runs.append(time.perf_counter() - t0)
        out["device_blake3"] = {
            "bytes": total,
            "GBps": gbps(total, statistics.median(runs)),
            "includes": f"BLAKE3 (standard, 32-byte) of every chunk in device memory, {DEVICE_HASH_BATCH} chunks per launch",
        }
    log("arena ...")
    t0 = time.perf_counter()
    arena = torch.empty(total + mutable * 6 + (64 << 20), dtype=torch.uint8, pin_memory=cuda)
    out["sink_arena"] = {
        "bytes": arena.numel(),
        "pinned": cuda,
        "alloc_s": round(time.perf_counter() - t0, 2),
        "note": "host memory for the in-memory image, allocated (and pinned) once before any timing",
    }
    log("agent capture ...")
    cap, store, image = agent_capture(tensors, chunk, workers, arena, frozen=True, hash_chunks=True)
    cap["includes"] = (
        "frozen stop-and-copy path: on-device fingerprint of every chunk + D2H straight into the sink's pinned "
        "host arena (the sink's direct placement) + BLAKE3 of every chunk on the CPU's threads + signed manifest commit"
    )
    out["agent_capture"] = cap
    log("agent restore ...")
    rest = agent_restore(tensors, store, image, workers)
    rest["includes"] = (
        "HMAC manifest check + H2D from the pinned arena into pre-allocated tensors + BLAKE3 of every chunk's "
        "arena bytes on the CPU's threads while the copies run: a mismatch fails the restore and the target "
        "stays unready (the transfer engine verifies on the GPU instead: bench/e2e.py)"
    )
    out["agent_restore"] = rest
    nover = agent_restore(tensors, store, image, workers, verify=False)
    nover["includes"] = (
        "pipeline bound only: as agent_restore without the per-chunk BLAKE3 check (never used for real restores)"
    )
    out["agent_restore_noverify"] = nover
    del store
    live, _, _ = agent_capture(tensors, chunk, workers, arena, frozen=False, hash_chunks=True)
    live["includes"] = (
        "live pre-copy path: as agent_capture plus a D2D staging copy and a fingerprint of the staged bytes per chunk"
    )
    out["agent_capture_live"] = live
    nohash, _, _ = agent_capture(tensors, chunk, workers, arena, frozen=True, hash_chunks=False)
    nohash["includes"] = "frozen path with the sink's hashing off: fingerprint + D2H into the arena only"
    out["agent_capture_nohash"] = nohash
    log("torch.save baseline ...")
    out["baseline_torch_save"] = torch_save_baseline(tensors, min(total, 2 << 30))
    log("downtime ...")
    weights = tensors
    out["downtime"] = downtime(weights, mutable, chunk, workers, device, arena)
    drv = out["driver"]
    base = out["baseline_torch_save"]
    out["ratios_vs_torch_save"] = {
        "capture": round(cap["GBps"] / base["save_GBps"], 1),
        "restore": round(rest["GBps"] / base["load_GBps"], 1),
    }
    if "checkpoint_GBps" in drv:
        out["ratios"] = {
            "capture_vs_driver_checkpoint": round(cap["GBps"] / drv["checkpoint_GBps"], 1),
            "restore_vs_driver_restore": round(rest["GBps"] / drv["restore_GBps"], 1),
        }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

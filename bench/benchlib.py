"""Helpers the benchmarks share (each benchmark is a script: ``bench/`` is on its import path)."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any


def threaded(n: int, fn: Any) -> float:
    """Seconds for ``fn(0)`` … ``fn(n - 1)`` on n threads at once, from the first start to the last join."""
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else float("inf")


def pinned_d2h_GBps(src: Any) -> float:
    """The line rate: 1 GiB of device→pinned-host copies from ``src`` (256 MiB of device bytes), median of 4."""
    import torch

    pinned = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k in range(4):
            pinned[k << 28 : (k + 1) << 28].copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return gbps(1 << 30, statistics.median(times[1:]))


SAFETENSORS = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
path, device, nbytes, width = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if sys.argv[5] == "save":
    layer = width * width * 4
    state = {f"layer{i}": torch.zeros(width, width) for i in range(max(1, nbytes // layer))}
    import safetensors.torch as st
    t = time.perf_counter(); st.save_file(state, path)
    print(json.dumps({"bytes": sum(v.numel() * 4 for v in state.values()), "save_s": time.perf_counter() - t}))
    raise SystemExit(0)
if device.startswith("cuda"):
    torch.zeros(1, device=device)  # the CUDA context: part of a cold start, kept out of the load figure
import safetensors.torch as st
t1 = time.perf_counter()
state = st.load_file(path, device=device)
if device.startswith("cuda"):
    torch.cuda.synchronize()
t2 = time.perf_counter()
print(json.dumps({"load_s": t2 - t1, "in_process_s": t2 - t0, "tensors": len(state)}))
"""


def safetensors_load(folder: Path, device: str, nbytes: int) -> dict[str, Any]:
    """``nbytes`` of fp32 layers in a safetensors file in ``folder``, loaded onto ``device`` by a fresh process: a
    restore's baseline (a cold load of the same bytes)."""
    if importlib.util.find_spec("safetensors") is None:
        return {"not_run": "safetensors is not installed here"}
    path = folder / "state.safetensors"
    width = 4096 if nbytes >= 64 << 20 else 256
    run = [sys.executable, "-c", SAFETENSORS, str(path), device, str(nbytes), str(width)]
    try:
        saved = json.loads(subprocess.run([*run, "save"], check=True, capture_output=True, text=True).stdout)
        got = json.loads(subprocess.run([*run, "load"], check=True, capture_output=True, text=True).stdout)
    finally:
        path.unlink(missing_ok=True)
    return {
        "bytes": saved["bytes"],
        "load_s": round(got["load_s"], 3),
        "load_gbps": gbps(saved["bytes"], got["load_s"]),
        "includes": f"safetensors.torch.load_file of {nbytes} bytes of fp32 layers from {folder} onto {device}, in a "
        "fresh process (its start and CUDA context not counted)",
    }

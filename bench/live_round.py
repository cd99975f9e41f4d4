"""A source's pre-copy rounds in one process: the agent over the reference model (16 GiB bf16 in 521 tensors),
each round into a fresh encrypted, compressed ``file://`` image in /dev/shm, timed around ``precopy_to``.

    python bench/live_round.py --json [--gib 16] [--rounds live,live2] [--codec auto] [--workers 16]

What ``bench/e2e.py``'s round 1 measures, without a second process, a serving loop or a target starting
beside it, so the capture path's own speed shows (and runs under a profiler). ``live`` rounds stage and
fingerprint each batch while the model could change; ``frozen`` rounds read the tensors as they are. Before
timing, the SDK's own warm-up at attach runs and is waited for (kernels compiled, a probe captured, slots
page-locked). Pair it with an older build of the package on the same machine (``PYTHONPATH``) for a
before/after figure. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch
from benchlib import gbps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="(always on)")
    p.add_argument("--gib", type=float, default=16)
    p.add_argument("--rounds", default="live,live2", help="comma-separated: live*, frozen*")
    p.add_argument("--codec", default="auto")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--chunk-mb", type=int, default=16)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "live_round", "not_run": "needs a CUDA GPU"}))
        return 0
    os.environ.setdefault("GPUMIGRATE_SNAPSHOT_CHUNK_MB", str(args.chunk_mb))
    from gpumigrate import transfer
    from gpumigrate.agent import images
    from gpumigrate.agent.images import make_agent
    from gpumigrate.workloads.model import build_model

    os.environ["GM_BENCH_KEY"] = transfer.generate_key()
    key_ref = {"env": "GM_BENCH_KEY"}
    model = build_model(0, "small", dtype="bfloat16", device="cuda", params_mb=args.gib * 1024)
    # the SDK's own warm-up at attach (agent/images.py), waited for: a source serves a while before it moves
    images.warm_device_kernels([torch.cuda.current_device()])
    warm_s = images.wait_for_kernels()
    agent = make_agent()
    agent.track_module("model", model)
    nbytes = sum(q.numel() * q.element_size() for q in model.parameters())
    opts = {"compression": args.codec, "parallelism": args.workers}
    out: dict[str, object] = {"bench": "live_round", "device": torch.cuda.get_device_name(0), "bytes": nbytes}
    out["warmup_wait_s"] = round(warm_s, 2)
    for label in args.rounds.split(","):
        store = f"/dev/shm/gm-bench-{label}"
        shutil.rmtree(store, ignore_errors=True)
        agent.forget_shipped()
        agent.frozen = label.startswith("frozen")
        t = time.perf_counter()
        got = agent.precopy_to(f"file://{store}", key_ref, options=opts)
        seconds = time.perf_counter() - t
        out[label] = {
            "seconds": round(seconds, 3),
            "GBps": gbps(nbytes, seconds),
            "stored_fraction": round(got["image"]["bytes_sent"] / nbytes, 4),
        }
        shutil.rmtree(store, ignore_errors=True)
    out["includes"] = (
        "agent.precopy_to of every chunk (fingerprint, stage, device BLAKE3, GPU planes + nvCOMP, AES-256-GCM, "
        "file:// writes on tmpfs, signed manifest), one process, no serving load"
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

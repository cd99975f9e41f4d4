"""A source's pre-copy rounds in one process: the agent over the reference model (16 GiB bf16 in 521 tensors),
each round into a fresh encrypted, compressed ``file://`` image in /dev/shm, timed around ``precopy_to``.

    python bench/live_round.py --json [--gib 16] [--rounds live,live2] [--codec auto] [--workers 16]
    python bench/live_round.py --json --rounds '' --finals 30 --mutable-mb 256 [--profile final.txt]

What ``bench/e2e.py``'s round 1 measures, without a second process, a serving loop or a target starting
beside it, so the capture path's own speed shows (and runs under a profiler). ``live`` rounds stage and
fingerprint each batch while the model could change; ``frozen`` rounds read the tensors as they are. Before
timing, the SDK's own warm-up at attach runs and is waited for (kernels compiled, a probe captured, slots
page-locked). Pair it with an older build of the package on the same machine (``PYTHONPATH``) for a
before/after figure. One JSON line.

``--finals N`` times the source's half of a stop-and-copy: a chain of images in one store (round 1 of
everything, round 2 after the mutable state changed), then N final rounds of the frozen source, each after
``--mutable-mb`` of state tracked as ``attach(state=...)`` tracks it changed again (every byte, as the
reference server's requests change it). Each is ``final_to`` timed around the call, with the agent's own
phases; the target's restore is not in it (``bench/e2e.py`` measures the whole downtime). ``--confirm later``: each final round returns before the confirmation
of its cold chunks ends (``snapshot/cutover.py``), and ``verdict_ms_median`` is the wait for its verdict after it
returned. ``--profile F``
records the final rounds alone with py-spy (raw stacks, every thread, idle included) where it is installed;
``--trace F`` runs one more under ``torch.profiler`` and writes its Chrome trace (device kernels and copies).

``--smoke`` (CI, CPU): the same rounds and two final rounds on a 4 MiB model in host memory; each round's image is
restored by a second agent into a model of zeros, and the run exits 1 unless the weights come back bit-identical.
Without a GPU and without ``--smoke`` (or ``--device cpu``) it reports ``not_run``: the figures are the GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from benchlib import gbps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="(always on)")
    p.add_argument("--gib", type=float, default=16)
    p.add_argument("--rounds", default="live,live2", help="comma-separated: live*, frozen*")
    p.add_argument("--codec", default="auto")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--chunk-mb", type=int, default=None, help="capture chunk size (default: the SDK's own choice)")
    p.add_argument("--finals", type=int, default=0, help="final rounds of a frozen source, after a round-1/2 chain")
    p.add_argument("--mutable-mb", type=float, default=256, help="state each final round finds changed")
    p.add_argument(
        "--confirm",
        choices=("wait", "later"),
        default="wait",
        help="final rounds confirm every reused chunk before they return (wait) or the cold ones after (later)",
    )
    p.add_argument("--profile", default=None, help="py-spy raw stacks of the final rounds into this file")
    p.add_argument("--trace", default=None, help="one more final round under torch.profiler: a Chrome trace here")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else None, help="cuda (default) or cpu")
    p.add_argument(
        "--smoke", action="store_true", help="CI: CPU, 4 MiB; exit 1 unless every image restores bit-identical"
    )
    args = p.parse_args(argv)
    if args.smoke:  # a 4 MiB model in host memory, one round of each kind, two final rounds
        args.device, args.gib, args.rounds = "cpu", 1 / 256, "live,frozen"
        args.finals, args.mutable_mb, args.workers = 2, 1, 2
    if args.device is None:
        print(
            json.dumps({"bench": "live_round", "not_run": "needs a CUDA GPU (--device cpu runs the same code small)"})
        )
        return 0
    if args.chunk_mb:  # else the SDK's own choice for GPU state (agent/warmup.py)
        os.environ.setdefault("GPUMIGRATE_SNAPSHOT_CHUNK_MB", str(args.chunk_mb))
    from gpumigrate import transfer
    from gpumigrate.agent import warmup
    from gpumigrate.agent.images import make_engine
    from gpumigrate.snapshot.server_commands import precopy_to
    from gpumigrate.stageclock import STAGES
    from gpumigrate.workloads.model import build_model

    os.environ["GM_BENCH_KEY"] = transfer.generate_key()
    key_ref = {"env": "GM_BENCH_KEY"}
    model = build_model(0, "small", dtype="bfloat16", device=args.device, params_mb=args.gib * 1024)
    # the SDK's own warm-up at attach (agent/warmup.py), waited for: a source serves a while before it moves
    if args.device != "cpu":
        warmup.warm_device_kernels([torch.cuda.current_device()])
    warm_s = warmup.wait_for_kernels()
    agent = make_engine()
    agent.track_module("model", model)
    nbytes = sum(q.numel() * q.element_size() for q in model.parameters())
    opts = {"compression": args.codec, "parallelism": args.workers}
    device = torch.cuda.get_device_name(0) if args.device != "cpu" else "cpu"
    out: dict[str, object] = {"bench": "live_round", "device": device, "bytes": nbytes}
    out["warmup_wait_s"] = round(warm_s, 2)
    for label in filter(None, args.rounds.split(",")):
        store = f"/dev/shm/gm-bench-{label}"
        shutil.rmtree(store, ignore_errors=True)
        agent.forget_shipped()
        agent.state.frozen = label.startswith("frozen")
        STAGES.take()
        t = time.perf_counter()
        got = precopy_to(agent, f"file://{store}", key_ref, options=opts)
        seconds = time.perf_counter() - t
        out[label] = {
            "seconds": round(seconds, 3),
            "GBps": gbps(nbytes, seconds),
            "stored_fraction": round(got["image"]["bytes_sent"] / nbytes, 4),
            "phases": got["stats"].get("phases"),
            "stages_s": STAGES.take(),  # seconds per stage summed over threads (gpumigrate/stageclock.py)
        }
        if args.smoke:
            out[label]["restored_identical"] = _restores_identical(model, store, got["image"]["id"], key_ref, args)  # type: ignore[index]
        shutil.rmtree(store, ignore_errors=True)
    if args.finals:
        out["finals"] = _finals(agent, key_ref, opts, args)
    out["includes"] = (
        "agent.precopy_to of every chunk (fingerprint, stage, device BLAKE3, GPU planes + nvCOMP, AES-256-GCM, "
        "file:// writes on tmpfs, signed manifest), one process, no serving load"
    )
    print(json.dumps(out))
    if args.smoke:
        labels = list(filter(None, args.rounds.split(",")))
        wrong = [f"{label}: the restored weights differ" for label in labels if not out[label]["restored_identical"]]  # type: ignore[index]
        if out["finals"]["count"] != args.finals:  # type: ignore[index]
            wrong.append("not every final round ran")
        if wrong:
            print("smoke: " + "; ".join(wrong), file=sys.stderr)
            return 1
    return 0


def _restores_identical(
    model: Any, store: str, image_id: str, key_ref: dict[str, str], args: argparse.Namespace
) -> bool:
    """A second agent over a model of zeros restores the image: are its weights the source's, bit for bit?"""
    from gpumigrate.agent.images import make_engine
    from gpumigrate.snapshot.server_commands import restore_from
    from gpumigrate.workloads.model import build_model, weights_digest

    fresh = build_model(0, "small", dtype="bfloat16", device=args.device, params_mb=args.gib * 1024, load_weights=False)
    target = make_engine()
    try:
        target.track_module("model", fresh)
        restore_from(target, f"file://{store}", image_id, key_ref)
    finally:
        target.close()
    return bool(weights_digest(fresh) == weights_digest(model))


def _finals(agent: Any, key_ref: dict[str, str], opts: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from gpumigrate.agent import tracking
    from gpumigrate.snapshot.server_commands import final_to, precopy_to

    mutable = torch.zeros(int(args.mutable_mb * (1 << 20)), dtype=torch.uint8, device=args.device)
    state: dict[str, Any] = {"mutable": mutable, "served": 0}
    for item in tracking.state_items(state):
        agent.track(item)
    store = "/dev/shm/gm-bench-chain"
    shutil.rmtree(store, ignore_errors=True)
    agent.forget_shipped()
    agent.state.frozen = False
    precopy_to(agent, f"file://{store}", key_ref, options=opts)  # round 1: everything
    mutable.add_(1)
    precopy_to(agent, f"file://{store}", key_ref, options=opts)  # round 2: the delta, parent = round 1
    agent.state.frozen = True  # as freeze() leaves it, without a serving loop to hold
    spy = _py_spy(args.profile) if args.profile else None
    runs: list[dict[str, Any]] = []
    try:
        for _ in range(args.finals):
            mutable.add_(1)
            state["served"] += 1
            if args.device != "cpu":
                torch.cuda.synchronize()
            t = time.perf_counter()
            got = final_to(agent, f"file://{store}", key_ref, options=opts, confirm=args.confirm)
            took = (time.perf_counter() - t) * 1e3
            t = time.perf_counter()  # the verdict of the cold chunks' confirmation (none pending with --confirm wait)
            verdict = agent.confirmation(got["image"]["id"])
            runs.append(
                {
                    "ms": took,
                    "phases": got["stats"]["phases"],
                    "verdict_ms": (time.perf_counter() - t) * 1e3,
                    "caught": verdict.caught,
                }
            )
    finally:
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            spy.wait(timeout=60)
    if args.trace:  # where the device's time goes in one final round: kernels, copies, and who waited on whom
        mutable.add_(1)
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            final_to(agent, f"file://{store}", key_ref, options=opts)
        prof.export_chrome_trace(args.trace)
    shutil.rmtree(store, ignore_errors=True)
    ms = sorted(r["ms"] for r in runs)
    phases = {k: round(statistics.median(r["phases"].get(k, 0.0) for r in runs) * 1e3, 2) for k in runs[0]["phases"]}
    return {
        "count": len(runs),
        "mutable_MiB": args.mutable_mb,
        "confirm": args.confirm,
        # after each round returned: the wait for its verdict (the cold chunks' hashes it had not waited for)
        "verdict_ms_median": round(statistics.median(r["verdict_ms"] for r in runs), 2),
        "caught": sum(r["caught"] for r in runs),
        "ms_median": round(statistics.median(ms), 2),
        "ms_min": round(ms[0], 2),
        "ms_max": round(ms[-1], 2),
        "phases_ms_median": phases,
        "profiled": bool(args.profile),
        "includes": "final_to of the frozen source (fingerprint all, BLAKE3 confirmation of the unchanged chunks, "
        "the changed mutable state shipped: codec, AES-256-GCM, file:// on tmpfs; signed manifest), one process",
    }


def _py_spy(path: str) -> subprocess.Popen[bytes] | None:
    exe = shutil.which("py-spy")
    if exe is None:
        print("py-spy is not installed: the final rounds run unprofiled", file=sys.stderr)
        return None
    cmd = [exe, "record", "--pid", str(os.getpid()), "--format", "raw", "--rate", "1000", "--threads", "--idle"]
    spy = subprocess.Popen([*cmd, "--output", path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached before the first round
    return spy


if __name__ == "__main__":
    sys.exit(main())

"""End-to-end migration benchmark: the product path between two processes, beside its baselines.

    python bench/e2e.py --json [--gb 16] [--mutable-mb 256] [--chunk-mb N] [--device cuda]
                        [--runs shm:auto,disk:auto] [--repeat 5] [--load-fraction 0.5] [--pacing adaptive|off]
                        [--workers N] [--rate-limit 4GB/s] [--confirm later|wait] [--root DIR] [--out FILE]
    python bench/e2e.py --json --runs shm:auto,disk:auto --repeat 5 --no-driver   # issue 34's table, one call

Source: the reference inference server (``--params-mb``, ``--device``, bf16, ``--mutable-mb``: state
that every request changes) with its embedded agent. Target: the same server awaiting a restore. Both
start the way a migration starts a workload: a ``WorkloadLaunch`` (argv with placeholders, the env
contract: ``GPUMIGRATE_AWAIT_RESTORE=1`` for the target) handed to the one launcher,
``LocalProvider.bootstrap``, on a local host of its own (supervised processes; ``GPUMIGRATE_HOME``
defaults to a directory under ``--root``). Everything moves through the real agent control channel and the
transfer engine into a ``file://`` store, the way the migrate flow runs its snapshot, transfer and restore
phases with a pre-loaded target, each round bounded as the plan's transfer section bounds it
(``--workers`` = ``transfer.parallelism``, ``--pacing``, ``--rate-limit``; gpumigrate/bounds.py):

  0. the source's capacity is measured (closed loop), then an open-loop load at ``--load-fraction`` of it runs
     through the whole migration (``load.windows``: p50, p99, throughput before, in each round, in the downtime,
     after; ``load.ratios``: round 1's p99 and the pre-copy's throughput over the ones before);
  1. the target starts while pre-copy round 1 writes the full image (capture figure; ``capture.pacing``: what the
     round's pacing did; ``target_start``: where the target's start went, from its SDK's own timeline);
  2. the target pre-loads round 1 (``restore``, ``ready: false``: restore figure);
  3. requests dirty the source's mutable state; round 2 ships the delta; the target pre-loads it;
  4. requests dirty it again; freeze → final → target restore → ready is the downtime (``--confirm later``, the
     default: the final round returns before its confirmation of the unchanged chunks ends, the target restores
     unready beside the source's verdict, then reports ready; ``--confirm wait``: the final round confirms first);
  5. the target's weights and mutable digests and its answer must equal the source's;
  6. the stop-and-copy again, ``--repeat`` times in all, on the same pair (``downtime_repeats_ms``, median, max).

Before the migration the bench waits until the source's agent no longer reports ``warming`` (the SDK's
one-time kernel compiles at attach: a source serves for a while before it moves) and reports the wait
(``source_warmup_wait_s``); the target's wait (``target_warmup_wait_s``) counts in the total migration
time. ``STORE:CODEC:source`` runs fill the target from the source's memory (``transfer.restore_from:
source``) instead of reading the store; the image is still written.

Each run is one ``STORE:CODEC`` pair: ``shm`` (/dev/shm) or ``disk`` (the target host's own ``<workdir>/store``
under ``--root``, where a migration to a local target puts it), and ``auto`` (the GPU codec where nvCOMP and a GPU
are present) or ``cpu`` (``GPUMIGRATE_GPU_CODEC=0``). A disk run also measures the disk itself: a plain
sequential write and read of the image's stored size (``fio`` or ``dd``, direct I/O) in the same filesystem,
and gives the store's capture and restore rates over them (``disk``). Baselines from the same run: a safetensors
cold load in a fresh process (load, and with start-up), ``torch.save``/``torch.load`` (``--torch-baseline``),
the CUDA driver checkpoint of the source process, and the pinned device→host line rate. The last stdout line is
one JSON object (``summary``: each run's figures beside their baselines); every figure says what it includes.
Each run also holds ``direct_stages_s``: the agents' own stage totals (``gpumigrate.stageclock.STAGES``, seconds
summed over threads) per capture and restore, by role. ``--target-after-capture`` starts the target after round 1
instead of during it: a diagnostic that shows the capture without the target's start-up beside it. ``--smoke``
runs a small CPU migration twice (from the image and from the source) under load, two stop-and-copies each, and
exits 1 unless the state came back bit-identical and every figure is there (CI runs it; it asserts no timings).
The parts beside the migration are in ``e2e_parts.py``, the two processes and the stop-and-copy in
``e2e_workloads.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchlib import gbps
from e2e_parts import (
    SourceLoad,
    baselines,
    capacity,
    disk_rate,
    driver_checkpoint,
    line_rate,
    load_ratios,
    start_timeline,
)
from e2e_workloads import (
    KEY_ENV,
    PROMPT,
    Run,
    Workload,
    bootstrap,
    log,
    provision,
    read_stages,
    roles_of,
    stop_and_copy,
    stop_and_copy_again,
    wait_warm,
    workload_launch,
)

from gpumigrate import control
from gpumigrate.agent.warmup import GPU_CHUNK_SIZE
from gpumigrate.infra.local import LocalProvider
from gpumigrate.interfaces import Host


# --------------------------------------------------------------------------- one migration
def migrate(args: argparse.Namespace, where: str, codec: str, restore_from: str = "store") -> dict[str, Any]:
    """Source → image in a ``file://`` store (``where``: shm, or disk: the target host's own ``<workdir>/store``, where
    a migration to a local target writes it) → pre-loaded target → stop-and-copy → ready, timed and checked; with
    the source under an open-loop load throughout (``--load-fraction``), and the stop-and-copy ``--repeat`` times.

    ``restore_from="source"``: the target's loads copy the source's tensors out of its memory (``transfer.restore_from:
    source``, snapshot/fill.py), each chunk checked against the image; the image is still written."""
    env = {"GPUMIGRATE_GPU_CODEC": "0" if codec == "cpu" else "1"}
    if args.chunk_mb:  # else the SDK's own choice (agent/warmup.py: 32 MiB for state on a GPU, 4 MiB in host memory)
        env["GPUMIGRATE_SNAPSHOT_CHUNK_MB"] = str(args.chunk_mb)
    provider = LocalProvider()
    hosts = [provision(provider, "e2e-source"), provision(provider, "e2e-target")]
    store_dir = (args.shm / "store") if where == "shm" else Path(str(hosts[1].workdir)) / "store"
    shutil.rmtree(store_dir, ignore_errors=True)
    # Both agents' direct paths log their stage totals per capture and restore (transfer/direct_writer.py, direct_reader.py); they go into
    # this run's JSON, by role (where a migration's threads spend their time, beside the figures they explain).
    stages_log = args.root / f"stages-{where}-{codec}-{restore_from}.jsonl"
    stages_log.unlink(missing_ok=True)
    env["GPUMIGRATE_STAGES_LOG"] = str(stages_log)
    # the plan's transfer section as the flow sends it with every round (gpumigrate/bounds.py)
    bounds = {"parallelism": args.workers, "pacing": args.pacing}
    if args.rate_limit:
        bounds["rate_limit"] = args.rate_limit
    run = Run(args, f"file://{store_dir}", {"env": KEY_ENV}, {"compression": "auto", **bounds}, confirm=args.confirm)
    out: dict[str, Any] = {"store": run.store, "codec": codec, "restore_from": restore_from, "bounds": bounds}
    out["target_starts"] = "after the capture" if args.target_after_capture else "during the capture"
    source: Workload | None = None
    target: Workload | None = None
    load: SourceLoad | None = None
    try:
        t0 = time.perf_counter()
        source = bootstrap(provider, hosts[0], workload_launch(args, env, await_restore=False))
        out["source_start_s"] = round(time.perf_counter() - t0, 2)
        # A source serves for a while before it moves: its SDK's one-time warm-up (kernel compiles, which a
        # fresh host's empty caches make long) is over by then. Waited for here, and reported, not timed below.
        out["source_warmup_wait_s"] = wait_warm(source)
        source.generate()  # warm: the first request compiles/allocates what later ones reuse
        if restore_from == "source":
            run.fill = {"source": source.agent.address}
        if args.load_fraction > 0:
            load = start_load(args, source, out)
        target = first_migration(args, run, provider, hosts[1], env, source, load, out)
        if load is not None:
            out["load"] = load.stop()
            out["load"]["ratios"] = load_ratios(out["load"]["windows"])
            load = None
        repeats = [out["downtime"]["ms"]]
        for k in range(1, args.repeat):
            log(f"  stop-and-copy {k + 1}/{args.repeat} ...")
            repeats.append(stop_and_copy_again(run, source, target)["ms"])
        out["downtime_repeats_ms"] = repeats
        out["downtime_median_ms"] = round(statistics.median(repeats), 1)
        out["downtime_max_ms"] = max(repeats)
        out["image_files_bytes"] = sum(p.stat().st_size for p in store_dir.rglob("*") if p.is_file())
        if args.device.startswith("cuda") and args.driver and codec == "auto" and where == "shm":
            target.close()
            provider.terminate(hosts[1])  # its GPU memory is free for the driver's copy
            target = None
            out["driver_checkpoint_of_source"] = driver_checkpoint(source.pid, out["capture"]["bytes"])
    finally:
        if load is not None:
            load.proc.kill()
        roles = roles_of(source=source, target=target)
        for w in (target, source):
            if w is not None:
                w.close()
        for host in hosts:
            provider.terminate(host)
        shutil.rmtree(store_dir, ignore_errors=True)
    out["direct_stages_s"] = read_stages(stages_log, roles)
    if where == "disk" and args.disk_rate and "capture" in out:
        out["disk"] = disk_figures(args, out)
    return out


def start_load(args: argparse.Namespace, source: Workload, out: dict[str, Any]) -> SourceLoad:
    """The source's capacity, then an open-loop load at ``--load-fraction`` of it, and a window of it before the
    migration starts (its p50/p99/throughput are what the migration's windows are compared with)."""
    url = f"{source.url}/v1/generate"
    out["source_capacity"] = capacity(url, PROMPT, clients=args.load_clients, seconds=args.window_s)
    rps = max(1.0, out["source_capacity"]["rps"] * args.load_fraction)
    load = SourceLoad(url, PROMPT, rps)
    load.mark("_settle")
    time.sleep(min(1.0, args.window_s))
    load.mark("before")
    time.sleep(args.window_s)
    return load


def first_migration(
    args: argparse.Namespace,
    run: Run,
    provider: LocalProvider,
    host: Host,
    env: dict[str, str],
    source: Workload,
    load: SourceLoad | None,
    out: dict[str, Any],
) -> Workload:
    """Round 1 while the target starts, its pre-load, round 2 and its pre-load, the stop-and-copy; the source's
    clients' windows marked on ``load``."""
    mark = load.mark if load is not None else (lambda name: None)
    # The target starts (through the launcher, as the provision phase starts it) while round 1 runs.
    t_migration = time.perf_counter()
    launched = time.time()
    with ThreadPoolExecutor(1) as starter:
        if args.target_after_capture:  # a diagnostic: the capture alone on the host, the total made longer
            mark("round1")
            t0 = time.perf_counter()
            round1 = run.precopy(source)
            capture_s = time.perf_counter() - t0
            mark("_to_round2")
            launched = time.time()
            target = bootstrap(provider, host, workload_launch(args, env, await_restore=True))
        else:
            starting = starter.submit(bootstrap, provider, host, workload_launch(args, env, await_restore=True))
            mark("round1")
            t0 = time.perf_counter()
            round1 = run.precopy(source)
            capture_s = time.perf_counter() - t0
            mark("_to_round2")
            target = starting.result()
    serving = time.time()
    out["target_start_s"] = round(time.perf_counter() - t_migration, 2)
    out["target_warmup_wait_s"] = wait_warm(target)  # inside the total migration time
    out["target_start"] = start_timeline(
        launched, serving, target.agent.call("info").get("timeline") or {}, time.time()
    )
    image_bytes = int(round1["image"]["bytes_image"])
    stored = int(round1["image"]["bytes_sent"])
    out["capture"] = {
        "bytes": image_bytes,
        "stored_bytes": stored,
        "stored_fraction": round(stored / max(1, image_bytes), 4),
        "seconds": round(capture_s, 3),
        "GBps": gbps(image_bytes, capture_s),
        "stored_GBps": gbps(stored, capture_s),
        "agent_seconds": round(float(round1["stats"]["seconds"]), 3),
        "agent_phases": round1["stats"].get("phases"),
        "pacing": round1["stats"].get("pacing"),
        "includes": "pre-copy round 1 of the live source (all chunks): fingerprint, stage, device BLAKE3, codec "
        "(GPU planes where nvCOMP is present, else the CPU byte-plane coder), AES-256-GCM, file:// store writes, "
        "signed manifest, under the run's bounds (parallelism, pacing); timed at the orchestrator around the agent "
        "call, "
        + (
            "before the target starts (--target-after-capture)"
            if args.target_after_capture
            else "while the target starts"
        ),
    }
    t0 = time.perf_counter()
    pre1 = run.preload(target, round1["image"]["id"])
    restore_s = time.perf_counter() - t0
    out["restore"] = {
        "bytes": int(pre1["bytes_loaded"]),
        "seconds": round(restore_s, 3),
        "GBps": gbps(int(pre1["bytes_loaded"]), restore_s),
        "stored_GBps": gbps(stored, restore_s),
        "agent_seconds": round(float(pre1["seconds"]), 3),
        "includes": "pre-load of round 1 into the cold target: manifest signature, store reads, AES-256-GCM open, "
        "decode (GPU or CPU), host→device copies, BLAKE3 of every chunk where it landed; timed around the call"
        if not run.fill
        else "pre-load of round 1 into the cold target, filled from the source's memory: manifest signature, "
        "the source's lend over the agent channel (CUDA IPC handles on a GPU, NIXL READs for host memory), the "
        "copy, BLAKE3 of every chunk where it landed against the manifest (blobs read from the store); timed "
        "around the call",
        "from_source": pre1.get("from_source"),
        "agent_phases": pre1.get("phases"),
    }
    source.generate()
    mark("round2")
    round2 = run.precopy(source)
    mark("_to_final")
    pre2 = run.preload(target, round2["image"]["id"])
    out["round2"] = {"stats": round2["stats"], "preload_seconds": round(float(pre2["seconds"]), 4)}
    source.generate()  # the mutable state is dirty again: the final round ships it
    mark("downtime")
    out["downtime"] = stop_and_copy(run, source, target)
    out["total_migration_s"] = round(out["downtime"].pop("t_ready") - t_migration, 3)
    out["target_ready_endpoint"] = target.ready()
    src_info, dst_info = source.info(), target.info()
    out["bit_identical"] = {
        "weights": src_info["weights_digest"] == dst_info["weights_digest"],
        "mutable": src_info.get("mutable_digest") == dst_info.get("mutable_digest") is not None,
    }
    source.agent.call("resume")
    mark("after")
    out["same_answer"] = source.generate()["tokens"] == target.generate()["tokens"]
    if load is not None:
        time.sleep(args.window_s)
        mark("_end")
    return target


def disk_figures(args: argparse.Namespace, out: dict[str, Any]) -> dict[str, Any]:
    """The store's device measured with a plain sequential write and read of the image's stored size (same
    filesystem as the store, same run), and the disk store's capture and restore beside them."""
    rate = disk_rate(args.root / "disk-rate", int(out["capture"]["stored_bytes"]))
    figures: dict[str, Any] = {"device": rate}
    if "write_GBps" in rate:
        figures["capture_vs_disk_write"] = round(out["capture"]["stored_GBps"] / rate["write_GBps"], 3)
    if "read_GBps" in rate and not out["restore"].get("from_source"):
        figures["restore_vs_disk_read"] = round(out["restore"]["stored_GBps"] / rate["read_GBps"], 3)
    figures["includes"] = (
        "the store's bytes (sealed, compressed objects) per second of the capture and of the pre-load, over the "
        "device's own sequential rate for as many bytes"
    )
    return figures


def ratios(out: dict[str, Any]) -> dict[str, Any]:
    """Each run's figures of issue 34's table beside their baselines from this run."""
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
            "downtime_median_ms": run["downtime_median_ms"],
            "downtime_max_ms": run["downtime_max_ms"],
            "downtime_runs": len(run["downtime_repeats_ms"]),
            "total_migration_s": run["total_migration_s"],
            **(run.get("load") or {}).get("ratios", {}),
        }
        for key in ("capture_vs_disk_write", "restore_vs_disk_read"):
            if key in (run.get("disk") or {}):
                row[key] = run["disk"][key]
        if cold:
            row["restore_vs_safetensors_load"] = round(run["restore"]["GBps"] / cold["load_GBps"], 2)
            row["total_vs_cold_start"] = round(run["total_migration_s"] / cold["cold_start_s"], 2)
        if line:
            row["capture_vs_line_rate"] = round(run["capture"]["GBps"] / line, 2)
            row["restore_vs_line_rate"] = round(run["restore"]["GBps"] / line, 2)
        rows[name] = row
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="(always on) print the result as JSON on the last line")
    p.add_argument("--gb", type=float, default=None, help="model weights in GiB (default 16 on a GPU, 0.03 on CPU)")
    p.add_argument("--mutable-mb", type=float, default=None, help="state each request changes (256 on a GPU)")
    p.add_argument("--chunk-mb", type=int, default=None, help="capture chunk size (default: the SDK's own choice)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda where available)")
    p.add_argument(
        "--runs",
        default="shm:auto,disk:auto",
        help="STORE:CODEC[:source] runs, comma-separated (:source fills the target from the source's memory)",
    )
    p.add_argument(
        "--root", default=None, help="disk directory for the hosts, the 'disk' store and logs (default: temp)"
    )
    p.add_argument("--workers", type=int, default=None, help="transfer.parallelism of each round (default: cores)")
    p.add_argument("--pacing", choices=("adaptive", "off"), default="adaptive", help="transfer.pacing of each round")
    p.add_argument("--rate-limit", default=None, help="transfer.rate_limit of each round (e.g. 4GB/s; default none)")
    p.add_argument(
        "--load-fraction", type=float, default=0.5, help="open-loop load on the source, of its capacity (0: none)"
    )
    p.add_argument("--load-clients", type=int, default=4, help="closed-loop clients measuring the capacity")
    p.add_argument("--window-s", type=float, default=4.0, help="seconds of the capacity, before and after windows")
    p.add_argument("--repeat", type=int, default=5, help="stop-and-copies measured per run (median and max)")
    p.add_argument(
        "--confirm",
        choices=("later", "wait"),
        default="later",
        help="the final round's confirmation: beside the target's restore (later) or before the final returns (wait)",
    )
    p.add_argument("--no-disk-rate", dest="disk_rate", action="store_false", help="skip the disk's own dd/fio rate")
    p.add_argument("--no-driver", dest="driver", action="store_false", help="skip the CUDA driver checkpoint")
    p.add_argument("--no-baselines", dest="baselines", action="store_false")
    p.add_argument("--torch-baseline", action="store_true", help="also torch.save/torch.load (slow at 16 GiB)")
    p.add_argument("--smoke", action="store_true", help="small CPU run; exit 1 unless the state is bit-identical")
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument(
        "--target-after-capture",
        action="store_true",
        help="start the target after round 1's capture instead of during it (the flow's way): a diagnostic that "
        "separates the capture's own speed from the target's start-up beside it; the total migration time grows",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    if args.smoke:
        args.device, args.runs, args.driver, args.baselines = "cpu", "disk:auto,disk:auto:source", False, False
        args.window_s, args.repeat = 0.5, 2
    args.device = args.device or ("cuda" if cuda else "cpu")
    gpu = args.device.startswith("cuda")
    args.gb = args.gb if args.gb is not None else (16.0 if gpu else 0.03)
    args.params_mb = round(args.gb * 1024, 3)
    args.mutable_mb = args.mutable_mb if args.mutable_mb is not None else (256 if gpu else 2)
    args.workers = args.workers or min(64, os.cpu_count() or 2)
    args.repeat = max(1, args.repeat)
    from gpumigrate import transfer

    os.environ[KEY_ENV] = transfer.generate_key()  # the hosts' supervisors inherit it; the agents resolve it
    args.root_given = bool(args.root)
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="gm-e2e-"))
    root.mkdir(parents=True, exist_ok=True)
    args.root = root
    os.environ.setdefault("GPUMIGRATE_HOME", str(root / "home"))  # the local hosts, their logs, the control key
    control.load_key(None, create=True)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() and not args.smoke else root
    args.shm = shm / f"gm-e2e-{os.getpid()}"
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
        "load_fraction": args.load_fraction,
        "runs": {},
    }
    if gpu:
        out["line_rate_pinned_d2h_GBps"] = line_rate(args.device)
    try:
        for spec in args.runs.split(","):
            where, codec, *fill = spec.split(":")
            log(f"migration {spec} ...")
            try:
                out["runs"][spec] = migrate(args, where, codec, "source" if fill == ["source"] else "store")
            except Exception as exc:
                out["runs"][spec] = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                shutil.rmtree(args.shm, ignore_errors=True)
            if args.out:  # partial results survive a run cut short
                Path(args.out).write_text(json.dumps(out) + "\n")
        if args.baselines:
            log("baselines ...")
            where = shm / f"gm-e2e-base-{os.getpid()}"
            try:
                out["baselines"] = baselines(args.params_mb, args.device, where, torch_load=args.torch_baseline)
            except Exception as exc:
                out["baselines"] = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                shutil.rmtree(where, ignore_errors=True)
    finally:
        if not args.root_given:
            shutil.rmtree(root, ignore_errors=True)
    out["summary"] = ratios(out)
    text = json.dumps(out)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if not args.smoke or smoke_ok(args, out) else 1


def smoke_ok(args: argparse.Namespace, out: dict[str, Any]) -> bool:
    """The smoke's verdict: every run bit-identical, answering like the source and ready; the dirty state moved in
    the final round (less than all of it in the second round); the filled run pulled chunks from the source; and
    the figures the issue asks for are there: the load's windows, every stop-and-copy, the disk's own rate."""
    for spec, run in out["runs"].items():
        windows = (run.get("load") or {}).get("windows") or {}
        ok = (
            "error" not in run
            and all(run["bit_identical"].values())
            and run["same_answer"]
            and run["target_ready_endpoint"]
            and run["downtime"]["restore_chunks_loaded"] >= 1
            and run["round2"]["stats"]["chunks_dirty"] < run["round2"]["stats"]["chunks_total"]
            and {"before", "round1", "round2", "downtime", "after"} <= set(windows)
            and len(run["downtime_repeats_ms"]) == args.repeat
            and "write_GBps" in run["disk"]["device"]
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
    return bool(out["runs"])


if __name__ == "__main__":
    sys.exit(main())

"""Workloads of N ranks end to end: capture and restore per GPU beside one GPU, downtime, next-step losses.

    python bench/e2e_ranks.py --json [--ranks 2] [--state-gb 16] [--device cuda|cpu] [--store DIR]
                              [--chunk-mb 64] [--parallelism 8]

Real worlds (torchrun, every rank embedding the SDK, NCCL on GPUs, gloo on the CPU) driven by the
orchestrator's ``World``, in one run:

* ``one_gpu``: the data-parallel job as a world of 1 rank on GPU 0 holding ``--state-gb`` of state
  (weights + AdamW's two moments), frozen, captured whole (a final round with no earlier round: every
  chunk), restored whole into a fresh world of 1 on GPU 1 (GPU 0 with one GPU). The baseline.
* ``ranks``: the same job as a world of ``--ranks`` ranks, each holding ``--state-gb``, rank r on GPU r,
  restored into a fresh world with the GPUs reversed (GPUs 0,1 → 1,0). Per GPU: capture and restore
  rates beside the baseline's (the issue's target: at least 80% of one GPU's); the freeze, the world
  image's composition; stop-and-copy with every byte dirty (a training step rewrites all of it).
  ``losses``: the source's next steps (``advance``) beside the target's, rank by rank.
* ``inference``: the tensor-parallel model (``--state-gb`` of weights per rank) after two pre-copy
  rounds pre-loaded into the target: the stop-and-copy downtime (hold → every target rank ready),
  for 1 rank and for ``--ranks`` ranks in the same run (target: ≤ 150 ms).

Images go to a file store (``--store``, default a folder under /dev/shm), uncompressed (what is
measured is capture and restore, not the codecs) and sealed with an image key given by reference, as
a migration writes them. Without a GPU everything runs on the CPU at the size given (e.g.
``--state-gb 0.003``): the figures then say nothing about GPUs, only that the benchmark runs. The
last stdout line is one JSON object; each figure says what it includes.

``--smoke`` (CI): the 2-rank worlds alone (training and inference) on the CPU at 3 MB per rank; exits 1 unless
the ranks came back where asked, the final round moved what a step rewrote (training) or only the progress
(inference), and the target's next-step losses equal the source's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gpumigrate.snapshot.world import World
from gpumigrate.transfer.format.keys import generate_key
from gpumigrate.workloads.worlds import LocalWorld, start_world

DP = "gpumigrate.workloads.dp_training"
TP = "gpumigrate.workloads.tp_inference"
# Images are written signed and sealed, as a migration writes them: the key by reference.
IMAGE_KEY: dict[str, str] = {"env": "GPUMIGRATE_BENCH_IMAGE_KEY"}
PARITY_STEPS = 3


STARTED = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - STARTED:7.1f} s] {msg}", file=sys.stderr, flush=True)


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else float("inf")


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.cuda = args.device == "cuda"
        self.gpus = torch.cuda.device_count() if self.cuda else 0
        self.options = {"compression": "none", "parallelism": args.parallelism}
        self.env = {"GPUMIGRATE_SNAPSHOT_CHUNK_MB": str(args.chunk_mb), "OMP_NUM_THREADS": str(args.threads)}
        self.started: list[LocalWorld] = []
        self.n = 0

    def store(self) -> str:
        self.n += 1
        path = Path(self.args.store) / f"store-{self.n}"
        shutil.rmtree(path, ignore_errors=True)
        return f"file://{path}"

    def drop_store(self, url: str) -> None:
        shutil.rmtree(url.removeprefix("file://"), ignore_errors=True)

    def devices(self, ranks: int, reverse: bool) -> list[str]:
        """``--devices`` for a world: rank r on GPU r (reversed for a target), wrapping on fewer GPUs."""
        if not self.cuda:
            return ["--device", "cpu"]
        order = [r % self.gpus for r in range(ranks)]
        if reverse:
            order = [(self.gpus - 1 - r) % self.gpus for r in range(ranks)]
        return ["--device", "cuda", "--devices", ",".join(map(str, order))]

    def worlds(
        self, module: str, ranks: int, args: list[str], *, name: str
    ) -> tuple[LocalWorld, World, LocalWorld, World]:
        """A source world and a target world awaiting its restore, started together (neither start is timed)."""
        src_args, dst_args = [*args, *self.devices(ranks, False)], [*args, *self.devices(ranks, True)]
        src_local = self.start(module, ranks, src_args, name=f"{name}-source", target=False)
        dst_local = self.start(module, ranks, dst_args, name=f"{name}-target", target=True)
        return src_local, self.agents(src_local, f"{name}-source"), dst_local, self.agents(dst_local, f"{name}-target")

    def start(self, module: str, ranks: int, args: list[str], *, name: str, target: bool) -> LocalWorld:
        local = start_world(
            module, ranks, args, log=self.work / f"{name}.log", await_restore=target, env=dict(self.env)
        )
        self.started.append(local)
        return local

    def agents(self, local: LocalWorld, name: str) -> World:
        """The world's agents, once every rank's answers."""
        deadline = time.monotonic() + 900
        while True:
            agents = World(local.agents, timeout_s=3600)
            try:
                agents.describe()
                return agents
            except Exception:
                agents.close()
                if time.monotonic() > deadline or local.popen.poll() is not None:
                    raise RuntimeError(f"{name}: the agents did not come up:\n{local.text()[-3000:]}") from None
                time.sleep(0.5)

    def stop(self) -> None:
        for w in self.started:
            w.stop()
        self.started.clear()

    # ------------------------------------------------------------------ data parallel: capture and restore
    def training(self, ranks: int, *, parity: bool) -> dict[str, Any]:
        mb = self.args.state_gb * 1024
        common = ["--steps", "1000000", "--params-mb", f"{mb / 3:g}"]
        src_local, src, dst_local, dst = self.worlds(DP, ranks, common, name=f"dp{ranks}")
        src_local.wait_steps(2, timeout_s=900)
        url = self.store()
        # One live round pre-loaded into the target: it warms both sides' pipelines (pinned rings,
        # streams), as a migration's pre-copy does. The job then steps on, rewriting all its state,
        # so the final round below captures, and the restore loads, every byte again.
        live = src.precopy_ranks(url, IMAGE_KEY, options=self.options)
        dst.restore_ranks(url, live["image"]["id"], IMAGE_KEY, ready=False)
        src_local.wait_steps(max(m["steps"] for m in src.metrics_ranks()) + 1, timeout_s=900)
        t0 = time.perf_counter()
        frozen = src.freeze_ranks(lease_s=600, timeout_s=600)
        t1 = time.perf_counter()
        final = src.final_ranks(url, IMAGE_KEY, options=self.options)
        t2 = time.perf_counter()
        restored = dst.restore_ranks(url, final["image"]["id"], IMAGE_KEY)
        t3 = time.perf_counter()
        per_rank = [x["stats"]["bytes_dirty"] for x in final["ranks"]]
        out: dict[str, Any] = {
            "ranks": ranks,
            "state_bytes_per_rank": [x["image"]["bytes_image"] for x in final["ranks"]],
            "captured_bytes_per_rank": per_rank,
            "live_round_s": round(live["stats"].seconds, 3),
            "capture_s_per_rank": [round(x["stats"]["seconds"], 3) for x in final["ranks"]],
            "capture_gbps_per_gpu": [
                gbps(b, x["stats"]["seconds"]) for b, x in zip(per_rank, final["ranks"], strict=True)
            ],
            "restore_s_per_rank": [round(x["seconds"], 3) for x in restored["ranks"]],
            "restore_gbps_per_gpu": [gbps(x["bytes_loaded"], x["seconds"]) for x in restored["ranks"]],
            "freeze_ms": ms(t1 - t0),
            "final_ms": ms(t2 - t1),
            "compose_ms": ms(final["compose_seconds"]),
            "restore_ms": ms(t3 - t2),
            "stop_and_copy_ms": ms(t3 - t0),
            "device_map": [
                {"rank": m["rank"], "source": m["source"], "target": m["target"]} for m in restored["device_map"]
            ],
        }
        if parity:
            cut = frozen["step"]
            advanced = src.advance_ranks(PARITY_STEPS, timeout_s=900)
            dst_local.wait_steps(cut + PARITY_STEPS, timeout_s=900)
            rows = []
            for r in range(ranks):
                source = [loss for _, loss in advanced[r]["losses"]]
                target_losses = dst_local.losses(r)
                rows.append(
                    {"source": source, "target": [target_losses[s] for s in range(cut + 1, cut + PARITY_STEPS + 1)]}
                )
            out["losses"] = {
                "steps_after_cut": PARITY_STEPS,
                "identical": all(row["source"] == row["target"] for row in rows),
                "per_rank": rows,
            }
        src.close()
        dst.close()
        self.stop()
        self.drop_store(url)
        return out

    # ------------------------------------------------------------------ tensor parallel: downtime after pre-copy
    def inference(self, ranks: int) -> dict[str, Any]:
        common = ["--port", "0", "--params-mb", f"{self.args.state_gb * 1024:g}", "--idle-ms", str(self.args.idle_ms)]
        src_local, src, _, dst = self.worlds(TP, ranks, common, name=f"tp{ranks}")
        src_local.wait_event("listening", timeout_s=900)
        url = self.store()
        rounds = []
        for _ in range(2):
            pre = src.precopy_ranks(url, IMAGE_KEY, options=self.options)
            loaded = dst.restore_ranks(url, pre["image"]["id"], IMAGE_KEY, ready=False)
            rounds.append(
                {
                    "bytes_dirty": pre["stats"].bytes_dirty,
                    "seconds": round(pre["stats"].seconds, 3),
                    "preload_s": round(loaded["seconds"], 3),
                }
            )
        t0 = time.perf_counter()
        src.freeze_ranks(lease_s=600, timeout_s=600)
        t1 = time.perf_counter()
        final = src.final_ranks(url, IMAGE_KEY, options=self.options)
        t2 = time.perf_counter()
        restored = dst.restore_ranks(url, final["image"]["id"], IMAGE_KEY)
        t3 = time.perf_counter()
        src.resume_ranks()
        out = {
            "ranks": ranks,
            "weights_bytes_per_rank": [x["image"]["bytes_image"] for x in final["ranks"]],
            "precopy_rounds": rounds,
            "final_bytes_dirty": final["bytes_dirty"],
            "freeze_ms": ms(t1 - t0),
            "final_ms": ms(t2 - t1),
            "compose_ms": ms(final["compose_seconds"]),
            "restore_ms": ms(t3 - t2),
            "downtime_ms": ms(t3 - t0),
            "chunks_loaded": [x["chunks_loaded"] for x in restored["ranks"]],
        }
        src.close()
        dst.close()
        self.stop()
        self.drop_store(url)
        return out


def machine(device: str) -> dict[str, Any]:
    facts: dict[str, Any] = {"torch": torch.__version__, "device": device, "cpus": os.cpu_count()}
    if device == "cuda":
        facts["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return facts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--state-gb", type=float, default=None, help="state per rank (default 16 on CUDA, 0.003 on CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--store", default=None, help="folder for the file stores (default: under /dev/shm)")
    p.add_argument("--chunk-mb", type=int, default=64, help="capture chunk size (GPUMIGRATE_SNAPSHOT_CHUNK_MB)")
    p.add_argument("--parallelism", type=int, default=8, help="writer threads per rank")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    p.add_argument("--idle-ms", type=float, default=5.0, help="the TP engine's idle tick")
    p.add_argument("--json", action="store_true", help="(the last stdout line is always the JSON object)")
    p.add_argument("--smoke", action="store_true", help="CI: the 2-rank worlds on the CPU at 3 MB; exit 1 unless right")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.state_gb, args.ranks = "cpu", 0.003, 2
    if args.state_gb is None:
        args.state_gb = 16.0 if args.device == "cuda" else 0.003
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        log(f"note: {torch.cuda.device_count()} GPU(s) for {args.ranks} ranks: ranks share GPUs")
    home = Path(tempfile.mkdtemp(prefix="gm-e2e-ranks-"))
    os.environ["GPUMIGRATE_HOME"] = str(home)  # the control key the worlds and the orchestrator share
    os.environ.setdefault(IMAGE_KEY["env"], generate_key())  # ranks inherit it when they start
    args.store = args.store or tempfile.mkdtemp(
        prefix="gm-e2e-ranks-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
    )
    bench = Bench(args, home)
    result: dict[str, Any] = {
        "benchmark": "e2e_ranks",
        "machine": machine(args.device),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
    }
    try:
        if not args.smoke:  # the smoke leaves out the worlds of 1: the baselines, the same code with fewer ranks
            log("one GPU: a world of 1, captured and restored whole")
            one = bench.training(1, parity=False)
        log(f"{args.ranks} ranks: captured and restored whole, onto reversed GPUs; next-step losses")
        many = bench.training(args.ranks, parity=True)
        log("inference: downtime after pre-copy, 1 rank and N ranks")
        tp_one = bench.inference(1) if not args.smoke else None
        tp_many = bench.inference(args.ranks)
    finally:
        bench.stop()
        shutil.rmtree(args.store, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
    if args.smoke:
        one = {k: many[k] for k in ("capture_gbps_per_gpu", "restore_gbps_per_gpu")} | {"ranks": 1, "not_run": "smoke"}
    base_capture, base_restore = one["capture_gbps_per_gpu"][0], one["restore_gbps_per_gpu"][0]
    result["one_gpu"] = {
        "what": "DDP job as 1 rank, after one live round pre-loaded into a fresh process (warm pipelines): freeze, "
        "the final round (capture: every chunk, as each step rewrites them all), its restore (every chunk)",
        **one,
    }
    result["ranks"] = {
        "what": f"the same job as {args.ranks} ranks, each its own GPU, restored onto the GPUs reversed; "
        "stop_and_copy_ms = hold → every target rank restored, every byte dirty",
        **{k: v for k, v in many.items() if k != "losses"},
        "capture_vs_one_gpu": [round(x / base_capture, 3) for x in many["capture_gbps_per_gpu"]],
        "restore_vs_one_gpu": [round(x / base_restore, 3) for x in many["restore_gbps_per_gpu"]],
    }
    result["losses"] = {
        "what": "the source's next steps (advance) beside the restored target's, per rank",
        **many["losses"],
    }
    result["inference"] = {
        "what": "tensor-parallel model after 2 pre-copy rounds pre-loaded into the target: "
        "downtime_ms = hold → every target rank restored and ready",
        "one_rank": tp_one,
        "ranks": tp_many,
    }
    result["targets"] = {"per_gpu_vs_one_gpu_min": 0.8, "downtime_ms_max": 150}
    print(json.dumps(result))
    if args.smoke and (wrong := smoke_failures(result)):
        print("smoke: " + "; ".join(wrong), file=sys.stderr)
        return 1
    return 0


def smoke_failures(result: dict[str, Any]) -> list[str]:
    """What every run must show, whatever the machine: the worlds' shapes, the losses, what each final round moved."""
    many, wrong = result["ranks"], []
    if many["ranks"] != 2 or [m["rank"] for m in many["device_map"]] != [0, 1]:
        wrong.append("the worlds did not have the ranks asked for")
    moved = zip(many["captured_bytes_per_rank"], many["state_bytes_per_rank"], strict=True)
    if not all(c > 0.9 * s for c, s in moved):  # each training step rewrites weights and moments
        wrong.append("the final round did not capture the state a training step rewrote")
    if result["losses"]["identical"] is not True:
        wrong.append("the target's next-step losses differ from the source's")
    for tp in filter(None, (result["inference"]["one_rank"], result["inference"]["ranks"])):
        if tp["final_bytes_dirty"] >= 1000:  # after the pre-copy only the progress and RNG move
            wrong.append(f"the inference world's final round moved {tp['final_bytes_dirty']} bytes")
    return wrong


if __name__ == "__main__":
    raise SystemExit(main())

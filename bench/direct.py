"""Component view of the transfer engine's direct path: where a capture or restore of device tensors
spends its time, per stage and thread, beside the host's own ceilings measured in the same run.

    python bench/direct.py --json [--gb 16] [--chunk-mb 16] [--store DIR] [--codecs gpu,cpu]

In one process: bf16 tensors on the device are captured frozen through ``DirectStoreImageWriter``
(device BLAKE3, pinned slots, codec, AES-256-GCM, ``file://`` store in ``--store``, default
/dev/shm) and restored through ``DirectStoreImageReader`` (read, open, decode, host→device copy,
device BLAKE3 check), then restored again by a fresh process warmed as the SDK warms a target
(``restore_fresh_process_*``): a migration's target is another process, and the two-process e2e
restore spent more time per byte in every stage than this one-process restore (bench/HISTORY.md, ninth
session). ``stages`` sums the seconds each stage took over all threads (``gpumigrate.stageclock.STAGES``).
Before each timed run, what the SDK's warm-up does (kernels compiled, slots page-locked) and one small
capture and restore: without it a fresh host's first run times mostly compiling. Ceilings from the same
run: AES-256-GCM on 1, 4 and all threads, and writing new files into the store's filesystem on 1 and all
threads. The last stdout line is one JSON object.

``--smoke`` (CI, CPU): the same capture, restore and fresh-process restore of a few MiB of host tensors through the
same writer and reader (no device kernels: host tensors take the engine's host path), small ceilings; exits 1 unless
the restored tensors are bit-identical and the fresh process restored (its reader checks every chunk's BLAKE3).
``--device cpu`` runs that path at any size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from benchlib import gbps, threaded

from gpumigrate import transfer
from gpumigrate.interfaces import RegionInfo, TensorChunk
from gpumigrate.stageclock import STAGES
from gpumigrate.transfer import direct

KEY = bytes(range(32))
PIECE = 256 << 20  # bytes per tensor (--piece-mb)
DEVICE = "cuda"  # --device


def _sync() -> None:
    if DEVICE != "cpu":
        torch.cuda.synchronize()


def aes_ceiling(threads: int, per_thread: int = 24) -> float:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead = AESGCM(KEY)
    bufs = [bytearray((16 << 20) + 16) for _ in range(threads)]

    def work(i: int) -> None:
        view = memoryview(bufs[i])
        for _ in range(per_thread):
            aead.encrypt_into(os.urandom(12), view[:-16], b"", view)

    return gbps(threads * per_thread * (16 << 20), threaded(threads, work))


def write_ceiling(where: Path, threads: int, per_thread: int = 32) -> float:
    where.mkdir(parents=True, exist_ok=True)
    data = os.urandom(11 << 20)

    def work(i: int) -> None:
        for k in range(per_thread):
            with open(where / f"{i}-{k}", "wb") as fh:
                fh.write(data)

    try:
        return gbps(threads * per_thread * len(data), threaded(threads, work))
    finally:
        shutil.rmtree(where, ignore_errors=True)


def warm(chunk: int, store: Path) -> None:
    """What the SDK's warm-up does before a source or target is timed (agent/images.py): compile the device
    kernels, page-lock the slots), then one small capture and restore."""
    from gpumigrate.transfer.device import devhash

    if DEVICE != "cpu":  # host tensors compile nothing and page-lock nothing
        devhash.warm(torch.device(DEVICE))
        direct.warm_slots(chunk)
    t = torch.randn(chunk, device=DEVICE).to(torch.bfloat16)
    url = f"file://{store}"
    writer = transfer.open_writer(url, key=KEY, chunk_size=chunk)
    writer.add_region(RegionInfo("w", t.numel() * 2, dtype="bfloat16", shape=tuple(t.shape)))
    flat = t.view(torch.uint8)
    parts = [TensorChunk("w", k // chunk, flat[k : k + chunk]) for k in range(0, flat.numel(), chunk)]
    for f in writer.put_tensors(parts):
        f.result()
    ref = writer.commit()
    transfer.open_reader(url, ref.id, key=KEY).read_tensors(parts)
    shutil.rmtree(store, ignore_errors=True)


def run(codec: str, gb: float, chunk: int, store: Path) -> dict[str, Any]:
    os.environ["GPUMIGRATE_GPU_CODEC"] = "1" if codec == "gpu" else "0"
    warm(chunk, store / "warm")
    g = torch.Generator(device=DEVICE).manual_seed(1)
    tensors = []
    for _ in range(max(1, int(gb * (1 << 30)) // PIECE)):
        t = torch.empty(PIECE // 2, dtype=torch.bfloat16, device=DEVICE)
        t.normal_(0.0, 0.02, generator=g)
        tensors.append(t)
    total = len(tensors) * PIECE
    shutil.rmtree(store, ignore_errors=True)
    url = f"file://{store}"
    writer = transfer.open_writer(url, key=KEY, chunk_size=chunk)
    chunks = []
    for i, t in enumerate(tensors):
        writer.add_region(RegionInfo(f"w{i}", PIECE, dtype="bfloat16", shape=tuple(t.shape)))
        flat = t.view(torch.uint8)
        chunks += [TensorChunk(f"w{i}", k // chunk, flat[k : k + chunk]) for k in range(0, PIECE, chunk)]
    _sync()
    STAGES.take()
    t0 = time.perf_counter()
    for f in writer.put_tensors(chunks):
        f.result()
    ref = writer.commit()
    capture = time.perf_counter() - t0
    capture_stages = STAGES.take()
    outs = [torch.zeros_like(t) for t in tensors]
    back = []
    for i, t in enumerate(outs):
        flat = t.view(torch.uint8)
        back += [TensorChunk(f"w{i}", k // chunk, flat[k : k + chunk]) for k in range(0, PIECE, chunk)]
    reader = transfer.open_reader(url, ref.id, key=KEY)
    _sync()
    t0 = time.perf_counter()
    reader.read_tensors(back)
    restore = time.perf_counter() - t0
    restore_stages = STAGES.take()
    ok = all(torch.equal(a, b) for a, b in zip(tensors, outs, strict=True))
    del outs, back
    if DEVICE != "cpu":
        torch.cuda.empty_cache()
    fresh = restore_in_fresh_process(codec, url, ref.id, len(tensors), chunk, store.parent / f"{store.name}-child")
    shutil.rmtree(store, ignore_errors=True)
    return {
        "bytes": total,
        "stored_fraction": round(ref.bytes_stored / total, 4),
        "capture_GBps": gbps(total, capture),
        "restore_GBps": gbps(total, restore),
        "bit_identical": ok,
        "capture_stages_s": capture_stages,
        "restore_stages_s": restore_stages,
        "restore_fresh_process_GBps": fresh.get("restore_GBps"),
        "restore_fresh_process_stages_s": fresh.get("restore_stages_s"),
        "restore_fresh_process_error": fresh.get("error"),
        "workers": direct.WORKERS,
    }


def restore_in_fresh_process(
    codec: str, url: str, image_id: str, pieces: int, chunk: int, scratch: Path
) -> dict[str, Any]:
    """The image restored by a new process of this script (``--restore-only``); its last stdout line is JSON."""
    cmd = [sys.executable, os.path.abspath(__file__), "--restore-only", url, image_id, "--pieces", str(pieces)]
    cmd += ["--chunk-mb", str(chunk >> 20), "--codecs", codec, "--store", str(scratch)]
    cmd += ["--device", DEVICE, "--piece-mb", str(PIECE >> 20)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": f"exit {done.returncode}: {done.stderr[-1500:]}"}
    return dict(json.loads(lines[-1]))


def restore_only(codec: str, url: str, image_id: str, pieces: int, chunk: int, scratch: Path) -> dict[str, Any]:
    """A fresh process: warm up as a target does, allocate the destinations, restore (every chunk's BLAKE3 checked
    on the device against its id by the reader), time it."""
    os.environ["GPUMIGRATE_GPU_CODEC"] = "1" if codec == "gpu" else "0"
    warm(chunk, scratch / "warm")
    outs = [torch.zeros(PIECE // 2, dtype=torch.bfloat16, device=DEVICE) for _ in range(pieces)]
    back = []
    for i, t in enumerate(outs):
        flat = t.view(torch.uint8)
        back += [TensorChunk(f"w{i}", k // chunk, flat[k : k + chunk]) for k in range(0, PIECE, chunk)]
    reader = transfer.open_reader(url, image_id, key=KEY)
    _sync()
    STAGES.take()
    t0 = time.perf_counter()
    reader.read_tensors(back)
    seconds = time.perf_counter() - t0
    shutil.rmtree(scratch, ignore_errors=True)
    return {"restore_GBps": gbps(pieces * PIECE, seconds), "restore_stages_s": STAGES.take()}


def main(argv: list[str] | None = None) -> int:
    global DEVICE, PIECE
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="(always on)")
    p.add_argument("--gb", type=float, default=16)
    p.add_argument("--chunk-mb", type=int, default=16)
    p.add_argument("--store", default="/dev/shm/gm-direct")
    p.add_argument("--codecs", default="gpu,cpu")
    p.add_argument("--restore-only", nargs=2, metavar=("URL", "IMAGE"), help=argparse.SUPPRESS)
    p.add_argument("--pieces", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for host tensors through the same path")
    p.add_argument("--piece-mb", type=int, default=PIECE >> 20, help="MiB per tensor")
    p.add_argument("--smoke", action="store_true", help="CI: CPU, 8 MiB; exit 1 unless the restores are bit-identical")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.gb, args.piece_mb, args.chunk_mb, args.codecs = "cpu", 8 / 1024, 4, 1, "cpu"
    DEVICE, PIECE = args.device, args.piece_mb << 20
    if DEVICE != "cpu" and not torch.cuda.is_available():
        print(
            json.dumps(
                {"bench": "direct", "not_run": "needs a CUDA GPU (--device cpu runs the same path on host tensors)"}
            )
        )
        return 0
    if args.restore_only:
        url, image_id = args.restore_only
        print(json.dumps(restore_only(args.codecs, url, image_id, args.pieces, args.chunk_mb << 20, Path(args.store))))
        return 0
    store = Path(args.store)
    cores = os.cpu_count() or 1
    device = torch.cuda.get_device_name(0) if DEVICE != "cpu" else "cpu"
    out: dict[str, Any] = {"bench": "direct", "device": device, "cpus": cores}
    per_thread = {"per_thread": 2} if args.smoke else {}
    out["aes_gcm_GBps"] = {str(n): aes_ceiling(n, **per_thread) for n in sorted({1, 4, cores})}
    out["new_file_writes_GBps"] = {
        str(n): write_ceiling(store / "ceiling", n, **per_thread) for n in sorted({1, cores})
    }
    for codec in args.codecs.split(","):
        out[codec] = run(codec, args.gb, args.chunk_mb << 20, store / codec)
        print(json.dumps({codec: out[codec]}), file=sys.stderr, flush=True)
    print(json.dumps(out))
    if args.smoke:
        wrong = [
            c for c in args.codecs.split(",") if not out[c]["bit_identical"] or out[c]["restore_fresh_process_error"]
        ]
        if wrong:
            print(f"smoke: codec {', '.join(wrong)}: a restore differed or the fresh process failed", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

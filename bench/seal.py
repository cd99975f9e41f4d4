"""Component view of the capture's sealing threads alone: AES-256-GCM and file:// store writes of chunk objects that
lie in page-locked slots, as the direct writer's workers do them (transfer/direct_writer.py, direct_reader.py), on N threads.

    python bench/seal.py --json [--gib 8] [--store /dev/shm/gm-seal] [--threads 8,16] [--dma]

Variants, each over the same slots (64 slots of 11 MiB, about a coded 16 MiB chunk; more than any CPU cache,
so every object is read from memory as a slot the device just filled would be):

* ``aes``: ``Sealer.seal`` in place, no store (the AES ceiling on cold slots);
* ``write``: ``FileStore.put_chunk`` of the slot, no AES (the store's ceiling);
* ``product``: the writer's way, AES in place then the store's write (two passes over the object);
* ``streamed``: AES in pieces into a small per-thread buffer that is written out while it is still in the cache
  (one pass over the slot; the same bytes, checked against ``product``'s object below);
* ``read``: the restore's side, objects that ``product`` stored read back into the slots (not timed: the writing);
* ``open``: ``read``, then each object authenticated and decrypted in place (``Sealer.open_payload``), as the
  direct reader's workers do before decoding.

``--dma`` keeps the GPU copying device→pinned host meanwhile, at line rate, as a capture does. Not the product's
speed: a component view, its sink named in every figure. The last stdout line is one JSON object.

``--smoke`` (CI): 1 MiB objects in 4 slots, 8 MiB per mode, 2 threads, every mode; ``open`` authenticates every
object it reads back (AES-GCM), and the run exits 1 unless ``streamed``'s object decrypts to its slot's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from benchlib import gbps, threaded

from gpumigrate.transfer.format.chunkobj import HEADER, HEADER_SIZE, MAGIC, TAG_SIZE, Sealer, sealed_size
from gpumigrate.transfer.stores.file import FileStore

KEY = bytes(range(32))
OBJECT = 11 << 20
SLOTS = 64
PIECE = 1 << 20


def make_slots() -> list[memoryview]:
    size = sealed_size(OBJECT, True)
    try:
        import torch

        if torch.cuda.is_available():
            pinned = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(SLOTS)]
            for t in pinned:
                t.random_(0, 256)
            return [memoryview(t.numpy()) for t in pinned]
    except ImportError:
        pass
    return [memoryview(bytearray(os.urandom(size))) for _ in range(SLOTS)]


def streamed_object(sealer: Sealer, chunk_id: str, slot: memoryview, fd: int, buf: memoryview) -> int:
    """Header, ciphertext in PIECE-sized parts through ``buf``, tag: written to ``fd`` as they come."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    nonce = os.urandom(12)
    header = HEADER.pack(MAGIC, 0, 1, 0, OBJECT, nonce, b"\0" * 32)
    enc = Cipher(algorithms.AES(KEY), modes.GCM(nonce)).encryptor()
    enc.authenticate_additional_data(bytes.fromhex(chunk_id) + header)
    os.write(fd, header)
    payload = slot[HEADER_SIZE : HEADER_SIZE + OBJECT]
    for at in range(0, OBJECT, PIECE):
        n = enc.update_into(payload[at : at + PIECE], buf)
        view = buf[:n]
        while view:
            view = view[os.write(fd, view) :]
    enc.finalize()
    os.write(fd, enc.tag)
    return HEADER_SIZE + OBJECT + TAG_SIZE


def run(mode: str, threads: int, gib: float, store_dir: Path, slots: list[memoryview]) -> dict[str, Any]:
    shutil.rmtree(store_dir, ignore_errors=True)
    if mode in ("read", "open"):
        _measure("product", threads, gib, store_dir, slots, keep=True)  # the objects to read back
    return _measure(mode, threads, gib, store_dir, slots)


def _measure(
    mode: str, threads: int, gib: float, store_dir: Path, slots: list[memoryview], *, keep: bool = False
) -> dict[str, Any]:
    store = FileStore(store_dir, f"file://{store_dir}")
    sealer = Sealer(KEY)
    count = max(threads, int(gib * (1 << 30)) // OBJECT)
    next_job = iter(range(count))
    lock = threading.Lock()
    size = sealed_size(OBJECT, True)

    def work(w: int) -> None:
        buf = memoryview(bytearray(PIECE + 16))
        while True:
            with lock:
                k = next(next_job, None)
            if k is None:
                return
            slot = slots[k % len(slots)]
            chunk_id = f"{k:064x}"
            if mode in ("aes", "product"):
                blob = sealer.seal(
                    chunk_id, 0, OBJECT, slot[HEADER_SIZE : HEADER_SIZE + OBJECT], None, slot, in_place=True
                )
                if mode == "product":
                    store.put_chunk(chunk_id, blob)
            elif mode == "write":
                store.put_chunk(chunk_id, slot[:size])
            elif mode in ("read", "open"):
                got = store.get_chunk_into(chunk_id, slot[:size])
                if mode == "open":
                    sealer.open_payload(chunk_id, slot[:got])
            else:
                path = store_dir / "chunks" / chunk_id[:2]
                path.mkdir(parents=True, exist_ok=True)
                tmp = path / f".{chunk_id}.tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    streamed_object(sealer, chunk_id, slot, fd, buf)
                finally:
                    os.close(fd)
                os.replace(tmp, path / chunk_id)

    t0 = time.perf_counter()
    threaded(threads, work)
    store.flush()
    seconds = time.perf_counter() - t0
    if not keep:
        shutil.rmtree(store_dir, ignore_errors=True)
    return {"mode": mode, "threads": threads, "objects": count, "GBps": gbps(count * OBJECT, seconds)}


def same_bytes(slots: list[memoryview], store_dir: Path) -> bool:
    """``streamed`` writes the object ``product`` writes, nonce aside: both decrypt to the slot's bytes."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    store_dir.mkdir(parents=True, exist_ok=True)
    plain = bytes(slots[0][HEADER_SIZE : HEADER_SIZE + OBJECT])
    fd = os.open(store_dir / "one", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        streamed_object(Sealer(KEY), "00" * 32, slots[0], fd, memoryview(bytearray(PIECE + 16)))
    finally:
        os.close(fd)
    blob = (store_dir / "one").read_bytes()
    shutil.rmtree(store_dir, ignore_errors=True)
    nonce = HEADER.unpack(blob[:HEADER_SIZE])[5]
    back = AESGCM(KEY).decrypt(nonce, blob[HEADER_SIZE:], bytes(32) + blob[:HEADER_SIZE])
    return back == plain


def dma_load(stop: threading.Event) -> None:
    import torch

    src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    while not stop.is_set():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="(always on)")
    p.add_argument("--gib", type=float, default=8)
    p.add_argument("--store", default="/dev/shm/gm-seal")
    p.add_argument("--threads", default=f"{max(1, (os.cpu_count() or 2) // 2)},{os.cpu_count() or 2}")
    p.add_argument("--modes", default="aes,write,product,streamed,read,open")
    p.add_argument("--dma", action="store_true", help="device→host copies at line rate meanwhile (GPU hosts)")
    p.add_argument("--smoke", action="store_true", help="CI: tiny objects, every mode once; exit 1 on a wrong byte")
    args = p.parse_args(argv)
    if args.smoke:
        global OBJECT, SLOTS
        OBJECT, SLOTS, args.gib, args.threads, args.dma = 1 << 20, 4, 1 / 128, "2", False
    store_dir = Path(args.store)
    slots = make_slots()
    out: dict[str, Any] = {
        "bench": "seal",
        "sink": f"file:// store in {store_dir} (chunk objects of {OBJECT >> 20} MiB from page-locked slots)",
        "cpus": os.cpu_count(),
        "streamed_decrypts_to_the_slot": same_bytes(slots, store_dir),
        "runs": [],
    }
    stop = threading.Event()
    loader = None
    if args.dma:
        loader = threading.Thread(target=dma_load, args=(stop,), daemon=True)
        loader.start()
        out["dma"] = "device→pinned copies at line rate during every run"
    try:
        run("write", os.cpu_count() or 2, args.gib / 2, store_dir, slots)  # first touch of the store's memory
        for threads in (int(t) for t in args.threads.split(",")):
            for mode in args.modes.split(","):
                out["runs"].append(run(mode, threads, args.gib, store_dir, slots))
                print(json.dumps(out["runs"][-1]), flush=True)
    finally:
        stop.set()
        if loader is not None:
            loader.join()  # torch's copy must end before the interpreter does
    print(json.dumps(out))
    if args.smoke and not (out["streamed_decrypts_to_the_slot"] and len(out["runs"]) == len(args.modes.split(","))):
        raise SystemExit("smoke: the streamed object did not decrypt to its slot, or a mode did not run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

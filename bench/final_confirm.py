"""What confirming the final round costs: BLAKE3 of every chunk the fingerprints call unchanged.

    python bench/final_confirm.py --json [--mb 1024] [--chunk-mb 4] [--device cpu|cuda]

A tracked tensor of ``--mb`` MB is pre-copied once and left unchanged, then frozen and finalised, so
the final round ships nothing and its time is the fingerprint pass plus the confirmation. Beside
it, from the same run and the same bytes: the fingerprint pass alone (what the final round cost
before it was confirmed) and the confirmation alone (``unchanged_by_hash``). The sink is
tests/support/memimage.py (host memory); no compression, no encryption, no network. The last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gpumigrate.snapshot.chunks import byte_view, chunk_count, fingerprint_chunks, unchanged_by_hash
from gpumigrate.snapshot.engine import SnapshotEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test helpers' in-memory store
from tests.support.memimage import MemoryStore  # noqa: E402

KEY = b"bench-key-not-secret-0123456789ab"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(mb: int, chunk_mb: int, device: torch.device) -> dict[str, Any]:
    cs = chunk_mb << 20
    tensor = torch.randn((mb << 20) // 4, generator=torch.Generator().manual_seed(0)).to(device)
    view = byte_view(tensor)
    store = MemoryStore()
    agent = SnapshotEngine(workers=os.cpu_count() or 2)
    agent.track_tensor("w", tensor)
    agent.capture_round(store.writer(KEY, chunk_size=cs))
    ids = list(store.reader(agent.last_image.id, KEY).metadata()["snapshot"]["chunks"]["w"])  # type: ignore[union-attr]
    agent.park()
    t0 = time.perf_counter()
    final = agent.capture_round(store.writer(KEY, chunk_size=cs)).stats
    final_s = time.perf_counter() - t0
    assert final.chunks_dirty == 0 and agent.fingerprint_collisions == 0
    fingerprint_chunks(view, cs)  # warm (a compiled kernel on CUDA)
    _sync(device)
    t0 = time.perf_counter()
    fingerprint_chunks(view, cs)
    _sync(device)
    fp_s = time.perf_counter() - t0
    pieces = [view[i * cs : (i + 1) * cs] for i in range(chunk_count(view.numel(), cs))]
    t0 = time.perf_counter()
    same = unchanged_by_hash(pieces, ids, None)
    confirm_s = time.perf_counter() - t0
    assert all(same)
    agent.close()
    gb = view.numel() / 1e9
    return {
        "device": str(device),
        "bytes": view.numel(),
        "chunk_bytes": cs,
        "cpus": os.cpu_count(),
        "final_round_s": round(final_s, 4),
        "baseline_fingerprint_only_s": round(fp_s, 4),
        "confirm_s": round(confirm_s, 4),
        "confirm_gb_per_s": round(gb / confirm_s, 2),
        "fingerprint_gb_per_s": round(gb / fp_s, 2),
        "includes": "final_round_s: fingerprints + BLAKE3 of every unchanged chunk + manifest commit, nothing shipped "
        "(a host tensor skips the fingerprints in the final round: BLAKE3 of every chunk); the baselines: one pass each",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=1024)
    p.add_argument("--chunk-mb", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    print(json.dumps(run(args.mb, args.chunk_mb, torch.device(args.device))))


if __name__ == "__main__":
    main()

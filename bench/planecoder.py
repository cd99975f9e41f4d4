#!/usr/bin/env python3
"""Plane coder benchmark: the huff coder (plane codec 2) beside zstd's Huffman stage, same planes, same run.

Prints one JSON document. For the sign-and-exponent plane of bf16 weights (normal and Laplace
distributed, the shapes real weights take), one thread, chunk-sized planes (2 MiB: the plane of a
4 MiB chunk): coded size as a fraction of the plane, coding and decoding speed in GB/s of plane,
for our coder and for libzstd set up as the writer uses it without the extension (planezstd.py:
a pure literal coder, standard frames). Speeds are CPU time of this thread, best of --repeat.

    python bench/planecoder.py --json [--mb 256] [--repeat 3]
    python bench/planecoder.py --smoke     # CI: 4 MiB, one pass; exit 1 unless both coders give every plane back
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

import numpy as np

CHUNK_PLANE = 2 << 20


def exponent_planes(kind: str, nbytes: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (
        rng.standard_normal(nbytes, dtype=np.float32)
        if kind == "normal"
        else rng.laplace(size=nbytes).astype(np.float32)
    )
    bf16 = (x * np.float32(0.02)).view(np.uint32) >> 16
    return (bf16 >> 8).astype(np.uint8)


def best_cpu(fn: Any, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def measure(planes: np.ndarray, repeat: int) -> dict[str, Any]:
    import zstandard

    from gpumigrate.transfer.format import planehuff, planezstd

    chunks = [planes[i : i + CHUNK_PLANE] for i in range(0, len(planes), CHUNK_PLANE)]
    total = len(planes)
    out = bytearray(CHUNK_PLANE + planehuff.HEADER_BYTES + 64)
    huff = [bytes(out[: planehuff.encode_into(c, out)]) for c in chunks]
    zstd = [bytes(planezstd.compress_plane(c)) for c in chunks]
    decoded = np.empty(CHUNK_PLANE, dtype=np.uint8)
    dec = zstandard.ZstdDecompressor()
    for c, h, z in zip(chunks, huff, zstd, strict=True):  # both must give the plane back before they are timed
        planehuff.decode_into(h, decoded[: len(c)])
        if decoded[: len(c)].tobytes() != c.tobytes() or dec.decompress(z) != c.tobytes():
            raise SystemExit("a coded plane did not decode to the plane it was coded from: nothing measured")

    def huff_encode() -> None:
        for c in chunks:
            planehuff.encode_into(c, out)

    def huff_decode() -> None:
        for c, h in zip(chunks, huff, strict=True):
            planehuff.decode_into(h, decoded[: len(c)])

    def zstd_encode() -> None:
        for c in chunks:
            planezstd.compress_plane(c)

    def zstd_decode() -> None:
        for z in zstd:
            dec.decompress(z)

    gb = total / 1e9
    res = {
        "huff": {
            "ratio": round(sum(map(len, huff)) / total, 4),
            "encode_GBps": round(gb / best_cpu(huff_encode, repeat), 3),
            "decode_GBps": round(gb / best_cpu(huff_decode, repeat), 3),
        },
        "zstd_literal_coder": {
            "ratio": round(sum(map(len, zstd)) / total, 4),
            "encode_GBps": round(gb / best_cpu(zstd_encode, repeat), 3),
            "decode_GBps": round(gb / best_cpu(zstd_decode, repeat), 3),
        },
    }
    res["encode_speedup"] = round(res["huff"]["encode_GBps"] / res["zstd_literal_coder"]["encode_GBps"], 2)
    res["decode_speedup"] = round(res["huff"]["decode_GBps"] / res["zstd_literal_coder"]["decode_GBps"], 2)
    res["size_vs_zstd"] = round(res["huff"]["ratio"] / res["zstd_literal_coder"]["ratio"], 4)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the JSON document (always printed; kept for symmetry)")
    ap.add_argument("--mb", type=int, default=256, help="MiB of plane per distribution (default 256)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="CI: 4 MiB, one pass; exit 1 unless every plane round-trips")
    args = ap.parse_args()
    if args.smoke:
        args.mb, args.repeat = min(args.mb, 4), 1
    from gpumigrate.transfer.format import planehuff

    if not planehuff.AVAILABLE:
        print(
            json.dumps(
                {
                    "bench": "planecoder",
                    "skipped": "the compiled coder is not built (pip install -e . with a C compiler)",
                }
            )
        )
        if args.smoke:  # CI builds it (make setup): a smoke run without it tested nothing
            raise SystemExit("smoke: transfer/_huffplane is not built")
        return
    report: dict[str, Any] = {
        "bench": "planecoder",
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "threads": 1,
        "plane_bytes_per_chunk": CHUNK_PLANE,
        "repeat": args.repeat,
    }
    for kind in ("normal", "laplace"):
        report[f"bf16_{kind}_exponent_plane"] = measure(exponent_planes(kind, args.mb << 20), args.repeat)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

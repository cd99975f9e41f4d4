"""Benchmark: requests/s of the reference inference server, beside its baseline in the same run.

    python bench/workload_inference.py [--size tiny] [--device cpu|cuda] [--dtype float32]
        [--concurrency 1,4,8] [--seconds 5] [--json]

Starts one real server process (``--threads 1 --workers 2``) and drives ``POST /v1/generate``
(8 new tokens, keep-alive, raw asyncio client in this process) at each concurrency for
``--seconds``. Baseline: greedy generation in-process (no HTTP) for the same prompt and model,
one thread, measured in the same run. The client shares the CPU with the server, as the load
generator does in the traffic tests. Last stdout line: one JSON object.

``--smoke`` (CI): half a second at concurrency 1 and 2; exits 1 unless every request was answered 200 and the
server's tokens for the prompt are the in-process model's (same seed, greedy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import torch

from gpumigrate.workloads.model import build_model, generate

PROMPT = "The quick brown fox jumps over the lazy dog"


async def _client(port: int, stop_at: float, lat: list[float], codes: list[int]) -> None:
    body = json.dumps({"prompt": PROMPT, "max_new_tokens": 8}).encode()
    head = f"POST /v1/generate HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    req = head.encode() + body
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    while time.perf_counter() < stop_at:
        t0 = time.perf_counter()
        writer.write(req)
        await writer.drain()
        header = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1]) for line in header.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
        lat.append(time.perf_counter() - t0)
        codes.append(int(header.split(b" ", 2)[1]))
    writer.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads): robust to CPU contention, unlike wall time."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(port: int, concurrency: int, seconds: float, pid: int) -> dict[str, float]:
    lat: list[float] = []
    codes: list[int] = []
    cpu0 = cpu_seconds(pid)
    start = time.perf_counter()
    await asyncio.gather(*[_client(port, start + seconds, lat, codes) for _ in range(concurrency)])
    elapsed = time.perf_counter() - start
    cpu = cpu_seconds(pid) - cpu0
    lat.sort()
    return {
        "concurrency": concurrency,
        "requests": len(lat),
        "rps": round(len(lat) / elapsed, 1),
        "ok_fraction": round(codes.count(200) / max(1, len(codes)), 4),
        "p50_ms": round(lat[len(lat) // 2] * 1000, 2),
        "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000, 2),
        "server_cpu_ms_per_request": round(cpu / max(1, len(lat)) * 1000, 3),
    }


def baseline_in_process(size: str, seconds: float, device: str, dtype: str) -> dict[str, float]:
    torch.set_num_threads(1)
    model = build_model(0, size, dtype, device)
    generate(model, PROMPT, 8)
    n, start, cpu0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        generate(model, PROMPT, 8)
        n += 1
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
    return {
        "generations_per_s": round(n / elapsed, 1),
        "ms_per_generation": round(elapsed / n * 1000, 3),
        "cpu_ms_per_generation": round(cpu / n * 1000, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--workers", type=int, default=2, help="the server's request worker threads")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--json", action="store_true", help="(always JSON; accepted for make bench)")
    ap.add_argument(
        "--smoke", action="store_true", help="CI: half a second per concurrency; exit 1 unless answers are right"
    )
    args = ap.parse_args()
    if args.smoke:
        args.concurrency, args.seconds = "1,2", 0.5
    argv = [
        sys.executable,
        "-m",
        "gpumigrate.workloads.inference",
        "--port",
        "0",
        "--size",
        args.size,
        "--threads",
        "1",
        "--workers",
        str(args.workers),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        port = json.loads(proc.stdout.readline())["port"]
        import httpx

        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the server on port {port} did not answer /readyz 200 within 60 s")
            time.sleep(0.05)
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/generate", json={"prompt": PROMPT, "max_new_tokens": 8}, timeout=30
        ).json()
        asyncio.run(_load(port, 2, 1.0, proc.pid))  # warm-up
        runs = [asyncio.run(_load(port, int(c), args.seconds, proc.pid)) for c in args.concurrency.split(",")]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    result = {
        "benchmark": "workload_inference",
        "size": args.size,
        "device": args.device,
        "dtype": args.dtype,
        "workers": args.workers,
        "cpu_count": os.cpu_count(),
        "server": runs,
        "baseline_in_process_no_http": baseline_in_process(args.size, min(args.seconds, 3.0), args.device, args.dtype),
        "note": "client and server share this machine's CPUs; numbers under contention are pessimistic",
    }
    print(json.dumps(result))
    if args.smoke:
        tokens, _ = generate(build_model(0, args.size, args.dtype, args.device), PROMPT, 8)
        wrong = [
            f"concurrency {r['concurrency']}: {r['ok_fraction']:.0%} answered 200"
            for r in runs
            if r["ok_fraction"] != 1
        ]
        wrong += [f"concurrency {r['concurrency']}: no request finished" for r in runs if r["requests"] == 0]
        if answer.get("tokens") != tokens:
            wrong.append(f"the server answered tokens {answer.get('tokens')}, the model in process {tokens}")
        if wrong:
            sys.exit("smoke: " + "; ".join(wrong))


if __name__ == "__main__":
    main()

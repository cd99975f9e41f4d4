"""Benchmark: the cost of judging output parity, GX suite vs the fast rules path vs a bare np.allclose.

Prints one JSON object. Synthetic outputs shaped like the golden smoke test (cases x tokens, logprobs);
the baseline (``allclose``) checks only the floats, without the shape/NaN/id rules or any report.
``gx_cold_s`` includes importing Great Expectations and building the context, measured first in
this process. With ``--e2e`` it also starts two real reference inference servers (same weights,
1 vs 2 threads) and times the whole smoke test on the demo's golden set (GX and fast path), beside
the baseline of only querying both services.
Usage: ``python bench/parity.py [--cases 30] [--tokens 16] [--repeat 20] [--e2e] [--json]``.
``--smoke`` (CI): a few cases, one repeat, the ``--e2e`` servers included; exits 1 unless GX and the fast path
both pass the matching outputs and both fail a drifted copy, and the smoke test against the servers passes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def make_rows(cases: int, tokens: int, seed: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    source = [
        {"id": f"c{i}", "tokens": [rng.randrange(260) for _ in range(tokens)],
         "logprobs": [-rng.uniform(0.01, 8.0) for _ in range(tokens)]}
        for i in range(cases)
    ]  # fmt: skip
    target = [dict(r, logprobs=[v * (1 + 1e-6) for v in r["logprobs"]]) for r in source]
    return source, target


def _start_server(seed: int, threads: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpumigrate.workloads.inference", "--port", "0", "--seed", str(seed),
         "--threads", str(threads), "--name", f"bench-{threads}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the server prints one JSON line once it listens
    port = json.loads(line)["port"]
    return proc, f"http://127.0.0.1:{port}"


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def e2e(repeat: int, *, warm: bool = True) -> dict:
    import httpx

    from gpumigrate.parity.output import load_golden, query_outputs, run_output_parity

    golden = Path(__file__).resolve().parent.parent / "examples" / "golden" / "tiny-lm.jsonl"
    procs = [_start_server(0, 1), _start_server(0, 2)]
    try:
        (_, src), (_, tgt) = procs
        for url in (src, tgt):
            for _ in range(300):
                try:
                    if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
        cases = load_golden(golden)

        def query_only() -> None:
            query_outputs(src, cases)
            query_outputs(tgt, cases)

        with tempfile.TemporaryDirectory() as tmp:
            runs = {
                "baseline_query_both_sequential": lambda: query_only(),
                "smoke_test_gx": lambda: run_output_parity(src, tgt, golden, atol=1e-4, rtol=1e-3, out_dir=tmp),
                "smoke_test_fast": lambda: run_output_parity(src, tgt, golden, atol=1e-4, rtol=1e-3, out_dir=tmp,
                                                             use_gx=False),
            }  # fmt: skip
            out: dict = {"cases": len(cases)}
            for name, fn in runs.items():
                if warm:
                    fn()
                samples = []
                for _ in range(max(1, repeat // 4)):
                    t = time.perf_counter()
                    fn()
                    samples.append(time.perf_counter() - t)
                out[name] = _ms(samples)
            last = run_output_parity(src, tgt, golden, atol=1e-4, rtol=1e-3, out_dir=tmp)
            out["passed"], out["max_abs_err"] = last.passed, last.max_abs_err
        return out
    finally:
        for proc, _ in procs:
            _stop(proc)


def _ms(samples: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(samples) * 1e3, 3), "min_ms": round(min(samples) * 1e3, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--e2e", action="store_true", help="also time the smoke test against two real servers")
    parser.add_argument("--json", action="store_true", help="(always JSON; accepted for make bench)")
    parser.add_argument(
        "--smoke", action="store_true", help="CI: small, with --e2e; exit 1 unless the verdicts are right"
    )
    args = parser.parse_args()
    if args.smoke:
        args.cases, args.tokens, args.repeat, args.e2e = min(args.cases, 4), min(args.tokens, 4), 1, True
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    from gpumigrate.parity.comparator import GXComparator, ToleranceComparator

    source, target = make_rows(args.cases, args.tokens, seed=0)
    gx, fast = GXComparator(1e-4, 1e-3), ToleranceComparator(1e-4, 1e-3)

    t0 = time.perf_counter()
    assert gx.compare(source, target).passed
    gx_cold = time.perf_counter() - t0

    def timed(fn) -> list[float]:
        out = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return out

    s_arr = np.array([r["logprobs"] for r in source])
    t_arr = np.array([r["logprobs"] for r in target])
    baseline = timed(lambda: np.allclose(t_arr, s_arr, atol=1e-4, rtol=1e-3))
    fast_t = timed(lambda: fast.compare(source, target))
    gx_t = timed(lambda: gx.compare(source, target))
    doc = {
        "bench": "parity",
        "rows": {"cases": args.cases, "tokens": args.tokens, "frame_rows": args.cases * (1 + 2 * args.tokens)},
        "baseline_np_allclose": _ms(baseline),
        "fast_rules_path": _ms(fast_t),
        "gx_suite_warm": _ms(gx_t),
        "gx_cold_s": round(gx_cold, 3),
        "note": "2-core shared machine; baseline checks floats only (no ids, shapes, NaN rules, reasons)",
    }  # fmt: skip
    if args.smoke:
        drifted = [dict(r, logprobs=[v + 0.5 for v in r["logprobs"]]) for r in target]
        doc["smoke_verdicts"] = {
            "fast_passes_matching": fast.compare(source, target).passed,
            "gx_passes_matching": gx.compare(source, target).passed,
            "fast_fails_drifted": not fast.compare(source, drifted).passed,
            "gx_fails_drifted": not gx.compare(source, drifted).passed,
        }
    if args.e2e:
        doc["e2e"] = e2e(args.repeat, warm=not args.smoke)
    print(json.dumps(doc))
    if args.smoke:
        wrong = [name for name, ok in doc["smoke_verdicts"].items() if ok is not True]
        if not doc["e2e"].get("passed"):
            wrong.append("the smoke test against two real servers failed")
        if wrong:
            print("smoke: wrong verdicts: " + ", ".join(wrong), file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

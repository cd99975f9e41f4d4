"""The device landing on a model's state: what `transfer.restore_from: source` moves on one GPU, measured alone.

    python bench/lend_model.py --json [--gib 16] [--chunk-mib 32] [--batch 4096] [--reps 3] [--layout model|one]

The state is the reference model's tensors at ``--gib`` (about 520 regions at 16 GiB, in about 90 allocations,
as a served model holds them), not one tensor. The source process lends them through
``DeviceSender.lend_all`` (CUDA IPC handles over the signed channel, no NIXL agent: what the agent's fill
uses); a fresh landing in a second process per pass (``DeviceLanding``, ``nixl=False``, as the fill opens one
per restore) maps them, copies every chunk with the BLAKE3 kernel that hashes what it stores, and compares
each hash with the chunk's id before it replies. ``lend_GBps`` counts that whole call, from the source's
request to the landing's reply that every chunk verified: sharing the handles, signing, mapping, copies,
checks. Connecting and the landing's unmapping (after its reply) are reported beside it. ``landing_phases``
splits the landing's side of it. Baselines from the same run, same bytes: one plain device copy of one tensor, and a
plain copy per region. Before any pass, the chunk ids the device kernels computed are checked against the
``blake3`` package's (the CPU reference): a disagreement ends the run with nothing measured. The last stdout line
is one JSON object. It also measures the one-tensor layout of the transport (``--layout one``), which replaced
``bench/transfer_link.py gpu``.

``--smoke`` (CI, CPU): nothing of the lend runs without CUDA (IPC handles, the copy-and-hash kernel), so it checks
the arguments, builds the model's layout in host memory at 4 MiB, and checks its CPU reference ids (one per chunk,
the ``blake3`` package's, tails included) against a whole-region hash; exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

TARGET = r"""
import json, sys, time, torch
from gpumigrate.transfer.device.devhash import blake3_chunks, warm
from gpumigrate.transfer.device.landing import DeviceLanding
job = json.loads(sys.stdin.readline())
warm(torch.device("cuda"))
regions = {name: torch.zeros(n, dtype=torch.uint8, device="cuda") for name, n in job["sizes"].items()}
for _ in range(job["passes"]):  # a fresh landing per pass, as a migration's fill opens one per restore
    landing = DeviceLanding(regions, chunk_size=job["chunk"], control_key=bytes.fromhex(job["key"]),
                            hasher=blake3_chunks, nixl=False, expected=job["ids"])
    print(json.dumps({"address": landing.address}), flush=True)
    result = landing.wait()
    t0 = time.perf_counter()
    landing.close()
    print(json.dumps({"result": result.__dict__, "closing": time.perf_counter() - t0}), flush=True)
"""


def model_state(gib: float, device: str = "cuda") -> dict[str, torch.Tensor]:
    """The reference model's tensors at ``gib`` GiB of bf16, as flat bytes, filled with noise."""
    from gpumigrate.workloads.model import build_model

    model = build_model(0, "small", dtype="bfloat16", device=device, params_mb=gib * 1024, load_weights=False)
    state = {name: t.view(-1).view(torch.uint8) for name, t in model.state_dict().items()}
    for t in state.values():
        t.random_(0, 256)
    return state


def chunk_ids(state: dict[str, torch.Tensor], chunk: int) -> dict[str, list[str]]:
    """What the image's manifest names: BLAKE3 of every chunk (device kernels; short tails on the CPU)."""
    import blake3

    from gpumigrate.transfer.device import devhash

    out: dict[str, list[str]] = {}
    for name, t in state.items():
        whole = t.numel() // chunk * chunk
        ids = [devhash.words_hex(w) for w in devhash.blake3_chunks(t[:whole], chunk).tolist()] if whole else []
        if t.numel() > whole:
            ids.append(blake3.blake3(t[whole:].cpu().numpy().tobytes()).hexdigest())
        out[name] = ids
    return out


def reference_ids(state: dict[str, torch.Tensor], chunk: int) -> dict[str, list[str]]:
    """The same ids by the ``blake3`` package on the host (threads: it releases the GIL): the CPU reference."""
    from concurrent.futures import ThreadPoolExecutor

    import blake3

    def ids(t: torch.Tensor) -> list[str]:
        host = t.cpu().numpy()
        return [blake3.blake3(host[o : o + chunk]).hexdigest() for o in range(0, host.nbytes, chunk)]

    with ThreadPoolExecutor(os.cpu_count() or 4) as pool:
        return dict(zip(state, pool.map(ids, state.values()), strict=True))


def smoke(args: argparse.Namespace) -> int:
    """What runs without CUDA: the arguments, the model's layout in host memory, the CPU reference ids."""
    import blake3

    chunk = 1 << 20
    state = model_state(args.gib, device="cpu")
    ids = reference_ids(state, chunk)
    wrong = [n for n, t in state.items() if len(ids[n]) != -(-t.numel() // chunk)]
    for name, t in state.items():  # one chunk's id is the region's hash where the region is one chunk
        if t.numel() <= chunk and ids[name] != [blake3.blake3(t.numpy().tobytes()).hexdigest()]:
            wrong.append(name)
    print(json.dumps({"bench": "lend_model", "smoke": "cpu reference only", "regions": len(state),
                      "bytes": sum(t.numel() for t in state.values()), "chunks": sum(map(len, ids.values()))}))  # fmt: skip
    if len(state) < 10 or wrong:
        print(f"smoke: layout of {len(state)} regions, wrong ids in {wrong[:5]}", file=sys.stderr)
        return 1
    return 0


def timed(fn: Any) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def one_tensor_copy(nbytes: int, reps: int) -> float:
    """Best seconds of one plain device copy of ``nbytes`` between two tensors (the ceiling a landing is held to)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return min(timed(lambda: b.copy_(a)) for _ in range(reps))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="(always on)")
    p.add_argument("--gib", type=float, default=16)
    p.add_argument("--chunk-mib", type=int, default=32, help="the SDK cuts GPU state into 32 MiB chunks")
    p.add_argument("--batch", type=int, nargs="+", default=[4096])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--layout", choices=["model", "one"], default="model", help="the reference model's tensors, or one tensor"
    )
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="CI, CPU: the arguments, the layout and the CPU reference ids")
    args = p.parse_args(argv)
    if args.smoke:
        args.gib = 4 / 1024
        return smoke(args)
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "lend_model", "not_run": "needs a CUDA GPU"}))
        return 0
    from gpumigrate.stageclock import STAGES
    from gpumigrate.transfer.device.devhash import warm
    from gpumigrate.transfer.device.sender import DeviceSender

    warm(torch.device("cuda"))
    chunk = args.chunk_mib << 20
    if args.layout == "model":
        state = model_state(args.gib)
    else:  # one tensor of the same bytes (the layout of the removed bench/transfer_link.py gpu)
        state = {"state": torch.empty(int(args.gib * (1 << 30)), dtype=torch.uint8, device="cuda").random_(0, 256)}
    nbytes = sum(t.numel() for t in state.values())
    ids = chunk_ids(state, chunk)
    if ids != reference_ids(state, chunk):
        raise SystemExit("the device kernels' chunk ids disagree with the blake3 package's: nothing measured")
    key = os.urandom(32)
    passes = 1 + args.reps * len(args.batch)  # the first warms the landing's process up (kernels, allocator)
    job = {"sizes": {k: t.numel() for k, t in state.items()}, "chunk": chunk, "key": key.hex(), "ids": ids}
    job["passes"] = passes
    child = subprocess.Popen([sys.executable, "-c", TARGET], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(json.dumps(job) + "\n")
    child.stdin.flush()

    def line_of(prefix: str) -> dict[str, Any]:
        line = child.stdout.readline()
        while line and not line.startswith(prefix):
            line = child.stdout.readline()
        if not line:
            raise SystemExit(f"the landing process ended early (exit {child.wait()})")
        return json.loads(line)

    def one_pass(batch: int) -> dict[str, float]:
        address = line_of('{"address"')["address"]
        t0 = time.perf_counter()
        sender = DeviceSender(address, state, control_key=key, nixl=False)
        connect = time.perf_counter() - t0
        replies: list[dict[str, Any]] = []
        took = timed(lambda: replies.append(sender.lend_all(batch=batch)))
        sender.close()
        landed = line_of('{"result"')
        return {
            "seconds": round(took, 4),
            "connect": round(connect, 4),
            "source_sharing": round(replies[0]["seconds_sharing"], 4),
            "opening": round(landed["result"]["seconds_opening"], 4),
            "landing_pass": round(landed["result"]["seconds_passes"], 4),
            "landing_close": round(landed["closing"], 4),
            "failed": landed["result"]["chunks_failed"],
        }

    one_pass(args.batch[0])
    STAGES.take()  # the source's own stages (gpumigrate.stageclock), from here on: the measured passes only
    runs: dict[str, list[dict[str, float]]] = {}
    for batch in args.batch:
        for _ in range(args.reps):
            runs.setdefault(str(batch), []).append(one_pass(batch))
    child.wait(timeout=60)
    plain = one_tensor_copy(nbytes, args.reps)
    copies = {k: torch.empty_like(t) for k, t in state.items()}
    per_region = min(timed(lambda: [copies[k].copy_(t) for k, t in state.items()]) for _ in range(args.reps))
    gbps = lambda s: round(nbytes / s / 1e9, 1)  # noqa: E731
    best = {b: min(r["seconds"] for r in rs) for b, rs in runs.items()}
    result = {
        "bench": "lend_model",
        "command": "bench/lend_model.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": torch.cuda.get_device_name(0),
        "bytes": nbytes,
        "layout": args.layout,
        "regions": len(state),
        "chunk_bytes": chunk,
        "chunks": sum(len(v) for v in ids.values()),
        "includes": "lend_GBps: DeviceSender.lend_all into a fresh DeviceLanding in another process per pass "
        "(nixl=False, as the agent's fill from the source opens one per restore), from the source's request to the "
        "landing's reply: the source's CUDA IPC handles for every region, the landing mapping them, copying every "
        "chunk with the kernel that hashes what it copies (short tails copied plainly, hashed together), every hash "
        "compared with the manifest's id on the device, the reply; best of reps after a warm-up pass. Outside it, "
        "reported beside: connect (TCP and the signed channel), landing_close (unmapping, after the reply). "
        "landing_phases: opening = mapping the handles, landing_pass = the landing's whole pass (opening included)",
        "GBps": {
            **{f"lend_batch{b}": gbps(s) for b, s in best.items()},
            "plain_device_copy_one_tensor": gbps(plain),
            "plain_device_copy_per_region": gbps(per_region),
        },
        "landing_phases": runs,
        "source_stages_per_pass": {k: round(v / sum(map(len, runs.values())), 4) for k, v in STAGES.take().items()},
        "targets": {"lend_GBps": ">= 700 (issue 15, counting the verification)"},
    }
    text = json.dumps(result)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

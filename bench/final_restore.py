"""The target's bookkeeping in the final restore (stop-and-copy downtime), without the bytes.

    python bench/final_restore.py --json [--repeat 15] [--chunk-kb 64] [--baseline PYTHONPATH]

The reference shape of issue 20 on host memory: a 521-tensor bf16 model (TinyLM, 43 blocks of d_model 256,
65 MiB) and a 1 MiB mutable uint8 tensor tracked as ``attach(state=...)`` tracks it, in 64 KiB chunks: about
1,400 chunk ids, as 16 GiB in 16 MiB chunks has. The source agent writes round 1, changes the mutable tensor,
writes round 2, freezes, changes it again and writes the final image (signed, file:// store on /dev/shm,
the transfer engine's real writer and reader). A target agent (its own tensors of the same shapes, in the
same process) pre-loads round 1 and round 2 with ``ready=False`` and then restores the final image with
``ready=True``; that last restore is timed, ``--repeat`` times (each from a fresh pre-load of rounds 1 and 2).

Figures, medians over the repeats, in ms: the agent's own phases of the final restore (``open``: the
reader factory, i.e. the manifest read and its signature check; ``check``: metadata, policy, regions,
targets and the per-region skip loop; ``from_image``: the changed chunks read and decoded from the image;
``after``: the items' restore hooks and the loaded-chunk bookkeeping; ``ready``), and ``call`` / ``outside``:
the same restore sent over the agent's authenticated control channel (``snapshot/server.py``, a client in
the same process) and the part of that call spent outside the agent (signing, JSON, the socket).

Each code tree runs in its own subprocess (``--baseline`` is a PYTHONPATH holding the old ``gpumigrate``;
the candidate is the one this script imports), alternately, so baseline and candidate come from the same
run. The last stdout line is one JSON object.

``--smoke`` (CI): the candidate alone, one batch of one repeat; exits 1 unless the target's model and state after the
final restore equal the source's, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

KEY = b"bench-key-not-secret-0123456789a"  # 32 bytes: an image key
PHASES = ("open", "lock", "check", "from_image", "from_source", "after", "ready")


def worker(repeat: int, chunk: int) -> dict[str, Any]:
    """One code tree's figures (runs in a subprocess whose PYTHONPATH picks the tree)."""
    import torch

    from gpumigrate import transfer
    from gpumigrate.agent.tracking import model_item, state_items
    from gpumigrate.snapshot.engine import Phases, SnapshotEngine

    Phases.phases = lambda self: dict(self._phases)  # type: ignore[method-assign]  # unrounded (the reply rounds to 0.1 ms)
    from gpumigrate.snapshot.client import AgentClient
    from gpumigrate.snapshot.server import serve
    from gpumigrate.snapshot.server_commands import final_to, precopy_to, restore_from
    from gpumigrate.workloads.model import ModelConfig, TinyLM

    def open_writer(store: str, key_ref: Any, parent: str | None, **_: Any) -> Any:
        return transfer.open_writer(store, key=KEY, parent=parent, chunk_size=chunk, source="agent")

    def open_reader(store: str, image_id: str, key_ref: Any) -> Any:
        return transfer.open_reader(store, image_id, key=KEY)

    def side() -> tuple[SnapshotEngine, torch.nn.Module, dict[str, Any]]:
        torch.manual_seed(0)
        model = TinyLM(ModelConfig(d_model=256, n_layers=43, n_heads=4, d_ff=1024)).to(torch.bfloat16)
        state: dict[str, Any] = {"cache": torch.zeros(1 << 20, dtype=torch.uint8), "step": 0}
        agent = SnapshotEngine(writer_factory=open_writer, reader_factory=open_reader)
        agent.track(model_item(model, "model"))
        for item in state_items(state):
            agent.track(item)
        return agent, model, state

    src, src_model, src_state = side()
    tgt, tgt_model, tgt_state = side()
    with torch.no_grad():
        for p in tgt_model.parameters():
            p.zero_()
    where = tempfile.mkdtemp(prefix="gm-final-restore-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    store = f"file://{where}"
    images = []
    for r in range(3):
        if r:
            src_state["cache"][r * 1000 : r * 1000 + (1 << 18)] += 1  # 4 of its 16 chunks change per round
            src_state["step"] = r
        if r == 2:
            src.state.frozen = True  # the final round: a frozen source (no freezer here: nothing runs)
            images.append(final_to(src, store, {})["image"]["id"])
        else:
            images.append(precopy_to(src, store, {})["image"]["id"])
    key = os.urandom(32)
    server = serve(tgt, key=key)
    client = AgentClient(server.address, key=key)
    per: dict[str, list[float]] = {p: [] for p in (*PHASES, "seconds", "call", "outside")}
    counts: dict[str, int] = {}
    try:
        for i in range(repeat + 1):  # the first is a warm-up
            for over_wire in (False, True):
                for image in images[:2]:
                    restore_from(tgt, store, image, {}, ready=False)
                t0 = time.perf_counter()
                if over_wire:
                    reply = client.call("restore", store=store, image_id=images[2], key_ref={}, policy={}, ready=True)
                else:
                    reply = restore_from(tgt, store, images[2], {}, ready=True)
                took = time.perf_counter() - t0
                if not i:
                    counts = {"chunks_loaded": reply["chunks_loaded"], "chunks_skipped": reply["chunks_skipped"]}
                    continue
                if over_wire:
                    per["call"].append(took)
                    per["outside"].append(took - float(reply["seconds"]))
                else:
                    per["seconds"].append(float(reply["seconds"]))
                    for p in PHASES:
                        per[p].append(float(reply["phases"].get(p, 0.0)))
        weights = zip(src_model.state_dict().values(), tgt_model.state_dict().values(), strict=True)
        identical = all(torch.equal(s, t) for s, t in weights) and torch.equal(src_state["cache"], tgt_state["cache"])
        identical = identical and tgt_state["step"] == src_state["step"]
    finally:
        client.close()
        server.stop()
        src.close()
        tgt.close()
        shutil.rmtree(where, ignore_errors=True)
    return {
        "ms": {k: [round(v * 1e3, 3) for v in vs] for k, vs in per.items()},
        "regions": len(tgt.tracker.live()),
        "identical": identical,  # the target's model and state after the last final restore are the source's
        **counts,
    }


def _run_tree(pythonpath: str | None, repeat: int, chunk: int) -> dict[str, Any]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
        env["PYTHONSAFEPATH"] = "1"
    out = subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            "--repeat",
            str(repeat),
            "--chunk-kb",
            str(chunk >> 10),
        ],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=15, help="timed final restores per tree and batch")
    p.add_argument("--batches", type=int, default=2, help="alternating batches per tree")
    p.add_argument("--chunk-kb", type=int, default=64)
    p.add_argument("--baseline", help="PYTHONPATH of the old code (e.g. a main checkout's build/typecheck)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true")
    p.add_argument("--smoke", action="store_true", help="CI: one restore; exit 1 unless the target equals the source")
    args = p.parse_args()
    if args.smoke:
        args.repeat, args.batches, args.baseline = 1, 1, None
    chunk = args.chunk_kb << 10
    if args.worker:
        print(json.dumps(worker(args.repeat, chunk)))
        return
    trees = {"candidate": os.environ.get("PYTHONPATH")}
    if args.baseline:
        trees = {"baseline": args.baseline, **trees}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for _ in range(args.batches):
        for name, path in trees.items():
            runs[name].append(_run_tree(path, args.repeat, chunk))
    out: dict[str, Any] = {
        "chunk_bytes": chunk,
        "load_average": os.getloadavg(),
        "repeats": args.repeat * args.batches,
        "includes": "median ms of the final ready=True restore after a ready=False pre-load of rounds 1 and 2: the "
        "agent's phases (open = manifest read + signature check; check = metadata, policy, regions, targets, skip "
        "loop; from_image = the changed chunks; after = restore hooks + bookkeeping), seconds = the agent's total, "
        "call = the same restore over the signed control channel, outside = call minus the agent's seconds; a code "
        "tree that frees the ready restore's reader a second later does so inside a later repeat's work here, "
        "where in a migration nothing restores after the final one",
    }
    for name, batches in runs.items():
        merged: dict[str, list[float]] = {}
        for b in batches:
            for k, vs in b["ms"].items():
                merged.setdefault(k, []).extend(vs)
        out[name] = {
            "median_ms": {k: round(statistics.median(vs), 2) for k, vs in merged.items() if vs},
            "regions": batches[0]["regions"],
            "chunks_loaded": batches[0]["chunks_loaded"],
            "chunks_skipped": batches[0]["chunks_skipped"],
            "identical": all(b["identical"] for b in batches),
        }
    print(json.dumps(out))
    if args.smoke and not (out["candidate"]["identical"] and out["candidate"]["chunks_loaded"] > 0):
        sys.exit("smoke: the final restore did not leave the target equal to the source (or moved no chunk)")


if __name__ == "__main__":
    main()

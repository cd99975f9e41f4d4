#!/usr/bin/env python3
"""Transfer engine benchmark: gpumigrate vs rsync --whole-file, rclone copy and cp+sha256sum, same data, same run.

Prints one JSON document. Figures (each beside its baseline from this run):
- pack+store (hash, compress, encrypt, write) and verify, local → local, for a bf16 weights file and a
  mixed directory; the baselines copy the same data (page cache warm for everyone: each tool reads the
  same files right after the previous one).
- paired with rsync (bf16 file): at least 5 rounds of rsync and our pack+store back to back, in
  alternating order, and the median of the per-round ratios (`paired_with_rsync` says why).
- stored/logical size ratio (bf16 target ≤ 0.72; zstd -1 over the whole file for comparison).
- incremental: change 5% of the weight file's chunks, pack against the parent, push to a store holding
  the parent: bytes and time vs the full operations.
- stream:// over an emulated link (two network namespaces, 1 Gbit/s + 10 ms each way = 20 ms RTT; needs
  root): goodput vs the link rate, beside one plain TCP connection over the same link. This kernel has
  no sch_netem, so bench/transfer_link.py builds the link from TUN devices, tbf and a delay forwarder.

Run small while developing: `bench/transfer.py --json --size-mb 128`. rsync/rclone are optional
(`apt-get install -y rsync rclone`); an absent baseline is reported as skipped, not faked.

`bench/transfer.py --smoke` (CI, seconds): 8 MiB datasets, one run of everything but the emulated link; exits 1
unless each image verifies, unpacks bit-identical to its source, and every figure of the report is there.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def make_bf16(path: Path, nbytes: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "wb") as fh:
        left = nbytes
        while left > 0:
            n = min(left, 64 * MiB) // 2
            x = rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
            fh.write((x.view(np.uint32) >> 16).astype(np.uint16).tobytes())
            left -= 2 * n


def make_mixed(root: Path, nbytes: int) -> None:
    """A checkpoint-like directory: weight shards, optimizer state (fp32), CRIU-like pages, logs, configs."""
    rng = np.random.default_rng(7)
    root.mkdir(parents=True)
    (root / "shards").mkdir()
    (root / "criu").mkdir()
    (root / "logs").mkdir()
    quarter = nbytes // 4
    for i in range(4):
        make_bf16(root / "shards" / f"model-{i:02d}.bin", quarter // 4, seed=i + 1)
    opt = (rng.standard_normal(quarter // 4) * 1e-3).astype(np.float32)
    (root / "optimizer.fp32").write_bytes(opt.tobytes())
    pages = bytearray(os.urandom(quarter // 2)) + bytearray(quarter // 2)  # half random, half zero pages
    (root / "criu" / "pages-1.img").write_bytes(pages)
    line = b'{"step": %d, "loss": 0.%06d, "lr": 3e-4, "tokens_per_s": 51234.5, "host": "gpu-node-17"}\n'
    with open(root / "logs" / "train.jsonl", "wb") as fh:
        written, step = 0, 0
        while written < quarter - 1_000_000:
            chunk = b"".join(line % (step + j, (step + j) * 7919 % 1000000) for j in range(1000))
            fh.write(chunk)
            written += len(chunk)
            step += 1000
    for i in range(200):
        (root / "logs" / f"config-{i}.yaml").write_text(f"layer: {i}\nwidth: 4096\nheads: 32\n" * 50)


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def drop_caches_possible() -> bool:
    return False  # shared machine: never drop other engineers' caches; everyone reads warm data


# ----------------------------------------------------------------------------- baselines


REPEAT = 1  # --repeat: every figure (ours and baselines alike) is the best of this many runs


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (user + system)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


LAST_CPU = [0.0]  # CPU seconds of the best run of the latest best_of (a figure load from others barely moves)


def best_of(setup: Any, run: Any) -> tuple[Any, float]:
    """Run ``setup()`` (untimed) then ``run()`` (timed) REPEAT times; the last result and the best time."""
    best, out = float("inf"), None
    for _ in range(REPEAT):
        setup()
        # Start every run with no dirty-page backlog: otherwise whoever runs after 4 GiB of earlier
        # copies is throttled by writeback to the disk and the figure measures the disk, not the tool.
        os.sync()
        c0 = cpu_seconds()
        out, t = timed(run)
        if t < best:
            best, LAST_CPU[0] = t, cpu_seconds() - c0
    return out, best


def cpu_s_per_gb(nbytes: int) -> float:
    return round(LAST_CPU[0] / (nbytes / 1e9), 3)


def run_cmd(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def rsync_cmd(src: Path, dst: Path) -> list[str]:
    """The rsync baseline every figure compares with: whole files, no delta algorithm."""
    return ["rsync", "-a", "--whole-file", str(src), str(dst) + "/"]


def baselines(src: Path, work: Path, nbytes: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    dst = work / "baseline-dst"

    def fresh() -> None:
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)

    sha = (
        f"cd {src.parent} && find {src.name} -type f -print0 | sort -z | xargs -0 sha256sum > {work}/src.sha && "
        f"cd {dst} && sha256sum -c --quiet {work}/src.sha"
    )
    _, t_cp = best_of(fresh, lambda: run_cmd(["cp", "-r", str(src), str(dst)]))
    out["cp"] = {
        "seconds": round(t_cp, 3),
        "GBps": gbps(nbytes, t_cp),
        "cpu_s_per_GB": cpu_s_per_gb(nbytes),
        "verified": False,
    }
    _, t_cpsha = best_of(fresh, lambda: (run_cmd(["cp", "-r", str(src), str(dst)]), run_cmd(["bash", "-c", sha])))
    out["cp+sha256sum"] = {
        "seconds": round(t_cpsha, 3),
        "GBps": gbps(nbytes, t_cpsha),
        "cpu_s_per_GB": cpu_s_per_gb(nbytes),
        "verified": "sha256 of source and copy compared",
    }
    if shutil.which("rsync"):
        _, t = best_of(fresh, lambda: run_cmd(rsync_cmd(src, dst)))
        out["rsync --whole-file"] = {
            "seconds": round(t, 3),
            "GBps": gbps(nbytes, t),
            "cpu_s_per_GB": cpu_s_per_gb(nbytes),
            "verified": "whole-file checksum",
        }
    else:
        out["rsync --whole-file"] = {"skipped": "rsync not installed (apt-get install -y rsync)"}
    if shutil.which("rclone"):
        _, t = best_of(fresh, lambda: run_cmd(["rclone", "copy", str(src), str(dst / src.name)]))
        out["rclone copy"] = {
            "seconds": round(t, 3),
            "GBps": gbps(nbytes, t),
            "cpu_s_per_GB": cpu_s_per_gb(nbytes),
            "verified": "md5/size",
        }
    else:
        out["rclone copy"] = {"skipped": "rclone not installed (apt-get install -y rclone)"}
    shutil.rmtree(dst, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------- gpumigrate


def ours(src: Path, work: Path, nbytes: int, key: bytes, parallelism: int) -> dict[str, Any]:
    from gpumigrate.transfer import pack_paths, push, verify

    store, dst = work / "store", work / "store2"

    def fresh(*dirs: Path) -> Any:
        return lambda: [shutil.rmtree(d, ignore_errors=True) for d in dirs]

    # Durable (every chunk synced before the manifest, the default), then page-cache semantics as cp/rsync/rclone write.
    _, t_durable = best_of(fresh(store), lambda: pack_paths([src], f"file://{store}", key=key, parallelism=parallelism))
    url = f"file://{store}?sync=none"
    ref, t_pack = best_of(fresh(store), lambda: pack_paths([src], url, key=key, parallelism=parallelism))
    cpu_pack = cpu_s_per_gb(nbytes)
    _, t_verify = best_of(lambda: None, lambda: verify(url, ref.id, key=key, parallelism=parallelism))
    stats, t_push = best_of(
        fresh(dst), lambda: push(url, f"file://{dst}?sync=none", ref.id, key=key, parallelism=parallelism)
    )
    res = {
        "image_id": ref.id,
        "pack_store": {
            "seconds": round(t_pack, 3),
            "GBps": gbps(nbytes, t_pack),
            "cpu_s_per_GB": cpu_pack,
            "what": "read + BLAKE3 + codec + AES-256-GCM + write to page cache (file://...?sync=none), as the baselines write",
        },
        "pack_store_durable": {
            "seconds": round(t_durable, 3),
            "GBps": gbps(nbytes, t_durable),
            "what": "same, every chunk fdatasynced before its rename (the default; syncs on background threads, flush waits)",
        },
        "verify": {"seconds": round(t_verify, 3), "GBps": gbps(nbytes, t_verify)},
        "pack_then_verify": {"seconds": round(t_pack + t_verify, 3), "GBps": gbps(nbytes, t_pack + t_verify)},
        "push_store_to_store": {
            "seconds": round(t_push, 3),
            "GBps": gbps(nbytes, t_push),
            "bytes_sent": stats.bytes_sent,
        },
        "stored_ratio": round(ref.bytes_stored / nbytes, 4),
    }
    shutil.rmtree(dst, ignore_errors=True)
    return res


def paired_with_rsync(src: Path, work: Path, nbytes: int, key: bytes, parallelism: int, rounds: int) -> dict[str, Any]:
    """rsync --whole-file and our pack+store back to back, ``rounds`` times, alternating which goes first.

    Each ratio compares two runs seconds apart. This machine class's speed drifts from minute to
    minute (the VM's free-page reporting hands freed memory back to the host, so page-cache writes
    sometimes pay a host fault per page), which a best-of-N taken minutes apart for each tool mixes
    into the ratio; the median of paired ratios does not.
    """
    if not shutil.which("rsync"):
        return {"skipped": "rsync not installed (apt-get install -y rsync)"}
    from gpumigrate.transfer import pack_paths

    dst, store = work / "pair-rsync", work / "pair-store"
    runs: list[dict[str, float]] = []
    for i in range(rounds):
        result: dict[str, float] = {}
        for tool in ("rsync", "gpumigrate") if i % 2 == 0 else ("gpumigrate", "rsync"):
            for d in (dst, store):
                shutil.rmtree(d, ignore_errors=True)
            dst.mkdir(parents=True)
            os.sync()
            if tool == "rsync":
                _, t = timed(lambda: run_cmd(rsync_cmd(src, dst)))
            else:
                _, t = timed(lambda: pack_paths([src], f"file://{store}?sync=none", key=key, parallelism=parallelism))
            result[tool] = gbps(nbytes, t)
        result["ratio"] = round(result["gpumigrate"] / result["rsync"], 3)
        runs.append(result)
    for d in (dst, store):
        shutil.rmtree(d, ignore_errors=True)
    ratios = [r["ratio"] for r in runs]
    return {
        "rounds": runs,
        "median_ratio": round(statistics.median(ratios), 3),
        "min_ratio": min(ratios),
        "what": "pack+store (sync=none) vs rsync --whole-file, run back to back, alternating order",
    }


def unpacked_identical(src: Path, work: Path, image_id: str, key: bytes) -> bool:
    """The image ``ours`` packed from ``src``, unpacked into a fresh directory: every file byte for byte as in ``src``."""
    from gpumigrate.transfer import unpack

    out = work / "unpacked"
    shutil.rmtree(out, ignore_errors=True)
    unpack(f"file://{work / 'store'}?sync=none", image_id, out, key=key)
    files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
    same = {p.relative_to(src.parent) for p in files} == {p.relative_to(out) for p in out.rglob("*") if p.is_file()}
    same = same and all((out / p.relative_to(src.parent)).read_bytes() == p.read_bytes() for p in files)
    shutil.rmtree(out, ignore_errors=True)
    return same


SMOKE_FIELDS = {
    "bf16_weights_file": ("gpumigrate", "baselines", "paired_with_rsync", "incremental_5pct"),
    "mixed_directory": ("gpumigrate", "baselines"),
}


def smoke_failures(report: dict[str, Any]) -> list[str]:
    """What a ``--smoke`` run must show: every image unpacked bit-identical, each section of the report present."""
    bad = []
    for name, fields in SMOKE_FIELDS.items():
        entry = report.get(name, {})
        bad += [f"{name}: no {f}" for f in fields if f not in entry]
        if entry.get("unpacked_identical") is not True:
            bad.append(f"{name}: the unpacked image differs from its source")
        mine = entry.get("gpumigrate", {})
        bad += [f"{name}: no gpumigrate.{f}" for f in ("pack_store", "verify", "push_store_to_store") if f not in mine]
    if not report.get("bf16_weights_file", {}).get("gpumigrate", {}).get("stored_ratio", 1) <= 0.72:
        bad.append("bf16_weights_file: the exponent planes were not compressed (stored ratio above 0.72)")
    incremental = report.get("bf16_weights_file", {}).get("incremental_5pct", {})
    if not 0 < incremental.get("push", {}).get("chunks_sent", 0) < incremental.get("chunks_total", 0):
        bad.append("incremental: the push did not send only the changed chunks")
    return bad


def zstd_whole_ratio(path: Path) -> float:
    comp = zstandard.ZstdCompressor(level=1, threads=-1)
    total = packed = 0
    with open(path, "rb") as fh:
        while block := fh.read(64 * MiB):
            total += len(block)
            packed += len(comp.compress(block))
    return round(packed / total, 4)


def incremental(weights: Path, work: Path, key: bytes, parallelism: int, full: dict[str, Any]) -> dict[str, Any]:
    from gpumigrate.transfer import open_reader, pack_paths, push

    url = f"file://{work / 'store'}?sync=none"
    parent_id = full["image_id"]
    reader = open_reader(url, parent_id, key=key)
    chunk = reader.chunk_size
    nchunks = reader.chunk_count(reader.regions()[0].name)
    rng = np.random.default_rng(3)
    changed = rng.choice(nchunks, size=max(1, round(nchunks * 0.05)), replace=False)
    with open(weights, "r+b") as fh:
        for c in changed:
            fh.seek(int(c) * chunk + 1024)
            fh.write(os.urandom(64))
    dst = work / "store-remote"
    shutil.rmtree(dst, ignore_errors=True)
    push(
        url, f"file://{dst}?sync=none", parent_id, key=key, parallelism=parallelism
    )  # the destination holds the parent
    parent_objects = set(reader.objects)

    def forget(root: Path, image_id: str) -> None:
        """Undo one incremental run (its new chunks and manifest) so the next repetition starts equal."""
        new = set(open_reader(f"file://{root}", image_id, key=key).objects) - parent_objects
        for cid in new:
            (root / "chunks" / cid[:2] / cid).unlink(missing_ok=True)
        (root / "manifests" / image_id).unlink(missing_ok=True)

    t_pack = t_push = float("inf")
    for rep in range(REPEAT):
        os.sync()
        ref, t = timed(lambda: pack_paths([weights], url, key=key, parent=parent_id, parallelism=parallelism))
        t_pack = min(t_pack, t)
        image_id = ref.id
        os.sync()
        stats, t = timed(lambda: push(url, f"file://{dst}?sync=none", image_id, key=key, parallelism=parallelism))  # noqa: B023
        t_push = min(t_push, t)
        if rep < REPEAT - 1:
            forget(dst, ref.id)
            forget(work / "store", ref.id)
    # The floor of an incremental pack: read and BLAKE3 every byte, store nothing (the same file
    # again, against the image just packed). Every chunk id is recomputed from the bytes, so an
    # incremental pack cannot cost less than this plus encoding the changed chunks.
    os.sync()
    _, t_floor = timed(
        lambda: pack_paths([weights], url, key=key, parent=image_id, parallelism=parallelism, reuse_unchanged=False)
    )
    full_pack_s = full["pack_store"]["seconds"]
    full_push_s = full["push_store_to_store"]["seconds"]
    full_sent = full["push_store_to_store"]["bytes_sent"]
    shutil.rmtree(dst, ignore_errors=True)
    return {
        "chunks_changed": int(len(changed)),
        "chunks_total": int(nchunks),
        "pack": {
            "seconds": round(t_pack, 3),
            "bytes_sent": ref.bytes_sent,
            "time_vs_full": round(t_pack / full_pack_s, 4),
            "bytes_vs_full": round(ref.bytes_sent / full_sent, 4),
        },
        "rehash_only_floor": {
            "seconds": round(t_floor, 3),
            "time_vs_full": round(t_floor / full_pack_s, 4),
            "what": "pack of an unchanged file with reuse_unchanged=False: read + BLAKE3 of every byte, nothing stored",
        },
        "push": {
            "seconds": round(t_push, 3),
            "bytes_sent": stats.bytes_sent,
            "chunks_sent": stats.chunks_sent,
            "time_vs_full": round(t_push / full_push_s, 4),
            "bytes_vs_full": round(stats.bytes_sent / full_sent, 4),
        },
        "targets": {"bytes_vs_full": "<= 0.07", "time_vs_full": "<= 0.15"},
    }


# ----------------------------------------------------------------------------- emulated link

RECEIVER = r"""
import json, sys, threading, signal
from gpumigrate.transfer import serve_stream
srv = serve_stream("10.77.0.2:0", sys.argv[1], key=bytes.fromhex(sys.argv[2]))
print(json.dumps({"url": srv.url}), flush=True)
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: stop.set())
stop.wait()
srv.close()
"""

RAW_SINK = r"""
import socket, sys
s = socket.create_server(("10.77.0.2", 0)); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); buf = bytearray(1 << 20); n = 0
while (k := c.recv_into(buf)): n += k
c.sendall(str(n).encode()); c.close()
"""

PING = r"""
import socket, sys, time, statistics
s = socket.create_connection(("10.77.0.2", int(sys.argv[1]))); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(20):
    t0 = time.perf_counter(); s.sendall(b"x"); s.recv(1); rtts.append(time.perf_counter() - t0)
print(statistics.median(rtts) * 1000)
"""

ECHO = r"""
import socket
s = socket.create_server(("10.77.0.2", 0)); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := c.recv(1)): c.sendall(b)
"""

RAW_SOURCE = r"""
import socket, sys, time
n = int(sys.argv[2]); buf = bytes(1 << 20); s = socket.create_connection(("10.77.0.2", int(sys.argv[1])))
t0 = time.perf_counter(); left = n
while left > 0: left -= s.send(buf[: min(left, len(buf))])
s.shutdown(socket.SHUT_WR); got = int(s.recv(64)); print(time.perf_counter() - t0, got)
"""

SENDER = r"""
import json, sys, time
from gpumigrate.transfer import push
t0 = time.perf_counter()
st = push(sys.argv[1], sys.argv[2], sys.argv[3], key=bytes.fromhex(sys.argv[4]), parallelism=int(sys.argv[5]))
print(json.dumps({"seconds": time.perf_counter() - t0, "bytes_sent": st.bytes_sent, "bytes_logical": st.bytes_logical,
                  "chunks_sent": st.chunks_sent}))
"""


def stream_bench(work: Path, image_id: str, key: bytes, parallelism: int, rate_mbit: int) -> dict[str, Any]:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return {"skipped": "needs root, ip and tc for network namespaces"}
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from transfer_link import NS_A, NS_B, link_up

    py = sys.executable
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    link_rate = rate_mbit * 1e6 / 8
    try:
        link = link_up(rate_mbit, 10)
    except (subprocess.CalledProcessError, RuntimeError, OSError) as exc:
        return {"skipped": f"could not build the emulated link: {exc}"}
    try:
        echo = subprocess.Popen(
            ["ip", "netns", "exec", NS_B, py, "-c", ECHO], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            eport = echo.stdout.readline().strip()  # type: ignore[union-attr]
            rtt_ms = float(
                subprocess.run(
                    ["ip", "netns", "exec", NS_A, py, "-c", PING, eport],
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=60,
                ).stdout
            )
        finally:
            echo.wait(timeout=30)
        # baseline: one plain TCP connection over the same link, same byte count as our stored image
        src_store = work / "store"
        nbytes = sum(p.stat().st_size for p in (src_store / "chunks").rglob("*") if p.is_file())
        sink = subprocess.Popen(
            ["ip", "netns", "exec", NS_B, py, "-c", RAW_SINK], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            port = sink.stdout.readline().strip()  # type: ignore[union-attr]
            os.sync()
            out = subprocess.run(
                ["ip", "netns", "exec", NS_A, py, "-c", RAW_SOURCE, port, str(nbytes)],
                capture_output=True,
                text=True,
                check=True,
                timeout=600,
            ).stdout.split()
            raw_s = float(out[0])
        finally:
            sink.wait(timeout=30)
        recv_store = work / "recv-store"
        shutil.rmtree(recv_store, ignore_errors=True)
        recv = subprocess.Popen(
            ["ip", "netns", "exec", NS_B, py, "-c", RECEIVER, f"file://{recv_store}", key.hex()],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        try:
            url = json.loads(recv.stdout.readline())["url"]  # type: ignore[union-attr]
            os.sync()
            res = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    NS_A,
                    py,
                    "-c",
                    SENDER,
                    f"file://{src_store}",
                    url,
                    image_id,
                    key.hex(),
                    str(parallelism),
                ],
                capture_output=True,
                text=True,
                env=env,
                check=True,
                timeout=900,
            )
            ours_res = json.loads(res.stdout.strip().splitlines()[-1])
        finally:
            os.killpg(recv.pid, signal.SIGTERM)
            recv.wait(timeout=30)
        shutil.rmtree(recv_store, ignore_errors=True)
        wire = ours_res["bytes_sent"] / ours_res["seconds"]
        return {
            "link": {
                "rate_bytes_per_s": link_rate,
                "rtt_ms_configured": 20,
                "rtt_ms_measured": round(rtt_ms, 2),
                "emulation": "TUN pair + tbf + user-space delay forwarder (no sch_netem in this kernel)",
            },
            "gpumigrate_stream": {
                "connections": parallelism,
                "seconds": round(ours_res["seconds"], 3),
                "bytes_on_wire": ours_res["bytes_sent"],
                "goodput_vs_link": round(wire / link_rate, 4),
                "logical_bytes_per_s_vs_link": round(ours_res["bytes_logical"] / ours_res["seconds"] / link_rate, 4),
            },
            "baseline_single_tcp": {
                "seconds": round(raw_s, 3),
                "bytes": nbytes,
                "goodput_vs_link": round(nbytes / raw_s / link_rate, 4),
                "note": "one plain TCP connection, no TLS, no verification",
            },
            "target": "goodput_vs_link >= 0.90",
        }
    except subprocess.CalledProcessError as exc:
        return {"skipped": f"network emulation failed: {' '.join(map(str, exc.cmd))[:200]}: {(exc.stderr or '')[:300]}"}
    finally:
        link.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the JSON document (always printed; kept for symmetry)")
    ap.add_argument("--size-mb", type=int, default=1024, help="size of each dataset in MiB (default 1024)")
    ap.add_argument("--parallelism", type=int, default=4)
    ap.add_argument("--workdir", default=None, help="where to put data (default: a temp dir, removed afterwards)")
    ap.add_argument("--skip-stream", action="store_true")
    ap.add_argument("--link-mbit", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=1, help="report the best of N runs for every figure (noisy machines)")
    ap.add_argument(
        "--smoke", action="store_true", help="CI: 8 MiB, no link; exit 1 unless every image comes back bit-identical"
    )
    args = ap.parse_args()
    if args.smoke:
        args.size_mb, args.skip_stream, args.repeat = min(args.size_mb, 8), True, 1
    global REPEAT
    REPEAT = max(1, args.repeat)
    sys.path.insert(0, str(REPO))
    nbytes = args.size_mb * MiB
    key = os.urandom(32)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gm-bench-transfer-"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "bench": "transfer",
        "size_mb": args.size_mb,
        "cpus": os.cpu_count(),
        "repeat": REPEAT,
        "loadavg_at_start": os.getloadavg(),
        "page_cache": "warm for every tool (same files, read back to back); os.sync() before every timed run",
    }
    try:
        wdir = work / "weights"
        wdir.mkdir(exist_ok=True)
        weights = wdir / "model.bf16"
        make_bf16(weights, nbytes)
        mixed = work / "mixed"
        make_mixed(mixed, nbytes)
        for name, src in (("bf16_weights_file", weights), ("mixed_directory", mixed)):
            size = tree_bytes(src)
            base = baselines(src, work, size)
            mine = ours(src, work, size, key, args.parallelism)
            entry: dict[str, Any] = {"bytes": size, "gpumigrate": mine, "baselines": base}
            if args.smoke:
                entry["unpacked_identical"] = unpacked_identical(src, work, mine["image_id"], key)
            rs = base.get("rsync --whole-file", {})
            if "GBps" in rs and rs["GBps"]:
                entry["pack_store_vs_rsync"] = round(mine["pack_store"]["GBps"] / rs["GBps"], 3)
            if name == "bf16_weights_file":
                entry["zstd_-1_whole_file_ratio"] = zstd_whole_ratio(weights)
                entry["targets"] = {
                    "pack_store_GBps": ">= 1.0",
                    "pack_store_vs_rsync": ">= 2.4",
                    "stored_ratio": "<= 0.72",
                }
                entry["paired_with_rsync"] = paired_with_rsync(
                    weights, work, size, key, args.parallelism, 1 if args.smoke else max(5, REPEAT)
                )
                entry["incremental_5pct"] = incremental(weights, work, key, args.parallelism, mine)
                if not args.skip_stream:
                    # re-pack the full (now modified) file alone so the stream carries one whole image
                    from gpumigrate.transfer import pack_paths

                    shutil.rmtree(work / "store", ignore_errors=True)
                    ref = pack_paths([weights], f"file://{work / 'store'}", key=key, parallelism=args.parallelism)
                    entry["stream_emulated_link"] = stream_bench(work, ref.id, key, args.parallelism, args.link_mbit)
            report[name] = entry
            shutil.rmtree(work / "store", ignore_errors=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=2))
    if args.smoke and (bad := smoke_failures(report)):
        sys.exit("smoke: " + "; ".join(bad))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Links for the transfer benchmarks, and the receivers' benchmark.

``python bench/transfer_link.py link [--mbit 1000] [--mib 512] [--reps 2]``: stream:// and nixl://
(encryption on) beside a plain TCP socket, over one veth link between two network namespaces that
``tbf`` shapes to ``--mbit``, all measured in the same run (needs root). It prints JSON (``--out``
writes it too). ``python bench/transfer_link.py --smoke`` (CI, root): a 2 MiB image pushed once over
each scheme and once over TCP, without the start-up figure; exits 1 unless both pushes ended with the
receiver holding every chunk it verified.

Device to device on one GPU host is measured by ``bench/lend_model.py`` (the way a migration's fill
moves device memory); the ``gpu`` mode that compared NIXL WRITE, NIXL READ and the CUDA IPC lend on one
tensor, and the hash kernels' variants, is gone with those variants.

The rest of this module is an emulated WAN link for bench/transfer.py: rate limit plus one-way
delay, without sch_netem.

This machine's kernel has no ``sch_netem`` (``tc qdisc ... netem`` fails: "qdisc kind is unknown"),
so the delay is added in user space, packet by packet, keeping TCP end to end:

    ns A: gmtA 10.77.0.1 ─┐                      ┌─ ns B: gmtB 10.77.0.2
          (tbf rate R)    └─► forwarder (delay D each way) ◄─┘  (tbf rate R)

Each namespace gets a TUN device with ``vnet_hdr`` and TSO offloads, so the kernel hands the
forwarder 64 KiB GSO super-packets (a few thousand per second at 1 Gbit/s, easy for Python) and
accepts them back whole on the other side; ``tbf`` on each TUN device sets the rate. Run as
``python transfer_link.py FORWARD DELAY_MS`` (what :func:`link_up` starts), needs root.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

NS_A, NS_B = "gmbenchA", "gmbenchB"
DEV_A, DEV_B = "gmtA", "gmtB"
ADDR_A, ADDR_B = "10.77.0.1", "10.77.0.2"

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
CLONE_NEWNET = 0x40000000
MAX_PACKET = 65536 + 64


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _setns(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({name}) failed")
    finally:
        os.close(fd)


def _open_tun(ns: str, dev: str) -> int:
    _setns(ns)
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", dev.encode(), IFF_TUN | IFF_NO_PI | IFF_VNET_HDR))
    fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
    return fd


def _tbf(ns: str, dev: str, rate_mbit: int, burst: str, latency: str) -> None:
    """Shape ``dev`` inside ``ns`` with a token bucket (the qdisc this kernel has; netem it lacks)."""
    rate = f"{rate_mbit}mbit"
    _sh(
        "ip",
        "netns",
        "exec",
        ns,
        "tc",
        "qdisc",
        "add",
        "dev",
        dev,
        "root",
        "tbf",
        "rate",
        rate,
        "burst",
        burst,
        "latency",
        latency,
    )


def forward(delay_s: float) -> None:
    """Move packets A→B and B→A, each released ``delay_s`` after it was read. Runs until SIGTERM."""
    fd_a = _open_tun(NS_A, DEV_A)
    fd_b = _open_tun(NS_B, DEV_B)
    queues = {fd_a: collections.deque(), fd_b: collections.deque()}  # packets read from fd, bound for the other
    other = {fd_a: fd_b, fd_b: fd_a}
    running = True

    def stop(*_: object) -> None:
        nonlocal running
        running = False

    signal.signal(signal.SIGTERM, stop)
    print("ready", flush=True)
    while running:
        now = time.monotonic()
        for src, q in queues.items():
            while q and q[0][0] <= now:
                with contextlib.suppress(BlockingIOError):  # a full TUN queue drops, as a router would
                    os.write(other[src], q.popleft()[1])
        due = [q[0][0] for q in queues.values() if q]
        timeout = max(0.0, min(due) - now) if due else 0.5
        try:
            readable, _, _ = select.select([fd_a, fd_b], [], [], timeout)
        except InterruptedError:
            continue
        now = time.monotonic()
        for fd in readable:
            for _ in range(256):
                try:
                    pkt = os.read(fd, MAX_PACKET)
                except BlockingIOError:
                    break
                queues[fd].append((now + delay_s, pkt))


@dataclass
class Link:
    forwarder: subprocess.Popen[str]
    rate_mbit: int
    delay_ms: float

    def close(self) -> None:
        if self.forwarder.poll() is None:
            os.killpg(self.forwarder.pid, signal.SIGTERM)
            try:
                self.forwarder.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.forwarder.pid, signal.SIGKILL)
                self.forwarder.wait(timeout=10)
        link_down()


def link_down() -> None:
    for ns in (NS_A, NS_B):
        subprocess.run(["ip", "netns", "del", ns], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def link_up(rate_mbit: int, delay_ms: float) -> Link:
    """Two namespaces joined by a ``rate_mbit`` link with ``delay_ms`` each way (RTT = 2 × delay)."""
    link_down()
    for ns, dev, addr in ((NS_A, DEV_A, ADDR_A), (NS_B, DEV_B, ADDR_B)):
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "tuntap", "add", "dev", dev, "mode", "tun", "vnet_hdr")
        _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _sh("ip", "-n", ns, "link", "set", dev, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        # burst must hold a whole 64 KiB GSO packet; the queue must hold a bandwidth-delay product
        _tbf(ns, dev, rate_mbit, "256kb", "200ms")
    proc = subprocess.Popen(
        [sys.executable, __file__, "FORWARD", str(delay_ms)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    line = proc.stdout.readline() if proc.stdout else ""
    if line.strip() != "ready":
        proc.kill()
        proc.wait()
        link_down()
        raise RuntimeError("the link forwarder did not start")
    return Link(proc, rate_mbit, delay_ms)


# ----------------------------------------------------------------------------- receivers over one shaped link
LINK_NS_A, LINK_NS_B = "gmlinkA", "gmlinkB"
LINK_DEV_A, LINK_DEV_B = "gmlA", "gmlB"
LINK_IP_A, LINK_IP_B = "10.78.0.1", "10.78.0.2"
KEY_ENV = "GM_BENCH_IMAGE_KEY"

TCP_SINK = r"""
import socket, sys
s = socket.create_server((sys.argv[1], 0)); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); buf = bytearray(1 << 20); n = 0
while (k := c.recv_into(buf)): n += k
c.sendall(str(n).encode()); c.close()
"""

TCP_SOURCE = r"""
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]); buf = bytes(1 << 20)
s = socket.create_connection((host, port)); t0 = time.perf_counter(); left = n
while left > 0: left -= s.send(buf[: min(left, len(buf))])
s.shutdown(socket.SHUT_WR); got = int(s.recv(64)); print(time.perf_counter() - t0, got)
"""


def veth_down() -> None:
    for ns in (LINK_NS_A, LINK_NS_B):
        subprocess.run(["ip", "netns", "del", ns], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def veth_up(rate_mbit: int) -> None:
    """Two namespaces joined by one veth pair, each end shaped by tbf to ``rate_mbit`` (no delay)."""
    veth_down()
    for ns in (LINK_NS_A, LINK_NS_B):
        _sh("ip", "netns", "add", ns)
    _sh(
        "ip",
        "link",
        "add",
        LINK_DEV_A,
        "netns",
        LINK_NS_A,
        "type",
        "veth",
        "peer",
        "name",
        LINK_DEV_B,
        "netns",
        LINK_NS_B,
    )
    burst = max(32 * 1024, rate_mbit * 1_000_000 // 8 // 100)  # 10 ms of traffic, as infra/netns.py shapes hosts
    for ns, dev, addr in ((LINK_NS_A, LINK_DEV_A, LINK_IP_A), (LINK_NS_B, LINK_DEV_B, LINK_IP_B)):
        _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _sh("ip", "-n", ns, "link", "set", dev, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _tbf(ns, dev, rate_mbit, str(burst), "50ms")
    _wait_settled((LINK_NS_A, LINK_DEV_A), (LINK_NS_B, LINK_DEV_B))


def _wait_settled(*links: tuple[str, str], timeout_s: float = 10.0) -> None:
    """Wait until each veth end is up and its IPv6 link-local address has passed duplicate address
    detection (about 1.3 s after ``link set up`` here). A nixl:// receiver and push started before
    that failed to reach each other every time here (NIXL_ERR_BACKEND when the sender adds the
    receiver's agent), and never once started after: UCX looks at a process's network devices when
    its first worker starts. A host whose links settled long ago never sees this."""
    deadline = time.monotonic() + timeout_s
    for ns, dev in links:
        ipv6 = subprocess.run(
            ["ip", "netns", "exec", ns, "cat", f"/proc/sys/net/ipv6/conf/{dev}/disable_ipv6"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        while True:
            link = subprocess.run(["ip", "-n", ns, "-o", "link", "show", "dev", dev], capture_output=True, text=True)
            addr = subprocess.run(["ip", "-n", ns, "-o", "addr", "show", "dev", dev], capture_output=True, text=True)
            settled = "tentative" not in addr.stdout and ("inet6" in addr.stdout or ipv6 != "0")
            if "state UP" in link.stdout and settled:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{dev} in {ns} did not settle: {link.stdout.strip()} {addr.stdout.strip()}")
            time.sleep(0.05)


def _in(ns: str, *argv: str) -> list[str]:
    return [
        "ip",
        "netns",
        "exec",
        ns,
        *argv,
    ]  # `ip netns exec` also gives the process its namespace's /sys (UCX reads it)


def tcp_run(nbytes: int) -> float:
    """Seconds for one plain TCP connection to move ``nbytes`` A→B, until B acknowledged the last byte."""
    sink = subprocess.Popen(
        _in(LINK_NS_B, sys.executable, "-c", TCP_SINK, LINK_IP_B), stdout=subprocess.PIPE, text=True
    )
    try:
        port = sink.stdout.readline().strip()  # type: ignore[union-attr]
        out = subprocess.run(
            _in(LINK_NS_A, sys.executable, "-c", TCP_SOURCE, LINK_IP_B, port, str(nbytes)),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert int(out[1]) == nbytes
        return float(out[0])
    finally:
        sink.wait(timeout=30)


def push_run(scheme: str, image: str, env: dict[str, str], work: Path, *, inline: bool = True) -> dict[str, object]:
    """A fresh receiver in B (nixl: UCX over TCP), then `gpumigrate image push` from A; the push's own figures.
    ``inline=False``: nixl:// chunks all wait for NIXL instead of travelling inline until its agent is up."""
    # The receiver's store lives in memory when it can: the figure is the link and the transport, not
    # this machine's disk (a shared VM's disk, with fdatasync, can be slower than a 1 Gbit/s link).
    scratch = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
    state = scratch / f"gm-recv-{scheme}-{time.monotonic_ns()}"
    argv = [
        sys.executable,
        "-m",
        "gpumigrate",
        "image",
        "receive",
        "--listen",
        f"{LINK_IP_B}:0",
        "--state-dir",
        str(state),
        "--key-env",
        KEY_ENV,
    ]
    if scheme == "nixl":
        argv += ["--nixl", "--nixl-transports", "tcp"]
    recv = subprocess.Popen(
        _in(LINK_NS_B, *argv), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    try:
        url = json.loads(recv.stdout.readline())["url"] + ("&transports=tcp" if scheme == "nixl" else "")  # type: ignore[union-attr]
        url += "" if inline or scheme != "nixl" else "&inline=0"
        started = time.perf_counter()
        out = subprocess.run(
            _in(
                LINK_NS_A,
                sys.executable,
                "-m",
                "gpumigrate",
                "image",
                "push",
                image,
                url,
                "--key-env",
                KEY_ENV,
                "--json",
                "-q",
                "-j",
                "4",
            ),
            capture_output=True,
            text=True,
            env=env,
        )
        process_s = time.perf_counter() - started  # the whole CLI process: interpreter start to exit
        if out.returncode != 0:
            raise RuntimeError(f"push over {scheme}:// failed: {out.stderr.strip()}")
        stats = json.loads(out.stdout.strip().splitlines()[-1])
        stats["process_seconds"] = process_s
        recv.send_signal(signal.SIGTERM)
        final = json.loads(recv.communicate(timeout=30)[0].strip().splitlines()[-1])  # the receiver's counts
        return {
            **stats,
            "chunks_via_nixl": final.get("chunks_via_nixl", 0),
            "chunks_received": final.get("chunks_received"),
        }
    finally:
        if recv.poll() is None:
            recv.send_signal(signal.SIGTERM)
            recv.wait(timeout=30)
        shutil.rmtree(state, ignore_errors=True)


def link_bench(rate_mbit: int, mib: int, reps: int, *, startup: bool = True) -> dict[str, object]:
    """``startup``: also the fixed cost of each scheme (a one-chunk push less a TCP socket's time for its bytes);
    without it (the smoke), every nixl:// chunk waits for NIXL, so the WRITE path runs however short the push."""
    import statistics
    import tempfile

    from gpumigrate import control
    from gpumigrate.transfer import pack_paths

    work = Path(tempfile.mkdtemp(prefix="gm-link-"))
    key = os.urandom(32)
    env = {**os.environ, "GPUMIGRATE_HOME": str(work / "home"), KEY_ENV: key.hex()}
    os.environ["GPUMIGRATE_HOME"] = env["GPUMIGRATE_HOME"]
    control.load_key(create=True)  # the control key both sides find under the shared state root
    images = {}
    for name, size in (("image", mib << 20), ("one-chunk", 1 << 20)):
        (work / name).mkdir()
        (work / name / "payload.bin").write_bytes(os.urandom(size))  # incompressible: wire bytes = image bytes
        store = f"file://{work / 'store'}"
        images[name] = f"{store}#{pack_paths([work / name], store, key=key, compression='none').id}"
    image = images["image"]
    link_Bps = rate_mbit * 1e6 / 8
    veth_up(rate_mbit)
    runs: list[dict[str, object]] = []
    setup: dict[str, float] = {}
    try:
        for scheme in ("stream", "nixl") if startup else ():  # fixed cost: a one-chunk image, less TCP's time for it
            small = push_run(scheme, images["one-chunk"], env, work)
            setup[scheme] = round(float(small["seconds"]) - tcp_run(int(small["bytes_sent"])), 3)  # type: ignore[arg-type]
        for rep in range(reps):
            for scheme in ("stream", "nixl"):
                stats = push_run(scheme, image, env, work, inline=startup)
                tcp_s = tcp_run(int(stats["bytes_sent"]))  # type: ignore[arg-type]
                rate = float(stats["bytes_sent"]) / float(stats["seconds"])  # type: ignore[arg-type]
                tcp = float(stats["bytes_sent"]) / tcp_s  # type: ignore[arg-type]
                runs.append(
                    {
                        "rep": rep,
                        "scheme": scheme,
                        "bytes_sent": stats["bytes_sent"],
                        "chunks_sent": stats["chunks_sent"],
                        "chunks_via_nixl": stats["chunks_via_nixl"],
                        "chunks_received": stats["chunks_received"],
                        "seconds": round(float(stats["seconds"]), 3),
                        "Bps": round(rate),  # type: ignore[arg-type]
                        "tcp_seconds": round(tcp_s, 3),
                        "tcp_Bps": round(tcp),
                        "vs_link": round(rate / link_Bps, 4),
                        "vs_tcp": round(rate / tcp, 4),
                        "process_seconds": round(float(stats["process_seconds"]), 3),  # type: ignore[arg-type]
                        "process_vs_link": round(
                            float(stats["bytes_sent"]) / float(stats["process_seconds"]) / link_Bps,  # type: ignore[arg-type]
                            4,
                        ),
                        "after_setup_vs_link": round(
                            float(stats["bytes_sent"]) / (float(stats["seconds"]) - setup[scheme]) / link_Bps,
                            4,  # type: ignore[arg-type]
                        )
                        if scheme in setup
                        else None,
                    }
                )
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    finally:
        veth_down()
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for scheme in ("stream", "nixl"):
        mine = [r for r in runs if r["scheme"] == scheme]
        summary[scheme] = {
            k: statistics.median(float(r[k]) for r in mine)  # type: ignore[arg-type]
            for k in ("Bps", "tcp_Bps", "vs_link", "vs_tcp", "process_vs_link", "after_setup_vs_link")
            if all(r[k] is not None for r in mine)
        }
        summary[scheme]["setup_seconds"] = setup.get(scheme)
    return {
        "bench": "transfer_link",
        "mode": "link",
        "link": {
            "qdisc": "tbf",
            "rate_mbit": rate_mbit,
            "rate_Bps": link_Bps,
            "delay_ms": 0,
            "between": "two network namespaces, one veth pair, tbf on both ends",
        },
        "image": {
            "bytes": mib << 20,
            "encryption": "aes-256-gcm",
            "compression": "none (random bytes)",
        },
        "receiver_store": "/dev/shm (tmpfs) when present",
        "setup": "setup_seconds: a one-chunk push's seconds less a TCP socket's for its bytes (nixl: importing NIXL "
        "and starting its UCX agent, beside the connections' start); after_setup_vs_link: the same runs without it",
        "includes": "push (seconds, vs_link, vs_tcp): the CLI's own seconds from the start of its push call to its "
        "end: opening the destination (nixl: importing NIXL and starting its UCX agent), manifest check, connect, "
        "TLS, HELLO, listing, NIXL slots leased, every chunk sent and verified by the receiver before it is stored, "
        "flush, manifest, close; the interpreter's and the CLI's own start before that call excluded, the same for "
        "both schemes. process_seconds / process_vs_link: the whole push process from exec to exit (interpreter "
        "start, imports, `ip netns exec`). tcp: one plain socket from connect to the receiver's count of the same "
        "number of bytes",
        "runs": runs,
        "median": summary,
        "targets": {"vs_link": ">= 0.90"},
    }


def main(argv: list[str]) -> None:
    import argparse

    if len(argv) == 2 and argv[0] == "FORWARD":
        forward(float(argv[1]) / 1000.0)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", choices=["link"], default="link")
    ap.add_argument("--mbit", type=int, default=1000, help="link rate")
    ap.add_argument("--mib", type=int, default=1024, help="image size")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--smoke", action="store_true", help="CI (root): 2 MiB once per scheme; exit 1 unless it arrived")
    args = ap.parse_args(argv)
    if args.smoke:
        args.mib, args.reps = 2, 1
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        raise SystemExit("transfer_link needs root, ip and tc (two network namespaces joined by a shaped link)")
    result = link_bench(args.mbit, args.mib, args.reps, startup=not args.smoke)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.smoke:
        runs = result["runs"]
        arrived = {r["scheme"] for r in runs if r["chunks_sent"] and r["chunks_received"] == r["chunks_sent"]}  # type: ignore[index]
        if arrived != {"stream", "nixl"}:
            raise SystemExit(
                f"smoke: the receiver did not verify every chunk pushed over { ({'stream', 'nixl'} - arrived) }"
            )
        if any(r["chunks_via_nixl"] != r["chunks_sent"] for r in runs if r["scheme"] == "nixl"):  # type: ignore[index]
            raise SystemExit("smoke: a nixl:// chunk travelled inline: the NIXL WRITE path did not run")


if __name__ == "__main__":
    main(sys.argv[1:])

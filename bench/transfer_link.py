#!/usr/bin/env python3
"""An emulated WAN link for bench/transfer.py: rate limit plus one-way delay, without sch_netem.

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
import os
import select
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

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
            f"{rate_mbit}mbit",
            "burst",
            "256kb",
            "latency",
            "200ms",
        )
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


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "FORWARD":
        forward(float(sys.argv[2]) / 1000.0)
    else:
        print(__doc__)

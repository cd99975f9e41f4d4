"""Network namespaces for local hosts: each host in its own namespace, joined to the root namespace
by a veth pair whose two ends ``tc netem`` shapes (rate, delay) to emulate a cross-cloud link.

Layout for host index ``i`` (1..254): namespace ``gm-<id>``, root end ``gmh<id>`` = 10.213.i.1/24,
namespace end ``gmn<id>`` = 10.213.i.2/24, default route inside via 10.213.i.1. The root namespace
forwards between hosts (``net.ipv4.ip_forward=1``), so host A reaches host B at 10.213.j.2 through
both shaped links, and processes in the root namespace (Envoy, the CLI) reach every host directly.
Needs root and iproute2; :func:`available` says whether this machine can.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from gpumigrate.errors import InvalidInputError, ProviderError

SUBNET = "10.213"
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)$")
_DELAY = re.compile(r"^\d+(\.\d+)?(us|ms|s)$")


@dataclass(frozen=True)
class NetnsLink:
    ns: str
    index: int
    host_if: str
    ns_if: str
    host_ip: str  # root-namespace end
    ns_ip: str  # the host's address
    rate: str | None = None
    delay: str | None = None


def available() -> tuple[bool, str]:
    """(True, "") when namespaces can be made here, else (False, why)."""
    if os.geteuid() != 0:
        return False, "needs root"
    if not shutil.which("ip"):
        return False, "iproute2 'ip' not found"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return False, f"'ip netns' unavailable: {probe.stderr.strip()}"
    return True, ""


def validate_shaping(rate: str | None, delay: str | None) -> None:
    if rate is not None and not _RATE.match(rate):
        raise InvalidInputError(f"rate {rate!r} is not a tc rate; use e.g. 100mbit, 1gbit, 500kbit")
    if delay is not None and not _DELAY.match(delay):
        raise InvalidInputError(f"delay {delay!r} is not a tc delay; use e.g. 10ms, 500us, 1s")


def _run(*argv: str, ns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", ns, *argv] if ns else list(argv)
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise ProviderError(f"{' '.join(cmd)} failed: {out.stderr.strip() or out.stdout.strip()}")


def _skip_dad(dev: str, ns: str | None = None) -> None:
    """No IPv6 duplicate-address detection on a link we just made (nothing else can hold its addresses).

    Otherwise its link-local address stays "tentative" for a second or so after the link comes up, and UCX
    (nixl://), which enumerates every interface when its agent starts, failed on a receiver started in that
    window. Hosts without IPv6 have nothing to turn off."""
    with contextlib.suppress(ProviderError):
        _run("sysctl", "-qw", f"net.ipv6.conf.{dev}.accept_dad=0", ns=ns)


def exists(ns: str) -> bool:
    return os.path.exists(f"/var/run/netns/{ns}")


def list_namespaces(prefix: str = "gm-") -> list[str]:
    try:
        return sorted(n for n in os.listdir("/var/run/netns") if n.startswith(prefix))
    except FileNotFoundError:
        return []


def used_indexes() -> set[int]:
    """Subnet indexes already taken by any gm link on this machine (any GPUMIGRATE_HOME)."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=False).stdout
    return {int(m.group(1)) for m in re.finditer(rf"inet {re.escape(SUBNET)}\.(\d+)\.1/", out)}


def create(host_id: str, index: int, *, rate: str | None = None, delay: str | None = None) -> NetnsLink:
    """Make the namespace, the veth pair, addresses, routes and shaping. Undone by :func:`destroy` on failure."""
    validate_shaping(rate, delay)
    if not 1 <= index <= 254:
        raise ProviderError(f"netns subnet index {index} out of range 1..254")
    link = NetnsLink(
        ns=f"gm-{host_id}",
        index=index,
        host_if=f"gmh{host_id}"[:15],
        ns_if=f"gmn{host_id}"[:15],
        host_ip=f"{SUBNET}.{index}.1",
        ns_ip=f"{SUBNET}.{index}.2",
        rate=rate,
        delay=delay,
    )
    try:
        _run("ip", "netns", "add", link.ns)
        _run("ip", "link", "add", link.host_if, "type", "veth", "peer", "name", link.ns_if)
        _run("ip", "link", "set", link.ns_if, "netns", link.ns)
        _skip_dad(link.host_if)
        _skip_dad(link.ns_if, ns=link.ns)
        _run("ip", "addr", "add", f"{link.host_ip}/24", "dev", link.host_if)
        _run("ip", "link", "set", link.host_if, "up")
        _run("ip", "link", "set", "lo", "up", ns=link.ns)
        _run("ip", "addr", "add", f"{link.ns_ip}/24", "dev", link.ns_if, ns=link.ns)
        _run("ip", "link", "set", link.ns_if, "up", ns=link.ns)
        _run("ip", "route", "add", "default", "via", link.host_ip, ns=link.ns)
        if rate or delay:
            shaping = shaping_qdisc(rate, delay, link.host_if)
            # Both directions: the root end shapes traffic into the host, the namespace end traffic out of it.
            _run("tc", "qdisc", "add", "dev", link.host_if, "root", *shaping)
            _run("tc", "qdisc", "add", "dev", link.ns_if, "root", *shaping, ns=link.ns)
        _enable_forwarding()
    except BaseException:
        destroy(link.ns, link.host_if)
        raise
    return link


_UNITS = {
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bps": 8,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
}


def rate_bits(rate: str) -> float:
    m = re.match(r"^(\d+(?:\.\d+)?)([a-z]+)$", rate)
    if not m or m.group(2) not in _UNITS:
        raise InvalidInputError(f"rate {rate!r} is not a tc rate; use e.g. 100mbit, 1gbit, 500kbit")
    return float(m.group(1)) * _UNITS[m.group(2)]


def netem_available(dev: str) -> bool:
    """Some kernels (this CI's included) ship without sch_netem; tbf is always there. Probes on our own ``dev``."""
    argv = ["tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", "0ms"]
    if subprocess.run(argv, capture_output=True, check=False).returncode == 0:
        subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True, check=False)
        return True
    return False


def shaping_qdisc(rate: str | None, delay: str | None, probe_dev: str) -> list[str]:
    """tc arguments: netem (rate and delay) where the kernel has it, else tbf (rate only)."""
    if netem_available(probe_dev):
        return ["netem"] + (["rate", rate] if rate else []) + (["delay", delay] if delay else [])
    if delay:
        raise ProviderError(
            f"delay {delay} needs the netem qdisc, which this kernel lacks; shape the rate only (tbf works here)"
        )
    assert rate is not None
    # A token bucket: burst of ~10 ms of traffic (at least 32 KiB) so the rate holds without stalls.
    burst = max(32 * 1024, int(rate_bits(rate) / 8 / 100))
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]


def _enable_forwarding() -> None:
    """Hosts in different namespaces talk through the root namespace, which must route between them."""
    path = "/proc/sys/net/ipv4/ip_forward"
    try:
        with open(path) as fh:
            if fh.read().strip() == "1":
                return
        with open(path, "w") as fh:
            fh.write("1\n")
    except OSError as exc:
        raise ProviderError(f"cannot enable IPv4 forwarding between local hosts: {exc}") from None


def destroy(ns: str, host_if: str | None = None) -> None:
    """Delete the namespace (its veth end goes with it, taking the pair). Idempotent, never raises."""
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
    if host_if:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, check=False)

"""Local hosts in their own network namespaces (root + ip netns only; skipped elsewhere)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumigrate.errors import InvalidInputError, ProviderError
from gpumigrate.infra import netns as netns_lib
from gpumigrate.infra.local import LocalProvider
from gpumigrate.interfaces import HostSpec

_ok, _why = netns_lib.available()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not _ok, reason=f"network namespaces unavailable: {_why}")]

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_local import crash_parent, wait_dead  # noqa: E402

PLAIN_HTTP = Path(__file__).resolve().parent / "plain_http.py"  # listens at once: no name lookup in the namespace


def spec(name: str) -> HostSpec:
    return HostSpec(name=name, provider="local", region="local")


@pytest.fixture
def provider(gm_home: Path):
    prov = LocalProvider(netns=True, rate="200mbit")
    yield prov
    for host in prov.list_hosts():
        prov.terminate(host)


def _wait_log(path: str, needle: str, timeout_s: float = 30) -> str:
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = Path(path).read_text()
        if needle in text:
            return text
        time.sleep(0.05)
    return text


def test_hosts_get_namespaces_that_reach_each_other(provider: LocalProvider) -> None:
    a = provider.provision(spec("ns-a"), migration_id="m")
    b = provider.provision(spec("ns-b"), migration_id="m")
    assert a.address.startswith("10.213.") and a.address != b.address
    assert netns_lib.exists(a.meta["netns"]) and netns_lib.exists(b.meta["netns"])
    inside = provider.spawn(a, ["ip", "-o", "-4", "addr"], name="addrs")
    assert wait_dead([inside["pid"]]) == []
    text = Path(inside["log"]).read_text()
    assert a.address in text and b.address not in text  # the process runs inside a's namespace
    port = b.ports["service"]
    provider.spawn(b, [sys.executable, str(PLAIN_HTTP), b.address, str(port)], name="http")
    probe = f"import time, urllib.request\nfor _ in range(200):\n    try:\n        print(urllib.request.urlopen('http://{b.address}:{port}/').status); break\n    except OSError: time.sleep(0.1)"
    client = provider.spawn(a, [sys.executable, "-c", probe], name="client")
    text = _wait_log(client["log"], "200")
    assert "200" in text, f"a's client never got 200 from {b.address}:{port} in 30 s; its log: {text[-500:]!r}"
    shaping = subprocess.run(
        ["tc", "qdisc", "show", "dev", f"gmh{a.meta['netns'][3:]}"], capture_output=True, text=True
    ).stdout
    assert "200Mbit" in shaping or "rate 200Mbit" in shaping


def test_terminate_removes_the_namespace(provider: LocalProvider) -> None:
    host = provider.provision(spec("ns-a"), migration_id="m")
    ns = host.meta["netns"]
    provider.terminate(host)
    assert not netns_lib.exists(ns)
    assert ns not in netns_lib.list_namespaces()


def test_no_orphan_namespaces_after_parent_crash(gm_home: Path) -> None:
    started = crash_parent("netns")
    assert len(started["netns"]) == 2
    assert wait_dead(started["pids"]) == []
    deadline = time.monotonic() + 20
    while any(netns_lib.exists(ns) for ns in started["netns"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(netns_lib.exists(ns) for ns in started["netns"])
    assert LocalProvider().list_hosts() == []


def test_bad_shaping_is_rejected_before_anything_starts(gm_home: Path) -> None:
    with pytest.raises(InvalidInputError, match="1gbit"):
        LocalProvider(netns=True, rate="fast")
    with pytest.raises(InvalidInputError, match="10ms"):
        LocalProvider(netns=True, delay="soon")
    prov = LocalProvider(netns=True, rate="1gbit", delay="10ms")
    try:
        host = prov.provision(spec("ns-d"), migration_id="m")
    except ProviderError as exc:  # kernels without sch_netem (this CI): delay cannot be emulated
        assert "netem" in str(exc)
        host_id = hashlib.sha256(str((gm_home / "hosts" / "ns-d").resolve()).encode()).hexdigest()[:8]
        assert not netns_lib.exists(f"gm-{host_id}")  # the half-made namespace was removed
    else:
        prov.terminate(host)


def test_cli_hosts_up_with_netns_and_down(cli_cmd: list[str], gm_home: Path) -> None:
    import json
    import os

    env = {**os.environ, "GPUMIGRATE_HOME": str(gm_home)}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*cli_cmd, "hosts", *args], capture_output=True, text=True, env=env, timeout=120)

    up = run("up", "--name", "cli-ns", "--netns", "--rate", "100mbit", "--json")
    assert up.returncode == 0, up.stderr
    (host,) = json.loads(up.stdout.splitlines()[-1])["hosts"]
    assert host["address"].startswith("10.213.") and netns_lib.exists(host["netns"])
    assert run("down", "--all").returncode == 0
    assert wait_dead([host["supervisor_pid"]]) == []
    assert not netns_lib.exists(host["netns"])

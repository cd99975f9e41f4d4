"""The local provider: supervised hosts on this machine, and no orphans whatever happens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gpumigrate.errors import CapacityError, NotFoundError, ProviderError, ResidencyError
from gpumigrate.infra.local import LocalProvider
from gpumigrate.interfaces import HostSpec, Provider

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def spec(name: str, region: str = "local-a", **kw) -> HostSpec:
    return HostSpec(name=name, provider="local", region=region, **kw)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pids: list[int], timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@pytest.fixture
def provider(gm_home: Path):
    prov = LocalProvider()
    yield prov
    for host in prov.list_hosts():
        prov.terminate(host)


def test_provision_is_idempotent_per_migration(provider: LocalProvider, gm_home: Path) -> None:
    assert isinstance(provider, Provider)
    a = provider.provision(spec("local-a"), migration_id="m1")
    again = provider.provision(spec("local-a"), migration_id="m1")
    assert again.meta["supervisor_pid"] == a.meta["supervisor_pid"] and again.ports == a.ports
    with pytest.raises(ProviderError, match="in use by migration m1"):
        provider.provision(spec("local-a"), migration_id="m2")
    b = provider.provision(spec("local-b", "local-b"), migration_id="m1")
    assert not set(a.ports.values()) & set(b.ports.values())
    assert {"service", "agent", "stream"} <= set(a.ports)
    record = json.loads((gm_home / "hosts" / "local-a" / "host.json").read_text())
    assert record["migration_id"] == "m1" and record["ports"] == a.ports
    assert provider.wait_ready(a, timeout_s=10).name == "local-a"
    assert sorted(h.name for h in provider.list_hosts()) == ["local-a", "local-b"]


def test_jurisdiction_price_and_capacity(provider: LocalProvider) -> None:
    assert provider.jurisdiction("local-b").country == "LOCAL"
    assert provider.jurisdiction("local-b").blocs == ("LOCAL",)
    with pytest.raises(ResidencyError):
        provider.jurisdiction("mars-1")
    assert provider.price(spec("x")) == 0.0
    with pytest.raises(CapacityError, match="asks for 64"):
        provider.check_capacity(spec("x", gpu_count=64))
    one = LocalProvider(max_hosts=1)
    one.provision(spec("solo"), migration_id="m")
    with pytest.raises(CapacityError, match="limit is 1"):
        one.provision(spec("second"), migration_id="m")


def test_spawn_runs_on_the_host_with_its_environment(provider: LocalProvider) -> None:
    host = provider.provision(spec("local-a"), migration_id="m1")
    code = "import os; print(os.environ['GPUMIGRATE_HOST_NAME'], os.environ['GPUMIGRATE_PORT_SERVICE'], os.getcwd())"
    proc = provider.spawn(host, [sys.executable, "-c", code], name="env")
    assert wait_dead([proc["pid"]]) == []
    out = Path(proc["log"]).read_text().split()
    assert out == ["local-a", str(host.ports["service"]), host.workdir]
    listed = {p["pid"]: p for p in provider.processes(host)}
    assert listed[proc["pid"]]["returncode"] == 0 and listed[proc["pid"]]["name"] == "env"
    with pytest.raises(ProviderError, match="cannot start"):
        provider.spawn(host, ["/nonexistent/binary"])


def test_bootstrap_starts_a_launch_in_its_cwd_and_waits_until_it_answers(
    provider: LocalProvider, tmp_path: Path
) -> None:
    """The one launcher: the plan's launch rendered for the host (its address, ports, env contract, cwd)."""
    from gpumigrate.infra.launch import service_url
    from gpumigrate.launch import WorkloadLaunch

    app = tmp_path / "app"
    app.mkdir()
    (app / "healthz").write_text("ok")  # served from the cwd: proves the launch ran there
    server = "import http.server as h, os; h.HTTPServer(('{host}', int(os.environ['PORT'])), h.SimpleHTTPRequestHandler).serve_forever()"
    launch = WorkloadLaunch(
        argv=("{python}", "-c", server), env={"PORT": "{service_port}"}, cwd="app", plan_dir=str(tmp_path)
    )
    host = provider.provision(spec("boot-a"), migration_id="m1")
    up = provider.bootstrap(host, launch, timeout_s=60)
    workload = up.meta["workload"]
    assert httpx.get(service_url(up) + "/healthz", timeout=5).text == "ok"
    env = Path(f"/proc/{workload['pid']}/environ").read_bytes().split(b"\0")
    assert f"GPUMIGRATE_AGENT_ADDR={host.address}:{host.ports['agent']}".encode() in env
    assert provider.bootstrap(up, launch, timeout_s=60) == up  # already answering: not started twice
    assert [c["name"] for c in provider.processes(up)] == ["workload"]


def test_bootstrap_of_a_launch_that_exits_says_why_with_its_last_lines(provider: LocalProvider) -> None:
    from gpumigrate.launch import WorkloadLaunch

    crash = "import sys; print('loading model...'); sys.exit('no such model: tiny-xl')"
    host = provider.provision(spec("boot-b"), migration_id="m1")
    launch = WorkloadLaunch(argv=("{python}", "-c", crash, "{service_port}"))
    t0 = time.monotonic()
    with pytest.raises(
        ProviderError, match=r"(?s)exited before it answered: exit code 1.*loading model...\nno such model: tiny-xl"
    ):
        provider.bootstrap(host, launch, timeout_s=120)
    assert time.monotonic() - t0 < 60  # the exit is noticed, not waited out
    with pytest.raises(ProviderError, match="cwd .* is not a directory"):
        provider.spawn(host, SLEEPER, cwd="/nonexistent/dir")


def test_terminate_kills_processes_and_their_children(provider: LocalProvider, gm_home: Path) -> None:
    host = provider.provision(spec("local-a"), migration_id="m1")
    # A process that starts a grandchild in its group: terminate must take both.
    code = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); print(p.pid, flush=True); time.sleep(600)"
    parent = provider.spawn(host, [sys.executable, "-c", code], name="tree")
    log = Path(parent["log"])
    deadline = time.monotonic() + 30
    while not log.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(log.read_text().split()[0])
    sup = host.meta["supervisor_pid"]
    provider.terminate(host)
    assert wait_dead([parent["pid"], grandchild, sup]) == []
    assert not (gm_home / "hosts" / "local-a" / "host.json").exists()
    provider.terminate(host)  # idempotent
    with pytest.raises(NotFoundError):
        provider.spawn(host, SLEEPER)


def test_signal_stops_one_process(provider: LocalProvider) -> None:
    host = provider.provision(spec("local-a"), migration_id="m1")
    proc = provider.spawn(host, SLEEPER, name="sleeper")
    provider.signal(host, proc["pid"], signal.SIGTERM)
    assert wait_dead([proc["pid"]]) == []
    with pytest.raises(ProviderError, match="not a process of host"):
        provider.signal(host, 1)


def test_supervisor_sigkill_takes_children_and_is_reaped(provider: LocalProvider, gm_home: Path) -> None:
    host = provider.provision(spec("local-a"), migration_id="m1")
    child = provider.spawn(host, SLEEPER)["pid"]
    os.kill(host.meta["supervisor_pid"], signal.SIGKILL)
    assert wait_dead([child]) == []  # PR_SET_PDEATHSIG
    assert provider.reap_stale() == ["local-a"]
    assert provider.list_hosts() == []


PARENT = """
import json, sys, time
from gpumigrate.infra.local import LocalProvider
from gpumigrate.interfaces import HostSpec
netns = sys.argv[1] == "netns"
prov = LocalProvider(netns=netns)
pids = []
for name in ("crash-a", "crash-b"):
    host = prov.provision(HostSpec(name=name, provider="local", region="local"), migration_id="m")
    pids.append(host.meta["supervisor_pid"])
    pids.append(prov.spawn(host, [sys.executable, "-c", "import time; time.sleep(600)"])["pid"])
    pids.append(prov.spawn(host, ["sleep", "600"])["pid"])
print(json.dumps({"pids": pids, "netns": [h.meta["netns"] for h in prov.list_hosts()]}), flush=True)
time.sleep(600)
"""


def crash_parent(mode: str) -> dict:
    """Start hosts from a child Python process, SIGKILL it, and return what it had started."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        started = json.loads(parent.stdout.readline())
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(10)
    return started


def test_no_orphans_after_the_parent_is_sigkilled(gm_home: Path) -> None:
    started = crash_parent("plain")
    assert len(started["pids"]) == 6
    assert wait_dead(started["pids"]) == []
    assert sorted(p.name for p in (gm_home / "hosts").iterdir() if (p / "host.json").exists()) == ["crash-a", "crash-b"]
    assert LocalProvider().list_hosts() == []  # the next run cleans the registry
    assert not list((gm_home / "hosts").glob("*/host.json"))


def test_cli_hosts_up_list_down(cli_cmd: list[str], gm_home: Path) -> None:
    env = {**os.environ, "GPUMIGRATE_HOME": str(gm_home)}
    run = lambda *a: subprocess.run([*cli_cmd, "hosts", *a], capture_output=True, text=True, env=env, timeout=120)  # noqa: E731
    up = run("up", "--name", "cli-a", "--name", "cli-b", "--json")
    assert up.returncode == 0, up.stderr
    hosts = json.loads(up.stdout.splitlines()[-1])["hosts"]
    pids = [h["supervisor_pid"] for h in hosts]
    assert all(alive(p) for p in pids)  # detached: they outlive the command
    listed = json.loads(run("list", "--json").stdout.splitlines()[-1])["hosts"]
    assert sorted(h["name"] for h in listed) == ["cli-a", "cli-b"]
    bad = run("down")
    assert bad.returncode == 2 and "--all" in bad.stderr
    assert run("down", "cli-a").returncode == 0
    assert [h["name"] for h in json.loads(run("list", "--json").stdout.splitlines()[-1])["hosts"]] == ["cli-b"]
    assert run("down", "--all").returncode == 0
    assert wait_dead(pids) == []
    assert json.loads(run("list", "--json").stdout.splitlines()[-1])["hosts"] == []
    shaped = run("up", "--rate", "1gbit")
    assert shaped.returncode == 2 and "--netns" in shaped.stderr

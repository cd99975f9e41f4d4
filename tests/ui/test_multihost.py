"""Several hosts for real: two local hosts in their own network namespaces, each running a Prefect
worker on its own queue (flows/MULTIHOST.md); a run dispatched to host X runs on X's worker, in X.

The server listens on the orchestrator's side of the first host's link (a root-namespace address
that every namespace reaches through the root namespace), not on a wildcard address.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpumigrate.infra import netns as netns_lib

_ok, _why = netns_lib.available()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not _ok, reason=f"network namespaces unavailable: {_why}")]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
HOSTS = ("mh-a", "mh-b")


def _deployments_file(path: Path) -> Path:
    """A prefect.yaml with the test flow deployed once per host, on the host's own queue."""
    doc = {
        "name": "gpumigrate-multihost-test",
        "pull": [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}],
        "deployments": [
            {
                "name": f"on-{host}",
                "entrypoint": str((HERE / "hostflow.py").relative_to(REPO)) + ":where_am_i",
                "work_pool": {"name": "gpumigrate", "work_queue_name": f"host-{host}"},
            }
            for host in HOSTS
        ],
    }
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def cluster(server_kit: Any) -> Iterator[tuple[Any, dict[str, Any], Any]]:
    from gpumigrate.infra.local import LocalProvider
    from gpumigrate.interfaces import HostSpec

    root = Path(tempfile.mkdtemp(prefix="gm-mh-"))
    old_home = os.environ.get("GPUMIGRATE_HOME")
    os.environ["GPUMIGRATE_HOME"] = str(root / "gmhome")
    provider = LocalProvider(netns=True)
    server = None
    try:
        hosts = {n: provider.wait_ready(provider.provision(HostSpec(n, "local", n), migration_id="mh")) for n in HOSTS}
        # The root side of the first host's veth (10.213.i.1; infra/LOCAL.md): reachable from both namespaces.
        orchestrator_side = hosts[HOSTS[0]].address.rsplit(".", 1)[0] + ".1"
        server = server_kit.start(root, host=orchestrator_side, logs=server_kit.artifacts / "logs-multihost")
        server.prefect("deploy", "--all", "--prefect-file", str(_deployments_file(root / "prefect.yaml")))
        for name, host in hosts.items():
            env = server.env(PREFECT_WORKER_QUERY_SECONDS="1")
            argv = [str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", "gpumigrate"]
            provider.spawn(host, argv + ["--work-queue", f"host-{name}"], env=env, name=f"worker-{name}")
        yield server, hosts, provider
    finally:
        if server is not None:
            server_kit.stop(server)
        for h in provider.list_hosts():
            provider.terminate(h)
        if old_home is None:
            os.environ.pop("GPUMIGRATE_HOME", None)
        else:
            os.environ["GPUMIGRATE_HOME"] = old_home
        shutil.rmtree(root, ignore_errors=True)


def test_a_run_dispatched_to_a_host_runs_on_that_hosts_worker(cluster: tuple[Any, dict[str, Any], Any]) -> None:
    server, hosts, _ = cluster
    runs = {name: server.run_deployment(f"where-am-i/on-{name}", {"tag": f"t-{name}"}) for name in HOSTS}
    seen: dict[str, dict[str, Any]] = {}
    for name, run_id in runs.items():
        run = server.wait_final(run_id, timeout_s=240)
        assert run["state"]["type"] == "COMPLETED", run["state"]
        assert run["work_queue_name"] == f"host-{name}"
        artifact = server.artifact(f"where-t-{name}")
        assert artifact is not None, f"the run on {name} left no answer"
        seen[name] = json.loads(artifact["data"])
    for name, facts in seen.items():
        host = hosts[name]
        ns = host.meta["netns"]
        # The run's process was in the host's own network namespace, and its packets leave from its address.
        assert facts["netns_inode"] == os.stat(f"/run/netns/{ns}").st_ino, (name, facts)
        assert facts["address"] == host.address
        assert facts["host"] == name
    assert seen[HOSTS[0]]["netns_inode"] != seen[HOSTS[1]]["netns_inode"]
    assert os.stat("/proc/self/ns/net").st_ino not in {f["netns_inode"] for f in seen.values()}

"""Who can steer the front door (traffic/access_control.py), tried as an outsider would: another user of the host at
Envoy's admin interface and at the control plane, an anonymous ADS stream, a stream that claims the real
Envoy's node id and rejects every push. A real Envoy and a real control plane each time."""

from __future__ import annotations

import json
import os
import queue
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpumigrate.traffic import access_control
from gpumigrate.traffic.state import split
from gpumigrate.traffic.xds import ControlPlane

NOBODY = 65534
PROBE = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
    s.sendall(b"POST /quitquitquit HTTP/1.0\\r\\n\\r\\n")
    print("reached:", s.recv(200))
except OSError as exc:
    print("refused:", type(exc).__name__)
"""


def _as_nobody(*argv: str) -> str:
    """Run ``argv`` as user nobody (another user of this host, no groups): its output."""
    if os.getuid() != 0:
        pytest.skip("switching to another user (setpriv) needs root here")
    cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout


def _tcp_listening_ports(pid: int) -> set[int]:
    """TCP ports process ``pid`` listens on, from its socket fds and /proc/net/tcp{,6}."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}") if os.path.islink(f"/proc/{pid}/fd/{fd}") else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_envoy_admin_is_a_socket_only_its_owner_reaches_and_no_tcp_port(light_env: Any) -> None:
    env = light_env
    envoy = env.envoy
    assert envoy.admin_url == f"unix:{envoy.admin_socket}"
    sock = envoy.admin_socket
    assert stat.S_ISSOCK(os.lstat(sock).st_mode) and _mode(sock) == 0o600
    assert _mode(sock.parent) == 0o700 and os.lstat(sock.parent).st_uid == os.getuid()
    # Nothing of Envoy listens on TCP but the client and probe listeners: no admin port, no xDS port.
    assert envoy.proc is not None
    assert _tcp_listening_ports(envoy.proc.pid) == {envoy.listen_port, envoy.probe_port}
    assert env.plane is not None and env.plane.port is None
    # Another user of the host reaches neither the admin socket nor the control plane's.
    for path in (sock, env.plane.socket_path):
        out = _as_nobody("/usr/bin/python3", "-c", PROBE, str(path))
        assert out.startswith("refused: PermissionError"), out
    assert envoy.admin.live()  # Envoy still serves: no /quitquitquit got through
    # Its owner does, for what the CLI and the ramp read.
    assert envoy.admin.live_weights() == {"source": 10000}
    # The door's files: its owner's only.
    for path in (
        env.state_dir / "desired.json",
        env.state_dir / access_control.XDS_KEY,
        envoy.workdir / f"envoy-{envoy.node_id}.json",
        envoy.log_path,
        *(env.state_dir / "status").glob("*.json"),
    ):
        assert _mode(path) == 0o600, path
    assert _mode(env.state_dir) == 0o700 and _mode(envoy.workdir) == 0o700


class _Stream:
    """An ADS stream of our own making (what an outsider would write with the public protos)."""

    def __init__(self, target: str, *, token: str | None) -> None:
        from envoy.service.discovery.v3 import ads_pb2_grpc

        self.channel = grpc.insecure_channel(target)
        self.requests: queue.Queue[Any] = queue.Queue()
        self.responses: list[Any] = []
        self.error: grpc.RpcError | None = None
        self.done = threading.Event()
        stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self.channel)
        metadata = [(access_control.TOKEN_HEADER, token)] if token is not None else []
        self._call = stub.StreamAggregatedResources(iter(self.requests.get, None), metadata=metadata)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for response in self._call:
                self.responses.append(response)
                self.nack(response)  # an impostor rejects every push
        except grpc.RpcError as exc:
            self.error = exc
        self.done.set()

    def send(self, node: str, type_url: str, **kw: Any) -> None:
        from envoy.service.discovery.v3 import discovery_pb2

        req = discovery_pb2.DiscoveryRequest(type_url=type_url, **kw)
        req.node.id = node
        self.requests.put(req)

    def subscribe(self, node: str) -> None:
        from gpumigrate.traffic import resources as res

        self.send(node, res.CLUSTER_TYPE)
        self.send(node, res.ROUTE_TYPE, resource_names=[res.ROUTE_NAME, res.PROBE_ROUTE_NAME])

    def nack(self, response: Any) -> None:
        from google.rpc import status_pb2

        self.send(
            self.node_for_nack,
            response.type_url,
            response_nonce=response.nonce,
            error_detail=status_pb2.Status(code=3, message="impostor rejects everything"),
        )

    node_for_nack = ""

    def close(self) -> None:
        self.requests.put(None)
        self._call.cancel()
        self.channel.close()


@pytest.fixture
def streams() -> Iterator[list[_Stream]]:
    made: list[_Stream] = []
    yield made
    for s in made:
        s.close()


def test_an_anonymous_or_impostor_stream_is_refused_and_set_weight_holds(light_env: Any, streams: list[Any]) -> None:
    env = light_env
    plane = env.plane
    node = env.envoy.node_id
    targets = [f"unix:{plane.socket_path}"]  # this user may connect; what it says is still checked
    attempts: list[tuple[str, str | None, str]] = [
        ("anonymous", None, ""),
        ("anonymous, the real node id", None, node),
        ("a token of another node, the real node id", access_control.node_token(env.state_dir, "other-node"), node),
        ("a made-up token, the real node id", "0" * 64, node),
    ]
    for target in targets:
        for what, token, claimed in attempts:
            s = _Stream(target, token=token)
            streams.append(s)
            s.node_for_nack = claimed
            s.subscribe(claimed)
            assert s.done.wait(30), f"{what}: the stream was not ended"
            assert s.error is not None and s.error.code() == grpc.StatusCode.UNAUTHENTICATED, what
            assert s.responses == [], f"{what}: it saw {len(s.responses)} responses"  # no cluster, no route
    assert plane.refused == len(attempts)
    # A stream that proved one node and then claims the real one, rejecting every push, changes nothing either.
    proven = _Stream(targets[0], token=access_control.node_token(env.state_dir, "aux-node"))
    streams.append(proven)
    proven.subscribe("aux-node")
    proven.node_for_nack = node
    # Meanwhile the weights move, and the real Envoy applies each one: set-weight never fails.
    for weight in (10, 0, 50):
        state = env.store.set_weights(split("source", "target", weight))
        env.store.wait_applied(state.version, [node], timeout_s=30)
    statuses = env.store.statuses()
    assert statuses[node]["nack"] is None and statuses[node]["connected"] is True
    assert statuses["aux-node"]["nack"] is not None  # the impostor's rejections are on its own node only
    assert env.envoy.admin.live_weights() == {"source": 5000, "target": 5000}
    assert "target" in json.dumps(env.envoy.admin.config_dump())  # the real Envoy has the clusters


def test_a_control_plane_on_a_tcp_port_refuses_anonymous_streams(tmp_path: Path, streams: list[Any]) -> None:
    from gpumigrate.traffic.state import DesiredState, StateStore, Upstream

    state_dir = tmp_path / "xds"
    StateStore(state_dir).init(
        DesiredState(upstreams={"source": Upstream("source", "127.0.0.1", 1)}, weights={"source": 100.0})
    )
    with ControlPlane(state_dir, port=0) as plane:
        assert plane.port
        s = _Stream(f"127.0.0.1:{plane.port}", token=None)
        streams.append(s)
        s.subscribe("gpumigrate-envoy")
        assert s.done.wait(30)
        assert s.error is not None and s.error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert s.responses == []
        deadline = time.monotonic() + 10
        while plane.refused < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert plane.refused == 1

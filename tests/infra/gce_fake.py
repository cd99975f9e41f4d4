"""A loopback HTTP server that answers the Compute Engine REST calls the GCP provider makes.

No GCE emulator exists, so tests run google-cloud-compute's real REST transport against this.
It keeps state (machine types, accelerators, regional quotas, instances, firewall rules,
operations, Secret Manager secrets) that tests set up and inspect afterwards, counts GPU quota
usage like GCE does, and logs every request (including the Authorization header, so a test can
see which credentials travelled). Hooks let a harness "boot" inserted instances
(tests/infra/cloud_harness.py): ``on_insert`` runs after an insert is accepted and may override
the instance's addresses, ``on_delete`` after a delete, ``console`` answers the serial port.
"""

from __future__ import annotations

import base64
import itertools
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

PREFIX = r"^/compute/v1/projects/(?P<project>[^/]+)"


@dataclass
class GceState:
    machine_types: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # zone -> name -> body
    accelerators: dict[str, dict[str, int]] = field(default_factory=dict)  # zone -> type -> max cards
    quotas: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # region -> metric -> [limit, usage]
    instances: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (zone, name) -> body
    operations: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    insert_error: str | None = None  # e.g. ZONE_RESOURCE_POOL_EXHAUSTED: the insert operation fails with it
    insert_http_error: tuple[int, str, str] | None = None  # (status, reason, message): the insert call itself fails
    gets_until_running: int = 1  # GETs of a new instance before it reports RUNNING
    exhausted_zones: set[str] = field(default_factory=set)  # inserts there fail with ZONE_RESOURCE_POOL_EXHAUSTED
    firewalls: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> body
    # "projects/P/secrets/S" -> {"replication": {...}, "data": bytes}
    secrets: dict[str, dict[str, Any]] = field(default_factory=dict)
    on_insert: Callable[[str, str, dict[str, Any]], dict[str, str] | None] | None = None
    on_delete: Callable[[str, str], None] | None = None
    console: Callable[[str, str], str] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def inserts(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["method"] == "POST" and r["path"].endswith("/instances")]


def default_state() -> GceState:
    a100 = {"guestAcceleratorType": "nvidia-tesla-a100", "guestAcceleratorCount": 1}
    s = GceState()
    for zone in ("europe-west4-a", "us-central1-a"):
        s.machine_types[zone] = {
            "a2-highgpu-1g": {"name": "a2-highgpu-1g", "guestCpus": 12, "memoryMb": 87040, "accelerators": [a100]},
            "n1-standard-8": {"name": "n1-standard-8", "guestCpus": 8, "memoryMb": 30720},
        }
        s.accelerators[zone] = {"nvidia-tesla-a100": 16, "nvidia-tesla-t4": 4}
    s.machine_types["europe-west4-a"]["a3-highgpu-8g"] = {
        "name": "a3-highgpu-8g",
        "guestCpus": 208,
        "accelerators": [{"guestAcceleratorType": "nvidia-h100-80gb", "guestAcceleratorCount": 8}],
    }
    for region in ("europe-west4", "us-central1"):
        s.quotas[region] = {"NVIDIA_A100_GPUS": [8, 0], "NVIDIA_T4_GPUS": [4, 0], "CPUS": [500, 0]}
    return s


def _gpu_metric(acc_type: str) -> str | None:
    return {
        "nvidia-tesla-a100": "NVIDIA_A100_GPUS",
        "nvidia-tesla-t4": "NVIDIA_T4_GPUS",
        "nvidia-h100-80gb": "NVIDIA_H100_GPUS",
    }.get(acc_type)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: Any) -> None:  # quiet: pytest shows failures, not access logs
        pass

    def _send(self, code: int, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _error(self, code: int, message: str, reason: str = "notFound") -> None:
        self._send(
            code, {"error": {"code": code, "message": message, "errors": [{"message": message, "reason": reason}]}}
        )

    def _handle(self, method: str) -> None:
        url = urlparse(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}") if length else {}
        st = self.server.state
        query = parse_qs(url.query)
        with st.lock:
            st.requests.append(
                {
                    "method": method,
                    "path": url.path,
                    "query": query,
                    "body": body,
                    "authorization": self.headers.get("Authorization"),
                }
            )
            code, out = self.server.route(method, url.path, body, query)
        after = out.pop("_after", None)
        if after is not None:  # harness hooks run outside the lock, before the caller hears back
            after()
        if code >= 400:
            self._error(code, out["message"], out.get("reason", "notFound"))
        else:
            self._send(code, out)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_DELETE(self) -> None:
        self._handle("DELETE")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, state: GceState) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.state = state
        self._ids = itertools.count(1)

    def _op(self, zone: str | None, kind: str, target: str, error: str | None = None) -> dict[str, Any]:
        name = f"operation-{next(self._ids)}"
        op = {
            "name": name,
            **({"zone": zone} if zone else {}),
            "operationType": kind,
            "targetLink": target,
            "status": "RUNNING",
            "kind": "compute#operation",
        }
        final = {**op, "status": "DONE", "progress": 100}
        if error:
            final["error"] = {
                "errors": [{"code": error, "message": f"The zone does not have enough resources ({error})"}]
            }
        self.state.operations[name] = final
        return op  # RUNNING: the client must wait for it

    def route(
        self, method: str, path: str, body: dict[str, Any], query: dict[str, list[str]] | None = None
    ) -> tuple[int, dict[str, Any]]:
        st = self.state
        query = query or {}
        extra = self._route_more(method, path, body, query)
        if extra is not None:
            return extra
        m = re.match(PREFIX + r"/regions/(?P<region>[^/]+)$", path)
        if m and method == "GET":
            q = st.quotas.get(m["region"])
            if q is None:
                return 404, {"message": f"region {m['region']} not found"}
            return 200, {
                "name": m["region"],
                "status": "UP",
                "quotas": [{"metric": k, "limit": v[0], "usage": v[1]} for k, v in q.items()],
            }
        m = re.match(PREFIX + r"/zones/(?P<zone>[^/]+)/machineTypes/(?P<name>[^/]+)$", path)
        if m and method == "GET":
            mt = st.machine_types.get(m["zone"], {}).get(m["name"])
            return (200, mt) if mt else (404, {"message": f"machine type {m['name']} not found"})
        m = re.match(PREFIX + r"/zones/(?P<zone>[^/]+)/acceleratorTypes$", path)
        if m and method == "GET":
            items = [{"name": k, "maximumCardsPerInstance": v} for k, v in st.accelerators.get(m["zone"], {}).items()]
            return 200, {"items": items}
        m = re.match(PREFIX + r"/zones/(?P<zone>[^/]+)/operations/(?P<op>[^/]+)(/wait)?$", path)
        if m:
            op = st.operations.get(m["op"])
            return (200, op) if op else (404, {"message": f"operation {m['op']} not found"})
        m = re.match(PREFIX + r"/zones/(?P<zone>[^/]+)/instances$", path)
        if m and method == "POST":
            return self._insert(m["zone"], body)
        m = re.match(PREFIX + r"/zones/(?P<zone>[^/]+)/instances/(?P<name>[^/]+)$", path)
        if m:
            key = (m["zone"], m["name"])
            inst = st.instances.get(key)
            if inst is None:
                return 404, {"message": f"The resource 'instances/{m['name']}' was not found"}
            if method == "GET":
                inst["_gets"] = inst.get("_gets", 0) + 1
                if inst["_gets"] > st.gets_until_running:
                    inst["status"] = "RUNNING"
                return 200, {k: v for k, v in inst.items() if not k.startswith("_")}
            if method == "DELETE":
                del st.instances[key]
                self._count_gpus(m["zone"], inst, -1)
                op = self._op(m["zone"], "delete", m["name"])
                if st.on_delete is not None:
                    hook, zone, name = st.on_delete, m["zone"], m["name"]
                    op["_after"] = lambda: hook(zone, name)
                return 200, op
        return 404, {"message": f"fake GCE does not serve {method} {path}"}

    def _route_more(
        self, method: str, path: str, body: dict[str, Any], query: dict[str, list[str]]
    ) -> tuple[int, dict[str, Any]] | None:
        """Aggregated listing, serial port, firewall rules, global operations, Secret Manager."""
        st = self.state
        if re.match(PREFIX + r"/aggregated/instances$", path) and method == "GET":
            wanted = re.findall(r'name = "([^"]+)"', (query.get("filter") or [""])[0])
            items: dict[str, dict[str, Any]] = {}
            for (zone, name), inst in st.instances.items():
                if not wanted or name in wanted:
                    listed = {k: v for k, v in inst.items() if not k.startswith("_")}
                    items.setdefault(f"zones/{zone}", {"instances": []})["instances"].append(listed)
            return 200, {"items": items}
        m = re.match(PREFIX + r"/zones/(?P<zone>[^/]+)/instances/(?P<name>[^/]+)/serialPort$", path)
        if m and method == "GET":
            if (m["zone"], m["name"]) not in st.instances:
                return 404, {"message": f"The resource 'instances/{m['name']}' was not found"}
            text = st.console(m["zone"], m["name"]) if st.console else ""
            return 200, {"contents": text, "start": "0", "next": str(len(text)), "kind": "compute#serialPortOutput"}
        m = re.match(PREFIX + r"/global/operations/(?P<op>[^/]+)(/wait)?$", path)
        if m:
            op = st.operations.get(m["op"])
            return (200, op) if op else (404, {"message": f"operation {m['op']} not found"})
        if re.match(PREFIX + r"/global/firewalls$", path) and method == "POST":
            if body["name"] in st.firewalls:
                return 409, {
                    "message": f"The resource 'firewalls/{body['name']}' already exists",
                    "reason": "alreadyExists",
                }
            st.firewalls[body["name"]] = body
            return 200, self._op(None, "insert", body["name"])
        m = re.match(PREFIX + r"/global/firewalls/(?P<name>[^/]+)$", path)
        if m:
            if m["name"] not in st.firewalls:
                return 404, {"message": f"The resource 'firewalls/{m['name']}' was not found"}
            if method == "GET":
                return 200, st.firewalls[m["name"]]
            if method == "DELETE":
                del st.firewalls[m["name"]]
                return 200, self._op(None, "delete", m["name"])
        m = re.match(r"^/v1/(?P<secret>projects/[^/]+/secrets/[^/:]+)(?P<access>/versions/latest:access)?$", path)
        if m and method == "GET":
            secret = st.secrets.get(m["secret"])
            if secret is None:
                return 404, {"message": f"Secret [{m['secret']}] not found or has no versions."}
            if m["access"]:
                return 200, {
                    "name": f"{m['secret']}/versions/1",
                    "payload": {"data": base64.b64encode(secret["data"]).decode()},
                }
            return 200, {"name": m["secret"], "replication": secret.get("replication", {"automatic": {}})}
        return None

    def _gpus(self, zone: str, inst: dict[str, Any]) -> list[tuple[str, int]]:
        mt_name = inst["machineType"].rsplit("/", 1)[-1]
        mt = self.state.machine_types.get(zone, {}).get(mt_name, {})
        accs = [(a["guestAcceleratorType"], a["guestAcceleratorCount"]) for a in mt.get("accelerators", [])]
        accs += [
            (a["acceleratorType"].rsplit("/", 1)[-1], a["acceleratorCount"]) for a in inst.get("guestAccelerators", [])
        ]
        return accs

    def _count_gpus(self, zone: str, inst: dict[str, Any], sign: int) -> None:
        region = zone.rsplit("-", 1)[0]
        for acc, n in self._gpus(zone, inst):
            metric = _gpu_metric(acc)
            if metric and metric in self.state.quotas.get(region, {}):
                self.state.quotas[region][metric][1] += sign * n

    def _insert(self, zone: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        st = self.state
        name = body.get("name", "")
        if (zone, name) in st.instances:
            return 409, {"message": f"The resource 'instances/{name}' already exists", "reason": "alreadyExists"}
        if st.insert_http_error:
            status, reason, message = st.insert_http_error
            return status, {"message": message, "reason": reason}
        if st.insert_error:
            return 200, self._op(zone, "insert", name, error=st.insert_error)
        if zone in st.exhausted_zones:
            return 200, self._op(zone, "insert", name, error="ZONE_RESOURCE_POOL_EXHAUSTED")
        nic = {**(body.get("networkInterfaces") or [{}])[0], "networkIP": f"10.164.0.{len(st.instances) + 2}"}
        for access in nic.get("accessConfigs", []):
            access["natIP"] = f"34.90.0.{len(st.instances) + 2}"
        inst = {**body, "status": "PROVISIONING", "zone": zone, "networkInterfaces": [nic]}
        st.instances[(zone, name)] = inst
        self._count_gpus(zone, inst, +1)
        op = self._op(zone, "insert", name)
        if st.on_insert is not None:
            hook = st.on_insert

            def boot() -> None:  # the harness boots it and tells where it is reachable
                addresses = hook(zone, name, body) or {}
                with st.lock:
                    if "networkIP" in addresses:
                        nic["networkIP"] = addresses["networkIP"]
                    for access in nic.get("accessConfigs", []):
                        access["natIP"] = addresses.get("natIP", access["natIP"])

            op["_after"] = boot
        return 200, op


class FakeGce:
    """Start/stop wrapper: ``endpoint`` is the api_endpoint to give the provider."""

    def __init__(self, state: GceState | None = None) -> None:
        self.state = state or default_state()
        self._server = _Server(self.state)
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-gce", daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeGce:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

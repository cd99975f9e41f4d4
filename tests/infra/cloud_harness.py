"""A cloud that boots its instances, for CI: moto's EC2 (ThreadedMotoServer on loopback) and the
loopback Compute Engine fake run each new instance's user data / startup script in a fresh local
network-namespace host (``LocalProvider(netns=True)``, infra/LOCAL.md).

The providers under test make their real boto3 and google-cloud-compute calls; this harness only
extends the two fakes with what a cloud does after an accepted launch:

* the instance gets the namespace's address as its private (and public) IP, so the orchestrator —
  this test process, in the root namespace — reaches the workload there;
* its script runs as root inside the namespace with what an instance's environment would give it:
  the cloud's API endpoint (a relay on the namespace's link to the loopback fake, standing in for the
  regional endpoint) and credentials (standing in for the instance profile / service account);
* its console output (EC2 ``GetConsoleOutput``, GCE ``getSerialPortOutput``) is the script's output;
* terminating the instance shuts the namespace host down;
* zones listed in ``exhausted_zones`` refuse launches with the cloud's own capacity error.

:meth:`CloudHarness.leftovers` says what is still running (instances in moto or the fake, booted
hosts, local hosts); the ``cloud`` fixture fails a test that leaves anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from gpumigrate.infra.local import LocalProvider
from gpumigrate.infra.netns import available as netns_available
from gpumigrate.interfaces import Host, HostSpec

# Credentials the booted machine gets: stand-ins for what the instance profile would hand out.
INSTANCE_AWS_KEY_ID = "AKIAINSTANCEPROFILE01"
INSTANCE_AWS_SECRET = "instance-profile-secret-not-a-real-one"


class Relay:
    """TCP relay: listens on ``listen_ip`` (a namespace link's root-side address) and forwards each
    connection to ``target`` on loopback, so a process in the namespace reaches a loopback fake."""

    def __init__(self, listen_ip: str, target: tuple[str, int]) -> None:
        self.target = target
        self._server = socket.create_server((listen_ip, 0))
        self.address = f"{listen_ip}:{self._server.getsockname()[1]}"
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"relay-{self.address}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._closed.set()
        self._server.close()


@dataclass
class Booted:
    key: str
    host: Host
    log: Path
    relays: list[Relay] = field(default_factory=list)


class CloudHarness:
    """Boots instances as network-namespace hosts; shared by the EC2 and GCE patches below."""

    def __init__(self) -> None:
        ok, why = netns_available()
        if not ok:
            pytest.skip(f"the cloud harness needs network namespaces: {why}")
        self.local = LocalProvider(netns=True)
        self.booted: dict[str, Booted] = {}
        self.exhausted_zones: set[str] = set()  # launches there are refused for want of capacity
        # More loopback services a machine reaches, by the environment variable that names them (a
        # storage endpoint, say): each gets its own relay on the machine's link, as the cloud API does.
        self.relayed: dict[str, str] = {}
        self.lock = threading.Lock()

    def boot(self, key: str, script: str, *, endpoint: str, env: Callable[[str], dict[str, str]]) -> str:
        """Run ``script`` as root in a new namespace host; return the host's address. ``endpoint`` is the
        loopback URL of the cloud API the machine may call; ``env(url)`` the environment the machine gets,
        given where that API is reachable from inside the namespace (a relay)."""
        name = "vm-" + hashlib.sha256(key.encode()).hexdigest()[:12]
        host = self.local.provision(HostSpec(name=name, provider="local", region="local"))
        link_ip = host.address.rsplit(".", 1)[0] + ".1"  # the root-side end of the host's veth (LOCAL.md)
        parts = urlsplit(endpoint)
        relays = [Relay(link_ip, (str(parts.hostname), int(parts.port or 80)))]
        extra: dict[str, str] = {}
        for name_env, url in self.relayed.items():
            where = urlsplit(url)
            relays.append(Relay(link_ip, (str(where.hostname), int(where.port or 80))))
            extra[name_env] = f"http://{relays[-1].address}"
        workdir = Path(str(host.workdir))
        user_data = workdir / "user-data"
        user_data.write_text(script)
        user_data.chmod(0o700)
        boot_env = {**env(f"http://{relays[0].address}"), **extra, "GPUMIGRATE_BOOT_DIR": str(workdir / "boot")}
        started = self.local.spawn(host, ["/bin/sh", str(user_data)], env=boot_env, name="user-data")
        with self.lock:
            self.booted[key] = Booted(key, host, Path(started["log"]), relays)
        return host.address

    def console(self, key: str) -> str | None:
        with self.lock:
            booted = self.booted.get(key)
        if booted is None:
            return None
        try:
            return booted.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def shutdown(self, key: str) -> None:
        with self.lock:
            booted = self.booted.pop(key, None)
        if booted is None:
            return
        for relay in booted.relays:
            relay.close()
        self.local.terminate(booted.host)

    def close(self) -> None:
        for key in list(self.booted):
            self.shutdown(key)


# ----------------------------------------------------------------------------- moto's EC2
def _instance_env(url: str) -> dict[str, str]:
    """What an EC2 instance's environment gives the boot script: the regional endpoint and the
    instance profile's credentials (here: the relay to moto, and stand-in keys)."""
    return {
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": INSTANCE_AWS_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": INSTANCE_AWS_SECRET,
    }


class Ec2Boot:
    """Patches moto's EC2 backend (in this process) so launches boot, terminations shut down, and the
    console output is the script's."""

    def __init__(self, harness: CloudHarness, moto_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
        from moto.core.responses import ActionResult
        from moto.core.utils import utcnow
        from moto.ec2.exceptions import EC2ClientError
        from moto.ec2.models.instances import InstanceBackend
        from moto.ec2.responses.general import General
        from moto.ec2.utils import Base64EncodedString

        self.harness = harness
        self.instances: list[Any] = []  # every moto instance launched while patched
        self.zones_asked: list[str] = []  # the zone of every RunInstances, accepted or refused, in order
        run_original = InstanceBackend.run_instances
        terminate_original = InstanceBackend.terminate_instances
        console_original = General.get_console_output
        boot = self

        def run_instances(backend: Any, image_id: str, count: int, user_data: Any, groups: Any, **kw: Any) -> Any:
            zone = boot._zone(backend, kw)
            boot.zones_asked.append(zone)
            if zone in harness.exhausted_zones:
                raise EC2ClientError(
                    "InsufficientInstanceCapacity",
                    f"We currently do not have sufficient {kw.get('instance_type')} capacity in the "
                    f"Availability Zone you requested ({zone}).",
                )
            reservation = run_original(backend, image_id, count, user_data, groups, **kw)
            for inst in reservation.instances:
                boot.instances.append(inst)
                if inst.user_data:
                    script = inst.user_data.decode() if hasattr(inst.user_data, "decode") else str(inst.user_data)
                    address = harness.boot(inst.id, script, endpoint=moto_url, env=_instance_env)
                    nic = inst.nics[0]
                    nic.private_ip_address = address
                    nic.private_ip_addresses = [{"Primary": True, "PrivateIpAddress": address}]
                    if nic.public_ip:
                        nic.public_ip = address
            return reservation

        def terminate_instances(backend: Any, instance_ids: list[str]) -> Any:
            result = terminate_original(backend, instance_ids)
            for inst, _ in result:
                harness.shutdown(inst.id)
            return result

        def get_console_output(response: Any) -> Any:
            instance_id = response._get_param("InstanceId")
            text = harness.console(instance_id)
            if text is None:
                return console_original(response)
            response.ec2_backend.get_instance(instance_id)
            out = {
                "InstanceId": instance_id,
                "Timestamp": utcnow(),
                "Output": Base64EncodedString.from_raw_string(text),
            }
            return ActionResult(out)

        monkeypatch.setattr(InstanceBackend, "run_instances", run_instances)
        monkeypatch.setattr(InstanceBackend, "terminate_instances", terminate_instances)
        monkeypatch.setattr(General, "get_console_output", get_console_output)

    @staticmethod
    def _zone(backend: Any, kw: dict[str, Any]) -> str:
        subnet_id = kw.get("subnet_id") or next(
            (n.get("SubnetId") for n in kw.get("nics") or [] if n.get("SubnetId")), None
        )
        if subnet_id:
            return str(backend.get_subnet(subnet_id).availability_zone)
        return str(kw.get("placement") or backend.region_name + "a")

    def running(self) -> list[str]:
        return [i.id for i in self.instances if i.state not in ("terminated", "shutting-down")]


# ----------------------------------------------------------------------------- the Compute Engine fake
class GceBoot:
    """Hooks on the fake Compute Engine: inserts boot, deletes shut down, the serial port is the script's."""

    def __init__(self, harness: CloudHarness, gce: Any) -> None:
        self.harness, self.gce = harness, gce
        st = gce.state

        def on_insert(zone: str, name: str, body: dict[str, Any]) -> dict[str, str] | None:
            items = {i["key"]: i.get("value", "") for i in (body.get("metadata") or {}).get("items", [])}
            script = items.get("startup-script")
            if not script:
                return None

            def env(url: str) -> dict[str, str]:  # the service account's Secret Manager, via the relay
                return {"GPUMIGRATE_SECRETMANAGER_ENDPOINT": url}

            address = harness.boot(f"{zone}/{name}", script, endpoint=gce.endpoint, env=env)
            return {"networkIP": address, "natIP": address}

        st.on_insert = on_insert
        st.on_delete = lambda zone, name: harness.shutdown(f"{zone}/{name}")
        st.console = lambda zone, name: harness.console(f"{zone}/{name}") or ""
        st.exhausted_zones = harness.exhausted_zones  # one set: tests exhaust zones on the harness

    @property
    def zones_asked(self) -> list[str]:
        """The zone of every insert, accepted or refused, in order."""
        return [r["path"].split("/zones/", 1)[1].split("/", 1)[0] for r in self.gce.state.inserts()]

    def running(self) -> list[str]:
        return [f"{zone}/{name}" for zone, name in self.gce.state.instances]


# ----------------------------------------------------------------------------- fixtures
@dataclass
class Cloud:
    harness: CloudHarness
    ec2: Ec2Boot | None = None
    gce: GceBoot | None = None

    def leftovers(self) -> list[str]:
        left = [f"moto instance {i}" for i in (self.ec2.running() if self.ec2 else [])]
        left += [f"fake GCE instance {i}" for i in (self.gce.running() if self.gce else [])]
        left += [f"booted host {k}" for k in self.harness.booted]
        left += [f"local host {h.name}" for h in self.harness.local.list_hosts()]
        return left


def booting_cloud(moto_url: str, gce: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cloud]:
    """moto's EC2 and the fake GCE, both booting their instances; fails if anything is left running
    (the body of the ``cloud`` fixture, for test modules outside this folder)."""
    harness = CloudHarness()
    state = Cloud(harness, Ec2Boot(harness, moto_url, monkeypatch), GceBoot(harness, gce))
    try:
        yield state
        left = state.leftovers()
    finally:
        harness.close()
    assert not left, f"left running after the test: {left}"


@pytest.fixture
def cloud(moto_url: str, aws_env: str, gce: Any, gm_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cloud]:
    """moto's EC2 and the fake GCE, both booting their instances; the test fails if anything is left running."""
    yield from booting_cloud(moto_url, gce, monkeypatch)


# ----------------------------------------------------------------------------- what a target account holds
CONTROL_SECRET = "gpumigrate/control-key"
IMAGE_SECRET = "gpumigrate/image-key"
INSTANCE_PROFILE = "gpumigrate-target"


@dataclass(frozen=True)
class Keys:
    control: str  # hex, as the secret holds it
    image: str


def seed_aws(moto_url: str, region: str, keys: Keys, *, secret_region: str | None = None) -> None:
    """The secrets (in ``secret_region``, default the target's) and the instance profile a plan names."""
    import boto3

    sm = boto3.client("secretsmanager", region_name=secret_region or region, endpoint_url=moto_url)
    for name, value in ((CONTROL_SECRET, keys.control), (IMAGE_SECRET, keys.image)):
        try:
            sm.create_secret(Name=name, SecretString=value)
        except sm.exceptions.ResourceExistsException:  # moto outlives a test: this test's keys are current
            sm.put_secret_value(SecretId=name, SecretString=value)
    iam = boto3.client("iam", region_name=region, endpoint_url=moto_url)
    with contextlib.suppress(iam.exceptions.EntityAlreadyExistsException):
        iam.create_role(RoleName=INSTANCE_PROFILE, AssumeRolePolicyDocument="{}")
        iam.create_instance_profile(InstanceProfileName=INSTANCE_PROFILE)
        iam.add_role_to_instance_profile(InstanceProfileName=INSTANCE_PROFILE, RoleName=INSTANCE_PROFILE)


def seed_gcp(gce: Any, project: str, keys: Keys, *, locations: tuple[str, ...] = ("europe-west4",)) -> None:
    """The two secrets in the fake's Secret Manager, replicated in ``locations`` (empty: automatic)."""
    replication: dict[str, Any] = (
        {"userManaged": {"replicas": [{"location": loc} for loc in locations]}} if locations else {"automatic": {}}
    )
    for name, value in (("gpumigrate-control-key", keys.control), ("gpumigrate-image-key", keys.image)):
        gce.state.secrets[f"projects/{project}/secrets/{name}"] = {"replication": replication, "data": value.encode()}


# ----------------------------------------------------------------------------- GCS that creates buckets
def _gcs_fake_class() -> Any:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "transfer"))
    from transfer_fake_gcs import FakeGcs

    return FakeGcs


class BucketGcs(_gcs_fake_class()):  # type: ignore[misc]
    """The transfer tests' GCS fake, plus bucket insert (``POST /storage/v1/b``) as GCS answers it."""

    def _post(self, h: Any) -> None:
        if urlsplit(h.path).path != "/storage/v1/b":
            return super()._post(h)
        body = json.loads(h.rfile.read(int(h.headers.get("Content-Length", "0"))) or b"{}")
        name, location = body["name"], str(body.get("location") or "US").upper()
        with self.lock:
            self.requests += 1
            if name in self.locations:
                return self._json(h, 409, {"error": {"code": 409, "message": "You already own this bucket."}})
            self.locations[name] = location
            self.created[name] = body
        return self._json(h, 200, {"kind": "storage#bucket", "name": name, "id": name, "location": location})

    def __init__(self, buckets: dict[str, str]) -> None:
        self.created: dict[str, dict[str, Any]] = {}  # bucket -> the insert request's body
        super().__init__(buckets)


def bucket_gcs() -> Iterator[BucketGcs]:
    """A GCS endpoint holding one bucket in the US multi-region (``gm-us-bucket``)."""
    server = BucketGcs({"gm-us-bucket": "US"})
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def gcs() -> Iterator[BucketGcs]:
    """A GCS endpoint holding one bucket in the US multi-region (``gm-us-bucket``)."""
    yield from bucket_gcs()

"""GCP provider: instance insert with guest accelerators (``on_host_maintenance=TERMINATE``: GPU VMs
cannot live-migrate), the workload's boot and firewall rules, operation wait, delete — through
google-cloud-compute's REST transport. Capacity and quota checks are its other half
(infra/gcp_capacity.py).

Credentials come from ``google.auth.default()`` (ADC: GOOGLE_APPLICATION_CREDENTIALS, gcloud, the
metadata server) unless ``credentials`` is given; this module never reads, logs or stores a token.
``api_endpoint`` points every client elsewhere (a loopback fake in tests); a plain ``http://``
endpoint gets anonymous credentials unless ``credentials`` is given, because a bearer token must
never travel unencrypted.

Idempotency: the instance name is derived from the host name and carries the label
``gpumigrate-migration``; a retried provision finds it and inserts nothing. ``request_id`` is set
too, so GCE itself deduplicates a retried insert.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar, cast

from google.api_core import exceptions as gexc
from google.api_core.client_options import ClientOptions
from google.cloud import compute_v1

from gpumigrate.errors import GpumigrateError, InvalidInputError, ProviderError
from gpumigrate.infra import bootstrap, gcp_network, network, pricing, residency
from gpumigrate.infra.bootagent import SECRET_MANAGER, SECRET_MANAGER_ENDPOINT_ENV
from gpumigrate.infra.bootstrap import CloudTarget
from gpumigrate.infra.gcp_capacity import GceCapacity, op_error_codes, translate
from gpumigrate.interfaces import Host, HostSpec, Jurisdiction
from gpumigrate.launch import WorkloadLaunch

log = logging.getLogger(__name__)
T = TypeVar("T")

LABEL_MIGRATION = "gpumigrate-migration"
LABEL_HOST = "gpumigrate-host"
METADATA_PORTS = "gpumigrate-ports"  # service=8000,agent=7070: what a found instance listens on
DEFAULT_IMAGE = "projects/deeplearning-platform-release/global/images/family/common-cu124-ubuntu-2204-py310"


def label_value(text: str) -> str:
    """A GCE label value (lowercase letters, digits, '-', '_', at most 63) that stays unique."""
    v = re.sub(r"[^a-z0-9_-]", "-", text.lower())
    return v if len(v) <= 63 else v[:50] + "-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def instance_name(host_name: str) -> str:
    """A valid GCE instance name: [a-z]([-a-z0-9]{0,61}[a-z0-9])?"""
    v = re.sub(r"[^a-z0-9-]", "-", host_name.lower())
    if not v or not v[0].isalpha():
        v = "gm-" + v
    if len(v) > 63:
        v = v[:50] + "-" + hashlib.sha256(host_name.encode()).hexdigest()[:12]
    return v.rstrip("-") or "gm-host"


class GcpProvider(GceCapacity):
    """Compute Engine behind the :class:`gpumigrate.interfaces.Provider` interface."""

    name = "gcp"

    def __init__(
        self,
        *,
        project: str | None = None,
        api_endpoint: str | None = None,
        credentials: Any = None,
        poll_interval_s: float = 2.0,
        network: str = "global/networks/default",
        boot_disk_gb: int = 200,
        target: CloudTarget | None = None,
        secret_manager_endpoint: str | None = None,
    ) -> None:
        self.api_endpoint = api_endpoint
        if credentials is None and api_endpoint and api_endpoint.startswith("http://"):
            from google.auth.credentials import AnonymousCredentials

            credentials = AnonymousCredentials()
        if credentials is None:
            credentials, project = self._default_credentials(project)
        self._credentials = credentials
        if not project:
            raise InvalidInputError("no GCP project: set GOOGLE_CLOUD_PROJECT or pass the project option")
        self.project = project
        self.poll_interval_s = poll_interval_s
        self.network = network
        self.boot_disk_gb = boot_disk_gb
        self.target = target or CloudTarget()
        self.secret_manager_endpoint = (
            secret_manager_endpoint or os.environ.get(SECRET_MANAGER_ENDPOINT_ENV) or SECRET_MANAGER
        ).rstrip("/")
        self._clients: dict[Callable[..., Any], Any] = {}
        self.last_capacity: dict[str, Any] = {}

    @staticmethod
    def _default_credentials(project: str | None) -> tuple[Any, str | None]:
        import google.auth
        from google.auth.exceptions import DefaultCredentialsError

        try:
            creds, found = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
        except DefaultCredentialsError:
            raise ProviderError(
                "no Google credentials in the standard chain (GOOGLE_APPLICATION_CREDENTIALS, gcloud ADC, metadata server)"
            ) from None
        return creds, project or found

    def _client(self, cls: Callable[..., T]) -> T:
        """One client of each class (``compute_v1.InstancesClient``, ...), made with this provider's credentials."""
        client = self._clients.get(cls)
        if client is None:
            opts = ClientOptions(api_endpoint=self.api_endpoint) if self.api_endpoint else None
            client = self._clients[cls] = cls(credentials=self._credentials, client_options=opts)
        return cast(T, client)  # the dict holds one client per class: cls made this one

    # -- lifecycle ----------------------------------------------------------------------
    def _get(self, zone: str, name: str, region: str) -> compute_v1.Instance | None:
        client = self._client(compute_v1.InstancesClient)
        try:
            return client.get(project=self.project, zone=zone, instance=name)
        except gexc.NotFound:
            return None
        except gexc.GoogleAPICallError as exc:
            raise translate(exc, f"get instance {name}", region) from None

    def wait_operation(self, op: compute_v1.Operation, zone: str, region: str, *, timeout_s: float = 600) -> None:
        """Wait for a zonal operation with our own client (it honours the endpoint); raise its error."""
        ops = self._client(compute_v1.ZoneOperationsClient)
        deadline = time.monotonic() + timeout_s
        while op.status != compute_v1.Operation.Status.DONE:
            if time.monotonic() >= deadline:
                raise ProviderError(f"GCP operation {op.name} in {zone} not done after {timeout_s:g} s")
            op = self._call("wait operation", region, ops.wait, project=self.project, zone=zone, operation=op.name)
        errors = op_error_codes(op)
        if errors:
            text = "; ".join(f"{c}: {m}" for c, m in errors)
            raise translate(ProviderError(text), f"operation {op.operation_type or op.name}", region)

    def _find(self, name: str, region: str) -> tuple[str, compute_v1.Instance] | None:
        """(zone, instance) of the instance called ``name`` in any zone: a retried provision may have
        landed in a fallback zone."""
        client = self._client(compute_v1.InstancesClient)
        pages = self._call(
            f"find instance {name}",
            region,
            client.aggregated_list,
            request={"project": self.project, "filter": f'name = "{name}"'},
        )
        try:
            for scope, listed in pages:
                for inst in listed.instances:
                    if inst.name == name:
                        return scope.rsplit("/", 1)[-1], inst
        except gexc.GoogleAPICallError as exc:
            raise translate(exc, f"find instance {name}", region) from None
        return None

    def provision(self, spec: HostSpec, *, migration_id: str) -> Host:
        """Insert one instance for ``spec``, or return the one this migration already inserted.

        With ``spec.launch`` the instance boots the workload (``startup-script``, infra/BOOT.md),
        carries a network tag of its own and gets firewall rules that admit the agent and service
        ports only from the orchestrator and the front door (infra/network.py).
        """
        region = self._region_of(spec)
        zone, name = str(spec.zone), instance_name(spec.name)
        found = self._find(name, region)
        if found is not None:
            found_zone, inst = found
            if inst.labels.get(LABEL_MIGRATION) != label_value(migration_id):
                raise ProviderError(
                    f"instance {name} in {found_zone} exists but was not launched by migration {migration_id}"
                )
            log.info("gcp: %s already inserted for %s", name, migration_id)
            return self._host(spec.name, region, found_zone, inst)
        if not spec.instance_type:
            raise InvalidInputError("a GCP target needs target.instance_type (e.g. a2-highgpu-1g)")
        mt = self.machine_type(zone, spec.instance_type, region)
        acc_type, count, built_in = self._gpus_of(spec, mt)
        labels = {LABEL_MIGRATION: label_value(migration_id), LABEL_HOST: label_value(spec.name)}
        labels.update({label_value(k): label_value(v) for k, v in spec.tags.items()})
        instance = compute_v1.Instance(
            name=name,
            machine_type=f"zones/{zone}/machineTypes/{spec.instance_type}",
            labels=labels,
            metadata=compute_v1.Metadata(items=[compute_v1.Items(key="gpumigrate-migration-id", value=migration_id)]),
            scheduling=compute_v1.Scheduling(on_host_maintenance="TERMINATE", automatic_restart=True),
            disks=[
                compute_v1.AttachedDisk(
                    boot=True,
                    auto_delete=True,
                    initialize_params=compute_v1.AttachedDiskInitializeParams(
                        source_image=spec.image or DEFAULT_IMAGE, disk_size_gb=self.boot_disk_gb
                    ),
                )
            ],
            network_interfaces=[compute_v1.NetworkInterface(network=self.network)],
        )
        if count and not built_in:
            instance.guest_accelerators = [
                compute_v1.AcceleratorConfig(
                    accelerator_type=f"zones/{zone}/acceleratorTypes/{acc_type}", accelerator_count=count
                )
            ]
        if spec.launch is not None:
            self._add_workload(instance, spec, region)
        request_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"gpumigrate:{migration_id}/{name}/{zone}"))
        client = self._client(compute_v1.InstancesClient)
        op = self._call(
            f"insert {spec.instance_type}",
            region,
            client.insert_unary,
            request={"project": self.project, "zone": zone, "instance_resource": instance, "request_id": request_id},
        )
        self.wait_operation(op, zone, region)
        created = self._get(zone, name, region)
        if created is None:
            raise ProviderError(f"GCP reported instance {name} inserted in {zone} but it cannot be found")
        log.info("gcp: inserted %s (%s) for %s", name, spec.instance_type, migration_id)
        host = self._host(spec.name, region, zone, created)
        if spec.launch is not None:
            try:
                self._open_ports(host, name, agents=spec.launch.ranks)
            except GpumigrateError:
                self.terminate(host)
                raise
        return host

    def _add_workload(self, instance: compute_v1.Instance, spec: HostSpec, region: str) -> None:
        """Startup script, ports, network tag, service account, subnetwork and addressing for a workload host."""
        assert spec.launch is not None
        boot = self.target.require_bootstrap("GCP")
        net = self.target.network
        ports = network.ports(net, spec.launch)
        config = bootstrap.boot_config(
            name=spec.name,
            provider="gcp",
            region=region,
            project=self.project,
            launch=spec.launch,
            ports=ports,
            bootstrap=boot,
            image_key_ref=self.target.image_key_ref,
        )
        instance.metadata.items.extend(
            [
                compute_v1.Items(key="startup-script", value=bootstrap.boot_script(config, boot)),
                compute_v1.Items(key=METADATA_PORTS, value=",".join(f"{k}={v}" for k, v in ports.items())),
            ]
        )
        instance.tags = compute_v1.Tags(items=[gcp_network.host_tag(str(instance.name))])
        nic = compute_v1.NetworkInterface(network=gcp_network.network_url(self.project, net.vpc or "default"))
        if net.subnets:
            sub = net.subnets[0]
            nic.subnetwork = sub if "/" in sub else f"projects/{self.project}/regions/{region}/subnetworks/{sub}"
        if net.public_ip:
            nic.access_configs = [compute_v1.AccessConfig(name="External NAT", type_="ONE_TO_ONE_NAT")]
        instance.network_interfaces = [nic]
        if boot.identity:
            instance.service_accounts = [
                compute_v1.ServiceAccount(
                    email=boot.identity, scopes=["https://www.googleapis.com/auth/cloud-platform"]
                )
            ]

    def _open_ports(self, host: Host, name: str, *, agents: int = 1) -> None:
        """The host's firewall rules: the agent port (one per rank) from the orchestrator, the service port from it
        and the front door."""
        net = self.target.network
        rules = network.port_rules(net, host.meta["private_ip"], service="service" in host.ports, agents=agents)
        client = self._client(compute_v1.FirewallsClient)
        for fw in gcp_network.firewalls(self.project, net.vpc or "default", name, rules):
            try:
                op = client.insert_unary(project=self.project, firewall_resource=fw)
            except gexc.Conflict:
                continue  # a retried provision: the rule is there
            except gexc.GoogleAPICallError as exc:
                raise translate(exc, f"firewall rule {fw.name}", host.region) from None
            self.wait_global_operation(op, host.region)

    def wait_global_operation(self, op: compute_v1.Operation, region: str, *, timeout_s: float = 300) -> None:
        ops = self._client(compute_v1.GlobalOperationsClient)
        deadline = time.monotonic() + timeout_s
        while op.status != compute_v1.Operation.Status.DONE:
            if time.monotonic() >= deadline:
                raise ProviderError(f"GCP operation {op.name} not done after {timeout_s:g} s")
            op = self._call("wait operation", region, ops.wait, project=self.project, operation=op.name)
        errors = op_error_codes(op)
        if errors:
            raise translate(ProviderError("; ".join(f"{c}: {m}" for c, m in errors)), op.name, region)

    def _host(self, host_name: str, region: str, zone: str, inst: compute_v1.Instance) -> Host:
        nic = inst.network_interfaces[0] if inst.network_interfaces else None
        private = nic.network_i_p if nic else ""
        public = nic.access_configs[0].nat_i_p if nic and nic.access_configs else ""
        items = {i.key: i.value for i in inst.metadata.items} if inst.metadata else {}
        ports = {k: int(v) for k, _, v in (p.partition("=") for p in items.get(METADATA_PORTS, "").split(",") if p)}
        return Host(
            name=host_name,
            provider="gcp",
            region=region,
            address=public if ports and self.target.network.public_ip else private,
            instance_id=inst.name,
            zone=zone,
            ports=ports,
            meta={
                "status": inst.status,
                "machine_type": inst.machine_type.rsplit("/", 1)[-1],
                "private_ip": private,
                "public_ip": public or None,
            },
        )

    def wait_ready(self, host: Host, *, timeout_s: float = 600) -> Host:
        """Until the instance is RUNNING; ProviderError on timeout or when it stops."""
        deadline = time.monotonic() + timeout_s
        zone = str(host.zone)
        while True:
            inst = self._get(zone, str(host.instance_id), host.region)
            if inst is None:
                raise ProviderError(f"GCP instance {host.instance_id} in {zone} disappeared while waiting for it")
            if inst.status == "RUNNING":
                return self._host(host.name, host.region, zone, inst)
            if inst.status in ("STOPPING", "STOPPED", "TERMINATED", "SUSPENDED"):
                raise ProviderError(f"GCP instance {host.instance_id} is {inst.status} while waiting for it to run")
            if time.monotonic() >= deadline:
                raise ProviderError(
                    f"GCP instance {host.instance_id} not running after {timeout_s:g} s ({inst.status})"
                )
            time.sleep(min(self.poll_interval_s, max(0.0, deadline - time.monotonic())))

    def terminate(self, host: Host) -> None:
        """Delete the instance, then its firewall rules; what is already gone is fine."""
        if not host.instance_id or not host.zone:
            return
        client = self._client(compute_v1.InstancesClient)
        try:
            op = client.delete_unary(project=self.project, zone=host.zone, instance=host.instance_id)
        except gexc.NotFound:
            op = None
        except gexc.GoogleAPICallError as exc:
            raise translate(exc, f"delete {host.instance_id}", host.region) from None
        if op is not None:
            self.wait_operation(op, host.zone, host.region)
            log.info("gcp: deleted %s", host.instance_id)
        firewalls = self._client(compute_v1.FirewallsClient)
        for rule in gcp_network.names_for(host.instance_id):
            try:
                fop = firewalls.delete_unary(project=self.project, firewall=rule)
            except gexc.NotFound:
                continue
            except gexc.GoogleAPICallError as exc:  # a rule left behind admits no one once the host is gone
                log.warning("gcp: firewall rule %s not deleted: %s", rule, exc)
                continue
            self.wait_global_operation(fop, host.region)

    # -- the workload ---------------------------------------------------------------------
    def console_output(self, host: Host) -> str:
        """Serial port 1 of the instance: where the startup script's output goes."""
        client = self._client(compute_v1.InstancesClient)
        try:
            out = client.get_serial_port_output(
                request={"project": self.project, "zone": host.zone, "instance": host.instance_id, "port": 1}
            )
        except gexc.NotFound:
            return ""
        except gexc.GoogleAPICallError as exc:
            raise translate(exc, f"serial port output of {host.instance_id}", host.region) from None
        return str(out.contents)

    def _status(self, host: Host) -> str:
        inst = self._get(str(host.zone), str(host.instance_id), host.region)
        return "GONE" if inst is None else str(inst.status)

    def bootstrap(self, host: Host, launch: WorkloadLaunch, *, timeout_s: float) -> Host:
        """Wait for the workload the startup script started (infra/BOOT.md). On failure the instance is
        deleted and :class:`BootError` carries its serial console output."""
        return bootstrap.boot_or_terminate(
            self, host, launch, state=self._status, running="RUNNING", timeout_s=timeout_s
        )

    def secret_locations(self, name: str) -> list[str] | None:
        """Where a Secret Manager secret's data is held (its replicas' locations), asked of Secret Manager;
        None when Google chooses (automatic replication)."""
        from google.auth.transport.requests import AuthorizedSession

        resource = name if name.startswith("projects/") else f"projects/{self.project}/secrets/{name}"
        session = AuthorizedSession(self._credentials)
        try:
            reply = session.get(f"{self.secret_manager_endpoint}/v1/{resource}", timeout=30)
        except Exception as exc:  # requests' and google-auth's errors: a failed lookup, never a secret
            raise ProviderError(f"GCP Secret Manager lookup of {resource} failed: {type(exc).__name__}") from None
        finally:
            session.close()
        if reply.status_code != 200:
            raise ProviderError(f"GCP Secret Manager answered {reply.status_code} for {resource}")
        return gcp_network.secret_locations(reply.json())

    def secret_held_in(self, name: str, region: str) -> list[str | None]:
        """:class:`~gpumigrate.infra.residency.SecretHolder`: the replicas' locations, or ``[None]`` where
        Google chooses (automatic replication). ``region`` plays no part: a GCP secret is project-wide."""
        where = self.secret_locations(name)
        return [*where] if where else [None]

    # -- policy and price -----------------------------------------------------------------
    def jurisdiction(self, region: str) -> Jurisdiction:
        return residency.jurisdiction("gcp", region)

    def price(self, spec: HostSpec) -> float:
        return pricing.hourly("gcp", spec.region, spec.instance_type)

"""AWS provider: idempotent launch, the workload's boot, readiness, terminate (boto3); capacity and
quota checks are its other half (infra/aws_capacity.py).

Credentials come from boto3's standard chain (environment, shared profile, SSO, instance role);
this module never reads, logs or stores them. ``endpoint_url`` (or ``AWS_ENDPOINT_URL``, which
boto3 honours itself) points every client at another endpoint, such as moto's server in tests.

Idempotency: every instance carries the tags ``gpumigrate:migration-id`` and ``gpumigrate:host``;
a retried :meth:`AwsProvider.provision` finds the live instance by those tags and launches nothing.
``ClientToken`` is also set, which makes EC2 itself deduplicate a retried RunInstances call.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from gpumigrate.errors import CapacityError, GpumigrateError, InvalidInputError, ProviderError
from gpumigrate.infra import aws_network, bootstrap, network, pricing, residency
from gpumigrate.infra.aws_capacity import Ec2Capacity, quota_for, translate
from gpumigrate.infra.bootstrap import CloudTarget
from gpumigrate.interfaces import Host, HostSpec, Jurisdiction
from gpumigrate.launch import WorkloadLaunch

log = logging.getLogger(__name__)

TAG_MIGRATION = "gpumigrate:migration-id"
TAG_HOST = "gpumigrate:host"
TAG_PORTS = "gpumigrate:ports"  # service=8000,agent=7070: what a found instance listens on
LIVE_STATES = ("pending", "running", "stopping", "stopped")
GONE_CODES = {"InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"}

# The Deep Learning Base AMI (NVIDIA driver) published by AWS as an SSM public parameter.
DLAMI_PARAMETER = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"


class AwsProvider(Ec2Capacity):
    """EC2 behind the :class:`gpumigrate.interfaces.Provider` interface."""

    name = "aws"

    def __init__(
        self,
        *,
        endpoint_url: str | None = None,
        session: boto3.session.Session | None = None,
        profile: str | None = None,
        poll_interval_s: float = 5.0,
        check_quota: bool = True,
        default_image: str | None = None,
        target: CloudTarget | None = None,
    ) -> None:
        try:
            self._session = session or boto3.session.Session(profile_name=profile)
        except BotoCoreError as exc:  # e.g. AWS_PROFILE names a profile that does not exist
            raise ProviderError(f"AWS session could not be created: {exc}") from None
        self.endpoint_url = endpoint_url
        self.poll_interval_s = poll_interval_s
        self.check_quota = check_quota
        self.default_image = default_image
        self.target = target or CloudTarget()
        self._clients: dict[tuple[str, str], Any] = {}
        self.last_capacity: dict[str, Any] = {}

    # -- plumbing ---------------------------------------------------------------------
    def client(self, service: str, region: str) -> Any:
        """One cached boto3 client per (service, region); tests attach botocore event hooks to it."""
        key = (service, region)
        if key not in self._clients:
            kwargs: dict[str, Any] = {"region_name": region, "config": Config(retries={"mode": "standard"})}
            if self.endpoint_url:
                kwargs["endpoint_url"] = self.endpoint_url
            self._clients[key] = self._session.client(service, **kwargs)
        return self._clients[key]

    # -- lifecycle ----------------------------------------------------------------------
    def find(self, *, region: str, migration_id: str, host_name: str | None = None) -> list[dict[str, Any]]:
        """Live instances launched for ``migration_id`` (and ``host_name``), found by their tags."""
        filters = [
            {"Name": f"tag:{TAG_MIGRATION}", "Values": [migration_id]},
            {"Name": "instance-state-name", "Values": list(LIVE_STATES)},
        ]
        if host_name:
            filters.append({"Name": f"tag:{TAG_HOST}", "Values": [host_name]})
        ec2 = self.client("ec2", region)
        resp = self._call("DescribeInstances", region, ec2.describe_instances, Filters=filters)
        return [i for r in resp.get("Reservations", []) for i in r["Instances"]]

    def _image(self, spec: HostSpec) -> str:
        if spec.image or self.default_image:
            return str(spec.image or self.default_image)
        ssm = self.client("ssm", spec.region)
        try:
            return str(ssm.get_parameter(Name=DLAMI_PARAMETER)["Parameter"]["Value"])
        except (ClientError, BotoCoreError):
            raise InvalidInputError(
                f"no machine image for the AWS target: set target.image (an AMI id in {spec.region}); "
                f"the AWS Deep Learning AMI parameter {DLAMI_PARAMETER} could not be read"
            ) from None

    def provision(self, spec: HostSpec, *, migration_id: str) -> Host:
        """Launch one instance for ``spec``, or return the one already launched for this migration.

        With ``spec.launch`` the instance boots the workload (user data, infra/BOOT.md) in the plan's
        subnet of ``spec.zone``, behind a security group of its own that admits the agent and service
        ports only from the orchestrator and the front door (infra/network.py).
        """
        existing = self.find(region=spec.region, migration_id=migration_id, host_name=spec.name)
        if existing:
            log.info("aws: %s already launched for %s: %s", spec.name, migration_id, existing[0]["InstanceId"])
            return self._host(spec.name, spec.region, existing[0])
        if not spec.instance_type:
            raise InvalidInputError("an AWS target needs target.instance_type (e.g. p5.48xlarge)")
        tags = {"Name": spec.name, TAG_MIGRATION: migration_id, TAG_HOST: spec.name, **dict(spec.tags)}
        token = hashlib.sha256(f"{migration_id}/{spec.name}/{spec.zone}".encode()).hexdigest()[:64]
        kwargs: dict[str, Any] = {
            "ImageId": self._image(spec),
            "InstanceType": spec.instance_type,
            "MinCount": 1,
            "MaxCount": 1,
            "ClientToken": token,
        }
        if spec.launch is None:  # a bare machine: no workload, no ports opened
            if spec.zone:
                kwargs["Placement"] = {"AvailabilityZone": spec.zone}
            return self._launch(spec, migration_id, kwargs, tags)
        return self._launch_workload(spec, migration_id, kwargs, tags)

    def _launch_workload(self, spec: HostSpec, migration_id: str, kwargs: dict[str, Any], tags: dict[str, str]) -> Host:
        assert spec.launch is not None
        boot = self.target.require_bootstrap("AWS")
        net, region = self.target.network, spec.region
        ec2 = self.client("ec2", region)
        try:
            subnet, vpc, zone = aws_network.subnet_for_zone(ec2, net, spec.zone)
        except (ClientError, BotoCoreError) as exc:
            raise translate(exc, "DescribeSubnets", region) from None
        ports = network.ports(net, spec.launch)
        http = "service" in ports
        tags[TAG_PORTS] = ",".join(f"{k}={v}" for k, v in ports.items())
        config = bootstrap.boot_config(
            name=spec.name,
            provider="aws",
            region=region,
            launch=spec.launch,
            ports=ports,
            bootstrap=boot,
            image_key_ref=self.target.image_key_ref,
        )
        kwargs["UserData"] = bootstrap.boot_script(config, boot)
        kwargs["MetadataOptions"] = {"HttpTokens": "required", "HttpEndpoint": "enabled"}  # IMDSv2 only
        if boot.identity:
            key = "Arn" if boot.identity.startswith("arn:") else "Name"
            kwargs["IamInstanceProfile"] = {key: boot.identity}
        group_tags = {TAG_MIGRATION: migration_id, TAG_HOST: spec.name}
        try:
            group = aws_network.ensure_group(ec2, vpc_id=vpc, host_name=spec.name, tags=group_tags)
            if not network.needs_instance_address(net):
                aws_network.admit(ec2, group, network.port_rules(net, service=http, agents=spec.launch.ranks))
        except (ClientError, BotoCoreError) as exc:
            raise translate(exc, "security group", region) from None
        kwargs["NetworkInterfaces"] = [
            {
                "DeviceIndex": 0,
                "SubnetId": subnet,
                "Groups": [group],
                "AssociatePublicIpAddress": net.public_ip,
                "DeleteOnTermination": True,
            }
        ]
        log.info("aws: launching %s in %s (subnet %s, security group %s)", spec.name, zone, subnet, group)
        try:
            host = self._launch(spec, migration_id, kwargs, tags)
        except GpumigrateError:
            self._delete_group(ec2, group, timeout_s=30)  # nothing runs in it: no wait for the instance
            raise
        if network.needs_instance_address(net):
            try:
                rules = network.port_rules(net, host.meta["private_ip"], service=http, agents=spec.launch.ranks)
                aws_network.admit(ec2, group, rules)
            except (ClientError, BotoCoreError, GpumigrateError) as exc:
                self.terminate(host)
                if isinstance(exc, GpumigrateError):
                    raise
                raise translate(exc, "AuthorizeSecurityGroupIngress", region) from None
        return host

    def _launch(self, spec: HostSpec, migration_id: str, kwargs: dict[str, Any], tags: dict[str, str]) -> Host:
        kwargs["TagSpecifications"] = [
            {"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}
        ]
        ec2 = self.client("ec2", spec.region)
        try:
            resp = self._call(f"RunInstances {spec.instance_type}", spec.region, ec2.run_instances, **kwargs)
        except CapacityError as exc:
            if exc.rule != "quota":
                raise
            code, qname = quota_for(str(spec.instance_type))
            raise CapacityError(
                f"{exc.message.removeprefix('denied by quota: ')}; the quota is {code} ({qname}) in {spec.region}: "
                "request an increase in Service Quotas",
                region=spec.region,
                rule="quota",
            ) from None
        inst = resp["Instances"][0]
        log.info("aws: launched %s (%s) for %s", inst["InstanceId"], spec.instance_type, migration_id)
        return self._host(spec.name, spec.region, inst)

    def _host(self, name: str, region: str, inst: dict[str, Any]) -> Host:
        tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
        ports = {k: int(v) for k, _, v in (p.partition("=") for p in tags.get(TAG_PORTS, "").split(",") if p)}
        private, public = inst.get("PrivateIpAddress") or "", inst.get("PublicIpAddress") or ""
        # A workload host is reached where the plan says; a bare one wherever it answers.
        wants_public = self.target.network.public_ip if ports else bool(public)
        address = public if wants_public else private
        return Host(
            name=name,
            provider="aws",
            region=region,
            address=address,
            instance_id=inst["InstanceId"],
            zone=(inst.get("Placement") or {}).get("AvailabilityZone"),
            ports=ports,
            meta={
                "state": inst["State"]["Name"],
                "instance_type": inst.get("InstanceType"),
                "private_ip": private,
                "public_ip": public or None,
            },
        )

    def wait_ready(self, host: Host, *, timeout_s: float = 600) -> Host:
        """Until the instance runs and both EC2 status checks pass; ProviderError on timeout or death."""
        ec2 = self.client("ec2", host.region)
        deadline = time.monotonic() + timeout_s
        while True:
            resp = self._call("DescribeInstances", host.region, ec2.describe_instances, InstanceIds=[host.instance_id])
            inst = resp["Reservations"][0]["Instances"][0]
            state = inst["State"]["Name"]
            if state in ("shutting-down", "terminated", "stopping", "stopped"):
                raise ProviderError(f"AWS instance {host.instance_id} is {state} while waiting for it to run")
            if state == "running":
                st = self._call(
                    "DescribeInstanceStatus",
                    host.region,
                    ec2.describe_instance_status,
                    InstanceIds=[host.instance_id],
                    IncludeAllInstances=True,
                )["InstanceStatuses"]
                checks = [st[0]["InstanceStatus"]["Status"], st[0]["SystemStatus"]["Status"]] if st else []
                if checks and all(c == "ok" for c in checks):
                    ready = self._host(host.name, host.region, inst)
                    ready.meta["status_checks"] = "ok"
                    return ready
            if time.monotonic() >= deadline:
                raise ProviderError(f"AWS instance {host.instance_id} not ready after {timeout_s:g} s (state {state})")
            time.sleep(min(self.poll_interval_s, max(0.0, deadline - time.monotonic())))

    def terminate(self, host: Host) -> None:
        """Terminate, then delete the host's security group; an instance already gone is fine."""
        if not host.instance_id:
            return
        ec2 = self.client("ec2", host.region)
        try:
            ec2.terminate_instances(InstanceIds=[host.instance_id])
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in GONE_CODES:
                raise translate(exc, "TerminateInstances", host.region) from None
        except BotoCoreError as exc:
            raise translate(exc, "TerminateInstances", host.region) from None
        log.info("aws: terminated %s", host.instance_id)
        try:
            groups = aws_network.find_groups(ec2, {TAG_HOST: host.name})
        except (ClientError, BotoCoreError) as exc:
            log.warning("aws: security groups of %s not listed: %s", host.name, exc)
            return
        if groups:
            self._wait_terminated(host)
        for group in groups:
            self._delete_group(ec2, group["GroupId"], timeout_s=300)

    def _wait_terminated(self, host: Host, timeout_s: float = 300) -> None:
        ec2 = self.client("ec2", host.region)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                resp = ec2.describe_instances(InstanceIds=[str(host.instance_id)])
            except ClientError:
                return
            states = [i["State"]["Name"] for r in resp["Reservations"] for i in r["Instances"]]
            if all(st == "terminated" for st in states):
                return
            time.sleep(self.poll_interval_s)

    def _delete_group(self, ec2: Any, group_id: str, *, timeout_s: float) -> None:
        """A security group left behind costs nothing and blocks nothing: warn, never raise."""
        try:
            aws_network.delete_group(ec2, group_id, timeout_s=timeout_s, poll_s=self.poll_interval_s)
        except ProviderError as exc:
            log.warning("aws: %s", exc)

    # -- the workload ---------------------------------------------------------------------
    def console_output(self, host: Host) -> str:
        """The instance's console output (the latest, where the instance type keeps it)."""
        ec2 = self.client("ec2", host.region)
        try:
            out = ec2.get_console_output(InstanceId=host.instance_id, Latest=True).get("Output") or ""
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in GONE_CODES:
                return ""
            raise translate(exc, "GetConsoleOutput", host.region) from None
        except BotoCoreError as exc:
            raise translate(exc, "GetConsoleOutput", host.region) from None
        return str(out)  # botocore decodes the base64 itself (its after-call handler for this operation)

    def _state(self, host: Host) -> str:
        ec2 = self.client("ec2", host.region)
        resp = self._call("DescribeInstances", host.region, ec2.describe_instances, InstanceIds=[host.instance_id])
        return str(resp["Reservations"][0]["Instances"][0]["State"]["Name"])

    def bootstrap(self, host: Host, launch: WorkloadLaunch, *, timeout_s: float) -> Host:
        """Wait for the workload the user data started (infra/BOOT.md). On failure the instance is
        terminated and :class:`BootError` carries its console output."""
        return bootstrap.boot_or_terminate(
            self, host, launch, state=self._state, running="running", timeout_s=timeout_s
        )

    def secret_region(self, name: str, region: str) -> str:
        """Where a Secrets Manager secret is held (its ARN's region), asked of Secrets Manager itself."""
        if name.startswith("arn:"):  # a secret named by ARN is asked of its own region
            region = name.split(":")[3]
        client = self.client("secretsmanager", region)
        arn = self._call(f"DescribeSecret {name}", region, client.describe_secret, SecretId=name)["ARN"]
        return str(arn.split(":")[3])

    def secret_held_in(self, name: str, region: str) -> list[str | None]:
        """:class:`~gpumigrate.infra.residency.SecretHolder`: the one region the secret lives in."""
        return [self.secret_region(name, region)]

    # -- policy and price -----------------------------------------------------------------
    def jurisdiction(self, region: str) -> Jurisdiction:
        return residency.jurisdiction("aws", region)

    def price(self, spec: HostSpec) -> float:
        return pricing.hourly("aws", spec.region, spec.instance_type)

"""Cloud targets boot the workload: real boto3 / google-cloud-compute calls against moto and the fake
Compute Engine, whose instances run their user data / startup script in a network-namespace host
(cloud_harness.py). The orchestrator is this process, in the root namespace."""

from __future__ import annotations

import base64
import os
import secrets
import socket
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from cloud_harness import (
    CONTROL_SECRET,
    IMAGE_SECRET,
    INSTANCE_PROFILE,
    Cloud,
    Keys,
    seed_aws,
    seed_gcp,
)

from gpumigrate.errors import CapacityError
from gpumigrate.infra import get_provider
from gpumigrate.infra.bootstrap import BootError, CloudTarget, markers
from gpumigrate.infra.network import source_address_towards
from gpumigrate.infra.placement import place
from gpumigrate.interfaces import HostSpec
from gpumigrate.launch import WorkloadLaunch
from gpumigrate.plan import TargetBootstrap, TargetNetwork

AMI = "ami-12c6146b"  # one of moto's built-in images
PLAIN_HTTP = Path(__file__).resolve().parent / "plain_http.py"  # a static service that listens at once in a namespace


def _inference_argv() -> tuple[str, ...]:
    argv = ("{python}", "-m", "gpumigrate.workloads.inference", "--host", "{host}", "--port", "{service_port}")
    argv += ("--name", "{name}", "--seed", "0", "--size", "tiny")
    from gpumigrate.workloads.inference import build_parser

    # The reference server reads its agent address from GPUMIGRATE_AGENT_ADDR (the launch contract); a
    # version that still takes --agent-port is told the same port.  (Drop this once all take the env.)
    takes_flag = any("--agent-port" in a.option_strings for a in build_parser()._actions)
    return argv + (("--agent-port", "{agent_port}") if takes_flag else ())


INFERENCE = _inference_argv()


@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch) -> Keys:
    k = Keys(control=secrets.token_hex(32), image=secrets.token_hex(32))
    monkeypatch.setenv("GPUMIGRATE_CONTROL_KEY", k.control)  # the orchestrator's key: the one the secret holds
    return k


def launch(argv: tuple[str, ...] = INFERENCE, health_path: str = "/healthz") -> WorkloadLaunch:
    # The orchestrator's own key reference rides along: the machine must use the key it fetched instead.
    contract = {"GPUMIGRATE_AWAIT_RESTORE": "1", "GPUMIGRATE_CONTROL_KEY_FILE": "/orchestrator/only/control.key"}
    return WorkloadLaunch(argv=argv, ready_timeout_s=120, health_path=health_path, contract_env=contract)


def aws_target(tmp_path: Path, **network: Any) -> CloudTarget:
    boot = TargetBootstrap(
        python=sys.executable,  # the "machine image" has gpumigrate installed for this interpreter
        identity=INSTANCE_PROFILE,
        control_key_secret=CONTROL_SECRET,
        image_key_secret=IMAGE_SECRET,
        timeout_s=180,
    )
    ref = {"file": str(tmp_path / "on-target" / "image.key")}
    return CloudTarget(network=TargetNetwork(**network), bootstrap=boot, image_key_ref=ref)


SPECS: dict[str, dict[str, Any]] = {
    "aws": {"name": "gm-svc-m1", "region": "eu-central-1", "zone": "eu-central-1a", "image": AMI},
    "gcp": {"name": "gm-svc-g1", "region": "europe-west4", "zone": "europe-west4-a"},
}
MACHINES = {"aws": ("g5.xlarge", "A10G"), "gcp": ("a2-highgpu-1g", "A100-40GB")}


def host_spec(provider: str, zone: str | None = None, argv: tuple[str, ...] = INFERENCE) -> HostSpec:
    base = dict(SPECS[provider])
    base["zone"] = zone or base["zone"]
    instance_type, gpu = MACHINES[provider]
    return HostSpec(
        provider=provider, instance_type=instance_type, gpu_model=gpu, gpu_count=1, launch=launch(argv), **base
    )


def aws_spec(zone: str | None = None, argv: tuple[str, ...] = INFERENCE) -> HostSpec:
    return host_spec("aws", zone, argv)


def gcp_spec(zone: str | None = None, argv: tuple[str, ...] = INFERENCE) -> HostSpec:
    return host_spec("gcp", zone, argv)


def aws(moto_url: str, target: CloudTarget) -> Any:
    return get_provider("aws", endpoint_url=moto_url, poll_interval_s=0.2, target=target)


@pytest.fixture
def ec2(cloud: Cloud, moto_url: str, keys: Keys, tmp_path: Path) -> Callable[..., Any]:
    """An AWS provider for a seeded account (the two secrets, the instance profile): ``ec2(**network)``."""
    seed_aws(moto_url, "eu-central-1", keys)
    return lambda **network: aws(moto_url, aws_target(tmp_path, **network))


def groups_of(ec2: Any, host_name: str) -> list[dict[str, Any]]:
    return list(
        ec2.describe_security_groups(Filters=[{"Name": "tag:gpumigrate:host", "Values": [host_name]}])["SecurityGroups"]
    )


def placed(
    provider: Any,
    spec: HostSpec,
    migration_id: str,
    allowed: list[str],
    fallback: list[str],
    events: list[tuple[str, dict]] | None = None,
) -> Any:
    """:func:`place` with the plan's fallback zones, recording its audit events into ``events``."""
    record = (lambda e, d: events.append((e, d))) if events is not None else None
    return place(
        provider, spec, migration_id=migration_id, allowed_jurisdictions=allowed, fallback_zones=fallback, record=record
    )


def serves(host: Any) -> None:
    """The health endpoint and the agent answer from here, where the orchestrator stands."""
    from gpumigrate.snapshot.client import AgentClient

    assert httpx.get(f"http://{host.address}:{host.ports['service']}/healthz", timeout=5, trust_env=False).is_success
    with AgentClient(f"{host.address}:{host.ports['agent']}", timeout_s=10) as agent:
        assert agent.request_info()


def test_aws_boots_the_workload_and_reports_its_ports(
    ec2: Callable[..., Any], moto_url: str, keys: Keys, tmp_path: Path, migration_id: str
) -> None:
    provider = ec2()
    events: list[str] = []
    host = place(
        provider,
        aws_spec(),
        migration_id=migration_id,
        allowed_jurisdictions=["EU"],
        record=lambda e, d: events.append(e),
    )
    assert host.ports == {"service": 8000, "agent": 7070} and host.zone == "eu-central-1a"
    assert host.address.startswith("10.213.")  # the private IP: the namespace the instance booted in
    ready = provider.bootstrap(host, launch(), timeout_s=180)
    serves(ready)
    assert ready.meta["version"] and events[:2] == ["residency.allow", "infra.provisioned"]

    ec2 = boto3.client("ec2", region_name="eu-central-1", endpoint_url=moto_url)
    inst = ec2.describe_instances(InstanceIds=[str(host.instance_id)])["Reservations"][0]["Instances"][0]
    assert inst["IamInstanceProfile"]["Arn"].endswith(f"instance-profile/{INSTANCE_PROFILE}")
    assert inst["MetadataOptions"]["HttpTokens"] == "required" and "PublicIpAddress" not in inst
    user_data = base64.b64decode(
        ec2.describe_instance_attribute(InstanceId=str(host.instance_id), Attribute="userData")["UserData"]["Value"]
    ).decode()
    # Secrets reach the machine by name only; the orchestrator's own key path stays home.
    assert CONTROL_SECRET in user_data and keys.control not in user_data and keys.image not in user_data
    assert "/orchestrator/only" not in user_data
    key_file = tmp_path / "on-target" / "image.key"
    assert key_file.read_text().strip() == keys.image and stat.S_IMODE(key_file.stat().st_mode) == 0o600

    # Found again by a retried provision, ports included (they ride on the instance's tags).
    again = provider.provision(aws_spec(), migration_id=migration_id)
    assert (again.instance_id, again.ports, again.address) == (host.instance_id, host.ports, host.address)
    provider.terminate(host)
    assert groups_of(ec2, "gm-svc-m1") == []


def test_aws_security_group_admits_agent_port_only_from_the_orchestrator(
    ec2: Callable[..., Any], moto_url: str, migration_id: str
) -> None:
    provider = ec2(frontdoor=["10.77.0.0/24"])
    host = provider.provision(aws_spec(), migration_id=migration_id)
    orchestrator = source_address_towards(host.address) + "/32"  # this process's address towards the instance
    ec2 = boto3.client("ec2", region_name="eu-central-1", endpoint_url=moto_url)
    inst = ec2.describe_instances(InstanceIds=[str(host.instance_id)])["Reservations"][0]["Instances"][0]
    nic_groups = [g["GroupId"] for g in inst["NetworkInterfaces"][0]["Groups"]]
    [group] = ec2.describe_security_groups(GroupIds=nic_groups)["SecurityGroups"]
    ingress = {p["FromPort"]: sorted(r["CidrIp"] for r in p["IpRanges"]) for p in group["IpPermissions"]}
    assert ingress == {7070: [orchestrator], 8000: sorted([orchestrator, "10.77.0.0/24"])}
    assert all(p["ToPort"] == p["FromPort"] and p["IpProtocol"] == "tcp" for p in group["IpPermissions"])
    provider.terminate(host)


def test_aws_failed_boot_reports_console_and_terminates(
    ec2: Callable[..., Any], cloud: Cloud, moto_url: str, keys: Keys, migration_id: str
) -> None:
    provider = ec2()
    crash = ("{python}", "-c", "import sys; print('weights /models/llama missing', flush=True); sys.exit(3)")
    host = provider.provision(aws_spec(argv=crash), migration_id=migration_id)
    with pytest.raises(BootError) as err:
        provider.bootstrap(host, launch(crash), timeout_s=120)
    text = str(err.value)
    assert "failed at launch" in text and "exit status 3" in text and "weights /models/llama missing" in text
    assert err.value.exit_code == 1 and keys.control not in text
    ec2 = boto3.client("ec2", region_name="eu-central-1", endpoint_url=moto_url)
    state = ec2.describe_instances(InstanceIds=[str(host.instance_id)])["Reservations"][0]["Instances"][0]["State"]
    assert state["Name"] == "terminated" and cloud.harness.booted == {}


def test_aws_missing_secret_fails_the_boot_by_name(
    cloud: Cloud, moto_url: str, keys: Keys, tmp_path: Path, migration_id: str
) -> None:
    seed_aws(moto_url, "eu-central-1", keys)
    target = aws_target(tmp_path)
    boot = target.bootstrap.model_copy(update={"control_key_secret": "gpumigrate/no-such-key"})  # type: ignore[union-attr]
    provider = aws(moto_url, CloudTarget(network=target.network, bootstrap=boot, image_key_ref=target.image_key_ref))
    host = provider.provision(aws_spec(), migration_id=migration_id)
    with pytest.raises(BootError, match=r"failed at secrets: secret gpumigrate/no-such-key could not be read"):
        provider.bootstrap(host, launch(), timeout_s=120)


def test_aws_no_capacity_in_first_zone_uses_the_second(
    ec2: Callable[..., Any], cloud: Cloud, migration_id: str
) -> None:
    cloud.harness.exhausted_zones.add("eu-central-1a")
    provider = ec2()
    events: list[tuple[str, dict]] = []
    host = placed(provider, aws_spec(), migration_id, ["EU"], ["eu-central-1b", "eu-central-1c"], events)
    assert host.zone == "eu-central-1b" and cloud.ec2 and cloud.ec2.zones_asked == ["eu-central-1a", "eu-central-1b"]
    assert [e for e, _ in events] == ["residency.allow", "infra.zone.no-capacity", "infra.provisioned"]
    serves(provider.bootstrap(host, launch(), timeout_s=180))
    provider.terminate(host)


def test_aws_no_capacity_anywhere_allowed_exits_2_naming_the_zones(
    ec2: Callable[..., Any], cloud: Cloud, moto_url: str, migration_id: str
) -> None:
    cloud.harness.exhausted_zones.update({"eu-central-1a", "eu-central-1b"})
    provider = ec2()
    events: list[tuple[str, dict]] = []
    with pytest.raises(CapacityError) as err:  # us-east-1a: residency forbids its region, so it is never tried
        placed(provider, aws_spec(), migration_id, ["EU"], ["us-east-1a", "eu-central-1b"], events)
    assert err.value.exit_code == 2 and "zones tried: eu-central-1a, eu-central-1b" in str(err.value)
    assert "InsufficientInstanceCapacity" in str(err.value) and "us-east-1a" not in str(err.value)
    assert cloud.ec2 and cloud.ec2.zones_asked == ["eu-central-1a", "eu-central-1b"]
    denied = [d for e, d in events if e == "residency.deny"]
    assert denied and denied[0]["region"] == "us-east-1" and denied[0]["point"] == "fallback-zone"
    ec2 = boto3.client("ec2", region_name="eu-central-1", endpoint_url=moto_url)
    assert groups_of(ec2, "gm-svc-m1") == []  # the group made for each attempt went with it


# ----------------------------------------------------------------------------- GCP
PROJECT = "test-proj"


def gcp_target(**network: Any) -> CloudTarget:
    boot = TargetBootstrap(
        python=sys.executable,
        identity="gpumigrate-target@test-proj.iam.gserviceaccount.com",
        control_key_secret="gpumigrate-control-key",
        image_key_secret="gpumigrate-image-key",
        timeout_s=180,
    )
    return CloudTarget(network=TargetNetwork(**network), bootstrap=boot, image_key_ref={"env": "GPUMIGRATE_IMAGE_KEY"})


def gcp(gce: Any, target: CloudTarget) -> Any:
    return get_provider(
        "gcp",
        project=PROJECT,
        api_endpoint=gce.endpoint,
        poll_interval_s=0.2,
        target=target,
        secret_manager_endpoint=gce.endpoint,
    )


def add_zone(gce: Any, zone: str) -> None:
    """A second zone in europe-west4 with the same machine types."""
    gce.state.machine_types[zone] = dict(gce.state.machine_types["europe-west4-a"])
    gce.state.accelerators[zone] = dict(gce.state.accelerators["europe-west4-a"])


def test_gcp_boots_the_workload_behind_its_firewall_rules(cloud: Cloud, gce: Any, keys: Keys) -> None:
    seed_gcp(gce, PROJECT, keys)
    provider = gcp(gce, gcp_target(frontdoor=["10.77.0.0/24"]))
    host = place(provider, gcp_spec(), migration_id="m-g1", allowed_jurisdictions=["EEA"])
    assert host.ports == {"service": 8000, "agent": 7070} and host.address.startswith("10.213.")
    ready = provider.bootstrap(host, launch(), timeout_s=180)
    serves(ready)

    body = gce.state.instances[("europe-west4-a", str(host.instance_id))]
    script = next(i["value"] for i in body["metadata"]["items"] if i["key"] == "startup-script")
    assert "gpumigrate-control-key" in script and keys.control not in script and keys.image not in script
    assert body["serviceAccounts"][0]["email"].startswith("gpumigrate-target@")
    assert "accessConfigs" not in body["networkInterfaces"][0]  # private addressing, as the plan says
    orchestrator = source_address_towards(host.address) + "/32"
    rules = {r["allowed"][0]["ports"][0]: r for r in gce.state.firewalls.values()}
    assert rules["7070"]["sourceRanges"] == [orchestrator]
    assert sorted(rules["8000"]["sourceRanges"]) == sorted([orchestrator, "10.77.0.0/24"])
    assert all(r["targetTags"] == body["tags"]["items"] for r in rules.values())
    # The image key went where the plan's reference points: the workload's environment.
    pid = next(
        int(line.split('"pid": ')[1].split(",")[0])
        for line in provider.console_output(host).splitlines()
        if '"event": "started"' in line
    )
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"GPUMIGRATE_IMAGE_KEY={keys.image}".encode() in environ
    assert not any(e.startswith(b"GPUMIGRATE_CONTROL_KEY=") for e in environ)
    provider.terminate(host)
    assert gce.state.firewalls == {} and gce.state.instances == {}


def test_gcp_failed_boot_reports_serial_console_and_deletes(cloud: Cloud, gce: Any, keys: Keys) -> None:
    seed_gcp(gce, PROJECT, keys)
    provider = gcp(gce, gcp_target())
    crash = ("{python}", "-c", "import sys; print('CUDA driver too old', flush=True); sys.exit(7)")
    host = provider.provision(gcp_spec(argv=crash), migration_id="m-g2")
    with pytest.raises(BootError) as err:
        provider.bootstrap(host, launch(crash), timeout_s=120)
    assert "exit status 7" in str(err.value) and "CUDA driver too old" in str(err.value)
    assert gce.state.instances == {} and gce.state.firewalls == {}


def test_gcp_zone_exhausted_falls_back_then_exits_2(cloud: Cloud, gce: Any, keys: Keys) -> None:
    seed_gcp(gce, PROJECT, keys)
    add_zone(gce, "europe-west4-b")
    provider = gcp(gce, gcp_target())
    cloud.harness.exhausted_zones.add("europe-west4-a")
    host = placed(provider, gcp_spec(), "m-g3", ["EEA"], ["us-central1-a", "europe-west4-b"])
    assert host.zone == "europe-west4-b" and cloud.gce and cloud.gce.zones_asked == ["europe-west4-a", "europe-west4-b"]
    provider.terminate(host)

    cloud.harness.exhausted_zones.add("europe-west4-b")
    with pytest.raises(CapacityError) as err:
        placed(provider, gcp_spec(), "m-g4", ["EEA"], ["us-central1-a", "europe-west4-b"])
    assert err.value.exit_code == 2 and "zones tried: europe-west4-a, europe-west4-b" in str(err.value)
    assert "ZONE_RESOURCE_POOL_EXHAUSTED" in str(err.value)
    assert "us-central1-a" not in cloud.gce.zones_asked and gce.state.instances == {} and gce.state.firewalls == {}


def test_gcp_training_job_is_reached_through_its_agent_only(cloud: Cloud, gce: Any, keys: Keys) -> None:
    # No {service_port} in its launch: it serves no HTTP, so only its agent port is opened and awaited.
    trainer = (
        "{python}",
        "-c",
        "import socket, time; s = socket.create_server(('{host}', {agent_port})); time.sleep(600)",
    )
    seed_gcp(gce, PROJECT, keys)
    provider = gcp(gce, gcp_target())
    host = provider.provision(gcp_spec(argv=trainer), migration_id="m-train")
    assert host.ports == {"agent": 7070}
    assert [r["allowed"][0]["ports"] for r in gce.state.firewalls.values()] == [["7070"]]
    ready = provider.bootstrap(host, launch(trainer), timeout_s=120)
    socket.create_connection((ready.address, 7070), timeout=5).close()  # reached from here
    provider.terminate(host)


def test_quota_refusal_stops_at_once_and_names_the_quota(cloud: Cloud, gce: Any, keys: Keys) -> None:
    add_zone(gce, "europe-west4-b")
    gce.state.quotas["europe-west4"]["NVIDIA_A100_GPUS"] = [8, 8]
    with pytest.raises(CapacityError) as err:
        placed(gcp(gce, gcp_target()), gcp_spec(), "m-q", ["EEA"], ["europe-west4-b"])
    assert err.value.rule == "quota" and "NVIDIA_A100_GPUS" in str(err.value)
    assert gce.state.inserts() == []


def test_a_workload_needs_bootstrap_settings(cloud: Cloud, moto_url: str, migration_id: str) -> None:
    from gpumigrate.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="target.bootstrap is needed"):
        aws(moto_url, CloudTarget()).provision(aws_spec(), migration_id=migration_id)
    assert os.environ.get("AWS_ENDPOINT_URL") == moto_url


SLEEPER = ("{python}", "-c", "import time; time.sleep(600)")


@pytest.mark.parametrize("provider_name", ["aws", "gcp"])
def test_public_addressing_as_the_plan_says(
    ec2: Callable[..., Any], gce: Any, keys: Keys, migration_id: str, provider_name: str
) -> None:
    public = {"public_ip": True, "orchestrator": ["10.213.0.0/16"]}
    if provider_name == "aws":
        provider = ec2(**public)
    else:
        seed_gcp(gce, PROJECT, keys)
        provider = gcp(gce, gcp_target(**public))
    host = provider.provision(host_spec(provider_name, argv=SLEEPER), migration_id=migration_id)
    # reached at its public address (the harness maps it to the namespace too), the private one kept in meta
    assert host.meta["public_ip"] and host.address == host.meta["public_ip"] and host.meta["private_ip"]
    if provider_name == "gcp":
        nic = gce.state.instances[("europe-west4-a", str(host.instance_id))]["networkInterfaces"][0]
        assert nic["accessConfigs"][0]["type"] == "ONE_TO_ONE_NAT"
    provider.terminate(host)


def test_ready_on_the_machine_but_unreachable_names_the_network(ec2: Callable[..., Any], migration_id: str) -> None:
    provider = ec2()
    static = ("{python}", str(PLAIN_HTTP), "{host}", "{service_port}")  # "/" answers 200 at once
    serve = launch(static, health_path="/")
    host = provider.provision(replace(aws_spec(), launch=serve), migration_id=migration_id)
    # The machine reports its workload ready first (the condition the message depends on); then a bootstrap that
    # looks where nothing listens runs out of a short bound instead of waiting out a long one for it.
    deadline = time.monotonic() + 180
    console = provider.console_output(host)
    while not any(e["event"] == "ready" for e in markers(console)):
        assert time.monotonic() < deadline, f"the machine never reported its workload ready in 180 s: {console[-2000:]}"
        time.sleep(0.1)
        console = provider.console_output(host)
    wrong = replace(host, ports={"service": 8001, "agent": 7071})  # nothing listens there
    with pytest.raises(BootError, match="reports its workload ready, but .* check target.network"):
        provider.bootstrap(wrong, serve, timeout_s=1)

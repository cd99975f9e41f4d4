"""AWS provider against moto's real server: real boto3 calls over loopback, errors injected with
botocore event hooks where moto does not enforce them (quotas, capacity)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ClientError
from cloud_helpers import all_instances, live_instances

from gpumigrate.errors import CapacityError, InvalidInputError, ProviderError, ResidencyError
from gpumigrate.infra import provision_host
from gpumigrate.infra.aws import quota_for
from gpumigrate.interfaces import HostSpec

AMI = "ami-12c6146b"  # one of moto's built-in images


def spec(**kw: Any) -> HostSpec:
    base = dict(
        name="gm-target",
        provider="aws",
        region="us-east-1",
        zone="us-east-1a",
        instance_type="p4d.24xlarge",
        gpu_model="A100-40GB",
        gpu_count=8,
        image=AMI,
    )
    base.update(kw)
    return HostSpec(**base)


def fail_with(code: str, message: str) -> Any:
    def hook(**_: Any) -> None:
        raise ClientError({"Error": {"Code": code, "Message": message}}, "RunInstances")

    return hook


def quota_answer(value: float) -> Any:
    """Service Quotas as AWS answers it (moto has none for EC2): returned from a before-call hook."""

    def hook(**_: Any) -> tuple[AWSResponse, dict[str, Any]]:
        return AWSResponse("https://servicequotas", 200, {}, None), {
            "Quota": {"QuotaCode": "L-417A185B", "Value": value}
        }

    return hook


def test_round_trip_provision_wait_terminate(aws: Any, ec2_of: Any, migration_id: str) -> None:
    report = aws.check_capacity(spec())
    assert report["gpus"] == "8 x A100" and "us-east-1a" in report["zones"]
    assert report["quota"].startswith("unchecked")  # moto's Service Quotas has no EC2: the clear path
    host = aws.provision(spec(), migration_id=migration_id)
    assert host.instance_id and host.zone == "us-east-1a"
    ready = aws.wait_ready(host, timeout_s=30)
    assert ready.meta["status_checks"] == "ok" and ready.address
    [inst] = live_instances(ec2_of("us-east-1"), migration_id)
    tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
    assert tags["gpumigrate:host"] == "gm-target" and inst["InstanceType"] == "p4d.24xlarge"
    aws.terminate(host)
    aws.terminate(host)  # idempotent
    assert live_instances(ec2_of("us-east-1"), migration_id) == []
    assert all_instances(ec2_of("us-east-1"), migration_id)[0]["State"]["Name"] == "terminated"


def test_retried_provision_finds_the_instance(aws: Any, ec2_of: Any, migration_id: str) -> None:
    first = aws.provision(spec(), migration_id=migration_id)
    calls: list[str] = []
    aws.client("ec2", "us-east-1").meta.events.register("before-call.ec2.RunInstances", lambda **_: calls.append("run"))
    again = aws.provision(spec(), migration_id=migration_id)
    assert again.instance_id == first.instance_id and calls == []
    assert len(live_instances(ec2_of("us-east-1"), migration_id)) == 1
    aws.terminate(first)


def test_type_not_offered_in_region_is_capacity_refusal(aws: Any) -> None:
    # moto's offering data (like AWS's) has no p5.48xlarge in eu-west-1
    with pytest.raises(CapacityError) as err:
        aws.check_capacity(spec(region="eu-west-1", zone="eu-west-1a", instance_type="p5.48xlarge", gpu_model="H100"))
    assert err.value.rule == "capacity" and err.value.exit_code == 2 and "eu-west-1" in str(err.value)


def test_zone_not_offered_names_the_zones_that_are(aws: Any) -> None:
    with pytest.raises(CapacityError, match=r"not offered in zone eu-west-1a: offered in eu-west-1c"):
        aws.check_capacity(spec(region="eu-west-1", zone="eu-west-1a"))


def test_unknown_type_and_gpu_mismatch(aws: Any) -> None:
    with pytest.raises(CapacityError, match="does not exist"):
        aws.check_capacity(spec(instance_type="p9.mega"))
    with pytest.raises(CapacityError, match="carries A100 GPUs, the target asks for H100"):
        aws.check_capacity(spec(gpu_model="H100"))
    with pytest.raises(CapacityError, match="has 1 GPUs, the target asks for 8"):
        aws.check_capacity(spec(instance_type="g5.xlarge", gpu_model="A10G"))


def test_vcpu_quota_refusal_before_launch(aws: Any, ec2_of: Any, migration_id: str) -> None:
    assert quota_for("p4d.24xlarge")[0] == "L-417A185B" and quota_for("g5.xlarge")[0] == "L-DB2E81BA"
    aws.client("service-quotas", "us-east-1").meta.events.register(
        "before-call.service-quotas.GetServiceQuota", quota_answer(64)
    )
    with pytest.raises(CapacityError) as err:
        provision_host(aws, spec(), migration_id=migration_id, allowed_jurisdictions=["US"])
    assert err.value.rule == "quota" and "L-417A185B" in str(err.value) and "limit 64" in str(err.value)
    assert all_instances(ec2_of("us-east-1"), migration_id) == []  # nothing launched


def test_quota_with_room_passes(aws: Any) -> None:
    aws.client("service-quotas", "us-east-1").meta.events.register(
        "before-call.service-quotas.GetServiceQuota", quota_answer(100_000)
    )
    report = aws.check_capacity(spec())
    assert report["quota_limit"] == 100_000 and report["quota_in_use"] >= 0


@pytest.mark.parametrize(
    ("code", "rule"), [("InsufficientInstanceCapacity", "capacity"), ("VcpuLimitExceeded", "quota")]
)
def test_launch_refusals_become_policy_errors(aws: Any, ec2_of: Any, migration_id: str, code: str, rule: str) -> None:
    aws.client("ec2", "us-east-1").meta.events.register("before-call.ec2.RunInstances", fail_with(code, "injected"))
    with pytest.raises(CapacityError) as err:
        aws.provision(spec(), migration_id=migration_id)
    assert err.value.rule == rule and code in str(err.value) and err.value.exit_code == 2
    if rule == "quota":  # the refusal names the quota to raise
        assert "L-417A185B (Running On-Demand P instances)" in str(err.value)
    assert all_instances(ec2_of("us-east-1"), migration_id) == []


def test_other_api_errors_are_provider_errors(aws: Any, migration_id: str) -> None:
    aws.client("ec2", "us-east-1").meta.events.register(
        "before-call.ec2.RunInstances", fail_with("UnauthorizedOperation", "not allowed")
    )
    with pytest.raises(ProviderError, match="UnauthorizedOperation"):
        aws.provision(spec(), migration_id=migration_id)


def test_residency_denial_at_provisioning_launches_nothing(aws: Any, ec2_of: Any, migration_id: str) -> None:
    records: list[tuple[str, dict]] = []
    with pytest.raises(ResidencyError) as err:
        provision_host(
            aws,
            spec(),
            migration_id=migration_id,
            allowed_jurisdictions=["EU"],
            record=lambda e, d: records.append((e, d)),
        )
    assert err.value.rule == "data-residency" and err.value.region == "us-east-1"
    assert records[0][0] == "residency.deny" and records[0][1]["point"] == "provision"
    assert all_instances(ec2_of("us-east-1"), migration_id) == []


def test_provision_host_in_allowed_region(aws: Any, ec2_of: Any, migration_id: str) -> None:
    records: list[str] = []
    host = provision_host(
        aws,
        spec(region="eu-central-1", zone="eu-central-1b"),
        migration_id=migration_id,
        allowed_jurisdictions=["DE"],
        record=lambda e, d: records.append(e),
    )
    assert records == ["residency.allow", "infra.provisioned"]  # placement records the zones it tried
    assert aws.jurisdiction("eu-central-1").country == "DE" and aws.price(spec(region="eu-central-1")) > 0
    aws.terminate(host)
    assert live_instances(ec2_of("eu-central-1"), migration_id) == []


def test_wait_ready_fails_for_terminated_instance(aws: Any, migration_id: str) -> None:
    host = aws.provision(spec(), migration_id=migration_id)
    aws.terminate(host)
    with pytest.raises(ProviderError, match="while waiting"):
        aws.wait_ready(host, timeout_s=5)


def test_missing_image_is_a_clear_input_error(aws: Any, ec2_of: Any, migration_id: str) -> None:
    with pytest.raises(InvalidInputError, match="set target.image"):
        aws.provision(spec(image=None), migration_id=migration_id)
    assert all_instances(ec2_of("us-east-1"), migration_id) == []


def test_preflight_checks_every_allowed_zone_and_launches_nothing(aws: Any, ec2_of: Any, migration_id: str) -> None:
    from gpumigrate.infra.placement import check_zones

    eu = spec(region="eu-central-1", zone="eu-central-1a", instance_type="g5.xlarge", gpu_model="A10G", gpu_count=1)
    zones = check_zones(aws, eu, allowed_jurisdictions=["EU"], fallback_zones=["us-east-1a", "eu-central-1b"])
    assert zones == ["eu-central-1a", "eu-central-1b"]  # us-east-1a: another region, never considered
    h100 = replace(eu, instance_type="p5.48xlarge", gpu_model="H100", gpu_count=8)  # not offered in eu-central-1
    with pytest.raises(CapacityError, match=r"zones tried: eu-central-1a, eu-central-1b"):
        check_zones(aws, h100, allowed_jurisdictions=["EU"], fallback_zones=["eu-central-1b"])
    assert all_instances(ec2_of("eu-central-1"), migration_id) == []

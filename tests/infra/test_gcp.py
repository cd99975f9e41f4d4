"""GCP provider through google-cloud-compute's real REST transport against the loopback fake."""

from __future__ import annotations

from typing import Any

import pytest
from cloud_helpers import GCP_TOKEN
from gce_fake import FakeGce

from gpumigrate.errors import CapacityError, ProviderError, ResidencyError
from gpumigrate.infra import get_provider, provision_host
from gpumigrate.interfaces import HostSpec


def spec(**kw: Any) -> HostSpec:
    base = dict(
        name="gm-lm-train-1",
        provider="gcp",
        region="europe-west4",
        zone="europe-west4-a",
        instance_type="a2-highgpu-1g",
        gpu_model="A100-40GB",
        gpu_count=1,
    )
    base.update(kw)
    return HostSpec(**base)


def test_round_trip_insert_wait_delete(gcp: Any, gce: FakeGce) -> None:
    report = gcp.check_capacity(spec())
    assert report["quota_metric"] == "NVIDIA_A100_GPUS" and report["quota_limit"] == 8
    host = gcp.provision(spec(), migration_id="m-1")
    body = gce.state.instances[("europe-west4-a", host.instance_id)]
    assert body["scheduling"]["onHostMaintenance"] == "TERMINATE"
    assert body["labels"]["gpumigrate-migration"] == "m-1"
    assert body["machineType"].endswith("/a2-highgpu-1g") and "guestAccelerators" not in body  # built-in A100
    ready = gcp.wait_ready(host, timeout_s=10)
    assert ready.meta["status"] == "RUNNING" and ready.address.startswith("10.164.")
    assert gce.state.quotas["europe-west4"]["NVIDIA_A100_GPUS"][1] == 1
    gcp.terminate(host)
    gcp.terminate(host)  # idempotent
    assert gce.state.instances == {} and gce.state.quotas["europe-west4"]["NVIDIA_A100_GPUS"][1] == 0


def test_insert_waits_on_its_own_operations_client(gcp: Any, gce: FakeGce) -> None:
    gcp.provision(spec(), migration_id="m-ops")
    waits = [r for r in gce.state.requests if r["path"].endswith("/wait")]
    assert waits and all(
        r["path"].startswith("/compute/v1/projects/test-proj/zones/europe-west4-a/operations/") for r in waits
    )


def test_guest_accelerators_for_n1(gcp: Any, gce: FakeGce) -> None:
    s = spec(name="t4-box", instance_type="n1-standard-8", gpu_model="T4", gpu_count=2)
    gcp.check_capacity(s)
    host = gcp.provision(s, migration_id="m-t4")
    body = gce.state.instances[("europe-west4-a", host.instance_id)]
    assert body["guestAccelerators"] == [
        {"acceleratorType": "zones/europe-west4-a/acceleratorTypes/nvidia-tesla-t4", "acceleratorCount": 2}
    ]


def test_retried_provision_inserts_once(gcp: Any, gce: FakeGce) -> None:
    a = gcp.provision(spec(), migration_id="m-retry")
    b = gcp.provision(spec(), migration_id="m-retry")
    assert a.instance_id == b.instance_id and len(gce.state.inserts()) == 1


def test_name_taken_by_another_migration_is_refused(gcp: Any) -> None:
    gcp.provision(spec(), migration_id="m-one")
    with pytest.raises(ProviderError, match="not launched by migration m-two"):
        gcp.provision(spec(), migration_id="m-two")


def test_quota_refusal_inserts_nothing(gcp: Any, gce: FakeGce) -> None:
    gce.state.quotas["europe-west4"]["NVIDIA_A100_GPUS"] = [8, 8]
    with pytest.raises(CapacityError) as err:
        provision_host(gcp, spec(), migration_id="m-q", allowed_jurisdictions=["EEA"])
    assert err.value.rule == "quota" and "NVIDIA_A100_GPUS" in str(err.value) and "limit 8, in use 8" in str(err.value)
    assert gce.state.inserts() == [] and gce.state.instances == {}


def test_missing_quota_metric_is_a_quota_refusal(gcp: Any, gce: FakeGce) -> None:
    gce.state.accelerators["europe-west4-a"]["nvidia-h100-80gb"] = 8
    with pytest.raises(CapacityError, match="no NVIDIA_H100_GPUS quota") as err:
        gcp.check_capacity(spec(instance_type="a3-highgpu-8g", gpu_model="H100", gpu_count=8))
    assert err.value.rule == "quota"


def test_capacity_refusals(gcp: Any, gce: FakeGce) -> None:
    with pytest.raises(CapacityError, match="not offered in zone us-central1-a"):
        gcp.check_capacity(spec(region="us-central1", zone="us-central1-a", instance_type="a3-highgpu-8g"))
    del gce.state.accelerators["europe-west4-a"]["nvidia-tesla-t4"]
    with pytest.raises(CapacityError, match=r"offers no nvidia-tesla-t4 \(offers: nvidia-tesla-a100\)"):
        gcp.check_capacity(spec(instance_type="n1-standard-8", gpu_model="T4", gpu_count=1))
    with pytest.raises(CapacityError, match="at most 16 per instance"):
        gcp.check_capacity(spec(instance_type="n1-standard-8", gpu_model="A100-40GB", gpu_count=17))
    with pytest.raises(CapacityError, match="carries nvidia-tesla-a100, the target asks for H100"):
        gcp.check_capacity(spec(gpu_model="H100"))


def test_zone_exhausted_during_insert_is_capacity_error(gcp: Any, gce: FakeGce) -> None:
    gce.state.insert_error = "ZONE_RESOURCE_POOL_EXHAUSTED"
    with pytest.raises(CapacityError) as err:
        gcp.provision(spec(), migration_id="m-x")
    assert err.value.rule == "capacity" and "ZONE_RESOURCE_POOL_EXHAUSTED" in str(err.value)
    assert gce.state.instances == {}


def test_quota_refused_by_the_insert_call_is_quota_error(gcp: Any, gce: FakeGce) -> None:
    # the regional quota looked fine, but the API refuses the insert (a race with another launch)
    gce.state.insert_http_error = (
        403,
        "quotaExceeded",
        "Quota 'NVIDIA_A100_GPUS' exceeded.  Limit: 8.0 in region europe-west4.",
    )
    with pytest.raises(CapacityError) as err:
        gcp.provision(spec(), migration_id="m-race")
    assert err.value.rule == "quota" and "NVIDIA_A100_GPUS" in str(err.value) and gce.state.instances == {}


def test_residency_denial_inserts_nothing(gcp: Any, gce: FakeGce) -> None:
    with pytest.raises(ResidencyError, match="us-central1"):
        provision_host(
            gcp, spec(region="us-central1", zone="us-central1-a"), migration_id="m-r", allowed_jurisdictions=["EU"]
        )
    assert gce.state.requests == []  # refused before any API call


def test_explicit_credentials_travel_only_to_the_endpoint(gce: FakeGce) -> None:
    from google.oauth2.credentials import Credentials

    provider = get_provider("gcp", project="p", api_endpoint=gce.endpoint, credentials=Credentials(token=GCP_TOKEN))
    provider.check_capacity(spec())
    assert all(r["authorization"] == f"Bearer {GCP_TOKEN}" for r in gce.state.requests)


def test_plain_http_endpoint_gets_anonymous_credentials(gcp: Any, gce: FakeGce) -> None:
    gcp.check_capacity(spec())
    assert gce.state.requests and all(r["authorization"] is None for r in gce.state.requests)
    assert gcp.jurisdiction("europe-west4").country == "NL" and gcp.price(spec()) > 0

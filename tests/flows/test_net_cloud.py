"""Whole migrations to cloud targets: `gpumigrate migrate` on an AWS plan (moto's server on loopback) and
on a GCP plan (the loopback Compute Engine endpoint), through every phase, with the cloud harness that
boots each instance's user data / startup script in a network-namespace host (tests/infra/cloud_harness.py).

The source serves on a local host behind a real front door; the flow checks the cloud and residency at
preflight (the bucket's real location through the cloud's API), places the target (zone fallback),
boots it from the plan's launch, the source's agent writes the image to the bucket where the target
reads it, the target restores from there, and parity, the ramp and finalize run. A rollback afterwards
terminates the instance; nothing is left running in moto or the fake.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "infra"))

from cloud_harness import (  # noqa: E402
    CONTROL_SECRET,
    IMAGE_SECRET,
    INSTANCE_PROFILE,
    Cloud,
    Keys,
    booting_cloud,
    bucket_gcs,
    seed_aws,
    seed_gcp,
)
from cloud_helpers import AWS_KEY_ID, AWS_SECRET  # noqa: E402
from gce_fake import FakeGce  # noqa: E402

from gpumigrate.infra import netns as netns_lib  # noqa: E402

_ok, _why = netns_lib.available()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not _ok, reason=f"network namespaces unavailable: {_why}")]

WORKLOAD = "tiny-lm"
MODEL = ("--seed", "0", "--size", "tiny", "--device", "cpu")
AMI = "ami-12c6146b"  # one of moto's built-in images
PROJECT = "test-proj"


# ----------------------------------------------------------------------------- the clouds (as tests/infra has them)
@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def aws_env(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", AWS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_url)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    return moto_url


@pytest.fixture
def gce() -> Iterator[FakeGce]:
    fake = FakeGce().start()
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture
def cloud(moto_url: str, aws_env: str, gce: FakeGce, gm_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cloud]:
    yield from booting_cloud(moto_url, gce, monkeypatch)


@pytest.fixture
def gcs() -> Iterator[Any]:
    yield from bucket_gcs()


# ----------------------------------------------------------------------------- the source
@dataclass
class Source:
    home: Path
    host: Any
    door: Any
    key_file: Path
    keys: Keys

    @property
    def endpoint(self) -> str:
        return f"http://{self.host.address}:{self.host.ports['service']}"

    @property
    def agent(self) -> str:
        return f"{self.host.address}:{self.host.ports['agent']}"


@pytest.fixture
def source(
    gm_home: Path,
    cloud: Cloud,
    gcs: Any,
    prefect_api: str,
    monkeypatch: pytest.MonkeyPatch,
    workload_launch: Callable[..., Any],
) -> Iterator[Source]:
    """The service on a local host, started with the control key the target account's secret holds, and
    the clouds' storage endpoints in its environment (its agent writes the image to the bucket)."""
    from gpumigrate.atomic import atomic_write_bytes
    from gpumigrate.infra.launch import service_url, wait_http
    from gpumigrate.infra.local import LocalProvider
    from gpumigrate.interfaces import HostSpec
    from gpumigrate.traffic.frontdoor import FrontDoor, default_dir

    keys = Keys(control=secrets.token_hex(32), image=secrets.token_hex(32))
    monkeypatch.setenv("GPUMIGRATE_GCS_ENDPOINT", gcs.endpoint)
    monkeypatch.setenv("GPUMIGRATE_CONTROL_KEY", keys.control)  # the orchestrator's and the source's key
    key_file = gm_home / "image.key"
    atomic_write_bytes(key_file, keys.image.encode(), mode=0o600)
    provider = LocalProvider(attached=False)
    door = None
    try:
        host = provider.wait_ready(provider.provision(HostSpec("cloud-src", "local", "local-a")))
        host = provider.bootstrap(host, workload_launch("inference", *MODEL), timeout_s=120)
        wait_http(service_url(host), path="/readyz", timeout_s=120)
        door = FrontDoor.start(
            default_dir(WORKLOAD), source_host=host.address, source_port=host.ports["service"], node_id="cloud-envoy"
        )
        yield Source(gm_home, host, door, key_file, keys)
    finally:
        if door is not None:
            door.stop()
        for h in provider.list_hosts():
            provider.terminate(h)


def write_plan(src: Source, path: Path, *, target: dict[str, Any], store: str, allowed: list[str]) -> Path:
    """The plan states its store's region as the README asks; preflight checks it against the bucket's real one."""
    from tests.support.plans import SERVER, inference_plan

    return inference_plan(
        path,
        name=WORKLOAD,
        source_host="cloud-src",
        endpoint=src.endpoint,
        agent=src.agent,
        key_file=src.key_file,
        model=MODEL,
        target=target,
        workload={"launch": {"argv": [*SERVER, "--name", "{name}", *MODEL], "ready_timeout_s": 180}},
        data={"allowed_jurisdictions": allowed},
        transfer={"store": store, "store_region": target["region"]},
        traffic={"rollback_window_s": 600},
    )
    return path


def bootstrap(identity: str, control: str, image: str) -> dict[str, Any]:
    """The "machine image" has gpumigrate installed for this interpreter; keys come from the secrets."""
    return {
        "python": sys.executable,
        "identity": identity,
        "control_key_secret": control,
        "image_key_secret": image,
        "timeout_s": 180,
    }


def aws_target(**extra: Any) -> dict[str, Any]:
    return {
        "provider": "aws",
        "region": "eu-central-1",
        "zone": "eu-central-1a",
        "instance_type": "g5.xlarge",
        "gpu_model": "A10G",
        "gpu_count": 1,
        "image": AMI,
        "bootstrap": bootstrap(INSTANCE_PROFILE, CONTROL_SECRET, IMAGE_SECRET),
        **extra,
    }


def gcp_target(**extra: Any) -> dict[str, Any]:
    return {
        "provider": "gcp",
        "region": "europe-west4",
        "zone": "europe-west4-a",
        "instance_type": "a2-highgpu-1g",
        "gpu_model": "A100-40GB",
        "gpu_count": 1,
        "bootstrap": bootstrap(
            "gpumigrate-target@test-proj.iam.gserviceaccount.com", "gpumigrate-control-key", "gpumigrate-image-key"
        ),
        **extra,
    }


def run_cli(src: Source, cli_cmd: list[str], prefect_api: str, *args: str, timeout: float = 420) -> Any:
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "GPUMIGRATE_HOME": str(src.home)}
    return subprocess.run([*cli_cmd, *args], env=env, capture_output=True, text=True, timeout=timeout)


def migrate(src: Source, cli_cmd: list[str], prefect_api: str, plan: Path, mid: str) -> tuple[Any, Any]:
    from gpumigrate.traffic.loadgen import LoadProcess

    lp = LoadProcess(src.door.url + "/v1/generate", rps=20, seconds=400)
    try:
        out = run_cli(src, cli_cmd, prefect_api, "migrate", str(plan), "--id", mid, "--json")
    finally:
        lp.stop()
        report = lp.wait(timeout_s=60)
    return out, report


def nothing_running(cloud: Cloud) -> bool:
    """No instance in moto or the fake, no booted machine (the source's local host is not the cloud's)."""
    return (
        not (cloud.ec2 and cloud.ec2.running()) and not (cloud.gce and cloud.gce.running()) and not cloud.harness.booted
    )


def events(home: Path, mid: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (home / "migrations" / mid / "audit.jsonl").read_text().splitlines()]


def result_of(out: Any) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return doc


def completes_then_rolls_back(src: Source, cli_cmd: list[str], prefect_api: str, plan: Path, mid: str) -> Any:
    """Every phase completes with no failed request; a rollback then terminates the instance."""
    out, report = migrate(src, cli_cmd, prefect_api, plan, mid)
    result = result_of(out)
    assert out.returncode == 0 and result["status"] == "completed", (result.get("error"), out.stderr[-3000:])
    assert all(p["status"] == "completed" for p in result["phases"].values())
    assert report.failed == 0 and report.ok > 0, report.errors  # the clients never noticed
    found = {e["event"]: e["data"] for e in events(src.home, mid)}
    assert found["image.verified"]["read_back"] is False and "image.transferred" not in found  # no forwarding
    back = run_cli(src, cli_cmd, prefect_api, "rollback", mid, "--json", timeout=180)
    assert back.returncode == 0, back.stderr[-3000:]
    names = [e["event"] for e in events(src.home, mid)]
    assert "rollback.target_torn_down" in names
    return found


# ----------------------------------------------------------------------------- AWS
def test_migrate_to_aws_completes_every_phase(
    source: Source, cloud: Cloud, aws_env: str, cli_cmd: list[str], prefect_api: str, tmp_path: Path
) -> None:
    seed_aws(aws_env, "eu-central-1", source.keys)
    cloud.harness.exhausted_zones.add("eu-central-1a")  # the plan's zone is full: its fallback is used
    target = aws_target(fallback_zones=["eu-central-1b"])
    plan = write_plan(source, tmp_path / "plan.yaml", target=target, store="s3://gm-aws-e2e/images", allowed=["EU"])
    found = completes_then_rolls_back(source, cli_cmd, prefect_api, plan, "cloud-aws")
    assert found["infra.provisioned"]["zone"] == "eu-central-1b"
    assert found["infra.provisioned"]["zones_tried"] == ["eu-central-1a", "eu-central-1b"]
    assert found["transfer.bucket.ready"]["region"] == "eu-central-1"  # created in the target's region
    s3 = boto3.client("s3", region_name="eu-central-1", endpoint_url=aws_env)
    assert s3.get_bucket_location(Bucket="gm-aws-e2e")["LocationConstraint"] == "eu-central-1"
    assert nothing_running(cloud)


def test_a_bucket_in_a_forbidden_region_is_denied_before_anything_launches(
    source: Source, cloud: Cloud, aws_env: str, cli_cmd: list[str], prefect_api: str, tmp_path: Path
) -> None:
    """The plan says the store is in Frankfurt; the bucket's real location (GetBucketLocation) is Virginia."""
    seed_aws(aws_env, "eu-central-1", source.keys)
    boto3.client("s3", region_name="us-east-1", endpoint_url=aws_env).create_bucket(Bucket="gm-us-images")
    doc = {"store": "s3://gm-us-images/x"}
    plan = write_plan(source, tmp_path / "plan.yaml", target=aws_target(), store=doc["store"], allowed=["EU"])
    out = run_cli(source, cli_cmd, prefect_api, "migrate", str(plan), "--id", "cloud-bucket", "--json")
    result = result_of(out)
    assert out.returncode == 2 and result["status"] == "denied", out.stderr[-3000:]
    assert "us-east-1" in result["error"]
    names = [e["event"] for e in events(source.home, "cloud-bucket")]
    assert "residency.deny" in names and "infra.provisioned" not in names and "image.committed" not in names
    assert cloud.ec2 is not None and cloud.ec2.zones_asked == []  # nothing was launched
    s3 = boto3.client("s3", region_name="us-east-1", endpoint_url=aws_env)
    assert s3.list_objects_v2(Bucket="gm-us-images").get("KeyCount", 0) == 0  # not a byte moved


def test_a_failed_bootstrap_leaves_nothing_running_and_the_source_serving(
    source: Source, cloud: Cloud, aws_env: str, cli_cmd: list[str], prefect_api: str, tmp_path: Path
) -> None:
    seed_aws(aws_env, "eu-central-1", source.keys)
    plan = write_plan(source, tmp_path / "plan.yaml", target=aws_target(), store="s3://gm-aws-boot/x", allowed=["EU"])
    data = yaml.safe_load(plan.read_text())
    data["workload"]["launch"]["argv"] = [
        "{python}",
        "-c",
        "import sys; print('weights /models/tiny missing', flush=True); sys.exit(3)",
    ]
    plan.write_text(yaml.safe_dump(data))
    out = run_cli(source, cli_cmd, prefect_api, "migrate", str(plan), "--id", "cloud-boot", "--json")
    result = result_of(out)
    assert out.returncode != 0 and result["status"] in ("failed", "rolled_back"), out.stderr[-3000:]
    assert "exit status 3" in result["error"] and "weights /models/tiny missing" in result["error"]
    assert nothing_running(cloud)  # the instance was terminated
    import httpx

    assert httpx.post(
        source.endpoint + "/v1/generate", json={"prompt": "hi", "max_new_tokens": 2}, timeout=10
    ).is_success
    names = [e["event"] for e in events(source.home, "cloud-boot")]
    assert "image.committed" not in names  # the source was never frozen or snapshotted


# ----------------------------------------------------------------------------- GCP
def test_migrate_to_gcp_completes_every_phase(
    source: Source,
    cloud: Cloud,
    gce: FakeGce,
    gcs: Any,
    cli_cmd: list[str],
    prefect_api: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GPUMIGRATE_GCP_ENDPOINT", gce.endpoint)
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", PROJECT)
    monkeypatch.setenv("GPUMIGRATE_SECRETMANAGER_ENDPOINT", gce.endpoint)
    cloud.harness.relayed["GPUMIGRATE_GCS_ENDPOINT"] = gcs.endpoint  # the machine reaches GCS as well
    seed_gcp(gce, PROJECT, source.keys)
    plan = write_plan(
        source, tmp_path / "plan.yaml", target=gcp_target(), store="gs://gm-gcp-e2e/images", allowed=["EEA"]
    )
    found = completes_then_rolls_back(source, cli_cmd, prefect_api, plan, "cloud-gcp")
    assert found["transfer.bucket.ready"]["region"].upper() == "EUROPE-WEST4"
    assert gcs.created["gm-gcp-e2e"]["location"].upper() == "EUROPE-WEST4"
    assert nothing_running(cloud) and gce.state.instances == {} and gce.state.firewalls == {}


def test_a_confidential_plan_whose_key_is_held_in_a_forbidden_region_is_denied(
    source: Source, cloud: Cloud, aws_env: str, cli_cmd: list[str], prefect_api: str, tmp_path: Path
) -> None:
    """The image key's secret lives in Virginia (asked of Secrets Manager); the data may stay in the EU only."""
    seed_aws(aws_env, "eu-central-1", source.keys, secret_region="us-east-1")
    sm = boto3.client("secretsmanager", region_name="us-east-1", endpoint_url=aws_env)
    arn = sm.describe_secret(SecretId=IMAGE_SECRET)["ARN"]
    target = aws_target()
    target["bootstrap"]["image_key_secret"] = arn
    plan = write_plan(source, tmp_path / "plan.yaml", target=target, store="s3://gm-aws-key/x", allowed=["EU"])
    data = yaml.safe_load(plan.read_text())
    data["data"]["classification"] = "confidential"
    plan.write_text(yaml.safe_dump(data))
    out = run_cli(source, cli_cmd, prefect_api, "migrate", str(plan), "--id", "cloud-key", "--json")
    result = result_of(out)
    assert out.returncode == 2 and result["status"] == "denied", out.stderr[-3000:]
    assert "key" in result["error"] and "us-east-1" in result["error"]
    denied = [e["data"] for e in events(source.home, "cloud-key") if e["event"] == "residency.deny"]
    assert denied and denied[0]["point"] == "key"
    assert cloud.ec2 is not None and cloud.ec2.zones_asked == []  # nothing was launched

"""The provider registry, plan → HostSpec, and what happens without credentials."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from gce_fake import FakeGce

from gpumigrate.errors import InvalidInputError, ProviderError
from gpumigrate.infra import PROVIDERS, get_provider, spec_from_plan
from gpumigrate.interfaces import Host, HostSpec, Provider
from gpumigrate.plan import parse_plan

REPO = Path(__file__).resolve().parents[2]


def test_registry_names_and_protocol(gce: FakeGce) -> None:
    assert PROVIDERS["local"] == "gpumigrate.infra.local:LocalProvider"
    assert isinstance(get_provider("aws", endpoint_url="http://127.0.0.1:9"), Provider)
    assert isinstance(get_provider("gcp", project="p", api_endpoint=gce.endpoint), Provider)
    with pytest.raises(InvalidInputError, match="unknown provider 'azure': allowed are aws, gcp, local"):
        get_provider("azure")


def test_spec_from_plan_is_stable_and_valid() -> None:
    plan = parse_plan(yaml.safe_load((REPO / "examples" / "gcp-training.yaml").read_text()))
    long_id = "lm-train-20261122-003000-" + "x" * 50
    a = spec_from_plan(plan, migration_id=long_id)
    b = spec_from_plan(plan, migration_id=long_id + "y")
    assert a == spec_from_plan(plan, migration_id=long_id) and a.name != b.name
    assert len(a.name) <= 63 and a.zone == "europe-west4-a" and a.gpu_count == 1
    local = parse_plan(yaml.safe_load((REPO / "examples" / "local-demo.yaml").read_text()))
    assert spec_from_plan(local, migration_id="m").name == "local-b"


def test_aws_without_credentials_is_a_clear_provider_error(monkeypatch: pytest.MonkeyPatch, moto_url: str) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", raising=False)
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", raising=False)
    aws = get_provider("aws", endpoint_url=moto_url)
    spec = HostSpec(name="h", provider="aws", region="us-east-1", instance_type="g5.xlarge")
    with pytest.raises(ProviderError, match="no AWS credentials found in the standard chain"):
        aws.check_capacity(spec)


def test_gcp_without_credentials_is_a_clear_provider_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(ProviderError, match="no Google credentials in the standard chain"):
        get_provider("gcp", project="p")


def test_gcp_wait_ready_times_out(gcp: Any, gce: FakeGce) -> None:
    gce.state.gets_until_running = 10**6
    spec = HostSpec(
        name="slow",
        provider="gcp",
        region="europe-west4",
        zone="europe-west4-a",
        instance_type="a2-highgpu-1g",
        gpu_model="A100-40GB",
        gpu_count=1,
    )
    host = gcp.provision(spec, migration_id="m-slow")
    with pytest.raises(ProviderError, match="not running after 0.2 s"):
        gcp.wait_ready(host, timeout_s=0.2)
    gone = Host(
        name="x", provider="gcp", region="europe-west4", address="", instance_id="never-made", zone="europe-west4-a"
    )
    gcp.terminate(gone)  # already gone: no error


def test_aws_unknown_profile_is_a_provider_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    with pytest.raises(ProviderError, match="could not be created.*no-such-profile"):
        get_provider("aws", profile="no-such-profile")

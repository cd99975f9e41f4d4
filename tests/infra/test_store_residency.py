"""Residency of what holds the data, checked where it really is: the image bucket's location as S3 / GCS
report it (moto, the GCS fake), the classification's need for a key, and the key's own location."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from cloud_harness import BucketGcs, Keys, seed_aws, seed_gcp
from cloud_helpers import example_plan

from gpumigrate.errors import PolicyDeniedError, ResidencyError
from gpumigrate.infra import get_provider
from gpumigrate.infra.residency import (
    check_classification,
    check_store_location,
    key_locations,
    validate_plan_residency,
)
from gpumigrate.plan import parse_plan
from gpumigrate.transfer import store_region
from gpumigrate.transfer.stores import open_store

REPO = Path(__file__).resolve().parents[2]
KEYS = Keys(control="11" * 32, image="22" * 32)


def plan(**changes: Any) -> Any:
    return parse_plan(example_plan("aws-eu.yaml", **changes), "test")


def locate_with(endpoint: str) -> Any:
    return lambda url: store_region(url, endpoint_url=endpoint)


def test_s3_bucket_in_forbidden_region_is_denied_before_a_byte_moves(aws_env: str) -> None:
    s3 = boto3.client("s3", region_name="us-east-1", endpoint_url=aws_env)
    s3.create_bucket(Bucket="gm-images-us")  # us-east-1: no location constraint
    records: list[tuple[str, dict]] = []
    with pytest.raises(ResidencyError) as err:
        check_store_location(
            "s3://gm-images-us/svc", ["EU"], locate=locate_with(aws_env), record=lambda e, d: records.append((e, d))
        )
    assert err.value.exit_code == 2 and "us-east-1" in str(err.value)
    [(event, data)] = records
    assert event == "residency.deny" and (data["point"], data["region"]) == ("bucket", "us-east-1")
    assert s3.list_objects_v2(Bucket="gm-images-us").get("KeyCount") == 0


def test_s3_plan_region_is_not_taken_on_trust(aws_env: str) -> None:
    s3 = boto3.client("s3", region_name="us-east-1", endpoint_url=aws_env)
    s3.create_bucket(Bucket="gm-images-mislabelled")
    with pytest.raises(ResidencyError, match="plan's transfer.store_region says eu-central-1"):
        check_store_location(
            "s3://gm-images-mislabelled/x", ["EU", "US"], locate=locate_with(aws_env), plan_region="eu-central-1"
        )


def test_s3_bucket_created_in_the_target_region_then_allowed(aws_env: str) -> None:
    store = open_store("s3://gm-images-new/svc", endpoint_url=aws_env)
    assert store.ensure_bucket("eu-central-1") == "eu-central-1"  # type: ignore[attr-defined]
    assert store.ensure_bucket("us-east-1") == "eu-central-1"  # type: ignore[attr-defined]  # found, not moved
    s3 = boto3.client("s3", region_name="eu-central-1", endpoint_url=aws_env)
    block = s3.get_public_access_block(Bucket="gm-images-new")["PublicAccessBlockConfiguration"]
    assert all(block.values())
    rule = s3.get_bucket_encryption(Bucket="gm-images-new")["ServerSideEncryptionConfiguration"]["Rules"][0]
    assert rule["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"
    decision = check_store_location(
        "s3://gm-images-new/svc", ["DE"], locate=locate_with(aws_env), plan_region="eu-central-1"
    )
    assert (decision.verdict, decision.point, decision.region) == ("allow", "bucket", "eu-central-1")


def test_gcs_bucket_location_from_gcs(gcs: BucketGcs) -> None:
    # A multi-region bucket ("US") is no region of the map: denied, not guessed.
    with pytest.raises(ResidencyError, match="not in the residency map"):
        check_store_location("gs://gm-us-bucket/x", ["EU"], locate=locate_with(gcs.endpoint))
    store = open_store("gs://gm-eu-bucket/x", endpoint_url=gcs.endpoint)
    assert store.ensure_bucket("europe-west4") == "europe-west4"  # type: ignore[attr-defined]
    iam = gcs.created["gm-eu-bucket"]["iamConfiguration"]
    assert iam["uniformBucketLevelAccess"]["enabled"] and iam["publicAccessPrevention"] == "enforced"
    decision = check_store_location("gs://gm-eu-bucket/x", ["NL"], locate=locate_with(gcs.endpoint))
    assert (decision.verdict, decision.region) == ("allow", "europe-west4")


def test_missing_bucket_is_denied_not_guessed(aws_env: str) -> None:
    with pytest.raises(ResidencyError, match="could not be read"):
        check_store_location("s3://gm-no-such-bucket/x", ["EU"], locate=locate_with(aws_env))


def test_file_and_stream_stores_keep_their_rules(aws_env: str) -> None:
    def never(url: str) -> str:
        raise AssertionError("no cloud call for file/stream stores")

    assert check_store_location("file:///tmp/s", ["LOCAL"], locate=never).verdict == "allow"
    stream = check_store_location(
        "stream://10.0.0.5:7443", ["EU"], locate=never, target_provider="gcp", target_region="europe-west4"
    )
    assert stream.point == "stream"


def test_confidential_plan_without_a_key_is_denied() -> None:
    records: list[tuple[str, dict]] = []
    bare = plan(**{"transfer.encryption_key": None, "target.bootstrap.image_key_secret": None})
    with pytest.raises(PolicyDeniedError) as err:
        check_classification(bare, record=lambda e, d: records.append((e, d)))
    assert err.value.exit_code == 2 and err.value.rule == "data-classification"
    assert "transfer.encryption_key" in str(err.value)
    assert records[0][0] == "residency.deny" and records[0][1]["rule"] == "data-classification"
    internal = plan(
        **{
            "data.classification": "internal",
            "transfer.encryption_key": None,
            "target.bootstrap.image_key_secret": None,
        }
    )
    assert [d.verdict for d in check_classification(internal)] == ["allow"]
    with pytest.raises(PolicyDeniedError):
        validate_plan_residency(bare)  # plan validation and the preflight both stop it


def test_cli_plan_validate_confidential_without_key_exits_2(tmp_path: Path, gm_home: Path, cli_cmd: list[str]) -> None:
    data = yaml.safe_load((REPO / "examples" / "aws-eu.yaml").read_text())
    del data["transfer"]["encryption_key"]
    del data["target"]["bootstrap"]["image_key_secret"]
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    out = subprocess.run([*cli_cmd, "plan", "validate", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "data-classification" in out.stderr and "Traceback" not in out.stderr


def test_key_held_in_a_forbidden_region_is_denied(aws_env: str) -> None:
    seed_aws(aws_env, "eu-central-1", KEYS, secret_region="us-east-1")
    arn = boto3.client("secretsmanager", region_name="us-east-1", endpoint_url=aws_env).describe_secret(
        SecretId="gpumigrate/image-key"
    )["ARN"]
    provider = get_provider("aws", endpoint_url=aws_env)
    held_us = plan(**{"target.bootstrap.image_key_secret": arn})
    where = key_locations(held_us, provider)
    assert where == [("aws", "us-east-1")]
    records: list[tuple[str, dict]] = []
    with pytest.raises(ResidencyError, match="key: .*us-east-1"):
        check_classification(held_us, key_locations=where, record=lambda e, d: records.append((e, d)))
    assert [e for e, _ in records] == ["residency.allow", "residency.deny"] and records[1][1]["point"] == "key"

    seed_aws(aws_env, "eu-central-1", KEYS)
    held_eu = plan(**{"target.bootstrap.image_key_secret": "gpumigrate/image-key"})
    assert key_locations(held_eu, provider) == [("aws", "eu-central-1")]
    assert [d.verdict for d in check_classification(held_eu, key_locations=key_locations(held_eu, provider))] == [
        "allow",
        "allow",
    ]


def test_gcp_key_replicas_count(gce: Any) -> None:
    gcp_plan = yaml.safe_load((REPO / "examples" / "gcp-training.yaml").read_text())
    gcp_plan["data"]["classification"] = "confidential"
    parsed = parse_plan(gcp_plan, "gcp")
    provider = get_provider("gcp", project="test-proj", api_endpoint=gce.endpoint, secret_manager_endpoint=gce.endpoint)
    seed_gcp(gce, "test-proj", KEYS, locations=("europe-west4",))
    assert [d.verdict for d in check_classification(parsed, key_locations=key_locations(parsed, provider))] == [
        "allow",
        "allow",
    ]
    seed_gcp(gce, "test-proj", KEYS, locations=("europe-west4", "us-central1"))
    with pytest.raises(ResidencyError, match="us-central1"):
        check_classification(parsed, key_locations=key_locations(parsed, provider))
    seed_gcp(gce, "test-proj", KEYS, locations=())  # automatic replication: Google chooses where
    with pytest.raises(ResidencyError, match="automatic replication"):
        check_classification(parsed, key_locations=key_locations(parsed, provider))


def test_the_locator_leaves_push_callable() -> None:
    """The preflight asks store_region before the transfer phase calls push (same module, transfer/push.py)."""
    code = "from gpumigrate.transfer import store_region; from gpumigrate.transfer import push, verify; print(callable(push), callable(verify))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "True"]

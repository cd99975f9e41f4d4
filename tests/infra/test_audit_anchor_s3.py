"""The S3 audit anchor against moto's real server: object lock enforced, heads kept as locked versions."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from cloud_helpers import AWS_SECRET, files_containing

from gpumigrate.audit import AuditLog
from gpumigrate.audit_anchor import anchor_from_url
from gpumigrate.errors import IntegrityError, InvalidInputError
from gpumigrate.infra.anchor_s3 import S3ObjectLockAnchor
from gpumigrate.state import Migration


@pytest.fixture
def s3(aws_env: str) -> Any:
    return boto3.client("s3", region_name="us-east-1")


@pytest.fixture
def locked_bucket(s3: Any) -> str:
    name = f"audit-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name, ObjectLockEnabledForBucket=True)
    return name


def test_heads_are_locked_versions(gm_home: Path, locked_bucket: str, s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"s3://{locked_bucket}/heads?mode=COMPLIANCE&days=2"
    monkeypatch.setenv("GPUMIGRATE_AUDIT_ANCHORS", f"file,{url}")
    m = Migration.create("m-s3", "x: 1\n")
    for weight in (1, 50, 100):
        m.record("traffic.stage", {"weight": weight})
    anchor = anchor_from_url(url)
    assert isinstance(anchor, S3ObjectLockAnchor) and anchor.describe() == f"s3://{locked_bucket}/heads"
    (chain,) = anchor.chains(m.audit.anchor_name)
    heads = anchor.heads(m.audit.anchor_name, chain)
    assert [h["count"] for h in heads] == [1, 2, 3, 4]
    verified = m.verify_audit()
    assert [a["latest_count"] for a in verified.anchors] == [4, 4]

    key = f"heads/{next(iter(s3.list_objects_v2(Bucket=locked_bucket)['Contents']))['Key'].split('/', 1)[1]}"
    versions = s3.list_object_versions(Bucket=locked_bucket, Prefix=key)["Versions"]
    first = s3.head_object(Bucket=locked_bucket, Key=key, VersionId=versions[0]["VersionId"])
    assert first["ObjectLockMode"] == "COMPLIANCE" and first["ObjectLockRetainUntilDate"]
    with pytest.raises(ClientError) as denied:  # the lock holds: no one removes a head
        s3.delete_object(Bucket=locked_bucket, Key=key, VersionId=versions[0]["VersionId"])
    assert denied.value.response["Error"]["Code"] == "AccessDenied"


def test_truncation_caught_by_s3_alone(gm_home: Path, locked_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The local anchor rewritten too (its directory is writable by the attacker): the locked heads still tell."""
    import shutil

    anchors_dir = gm_home.parent / "local-anchors"
    monkeypatch.setenv("GPUMIGRATE_AUDIT_ANCHORS", f"{anchors_dir.as_uri()},s3://{locked_bucket}/h")
    m = Migration.create("m-trunc", "x: 1\n")
    m.record("residency.deny", {"region": "us-east-1"})
    m.record("phase.preflight.failed", {})
    lines = m.audit.path.read_bytes().splitlines(keepends=True)
    m.audit.path.write_bytes(b"".join(lines[:1]))
    shutil.rmtree(anchors_dir)  # and the local heads gone
    with pytest.raises(IntegrityError, match=f"truncated: the head anchored in s3://{locked_bucket}/h .* counts 3"):
        m.verify_audit()


def test_bucket_without_object_lock_is_refused(gm_home: Path, s3: Any) -> None:
    plain = f"plain-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=plain)
    log = AuditLog(gm_home / "audit" / "policy.jsonl", anchors=[anchor_from_url(f"s3://{plain}/x")])
    with pytest.raises(InvalidInputError, match="object lock"):
        log.append("residency.allow", {})


@pytest.mark.parametrize("url", ["s3://b/p?mode=NEVER", "s3://b/p?days=0", "s3://b/p?days=x", "s3://b/p?color=red"])
def test_bad_anchor_urls_are_invalid_input(url: str) -> None:
    with pytest.raises(InvalidInputError):
        anchor_from_url(url)


def test_cli_audit_checks_an_extra_anchor(
    gm_home: Path, locked_bucket: str, cli_cmd: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"s3://{locked_bucket}/cli"
    monkeypatch.setenv("GPUMIGRATE_AUDIT_ANCHORS", f"file,{url}")
    m = Migration.create("m-cli", "x: 1\n")
    m.record("rollback.requested", {"reason": "[/bold] not markup"})
    env = {**os.environ, "GPUMIGRATE_AUDIT_ANCHORS": "file"}  # the auditor's own settings name the file only
    out = subprocess.run([*cli_cmd, "audit", "m-cli", "--json", "--anchor", url], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.splitlines()[-1])
    assert [(a["anchor"], a["latest_count"]) for a in doc["anchors"]][1] == (url, 2)
    human = subprocess.run([*cli_cmd, "audit", "m-cli", "--anchor", url], env=env, capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert human.returncode == 0 and "[/bold] not markup" in human.stderr, human.stderr
    assert not files_containing(gm_home, [AWS_SECRET])

"""The actor of audit records: STS caller identity (moto's server), Google credentials, Prefect Cloud user."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from cloud_helpers import AWS_SECRET

from gpumigrate.audit import AuditLog
from gpumigrate.infra.identity import resolve_identity
from gpumigrate.settings import Identity, identity, set_identity_resolver


@pytest.fixture
def no_cloud(no_cloud_credentials: None) -> None:
    """No credentials but the ones a test plants."""


def test_sts_caller_identity_from_moto(aws_env: str, no_cloud: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAPLANTEDKEY000001")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
    found = resolve_identity()
    assert found is not None and found.auth == "aws-sts"
    assert found.name.startswith("arn:aws:") and AWS_SECRET not in found.name


def test_cli_records_carry_the_sts_identity(aws_env: str, gm_home: Path, cli_cmd: list[str], repo: Path) -> None:
    out = subprocess.run([*cli_cmd, "plan", "validate", "examples/local-demo.yaml"], cwd=repo, env=dict(os.environ),
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    (record,) = AuditLog(gm_home / "audit" / "policy.jsonl").records()[:1]
    assert record["identity"]["auth"] == "aws-sts" and record["actor"].startswith("arn:aws:")
    assert AWS_SECRET not in (gm_home / "audit" / "policy.jsonl").read_text()


def test_without_credentials_the_operator_is_recorded_unauthenticated(
    no_cloud: None, gm_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUMIGRATE_OPERATOR", "carol")
    assert resolve_identity() is None
    set_identity_resolver(resolve_identity)
    try:
        assert identity() == Identity("carol", "none")
        record = AuditLog(gm_home / "x.jsonl").append("residency.allow", {})
        assert record.count == 1
        assert AuditLog(gm_home / "x.jsonl").records()[0]["identity"] == {"name": "carol", "auth": "none"}
    finally:
        set_identity_resolver(None)


def test_an_sts_that_fails_falls_back_with_a_warning(
    no_cloud: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAPLANTEDKEY000001")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    with caplog.at_level(logging.WARNING):
        assert resolve_identity(["aws"]) is None
    assert "identity source aws failed" in caplog.text and AWS_SECRET not in caplog.text


def test_google_service_account_email(no_cloud: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    info = {
        "type": "service_account", "project_id": "p1", "private_key_id": "k1", "private_key": pem.decode(),
        "client_email": "mover@p1.iam.gserviceaccount.com", "client_id": "1",
        "token_uri": "http://127.0.0.1:9/token",
    }  # fmt: skip
    creds = tmp_path / "sa.json"
    creds.write_text(json.dumps(info))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(creds))
    assert resolve_identity() == Identity("mover@p1.iam.gserviceaccount.com", "gcp")


def _prefect_cloud(method: str, path: str, headers: Mapping[str, str], body: bytes) -> tuple[int, Any]:
    """The one route of Prefect Cloud's API that identity needs: GET /api/me/ with a bearer key."""
    if method != "GET" or path != "/api/me/" or headers.get("Authorization") != "Bearer pnu_planted":
        return 401, {"detail": "unauthorized"}
    return 200, {"id": "u1", "handle": "dana", "email": "dana@example.com"}


@pytest.fixture
def prefect_cloud(json_http: Callable[[Any], str]) -> str:
    return json_http(_prefect_cloud) + "/api"


def test_prefect_cloud_user(
    no_cloud: None, prefect_cloud: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PREFECT_CLOUD_API_URL", prefect_cloud)
    monkeypatch.setenv("PREFECT_API_KEY", "pnu_planted")
    assert resolve_identity() == Identity("dana", "prefect")
    monkeypatch.setenv("PREFECT_API_KEY", "pnu_wrong")
    with caplog.at_level(logging.WARNING):
        assert resolve_identity() is None
    assert "identity source prefect failed" in caplog.text and "pnu_wrong" not in caplog.text


def test_identity_lookup_can_be_turned_off(aws_env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUMIGRATE_IDENTITY", "none")
    assert resolve_identity() is None

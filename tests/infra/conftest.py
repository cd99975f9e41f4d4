"""Fixtures for infra tests: moto's real server on loopback, and the fake Compute Engine endpoint."""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the fake GCE module next to this file

from cloud_harness import cloud, gcs  # noqa: E402,F401  (the booting cloud; GCS that creates buckets)
from cloud_helpers import AWS_KEY_ID, AWS_SECRET  # noqa: E402
from gce_fake import FakeGce  # noqa: E402


@pytest.fixture(scope="session")
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
    """The standard boto3 credential chain (environment) pointed at moto, with planted secrets."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", AWS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_url)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    return moto_url


@pytest.fixture
def aws(aws_env: str) -> Any:
    from gpumigrate.infra import get_provider

    return get_provider("aws", endpoint_url=aws_env, poll_interval_s=0.05)


@pytest.fixture
def ec2_of(aws_env: str) -> Any:
    """A plain boto3 EC2 client per region, to inspect moto's state independently of the provider."""

    def make(region: str) -> Any:
        return boto3.client("ec2", region_name=region, endpoint_url=aws_env)

    return make


@pytest.fixture
def migration_id() -> str:
    return f"mig-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def gce() -> Iterator[FakeGce]:
    fake = FakeGce().start()
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture
def gcp(gce: FakeGce) -> Any:
    from gpumigrate.infra import get_provider

    return get_provider("gcp", project="test-proj", api_endpoint=gce.endpoint, poll_interval_s=0.02)

"""Fixtures for transfer tests: keys, float data, a moto S3 server and a fake GCS server on loopback."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from transfer_fake_gcs import FakeGcs  # noqa: E402


@pytest.fixture(autouse=True)
def own_state_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's own $XDG_STATE_HOME (and its CLI subprocesses'): the record of the newest image each store gave
    a URL without an id (transfer/latest.py) lives there, never in the home directory of whoever runs the tests.
    It gives the code nothing a user's shell lacks: every shell has a state home."""
    home = tmp_path / "xdg-state"
    monkeypatch.setenv("XDG_STATE_HOME", str(home))
    return home


@pytest.fixture
def key() -> bytes:
    return os.urandom(32)


@pytest.fixture
def store(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


FAKE_AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def moto_endpoint(moto_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The moto endpoint, with fake credentials set for this test only."""
    for name, value in FAKE_AWS_ENV.items():
        monkeypatch.setenv(name, value)
    return moto_server


@pytest.fixture
def s3_bucket(moto_endpoint: str, request: pytest.FixtureRequest) -> str:
    import boto3

    name = "gm-" + request.node.name.lower().replace("_", "-")[:40].strip("-")
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(
        Bucket=name, CreateBucketConfiguration={"LocationConstraint": "eu-central-1"}
    )
    return name


@pytest.fixture
def fake_gcs() -> Iterator[FakeGcs]:
    server = FakeGcs({"gm-bucket": "EUROPE-WEST4"})
    try:
        yield server
    finally:
        server.close()

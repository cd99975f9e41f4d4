"""Fixtures for transfer tests: keys, float data, a moto S3 server and a fake GCS server on loopback."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_gcs import FakeGcs  # noqa: E402


@pytest.fixture
def key() -> bytes:
    return os.urandom(32)


@pytest.fixture
def store(tmp_path: Path) -> str:
    return f"file://{tmp_path / 'store'}"


def bf16_weights(n: int, seed: int = 0) -> np.ndarray:
    """n bf16 values from normal(0, 0.02), as uint16 bit patterns (numpy has no bfloat16)."""
    x = np.random.default_rng(seed).standard_normal(n, dtype=np.float32) * np.float32(0.02)
    return (x.view(np.uint32) >> 16).astype(np.uint16)


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


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

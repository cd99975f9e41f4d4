"""End to end through the real CLI and flow: a residency denial exits 2 before anything is launched
or any byte moves — proven by reading moto's EC2 and S3 state afterwards."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import boto3
import pytest
import yaml
from cloud_helpers import all_instances

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_migrate_to_forbidden_region_launches_nothing_moves_nothing(
    tmp_path: Path, aws_env: str, gm_home: Path, cli_cmd: list[str], ec2_of: object
) -> None:
    s3 = boto3.client("s3", region_name="us-east-1", endpoint_url=aws_env)
    s3.create_bucket(Bucket="gm-deny-images")
    data = yaml.safe_load((REPO / "examples" / "aws-eu.yaml").read_text())
    data["target"].update(region="us-east-1", zone="us-east-1a", instance_type="p4d.24xlarge", gpu_model="A100-40GB")
    data["target"].pop("fallback_zones")  # the example's zones are in its own region
    data["transfer"].update(store="s3://gm-deny-images/x", store_region="us-east-1", encryption_key={"env": "GM_KEY"})
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    out = subprocess.run(
        [*cli_cmd, "migrate", str(plan), "--id", "deny-e2e", "--json"],
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "data-residency" in out.stderr and "us-east-1" in out.stderr
    audit = [json.loads(x) for x in (gm_home / "migrations" / "deny-e2e" / "audit.jsonl").read_text().splitlines()]
    denials = [r["data"] for r in audit if r["event"] == "residency.deny"]
    assert denials and denials[0]["region"] == "us-east-1" and denials[0]["rule"] == "data-residency"
    assert all_instances(ec2_of("us-east-1"), "deny-e2e") == []  # nothing provisioned
    assert s3.list_objects_v2(Bucket="gm-deny-images").get("KeyCount", 0) == 0  # no byte moved

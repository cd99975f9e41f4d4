"""``gpumigrate capacity`` as a real subprocess against moto and the fake GCE; and the credential scan:
planted secrets never reach the state root, the audit log, logs or CLI output."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

import yaml
from cloud_helpers import AWS_KEY_ID, AWS_SECRET, GCP_TOKEN, all_instances, files_containing
from gce_fake import FakeGce

from gpumigrate.infra import get_provider, provision_host, spec_from_plan
from gpumigrate.plan import parse_plan
from gpumigrate.state import Migration

REPO = Path(__file__).resolve().parents[2]


def write_plan(tmp_path: Path, example: str, **target: Any) -> Path:
    data = yaml.safe_load((REPO / "examples" / example).read_text())
    if "region" in target:  # the example's fallback zones belong to its own region
        data["target"].pop("fallback_zones", None)
    data["target"].update(target)
    path = tmp_path / f"plan-{len(list(tmp_path.glob('plan-*')))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run(cli_cmd: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cli_cmd, *args], capture_output=True, text=True, timeout=90, env=os.environ.copy())


def test_cli_capacity_aws(tmp_path: Path, aws_env: str, gm_home: Path, cli_cmd: list[str]) -> None:
    ok = run(
        cli_cmd,
        "capacity",
        str(write_plan(tmp_path, "aws-eu.yaml", instance_type="p4d.24xlarge", gpu_model="A100-40GB")),
        "--json",
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout.splitlines()[-1])["report"]["gpus"] == "8 x A100"
    # moto's offering data has no p5.48xlarge in eu-central-1: a capacity refusal, exit 2, no traceback
    no = run(cli_cmd, "capacity", str(write_plan(tmp_path, "aws-eu.yaml")))
    assert no.returncode == 2 and "denied by capacity" in no.stderr and "eu-central-1" in no.stderr
    assert "Traceback" not in no.stderr


def test_cli_capacity_gcp_quota(tmp_path: Path, gm_home: Path, cli_cmd: list[str], monkeypatch: Any) -> None:
    fake = FakeGce().start()
    try:
        fake.state.quotas["europe-west4"]["NVIDIA_A100_GPUS"] = [1, 1]
        monkeypatch.setenv("GPUMIGRATE_GCP_ENDPOINT", fake.endpoint)
        monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "cli-proj")
        out = run(cli_cmd, "capacity", str(write_plan(tmp_path, "gcp-training.yaml")))
        assert out.returncode == 2 and "denied by quota" in out.stderr and "NVIDIA_A100_GPUS" in out.stderr
        assert fake.state.inserts() == [] and fake.state.instances == {}
        assert any(r["path"].endswith("/regions/europe-west4") for r in fake.state.requests)
    finally:
        fake.stop()


def test_cli_capacity_residency_first(tmp_path: Path, aws_env: str, gm_home: Path, cli_cmd: list[str]) -> None:
    plan = write_plan(tmp_path, "aws-eu.yaml", region="us-west-2", zone="us-west-2a")
    out = run(cli_cmd, "capacity", str(plan))
    assert out.returncode == 2 and "data-residency" in out.stderr and "us-west-2" in out.stderr
    records = [json.loads(x) for x in (gm_home / "audit" / "policy.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "residency.deny" and records[-1]["data"]["region"] == "us-west-2"


def test_planted_credentials_never_written(
    tmp_path: Path, aws_env: str, gm_home: Path, cli_cmd: list[str], ec2_of: Any
) -> None:
    log_file = gm_home / "logs" / "run.log"
    log_file.parent.mkdir()
    handler = logging.FileHandler(log_file)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    fake = FakeGce().start()
    outputs: list[str] = []
    try:
        # AWS: a whole provision recorded into a migration's state and audit log
        data = yaml.safe_load((REPO / "examples" / "aws-eu.yaml").read_text())
        data["target"].update(
            region="us-east-1",
            zone="us-east-1a",
            instance_type="p4d.24xlarge",
            gpu_model="A100-40GB",
            image="ami-12c6146b",
        )
        data["target"].pop("fallback_zones")  # the example's zones are in its own region
        data["data"]["allowed_jurisdictions"] = ["US"]
        data["transfer"]["store_region"] = "us-east-1"
        plan = parse_plan(data)
        m = Migration.create("secret-scan-aws", yaml.safe_dump(data))
        aws = get_provider("aws", poll_interval_s=0.05)  # credentials from the environment chain
        host = provision_host(
            aws,
            spec_from_plan(plan, migration_id=m.id),
            migration_id=m.id,
            allowed_jurisdictions=["US"],
            record=m.record,
        )
        m.record("host.ready", {"address": aws.wait_ready(host, timeout_s=30).address})
        aws.terminate(host)
        assert all_instances(ec2_of("us-east-1"), m.id)
        # GCP: a token planted as explicit credentials
        from google.oauth2.credentials import Credentials

        gcp_data = yaml.safe_load((REPO / "examples" / "gcp-training.yaml").read_text())
        gplan = parse_plan(gcp_data)
        g = Migration.create("secret-scan-gcp", yaml.safe_dump(gcp_data))
        gcp = get_provider("gcp", project="p", api_endpoint=fake.endpoint, credentials=Credentials(token=GCP_TOKEN))
        provision_host(
            gcp,
            spec_from_plan(gplan, migration_id=g.id),
            migration_id=g.id,
            allowed_jurisdictions=["EEA"],
            record=g.record,
        )
        assert fake.state.requests[-1]["authorization"] == f"Bearer {GCP_TOKEN}"  # the token was really used
        # the CLI with the planted environment
        for args in (
            ["capacity", str(write_plan(tmp_path, "aws-eu.yaml"))],
            ["plan", "validate", str(REPO / "examples" / "aws-eu.yaml")],
            ["cost", str(REPO / "examples" / "aws-eu.yaml"), "--json"],
        ):
            out = run(cli_cmd, *args)
            outputs += [out.stdout, out.stderr]
    finally:
        fake.stop()
        root.removeHandler(handler)
        root.setLevel(old_level)
        handler.close()
    assert log_file.read_text() and (gm_home / "migrations" / "secret-scan-aws" / "audit.jsonl").exists()
    assert files_containing(gm_home, [AWS_SECRET, AWS_KEY_ID, GCP_TOKEN]) == []
    assert not any(s in o for o in outputs for s in (AWS_SECRET, AWS_KEY_ID, GCP_TOKEN))

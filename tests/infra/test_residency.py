"""Residency: the region map, the decision at each enforcement point, and the audit record."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import botocore.session
import pytest
import yaml
from cloud_helpers import example_plan

from gpumigrate.audit import AuditLog
from gpumigrate.errors import InvalidInputError, ResidencyError
from gpumigrate.infra import residency
from gpumigrate.infra.residency import check_region, check_store, evaluate_region, validate_plan_residency
from gpumigrate.plan import load_plan, parse_plan

REPO = Path(__file__).resolve().parents[2]


def test_every_botocore_region_is_mapped() -> None:
    data = botocore.session.get_session().get_data("endpoints")
    regions = {r for p in data["partitions"] for r in p["regions"]}
    missing = sorted(r for r in regions if residency.lookup("aws", r) is None)
    assert missing == ["eu-isoe-west-1"]  # documented as deliberately unmapped: denied


@pytest.mark.parametrize(
    ("provider", "region", "country", "blocs"),
    [
        ("aws", "eu-central-1", "DE", ("EEA", "EU")),
        ("aws", "eu-west-2", "GB", ()),
        ("aws", "eu-central-2", "CH", ("EFTA",)),
        ("aws", "us-gov-west-1", "US", ()),
        ("gcp", "europe-west4", "NL", ("EEA", "EU")),
        ("gcp", "europe-north1", "FI", ("EEA", "EU")),
        ("gcp", "me-central2", "SA", ()),
        ("local", "local-b", "LOCAL", ("LOCAL",)),
    ],
)
def test_map_entries(provider: str, region: str, country: str, blocs: tuple[str, ...]) -> None:
    j = residency.jurisdiction(provider, region)
    assert (j.country, j.blocs) == (country, blocs) and j.source


def test_unknown_region_is_denied_not_guessed() -> None:
    with pytest.raises(ResidencyError, match="not in the residency map") as err:
        residency.jurisdiction("aws", "eu-mars-1")
    assert err.value.exit_code == 2 and err.value.region == "eu-mars-1"
    assert evaluate_region("gcp", "europe-west99", ["EU"]).verdict == "deny"
    with pytest.raises(InvalidInputError, match="unknown provider"):
        residency.jurisdiction("azure", "westeurope")


def test_allow_rules_country_bloc_any() -> None:
    assert evaluate_region("aws", "eu-west-1", ["IE"]).verdict == "allow"
    assert evaluate_region("aws", "eu-north-1", ["EEA"]).verdict == "allow"
    assert evaluate_region("aws", "us-east-1", ["US"]).verdict == "allow"
    assert evaluate_region("aws", "eu-west-2", ["EU"]).verdict == "deny"  # GB left the EU
    assert evaluate_region("aws", "eu-west-2", ["ANY"]).verdict == "allow"
    assert evaluate_region("local", "local-b", ["EU"]).verdict == "deny"


def test_check_region_records_then_raises() -> None:
    seen: list[tuple[str, dict]] = []
    with pytest.raises(ResidencyError) as err:
        check_region("gcp", "us-central1", ["EU"], point="provision", record=lambda e, d: seen.append((e, d)))
    assert err.value.rule == "data-residency" and "us-central1" in str(err.value)
    event, data = seen[0]
    assert event == "residency.deny"
    assert data | {"reason": ""} == {
        "rule": "data-residency",
        "point": "provision",
        "provider": "gcp",
        "region": "us-central1",
        "jurisdiction": {"country": "US", "blocs": []},
        "allowed": ["EU"],
        "verdict": "deny",
        "reason": "",
    }


def test_store_checks() -> None:
    assert check_store("s3://bucket/x", "eu-central-1", ["EU"]).region == "eu-central-1"
    with pytest.raises(ResidencyError, match="us-east-1"):
        check_store("s3://bucket/x", "us-east-1", ["EU"])
    with pytest.raises(ResidencyError, match="store_region is not set"):
        check_store("gs://bucket", None, ["EU"])
    assert check_store("gs://bucket", "europe-west4", ["NL"]).provider == "gcp"
    assert check_store("file:///tmp/s", None, ["LOCAL"]).verdict == "allow"
    with pytest.raises(ResidencyError):
        check_store("file:///tmp/s", None, ["EU"])
    assert check_store("file:///mnt/nfs", "eu-west-1", ["EU"]).verdict == "allow"  # operator says where the disk is
    stream = check_store("stream://10.0.0.5:7443", None, ["EU"], target_provider="gcp", target_region="europe-west4")
    assert (stream.point, stream.region) == ("stream", "europe-west4")
    with pytest.raises(ResidencyError, match="stream"):
        check_store("stream://10.0.0.5:7443", None, ["EU"], target_provider="aws", target_region="us-west-2")


def _plan_dict(**changes: object) -> dict:
    return example_plan("aws-eu.yaml", **changes)


def test_validate_plan_residency() -> None:
    decisions = validate_plan_residency(load_plan(REPO / "examples" / "aws-eu.yaml"))
    assert [d.point for d in decisions] == ["plan", "store", "classification"]
    assert all(d.verdict == "allow" for d in decisions)
    store_us = parse_plan(_plan_dict(**{"transfer.store_region": "us-east-1"}))
    with pytest.raises(ResidencyError, match="store: .*us-east-1"):
        validate_plan_residency(store_us)


def _write_plan(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_cli_plan_validate_denies_with_exit_2_and_audit(tmp_path: Path, gm_home: Path, cli_cmd: list[str]) -> None:
    moved = {"target.region": "us-east-1", "target.zone": "us-east-1a", "target.fallback_zones": []}
    plan = _write_plan(tmp_path, _plan_dict(**moved))
    out = subprocess.run(
        [*cli_cmd, "plan", "validate", str(plan), "--json"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2, out.stderr
    assert "data-residency" in out.stderr and "us-east-1" in out.stderr
    denial = json.loads(out.stdout.splitlines()[-1])["plans"][0]["denied"]
    assert denial["rule"] == "data-residency" and denial["region"] == "us-east-1"
    log = AuditLog(gm_home / "audit" / "policy.jsonl")
    log.verify()
    [rec] = log.records()
    assert (
        rec["event"] == "residency.deny" and rec["data"]["region"] == "us-east-1" and rec["data"]["allowed"] == ["EU"]
    )


def test_cli_plan_validate_allows_examples(gm_home: Path, cli_cmd: list[str]) -> None:
    plans = [str(p) for p in sorted((REPO / "examples").glob("*.yaml"))]
    out = subprocess.run([*cli_cmd, "plan", "validate", *plans], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    events = [r["event"] for r in AuditLog(gm_home / "audit" / "policy.jsonl").records()]
    assert events and set(events) == {"residency.allow"}

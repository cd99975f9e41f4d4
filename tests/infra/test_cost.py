"""Cost model arithmetic on known prices, the residency-aware planner, and ``gpumigrate cost``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpumigrate.errors import InvalidInputError
from gpumigrate.infra import pricing
from gpumigrate.infra.cost import Placement, estimate, evaluate_move, plan_moves, propose_moves
from gpumigrate.plan import Plan, parse_plan

# Known prices from prices.json (as_of 2026-10-01), USD/h: p4d.24xlarge in eu-central-1 and eu-west-1.
SRC_HOURLY, DST_HOURLY = 26.791, 24.595


def plan_data(**over: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "workload": {
            "name": "svc",
            "kind": "training",
            "source_host": "i-1",
            "source_provider": "aws",
            "source_region": "eu-central-1",
            "source_instance_type": "p4d.24xlarge",
            "launch": {"argv": ["{python}", "train.py"]},
        },
        "target": {
            "provider": "aws",
            "region": "eu-west-1",
            "zone": "eu-west-1c",
            "instance_type": "p4d.24xlarge",
            "gpu_model": "A100-40GB",
            "gpu_count": 8,
        },
        "data": {"classification": "internal", "allowed_jurisdictions": ["EU"]},
        "transfer": {"store": "s3://images-eu-west-1/svc", "store_region": "eu-west-1"},
        "traffic": {
            "stages": [{"weight": 50, "hold_s": 1800}, {"weight": 100, "hold_s": 1800}],
            "rollback_window_s": 3600,
        },
        "cost": {"horizon_hours": 720, "min_savings_usd": 0},
    }
    for key, value in over.items():
        section, field = key.split("__")
        data[section][field] = value
    return data


def make_plan(**over: Any) -> Plan:
    return parse_plan(plan_data(**over))


def test_prices_file_is_dated_and_sourced() -> None:
    data = pricing.price_data()
    assert data["as_of"] == "2026-10-01" and {"aws", "gcp", "aws_egress", "gcp_egress"} <= set(data["sources"])
    assert pricing.hourly("aws", "eu-central-1", "p4d.24xlarge") == SRC_HOURLY
    assert pricing.hourly("local", "local-b", None) == 0.0
    with pytest.raises(InvalidInputError, match="priced regions are"):
        pricing.hourly("aws", "sa-east-1", "p4d.24xlarge")
    with pytest.raises(InvalidInputError, match="known types are"):
        pricing.hourly("gcp", "europe-west4", "z9-giant")


def test_estimate_arithmetic() -> None:
    est = estimate(make_plan(), image_bytes=100 * 10**9)
    # egress: eu-central-1 -> bucket in eu-west-1 (inter-region 0.02/GB), bucket -> target in eu-west-1 (0.02/GB)
    assert [h.path for h in est.egress_hops] == ["inter_region", "intra_region"]
    assert est.egress_usd == pytest.approx(100 * (0.02 + 0.02))
    # dual running: target for setup 0.5 h + ramp 1 h, source warm through the 1 h rollback window
    assert est.overlap_hours == pytest.approx(1.5) and est.rollback_window_hours == pytest.approx(1.0)
    assert est.dual_running_usd == pytest.approx(DST_HOURLY * 1.5 + SRC_HOURLY * 1.0)
    migration = 4.0 + DST_HOURLY * 1.5 + SRC_HOURLY
    assert est.migration_cost_usd == pytest.approx(migration)
    assert est.hourly_savings_usd == pytest.approx(SRC_HOURLY - DST_HOURLY)
    assert est.savings_usd == pytest.approx((SRC_HOURLY - DST_HOURLY) * 720)
    assert est.net_savings_usd == pytest.approx((SRC_HOURLY - DST_HOURLY) * 720 - migration)
    assert est.break_even_hours == pytest.approx(migration / (SRC_HOURLY - DST_HOURLY))
    assert est.to_dict()["break_even_hours"] == round(migration / (SRC_HOURLY - DST_HOURLY), 4)


def test_stream_and_cross_cloud_egress() -> None:
    plan = make_plan(transfer__store="stream://10.0.0.9:7443", transfer__store_region=None)
    est = estimate(plan, Placement("gcp", "europe-west4", "a2-highgpu-8g"), image_bytes=10 * 10**9)
    assert [(h.path, h.usd_per_gb) for h in est.egress_hops] == [("internet", 0.09)]  # billed by AWS, the sender
    assert est.egress_usd == pytest.approx(0.9)


def test_image_size_estimated_from_gpu_memory() -> None:
    est = estimate(make_plan())
    assert est.image_estimated and est.image_gb == 8 * 40


def test_no_savings_never_breaks_even() -> None:
    est = estimate(make_plan(workload__source_region="us-east-1"), image_bytes=0)  # cheaper source
    assert est.hourly_savings_usd < 0 and est.break_even_hours is None


def test_planner_never_proposes_forbidden_regions() -> None:
    cands = [
        "aws:us-east-1:p4d.24xlarge",
        "aws:eu-west-2:p4d.24xlarge",
        "aws:eu-west-1:p4d.24xlarge",
        "gcp:europe-west4",
        "aws:eu-mars-1:p4d.24xlarge",
    ]
    moves = plan_moves(make_plan(), cands, image_bytes=10**10)
    labels = [p.target.label for p in moves.proposals]
    # us-east-1 is cheapest but outside the EU; eu-west-2 is London (not EU); eu-mars-1 is unknown
    assert "aws:us-east-1:p4d.24xlarge" not in labels and "aws:eu-west-2:p4d.24xlarge" not in labels
    assert labels == ["aws:eu-west-1:p4d.24xlarge", "gcp:europe-west4:a2-highgpu-8g"]  # ranked by net savings
    nets = [p.estimate.net_savings_usd for p in moves.proposals]
    assert nets == sorted(nets, reverse=True)
    rejected = {r["target"]: r["reason"] for r in moves.rejected}
    assert set(rejected) == {"aws:us-east-1:p4d.24xlarge", "aws:eu-west-2:p4d.24xlarge", "aws:eu-mars-1:p4d.24xlarge"}
    assert "outside the allowed jurisdictions EU" in rejected["aws:us-east-1:p4d.24xlarge"]
    assert [p.target.label for p in propose_moves(make_plan(), cands)] == labels


def test_planner_skips_the_source_and_unpriced() -> None:
    moves = plan_moves(make_plan(), ["aws:eu-central-1:p4d.24xlarge", "aws:eu-south-1:p4d.24xlarge"])
    assert moves.proposals == []
    assert [r["reason"] for r in moves.rejected][0] == "this is where the workload runs now"
    assert "no aws price" in moves.rejected[1]["reason"]
    with pytest.raises(InvalidInputError, match="provider:region"):
        plan_moves(make_plan(), ["eu-west-1"])


def test_evaluate_move_go_and_no_go() -> None:
    records: list[str] = []
    go = evaluate_move(make_plan(), image_bytes=10**11, record=lambda e, d: records.append(e))
    assert go.go and go.target == "aws:eu-west-1:p4d.24xlarge" and go.break_even_hours is not None
    assert go.savings_usd == pytest.approx(go.estimate.net_savings_usd) and records == ["residency.allow"]
    high_bar = evaluate_move(make_plan(cost__min_savings_usd=100_000), image_bytes=10**11)
    assert not high_bar.go and "below the minimum" in high_bar.reason
    forbidden = evaluate_move(make_plan(cost__candidates=["aws:us-east-1:p4d.24xlarge"]))
    assert not forbidden.go and forbidden.target is None and "outside the allowed" in forbidden.reason


def test_no_difference_per_hour_reads_the_same_never_minus_zero(
    tmp_path: Path, gm_home: Path, cli_cmd: list[str]
) -> None:
    same = {
        "workload__source_region": "us-east-1",
        "target__region": "us-east-2",
        "target__zone": "us-east-2a",
        "data__allowed_jurisdictions": ["US"],
        "transfer__store": "s3://images-us-east-2/svc",
        "transfer__store_region": "us-east-2",
    }
    decision = evaluate_move(make_plan(**same), image_bytes=10**10)
    assert not decision.go and "-0.00" not in decision.reason
    assert (
        decision.reason == "aws:us-east-2:p4d.24xlarge costs the same per hour as the source (21.96 USD/h): no savings"
    )
    dearer = evaluate_move(make_plan(workload__source_region="us-east-1"), image_bytes=10**10)
    assert (
        dearer.reason
        == f"aws:eu-west-1:p4d.24xlarge costs {DST_HOURLY - 21.96:.2f} USD/h more than the source: no savings"
    )
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan_data(**same)))
    out = subprocess.run([*cli_cmd, "cost", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "costs the same per hour" in out.stderr, out.stderr
    assert "-0.00" not in out.stderr and "$0.00" in out.stderr  # the savings over the horizon
    path.write_text(yaml.safe_dump(plan_data(workload__source_region="us-east-1")))
    out = subprocess.run([*cli_cmd, "cost", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "more than the source" in out.stderr, out.stderr
    assert "-$" in out.stderr and "$-" not in out.stderr  # a loss reads -$67.70, its sign before the dollar


def test_cli_cost_json(tmp_path: Path, gm_home: Path, cli_cmd: list[str]) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan_data(cost__candidates=["aws:eu-west-1", "aws:us-east-1"])))
    out = subprocess.run(
        [*cli_cmd, "cost", str(path), "--json", "--image-gb", "100", "--hours", "100"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.splitlines()[-1])
    est = doc["estimate"]
    assert est["horizon_hours"] == 100 and est["image_gb"] == 100 and not est["image_estimated"]
    assert est["egress_usd"] == pytest.approx(4.0)
    assert est["savings_usd"] == pytest.approx(round((SRC_HOURLY - DST_HOURLY) * 100, 4))
    assert [p["target"] for p in doc["proposals"]] == ["aws:eu-west-1:p4d.24xlarge"]
    assert doc["rejected"][0]["target"] == "aws:us-east-1" and doc["decision"]["go"] is True


def test_cli_cost_human_and_bad_flags(cli_cmd: list[str], gm_home: Path, repo: Path) -> None:
    ok = subprocess.run(
        [*cli_cmd, "cost", str(repo / "examples" / "gcp-training.yaml")], capture_output=True, text=True, timeout=60
    )
    assert ok.returncode == 0 and "break-even" in ok.stderr
    bad = subprocess.run(
        [*cli_cmd, "cost", str(repo / "examples" / "gcp-training.yaml"), "--hours", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--hours must be more than 0" in bad.stderr and "Traceback" not in bad.stderr


def test_cli_cost_denies_forbidden_target(tmp_path: Path, gm_home: Path, cli_cmd: list[str]) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan_data(target__region="us-east-1", target__zone="us-east-1a")))
    out = subprocess.run([*cli_cmd, "cost", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "data-residency" in out.stderr and "us-east-1" in out.stderr

"""The scheduled cost-driven move decides both ways; the deployments in prefect.yaml are real flows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def _plan(tmp_path: Path, **cost: Any) -> Path:
    data = {
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
            "region": "eu-central-1",
            "zone": "eu-central-1a",
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
        "cost": {"horizon_hours": 720, "candidates": ["aws:eu-west-1:p4d.24xlarge"], **cost},
    }
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_cost_flow_triggers_the_migrate_deployment_when_it_pays(
    prefect_api: str, gm_home: Path, tmp_path: Path
) -> None:
    from gpumigrate.flows.cost_move import cost_move_flow

    calls: list[tuple[str, dict[str, Any]]] = []
    out = cost_move_flow(
        str(_plan(tmp_path, min_savings_usd=0)),
        image_bytes=10**11,
        trigger=lambda name, params: calls.append((name, params)),
    )
    assert out["go"] and out["triggered"] and out["target"] == "aws:eu-west-1:p4d.24xlarge"
    assert calls and calls[0][0] == "migrate/migrate"
    derived = yaml.safe_load(Path(calls[0][1]["plan_path"]).read_text())
    assert derived["target"]["region"] == "eu-west-1" and derived["target"]["instance_type"] == "p4d.24xlarge"
    log = [json.loads(x) for x in (gm_home / "audit" / "cost-moves.jsonl").read_text().splitlines()]
    assert [r["event"] for r in log][-1] == "cost.triggered"
    assert any(r["event"] == "residency.allow" for r in log)


def test_cost_flow_does_nothing_below_the_threshold(prefect_api: str, gm_home: Path, tmp_path: Path) -> None:
    from gpumigrate.flows.cost_move import cost_move_flow

    calls: list[Any] = []
    out = cost_move_flow(
        str(_plan(tmp_path, min_savings_usd=1_000_000)), image_bytes=10**11, trigger=lambda *a: calls.append(a)
    )
    assert not out["go"] and not out["triggered"] and calls == []
    assert "minimum" in out["reason"]


def test_cost_flow_never_moves_where_residency_forbids(gm_home: Path, tmp_path: Path) -> None:
    """The decision function without Prefect: a cheaper region outside the EU is never triggered."""
    from gpumigrate.flows.cost_move import decide_and_trigger

    path = _plan(tmp_path, min_savings_usd=0, candidates=["aws:us-east-1:p4d.24xlarge"])
    calls: list[Any] = []
    out = decide_and_trigger(path, trigger=lambda *a: calls.append(a), image_bytes=10**11)
    assert not out["triggered"] and calls == [] and "outside the allowed" in out["reason"]


@pytest.mark.parametrize(
    "deployment", yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"], ids=lambda d: d["name"]
)
def test_prefect_yaml_deployments_point_at_real_flows(deployment: dict[str, Any]) -> None:
    from prefect.flows import Flow, load_flow_from_entrypoint

    path, _, func = deployment["entrypoint"].partition(":")
    assert (REPO / path).is_file(), deployment["entrypoint"]
    flow = load_flow_from_entrypoint(str(REPO / path) + ":" + func)
    assert isinstance(flow, Flow)
    params = set(flow.parameters.properties)
    assert set(deployment.get("parameters") or {}) <= params, f"unknown parameters for {flow.name}"
    for schedule in deployment.get("schedules") or []:
        from prefect.client.schemas.schedules import construct_schedule

        construct_schedule(cron=schedule["cron"], timezone=schedule.get("timezone"))


def test_prefect_yaml_names_match_what_the_code_calls() -> None:
    from gpumigrate.flows.cost_move import MIGRATE_DEPLOYMENT
    from gpumigrate.flows.host_actions import deployment_name

    names = {(d["entrypoint"], d["name"]) for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]}
    assert ("flows/migrate.py:migrate_flow", MIGRATE_DEPLOYMENT.split("/")[1]) in names
    assert ("flows/rollback.py:rollback_flow", "rollback") in names
    assert ("flows/host_actions.py:host_action_flow", deployment_name("local-a").split("/")[1]) in names

"""Schedules ship paused: a cost-driven move launches nothing until an operator turns its schedule on."""

from __future__ import annotations

from pathlib import Path

import yaml
from prefect.cli.deploy._schedules import _schedule_config_to_deployment_schedule
from prefect.client.schemas.actions import DeploymentScheduleCreate

REPO = Path(__file__).resolve().parents[2]


def test_every_shipped_schedule_is_paused() -> None:
    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    scheduled = {d["name"]: d["schedules"] for d in deployments if d.get("schedules")}
    assert "cost-move" in scheduled  # the cost-driven move is scheduled, and so paused
    for name, schedules in scheduled.items():
        for config in schedules:
            # What `prefect deploy` makes of it: the schedule Prefect creates is inactive.
            created = DeploymentScheduleCreate(**_schedule_config_to_deployment_schedule(config))
            assert created.active is False, f"deployment {name} ships an active schedule: {config}"

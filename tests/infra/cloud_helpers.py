"""Helpers shared by the infra tests (importable because tests/infra/conftest.py puts this folder on sys.path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]

# Planted credentials: tests scan everything a run wrote for these strings.
AWS_KEY_ID = "AKIAPLANTEDKEY000001"
AWS_SECRET = "planted-aws-secret-9f3c1e7d5b"
GCP_TOKEN = "ya29.planted-gcp-token-4b1d"


def live_instances(ec2: Any, migration_id: str) -> list[dict[str, Any]]:
    resp = ec2.describe_instances(
        Filters=[
            {"Name": "tag:gpumigrate:migration-id", "Values": [migration_id]},
            {"Name": "instance-state-name", "Values": ["pending", "running"]},
        ]
    )
    return [i for r in resp["Reservations"] for i in r["Instances"]]


def all_instances(ec2: Any, migration_id: str) -> list[dict[str, Any]]:
    resp = ec2.describe_instances(Filters=[{"Name": "tag:gpumigrate:migration-id", "Values": [migration_id]}])
    return [i for r in resp["Reservations"] for i in r["Instances"]]


def files_containing(root: Path, needles: list[str]) -> list[str]:
    """Every file under ``root`` that holds one of ``needles`` (bytes match)."""
    hits = []
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            hits += [f"{path}: {n}" for n in needles if n.encode() in data]
    return hits


def example_plan(name: str = "aws-eu.yaml", **changes: Any) -> dict[str, Any]:
    """An example plan as data, with ``changes`` by dotted path (``"target.region"``); None drops a field."""
    data = yaml.safe_load((REPO / "examples" / name).read_text())
    for dotted, value in changes.items():
        node = data
        *path, leaf = dotted.split(".")
        for key in path:
            node = node[key]
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return data

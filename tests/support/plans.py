"""The plan the flow tests migrate most: the reference inference server (``gpumigrate.workloads.inference``) on a
local host, moved to another host behind the front door, with golden inputs and a two-stage ramp under gates."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

SERVER = ["{python}", "-m", "gpumigrate.workloads.inference", "--host", "{host}", "--port", "{service_port}"]


def inference_plan(
    path: Path,
    *,
    name: str,
    source_host: str,
    endpoint: str,
    agent: str,
    key_file: Path,
    model: Sequence[str],
    target: str | Mapping[str, Any],
    **sections: Mapping[str, Any],
) -> Path:
    """Write to ``path`` the plan of a migration of the reference server at ``endpoint`` (agent at ``agent``, its
    model arguments ``model``) to ``target`` (a local host's name, or a whole ``target`` section), its image sealed
    with the key in ``key_file``; golden inputs beside it. Each keyword replaces the keys it names in that top-level
    section (``snapshot={"precopy_rounds": 2}``, ``traffic={"rollback_window_s": 0}``)."""
    from gpumigrate.flows.demo import golden_inputs

    plan: dict[str, Any] = {
        "version": 1,
        "workload": {
            "name": name,
            "kind": "inference",
            "source_host": source_host,
            "endpoint": endpoint,
            "agent": agent,
            "source_region": "local-a",
            "launch": {"argv": [*SERVER, "--name", "{name}", *model]},
        },
        "target": {"provider": "local", "region": "local-b", "host": target} if isinstance(target, str) else target,
        "data": {"classification": "internal", "allowed_jurisdictions": ["LOCAL"]},
        "snapshot": {"precopy_rounds": 1},
        "transfer": {"store": "file://store", "encryption_key": {"file": str(key_file)}, "parallelism": 2},
        "parity": {
            "golden_inputs": str(golden_inputs(path.parent / "golden.jsonl")),
            "request": {
                "path": "/v1/generate",
                "compare": [{"field": "tokens", "kind": "exact"}, {"field": "logprobs", "kind": "numeric"}],
            },
            "atol": 1e-4,
            "rtol": 1e-3,
        },
        "traffic": {
            "stages": [{"weight": 50, "hold_s": 1}, {"weight": 100, "hold_s": 1}],
            "gates": {"min_success_rate": 0.99, "max_p99_ratio": 4.0, "min_requests": 3, "failures_to_rollback": 2},
            "analysis_interval_s": 0.5,
            "rollback_window_s": 0,
        },
    }
    for section, keys in sections.items():
        plan[section] = {**plan.get(section, {}), **keys}
    path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return path

"""`gpumigrate rollback ID` acts before anything slow loads (issue 35, finding 5: it took 13 s to act, 21 s to return,
and as long for a migration already rolled back): every request goes back to the source before Prefect is so much as
imported, and an idempotent rollback answers without it. How fast: bench/rollback.py (a figure, never a test).

The migration is one a cut-over leaves: its record in the rollback window (made through the flows' own RunContext),
a front door (`gpumigrate frontdoor up`, real Envoy) with the target at 100%.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml


def _answer(side: str) -> Callable[[str, str, Mapping[str, str], bytes], tuple[int, Any]]:
    return lambda method, path, headers, body: (200, {"side": side})


def _cut_over(home: Path, source: str, target: str, mid: str) -> Path:
    from gpumigrate.flows.context import RunContext
    from gpumigrate.traffic import frontdoor
    from gpumigrate.traffic.state import StateStore, split

    plan = home / f"{mid}.yaml"
    plan.write_text(yaml.safe_dump({
        "version": 1,
        "workload": {"name": "cli-svc", "kind": "inference", "source_host": "local-a", "endpoint": source,
                     "agent": "127.0.0.1:9", "launch": {"argv": ["{python}", "service.py"]}},
        "target": {"provider": "local", "region": "local-b", "host": "cli-b"},
        "data": {"classification": "internal", "allowed_jurisdictions": ["LOCAL"]},
        "transfer": {"store": "file://store"},
    }))  # fmt: skip
    ctx = RunContext.create(plan, migration_id=mid, resume=False)
    door_dir = ctx.traffic_dir()
    nodes = frontdoor.read(door_dir).nodes
    parts = urlsplit(target)
    frontdoor.add_target(door_dir, parts.hostname or "127.0.0.1", parts.port or 80, nodes=nodes)
    store = StateStore(door_dir)
    store.wait_applied(store.set_weights(split("source", "target", 100)).version, nodes, timeout_s=30)
    ctx.update(target_endpoint=target, rollback_deadline=time.time() + 600)
    ctx.migration.update(status="completed")
    return door_dir


def test_the_rollback_command_moves_traffic_before_prefect_loads_and_answers_again_at_once(
    cli_cmd: list[str], gm_home: Path, json_http: Callable[..., str]
) -> None:
    from gpumigrate.traffic.frontdoor import read
    from gpumigrate.traffic.state import StateStore

    env = {**os.environ, "GPUMIGRATE_HOME": str(gm_home)}
    env.pop("PREFECT_API_URL", None)
    source, target = json_http(_answer("source")), json_http(_answer("target"))
    up = subprocess.run([*cli_cmd, "frontdoor", "up", "--source", source, "--listen", "127.0.0.1:0"], env=env,
                        capture_output=True, text=True, timeout=180)  # fmt: skip
    assert up.returncode == 0, up.stderr
    try:
        door_dir = _cut_over(gm_home, source, target, "cli-rb")
        # -X importtime lists every module as it is imported, in order: the traffic decision must come first.
        argv = [sys.executable, "-X", "importtime", "-m", "gpumigrate", "rollback", "cli-rb", "--json"]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout.strip().splitlines()[-1])["status"] == "rolled_back"
        imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "import time:" in line]
        assert imported and not any(name.split(".")[0] == "prefect" for name in imported), "Prefect was loaded"
        assert StateStore(door_dir).read().weights == {"source": 100.0, "target": 0.0}
        statuses = StateStore(door_dir).statuses()
        assert all(s.get("applied", -1) >= StateStore(door_dir).read().version for s in statuses.values())
        assert read(door_dir).nodes and len(statuses) == len(read(door_dir).nodes)
        audit = [json.loads(x) for x in (gm_home / "migrations" / "cli-rb" / "audit.jsonl").read_text().splitlines()]
        names = [e["event"] for e in audit]
        assert (
            names.index("rollback.requested") < names.index("traffic.rolled_back") < names.index("rollback.completed")
        )

        again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0 and "already rolled back" in again.stderr
        assert not any(" prefect" in line for line in again.stderr.splitlines() if "import time:" in line)
    finally:
        subprocess.run([*cli_cmd, "frontdoor", "down"], env=env, capture_output=True, timeout=120)

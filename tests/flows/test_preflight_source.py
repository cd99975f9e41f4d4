"""Preflight proves what it can of the running source before anything is provisioned (issue 35, findings 1-4): a
health or ready path that does not answer as the launch contract needs, a parity request the source does not answer
with every compared field, an image key the source's own environment lacks, a front door that checks another path.
Each is exit 2 (`denied`) naming what to fix, with no host started and the source never frozen. Found later, each
cost a target started and torn down (minutes), or a freeze and a rollback.

The source is a user's own service (tests/agent/kv_service.py) started as the README starts one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.own_service import Source, door_up, migrate, phase, service_plan, untouched


def _with_key_from_env(doc: dict[str, Any]) -> None:
    doc["transfer"]["encryption_key"] = {"env": "KV_IMAGE_KEY"}  # set for `migrate`, not in the source's environment


CASES: list[tuple[str, Callable[[dict[str, Any]], None], tuple[str, ...], str]] = [
    (
        "health-path",
        lambda d: d["workload"].update(health_path="/livez"),
        ("the source's workload.health_path GET", "/livez answered HTTP 404", "answers 200 while the process lives"),
        "/readyz",
    ),
    (
        "ready-path",
        lambda d: d["workload"].update(ready_path="/nope"),
        ("the source's workload.ready_path GET", "/nope answered HTTP 404", "the service has no such path"),
        "/nope",
    ),
    (
        "door-path",
        lambda d: d["workload"].update(ready_path="/v1/state"),
        ("the front door health-checks the source on GET /readyz", "--health-path /v1/state`"),
        "/readyz",
    ),
    (
        "parity-path",
        lambda d: d["parity"]["request"].update(path="/v1/predictions"),
        ("golden case c0 (POST /v1/predictions) asked of the source", "answered HTTP 404"),
        "/readyz",
    ),
    (
        "missing-field",
        lambda d: d["parity"]["request"].update(
            compare=[{"field": "y", "kind": "numeric"}, {"field": "embedding", "kind": "numeric"}]
        ),
        ("the answer has no field 'embedding' (parity.request.compare names it)", "the answer's fields are y"),
        "/readyz",
    ),
    (
        "key",
        _with_key_from_env,
        ("the workload's agent (pid", "cannot read the image key", "environment variable KV_IMAGE_KEY is not set"),
        "/readyz",
    ),
]


def test_a_source_that_cannot_do_what_the_plan_asks_is_refused_in_preflight(
    source: Source, cli_cmd: list[str], tmp_path: Path
) -> None:
    """One source and one front door for every case (the door's path set by `frontdoor up --health-path`)."""
    source.env["KV_IMAGE_KEY"] = source.key_file.read_text().strip()  # `migrate`'s shell has it, the source not
    for case, edit, says, door_path in CASES:
        door_up(source, cli_cmd, health_path=door_path)
        code, result, err = migrate(source, cli_cmd, service_plan(source, tmp_path / f"{case}.yaml", edit), case)
        assert code == 2 and result.get("status") == "denied", (case, err[-3000:])
        for text in says:
            assert text in result["error"], (case, result["error"])
        assert "nothing was moved" in result["error"] or case in ("door-path", "key"), result["error"]
        assert phase(source, case, "provision") == "pending"
        untouched(source)

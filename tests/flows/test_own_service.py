"""A user's own service (tests/agent/kv_service.py: a small torch model behind Starlette embedding gpumigrate.agent,
not the reference server) through `gpumigrate migrate`: migrated under load with 0 failed requests and exact
parity; and bad input, each a clear message naming what is wrong and what is allowed, the documented exit code, no
traceback, and nothing harmed: the source keeps serving, never frozen, and no target is left running.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.own_service import Source, X
from tests.support.own_service import door_up as _door_up
from tests.support.own_service import gm as _gm
from tests.support.own_service import migrate as _migrate
from tests.support.own_service import phase as _phase
from tests.support.own_service import service_plan as _plan
from tests.support.own_service import untouched as _untouched


@pytest.mark.parametrize("restore_from", ["store", "source"])
def test_a_service_outside_the_package_migrates_under_load_with_exact_parity(
    source: Source, cli_cmd: list[str], tmp_path: Path, restore_from: str
) -> None:
    """With ``restore_from: source`` the target is filled from the service's own memory (host memory here)."""
    from gpumigrate.traffic.frontdoor import read
    from gpumigrate.traffic.loadgen import LoadProcess
    from gpumigrate.traffic.state import StateStore

    _door_up(source, cli_cmd)
    door = source.home / "traffic" / "kv"

    def edit(doc: dict[str, Any]) -> None:
        doc["parity"]["atol"] = doc["parity"]["rtol"] = 0  # the same floats, bit for bit
        doc["transfer"]["restore_from"] = restore_from
        doc["traffic"] = {
            "stages": [{"weight": 50, "hold_s": 1}, {"weight": 100, "hold_s": 1}],
            "gates": {"min_requests": 3, "max_p99_ratio": 4.0},
            "analysis_interval_s": 0.5,
        }

    load = LoadProcess(str(read(door).listener) + "/v1/predict", rps=20, seconds=240, body={"x": X})
    try:
        code, result, err = _migrate(source, cli_cmd, _plan(source, tmp_path / "plan.yaml", edit), "kv-1")
    finally:
        load.stop()
        report = load.wait()
    assert code == 0 and result["status"] == "completed", err[-3000:]
    assert result["parity"] == {"passed": True, "cases": 3, "max_abs_err": 0.0}
    assert report.failed == 0 and report.ok > 20, report.errors
    assert StateStore(door).read().weights == {"source": 0.0, "target": 100.0}
    audit = [json.loads(x) for x in (source.home / "migrations" / "kv-1" / "audit.jsonl").read_text().splitlines()]
    loads = [e["data"] for e in audit if e["event"] in ("image.preloaded", "image.restored")]
    filled = [d["from_source"]["chunks"] for d in loads if "from_source" in d]
    assert (sum(filled) > 0) if restore_from == "source" else not filled


def test_the_front_door_keeps_a_frozen_source_and_its_clients_wait(source: Source, cli_cmd: list[str]) -> None:
    """A frozen source stays in the door's rotation (its readiness path says it holds requests), and a client's
    request is held at the safe point until the resume, never refused."""
    import threading

    from gpumigrate.snapshot.client import AgentClient
    from gpumigrate.traffic.frontdoor import read, source_healthy

    _door_up(source, cli_cmd)
    door = source.home / "traffic" / "kv"
    listener = str(read(door).listener)
    answers: list[httpx.Response] = []
    with AgentClient(source.agent, timeout_s=30) as agent:
        agent.request_freeze(lease_s=30)
        try:
            assert httpx.get(source.endpoint + "/readyz", timeout=5).status_code == 200  # held, not refused
            time.sleep(1.5)  # three of Envoy's health checks (every 0.5 s) while frozen
            assert source_healthy(door)
            client = threading.Thread(
                target=lambda: answers.append(httpx.post(listener + "/v1/predict", json={"x": X}, timeout=30))
            )
            client.start()
            time.sleep(0.5)
            assert answers == []  # held at the safe point
        finally:
            agent.request_resume()
    client.join(timeout=30)
    assert [a.status_code for a in answers] == [200]


def test_without_a_front_door_exit_2_says_how_to_start_it_before_anything_is_provisioned(
    source: Source, cli_cmd: list[str], tmp_path: Path
) -> None:
    code, result, err = _migrate(source, cli_cmd, _plan(source, tmp_path / "plan.yaml"), "no-door")
    assert code == 2 and result["status"] == "denied"
    # One instruction, the README's own command (no --workload, which the README never shows).
    assert result["error"] == (
        f"denied by front-door: no front door fronts {source.endpoint}: start it with "
        f"`gpumigrate frontdoor up --source {source.endpoint}`"
    )
    assert _phase(source, "no-door", "provision") == "pending"
    _untouched(source)


def test_a_launch_that_exits_at_once_names_its_stderr_and_tears_the_target_down(
    source: Source, cli_cmd: list[str], tmp_path: Path
) -> None:
    _door_up(source, cli_cmd)
    crash = "import sys; sys.stderr.write('cannot load the model: weights.bin missing\\n'); sys.exit(3)"

    def edit(doc: dict[str, Any]) -> None:
        doc["workload"]["launch"]["argv"] = ["{python}", "-c", crash]

    code, result, err = _migrate(source, cli_cmd, _plan(source, tmp_path / "plan.yaml", edit), "crash")
    assert code == 1 and result["status"] == "failed", err[-2000:]
    assert "exit code 3" in result["error"] and "weights.bin missing" in result["error"]
    state = json.loads((source.home / "migrations" / "crash" / "state.json").read_text())
    assert state["runtime"].get("target_torn_down") is True
    _untouched(source)


@pytest.mark.parametrize(
    ("edit", "says", "code"),
    [
        (lambda d: d["workload"].pop("launch"), "workload.launch: required with snapshot.backend agent", 2),
        (lambda d: d["parity"].pop("request"), "parity.request: required with parity.golden_inputs", 2),
        (lambda d: d["parity"]["request"].update(path="v1/predict"), "parity.request.path", 2),
    ],
    ids=["no-launch", "no-request", "relative-path"],
)
def test_an_invalid_service_plan_exits_2_before_anything_is_recorded(
    tmp_path: Path, gm_home: Path, cli_cmd: list[str], edit: Callable[[dict[str, Any]], None], says: str, code: int
) -> None:
    src = Source(gm_home, {**os.environ, "GPUMIGRATE_HOME": str(gm_home)}, "http://127.0.0.1:9", "127.0.0.1:9",
                 tmp_path / "image.key")  # fmt: skip
    out = _gm(cli_cmd, src.env, "migrate", str(_plan(src, tmp_path / "plan.yaml", edit)), "--id", "bad", "--json")
    assert out.returncode == code and says in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert not (gm_home / "migrations" / "bad").exists()


def _training(doc: dict[str, Any]) -> None:
    doc["workload"].update(kind="training", launch={"argv": ["{python}", "train.py"]})
    doc["workload"].pop("endpoint")
    doc.pop("traffic")
    doc["parity"] = {"training": {"steps": 3}}


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda d: d.update(traffic={"stages": [{"weight": 100}]}), "traffic: a training job has no clients"),
        (lambda d: d["snapshot"].update(backend="criu"), "snapshot.backend criu: a training job moves with the agent"),
        (lambda d: d["workload"].pop("agent"), "workload.agent: a training job needs its agent's address"),
        (
            lambda d: d["parity"].update(
                golden_inputs="golden.jsonl", request={"path": "/x", "compare": [{"field": "y", "kind": "exact"}]}
            ),
            "parity.golden_inputs / parity.request: these ask a service",
        ),  # fmt: skip
    ],
    ids=["ramp", "criu", "no-agent", "golden"],
)
def test_a_training_plan_the_flow_cannot_run_exits_2_before_anything_is_provisioned(
    tmp_path: Path, gm_home: Path, cli_cmd: list[str], prefect_api: str, edit: Callable[[dict[str, Any]], None],
    says: str,
) -> None:  # fmt: skip
    src = Source(gm_home, {**os.environ, "GPUMIGRATE_HOME": str(gm_home), "PREFECT_API_URL": prefect_api},
                 "http://127.0.0.1:9", "127.0.0.1:9", tmp_path / "image.key")  # fmt: skip

    def both(doc: dict[str, Any]) -> None:
        _training(doc)
        edit(doc)

    code, result, _ = _migrate(src, cli_cmd, _plan(src, tmp_path / "plan.yaml", both), "bad-train")
    assert code == 2 and result["status"] == "denied" and says in result["error"], result.get("error")
    assert _phase(src, "bad-train", "provision") == "pending"
    from gpumigrate.infra import get_provider

    assert get_provider("local").list_hosts() == []

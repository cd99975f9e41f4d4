"""Training loops that cannot prove a move (issue 35, finding 2): one that never calls ``step.report`` is refused in
preflight (exit 2, no host started); a target that reports no loss, or trains to its end and exits, is found at once
after the restore (no retry against a target that is gone), and the migration reads rolled back (exit 3) because
the source, resumed by the undo, trains on.

The loop below is a user's plain PyTorch loop: ``REPORT=0`` in its environment leaves ``step.report`` out, ``STEPS``
is where it ends (the plan's launch gives the target its own).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
LOOP = """
import json, os, time
import torch
import gpumigrate.agent as gm

REPORT = os.environ.get("REPORT", "1") == "1"
STEPS = int(os.environ.get("STEPS", "100000"))
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
state = {"step": 0, "data": torch.Generator().manual_seed(1)}
handle = gm.attach(model, optimizer=optimizer, state=state)
while state["step"] < STEPS:
    with handle.safe_point() as step:
        x = torch.randn(16, 8, generator=state["data"])
        loss = torch.nn.functional.mse_loss(model(x), x[:, :1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        state["step"] += 1
        if REPORT:
            step.report(loss=loss.item())
    print(json.dumps({"event": "step", "step": state["step"]}), flush=True)
    time.sleep(0.02)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gm(cli_cmd: list[str], env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cli_cmd, *args], env=env, capture_output=True, text=True, timeout=600)


@dataclass
class Loop:
    env: dict[str, str]
    agent: str
    proc: subprocess.Popen[bytes]
    log: Path
    folder: Path

    def steps(self) -> int:
        lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.startswith('{"event": "step"')]
        return int(json.loads(lines[-1])["step"]) if lines else 0

    def plan(self, path: Path, **launch_env: str) -> Path:
        doc = yaml.safe_load((REPO / "examples" / "train" / "plan.yaml").read_text())
        doc["workload"].update(agent=self.agent, launch={"argv": ["{python}", "loop.py"], "cwd": str(self.folder),
                                                         "env": launch_env, "ready_timeout_s": 60})  # fmt: skip
        doc["target"]["host"] = "own-loop-b"
        doc["parity"]["training"]["steps"] = 3
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path


@pytest.fixture
def loop(
    request: pytest.FixtureRequest, tmp_path: Path, gm_home: Path, prefect_api: str, cli_cmd: list[str]
) -> Iterator[Loop]:
    """The source: the loop above, started as the README starts one; ``REPORT`` from the test's parameter."""
    (tmp_path / "loop.py").write_text(LOOP)
    env = {**os.environ, "GPUMIGRATE_HOME": str(gm_home), "PREFECT_API_URL": prefect_api, "OMP_NUM_THREADS": "1"}
    env.pop("GPUMIGRATE_AWAIT_RESTORE", None)
    key_file = tmp_path / "train.key"
    assert _gm(cli_cmd, env, "image", "keygen", "--out", str(key_file)).returncode == 0
    env["GPUMIGRATE_TRAIN_KEY"] = key_file.read_text().strip()
    agent = f"127.0.0.1:{_free_port()}"
    log = tmp_path / "source.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "loop.py"], cwd=tmp_path, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
            env={**env, "GPUMIGRATE_AGENT_ADDR": agent, "REPORT": getattr(request, "param", "1")},
        )  # fmt: skip
    source = Loop(env, agent, proc, log, tmp_path)
    try:
        deadline = time.monotonic() + 120
        while source.steps() < 5:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
            time.sleep(0.1)
        yield source
    finally:
        from gpumigrate.infra import get_provider

        provider = get_provider("local")
        for host in provider.list_hosts():
            provider.terminate(host)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _result(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {}


@pytest.mark.parametrize("loop", ["0"], indirect=True)
def test_a_loop_that_reports_no_loss_is_refused_in_preflight(loop: Loop, cli_cmd: list[str], tmp_path: Path) -> None:
    out = _gm(cli_cmd, loop.env, "migrate", str(loop.plan(tmp_path / "plan.yaml")), "--id", "no-loss", "--json")
    result = _result(out)
    assert out.returncode == 2 and result["status"] == "denied", out.stderr[-3000:]
    assert "the source took" in result["error"] and "reported no loss; nothing was moved" in result["error"]
    assert "step.report(loss=loss.item())" in result["error"]
    assert result["phases"]["preflight"]["status"] == "failed" and "provision" not in result["phases"]
    from gpumigrate.infra import get_provider

    assert get_provider("local").list_hosts() == []


@pytest.mark.parametrize(
    ("launch", "says"),
    [
        ({"REPORT": "0"}, "the target took"),  # trains on, never reports a loss
        ({"STEPS": "3"}, "the target's training process ended"),  # its STEPS are behind it: done at once
    ],
    ids=["target-reports-nothing", "target-ends"],
)
def test_a_target_that_cannot_prove_the_move_rolls_back_at_once_and_the_source_trains_on(
    loop: Loop, cli_cmd: list[str], tmp_path: Path, launch: dict[str, str], says: str
) -> None:
    mid = "loop-" + next(iter(launch)).lower()
    out = _gm(cli_cmd, loop.env, "migrate", str(loop.plan(tmp_path / "plan.yaml", **launch)), "--id", mid, "--json")
    result = _result(out)
    assert out.returncode == 3 and result["status"] == "rolled_back", out.stderr[-3000:]
    assert says in result["error"] and "Connection refused" not in result["error"], result["error"]
    assert result["rollback"]["triggered"] is True and result["rollback"]["trigger"] == "error"
    audit = [json.loads(x) for x in (Path(loop.env["GPUMIGRATE_HOME"]) / "migrations" / mid / "audit.jsonl")
             .read_text().splitlines()]  # fmt: skip
    names = [e["event"] for e in audit]
    assert names.count("phase.restore.started") == 1  # never retried against a target that is gone
    assert names.count("rollback.source_resumed") == 1 and "rollback.target_torn_down" in names
    # The source runs again: it trains on past where it was frozen.
    frozen_at = loop.steps()
    deadline = time.monotonic() + 60
    while loop.steps() < frozen_at + 5:
        assert loop.proc.poll() is None and time.monotonic() < deadline, "the source never trained on"
        time.sleep(0.1)

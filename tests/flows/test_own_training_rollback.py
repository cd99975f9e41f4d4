"""A training loop whose target does not continue like the source rolls back: the user's loop below forgot to give
its data stream to the agent, so the restored target draws other batches and its next losses differ. The flow
then tears the target down and the source trains on from where it was frozen. The freeze lease is one second,
far shorter than the flow works on the frozen source: the source stays frozen only because the flow renews it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train"
FORGETFUL = """
import json, os, time
import torch
import gpumigrate.agent as gm

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(1)  # NOT in state: a restored target starts this stream over
state = {"step": 0}
handle = gm.attach(model, optimizer=optimizer, state=state)
while state["step"] < 100000:
    with handle.safe_point() as step:
        x = torch.randn(16, 8, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x[:, :1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        state["step"] += 1
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


def test_a_target_that_trains_differently_rolls_back_and_the_source_trains_on(
    tmp_path: Path, gm_home: Path, prefect_api: str, cli_cmd: list[str]
) -> None:
    from gpumigrate.infra import get_provider
    from gpumigrate.snapshot.client import AgentClient

    loop = tmp_path / "loop.py"
    loop.write_text(FORGETFUL)
    env = {**os.environ, "GPUMIGRATE_HOME": str(gm_home), "PREFECT_API_URL": prefect_api, "OMP_NUM_THREADS": "1"}
    env.pop("GPUMIGRATE_AWAIT_RESTORE", None)
    key_file = tmp_path / "train.key"
    assert _gm(cli_cmd, env, "image", "keygen", "--out", str(key_file)).returncode == 0
    env["GPUMIGRATE_TRAIN_KEY"] = key_file.read_text().strip()
    agent = f"127.0.0.1:{_free_port()}"
    log = tmp_path / "source.log"
    with open(log, "wb") as fh:
        source = subprocess.Popen(
            [sys.executable, str(loop)], cwd=tmp_path, env={**env, "GPUMIGRATE_AGENT_ADDR": agent}, stdout=fh,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while '"step"' not in log.read_text():
            assert source.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        doc = yaml.safe_load((TRAIN / "plan.yaml").read_text())
        doc["workload"].update(agent=agent, launch={"argv": ["{python}", "loop.py"], "cwd": "{plan_dir}"})
        doc["target"]["host"] = "own-train-rb"
        doc["snapshot"]["freeze_lease_s"] = 1.0
        # Enough parity steps that the source stays frozen longer than its lease: only renewals keep it.
        doc["parity"].setdefault("training", {})["steps"] = 60
        plan = tmp_path / "plan.yaml"
        plan.write_text(yaml.safe_dump(doc, sort_keys=False))

        out = _gm(cli_cmd, env, "migrate", str(plan), "--id", "train-rb", "--json")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert out.returncode == 3 and result["status"] == "rolled_back", out.stderr[-3000:]
        assert "training parity failed" in result["error"] and result["parity"]["passed"] is False
        audit = [json.loads(x) for x in (gm_home / "migrations" / "train-rb" / "audit.jsonl").read_text().splitlines()]
        names = [e["event"] for e in audit]
        assert "rollback.target_torn_down" in names and "rollback.source_resumed" in names
        judged = next(e["data"] for e in audit if e["event"] == "parity.training")
        frozen_s = next(e["ts"] for e in audit if e["event"] == "parity.training") - next(
            e["data"]["frozen_at"] for e in audit if e["event"] == "phase.snapshot.completed"
        )
        assert frozen_s > 1.0, frozen_s  # longer than the lease ...
        assert judged["lease_renewals"] >= 1 and judged["source"] != judged["target"]  # ... so it was renewed
        assert get_provider("local").list_hosts() == []
        with AgentClient(agent, timeout_s=30) as client:
            info = client.request_info()
            assert info.frozen is False
            assert info.lease_expiries == 0  # frozen for seconds under a 1 s lease: renewed, never lapsed
            before = client.request_metrics().steps
            deadline = time.monotonic() + 60
            while client.request_metrics().steps < before + 3:  # it trains on
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        os.killpg(source.pid, signal.SIGKILL)
        source.wait(timeout=30)

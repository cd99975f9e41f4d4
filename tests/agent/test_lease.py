"""The freeze lease: a frozen source whose orchestrator stops renewing resumes by itself."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

import gpumigrate.agent as gm
from gpumigrate.errors import SnapshotError
from gpumigrate.snapshot.client import AgentClient

HERE = Path(__file__).resolve().parent


def test_an_unrenewed_lease_resumes_and_a_renewed_one_holds() -> None:
    handle = gm.attach(torch.nn.Linear(2, 2))
    with AgentClient(handle.address) as c:
        assert c.call("freeze", lease_s=1.0) == {"frozen": True, "lease_s": 1.0, "steps": 0}
        for _ in range(3):  # renewed in time: stays frozen past the first lease
            time.sleep(0.5)
            assert c.call("renew", lease_s=1.0)["frozen"] is True
        assert handle.frozen and c.request_info().lease["lease_s"] == 1.0
        held: list[float] = []

        def request() -> None:
            with handle.safe_point():
                held.append(time.monotonic())

        t = threading.Thread(target=request)
        t.start()
        stopped = time.monotonic()
        t.join(10)  # no renew: the lease runs out and the held request goes on
        assert held and 0.5 < held[0] - stopped < 5 and not handle.frozen
        info = c.request_info()
        assert info.lease_expiries == 1 and info.lease is None and not info.frozen
        with pytest.raises(SnapshotError, match="lease ran out .* and it resumed"):
            c.call("renew")
        with pytest.raises(SnapshotError, match="lease_s"):
            c.call("freeze", lease_s=0)
        c.call("freeze", lease_s=30)
        c.call("resume")  # a resume ends the lease: nothing runs out later
        assert c.request_info().lease is None


def test_source_serves_again_within_the_lease_after_the_orchestrator_is_killed(spawn) -> None:
    src = spawn([str(HERE / "kv_service.py")], name="source", http=True)
    src.wait_http("/readyz")
    orchestrator = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from gpumigrate.snapshot.client import AgentClient\n"
            "AgentClient(sys.argv[1]).call('freeze', lease_s=3)\n"
            "print('frozen', flush=True)\n"
            "time.sleep(600)\n",
            src.agent,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert orchestrator.stdout is not None and orchestrator.stdout.readline().strip() == "frozen"
    assert httpx.get(src.url + "/readyz").json()["status"] == "held"
    results: list[int] = []
    held = threading.Thread(
        target=lambda: results.append(
            httpx.post(src.url + "/v1/predict", json={"x": [0.0] * 16}, timeout=30).status_code
        )
    )
    held.start()
    orchestrator.kill()  # SIGKILL: it never renews, never resumes
    orchestrator.wait(10)
    killed = time.monotonic()
    held.join(30)
    assert results == [200] and time.monotonic() - killed < 10  # within the 3 s lease (plus start-up slack)
    assert httpx.get(src.url + "/readyz").json()["status"] == "ready"  # no longer frozen
    with src.client() as c:
        assert c.request_info().lease_expiries == 1

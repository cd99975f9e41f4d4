"""The Lightning training job migrated mid-run between two real processes: the target continues
with bit-identical losses and ends with the same weights as a source that kept running."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from gpumigrate.snapshot.client import AgentClient

STEPS = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp: Path, name: str, *extra: str) -> tuple[subprocess.Popen, str, Path]:
    port = _free_port()
    out = tmp / f"{name}.json"
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 - closed with the process below
    cmd = [
        sys.executable,
        "-m",
        "gpumigrate.workloads.training",
        "--steps",
        str(STEPS),
        "--seed",
        "3",
        "--device",
        "cpu",
        "--agent-port",
        str(port),
        "--out",
        str(out),
        "--name",
        name,
        *extra,
    ]
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    proc._log = log  # type: ignore[attr-defined]
    return proc, f"127.0.0.1:{port}", out


def _wait_agent(address: str, proc: subprocess.Popen, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "training process exited early"
        try:
            AgentClient(address, timeout_s=5).call("ping")
            return
        except Exception:
            time.sleep(0.2)
    raise AssertionError(f"agent at {address} did not come up")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    proc._log.close()  # type: ignore[attr-defined]


def test_training_job_migrates_mid_run_with_identical_losses(tmp_path, key_env, store_url) -> None:
    src, src_addr, src_out = _start(tmp_path, "source", "--step-delay-ms", "200")
    dst, dst_addr, dst_out = _start(tmp_path, "target", "--await-restore")
    try:
        _wait_agent(src_addr, src)
        _wait_agent(dst_addr, dst)
        with AgentClient(src_addr) as s, AgentClient(dst_addr) as d:
            deadline = time.monotonic() + 60
            while _last_step(tmp_path / "source.log") < 3 and time.monotonic() < deadline:
                time.sleep(0.2)  # let the source take a few steps first
            conv = s.precopy_until(store_url, key_env, max_rounds=3, max_downtime_ms=10_000)
            d.request_restore(store_url, conv.images[-1], key_env, ready=False)
            s.request_freeze()
            step_at_freeze = _last_step(tmp_path / "source.log")  # parked after this step's line
            final = s.request_final(store_url, key_env)
            d.request_restore(store_url, final.image.id, key_env)  # target resumes from here
            s.request_resume()  # the source keeps going too: it is the reference
        assert 3 <= step_at_freeze < STEPS
        assert src.wait(120) == 0 and dst.wait(120) == 0
        a, b = json.loads(src_out.read_text()), json.loads(dst_out.read_text())
        assert a["step"] == b["step"] == STEPS
        assert b["losses"] == a["losses"]  # the restored prefix and every step after it, bit for bit
        assert b["weights_digest"] == a["weights_digest"]
        # The target took only the steps after the freeze: it continued, it did not start over.
        dst_steps = [
            json.loads(line)["step"]
            for line in (tmp_path / "target.log").read_text().splitlines()
            if line.startswith('{"event": "step"')
        ]
        assert dst_steps == list(range(step_at_freeze + 1, STEPS + 1))
    finally:
        _stop(src)
        _stop(dst)


def _last_step(log: Path) -> int:
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines() if line.startswith('{"event": "step"')]
    return steps[-1] if steps else 0

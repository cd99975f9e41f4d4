"""``gpumigrate traffic`` as a real subprocess: rollback from outside a running ramp, load, watch, serve."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpumigrate.errors import TrafficError
from gpumigrate.traffic import access_control
from gpumigrate.traffic.analysis import GateSettings
from gpumigrate.traffic.envoy import EnvoyAdmin, free_port
from gpumigrate.traffic.loadgen import LoadProcess
from gpumigrate.traffic.ramp import RampController, RampSettings

BODY = {"prompt": "hello", "max_new_tokens": 1}


def _run(cmd: list[str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cmd, "traffic", *args], capture_output=True, text=True, timeout=timeout)


def test_rollback_command_stops_a_running_ramp(light_env: Any, cli_cmd: list[str]) -> None:
    env = light_env
    out: dict[str, Any] = {}

    def rollback_from_another_process() -> None:
        out["proc"] = _run(
            cli_cmd,
            "rollback",
            "--state-dir",
            str(env.state_dir),
            "--reason",
            "pager went off",
            "--wait-node",
            env.envoy.node_id,
            "--json",
        )

    def on_interval(sample: Any) -> None:
        if sample.stage == 1 and "thread" not in out:
            out["thread"] = threading.Thread(target=rollback_from_another_process)
            out["thread"].start()

    settings = RampSettings(
        stages=((5, 1.0), (25, 60.0), (100, 1.0)),
        interval_s=0.5,
        gates=GateSettings(min_requests=3, p99_slack_ms=150),
        max_inconclusive=200,
    )
    ctl = RampController(
        env.state_dir, [env.envoy.admin_url], settings, nodes=[env.envoy.node_id], on_interval=on_interval
    )
    load = LoadProcess(env.url, rps=30, seconds=90, body=BODY)
    try:
        result = ctl.run()
    finally:
        load.stop()
    report = load.wait()
    out["thread"].join(60)
    proc = out["proc"]
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["weights"] == {"source": 100.0, "target": 0.0}
    assert result.status == "rolled_back"
    assert result.trigger == "external"
    assert "pager went off" in (result.reason or "")
    assert env.envoy.admin.live_weights() == {"source": 10000}
    assert report.failed == 0


def test_load_watch_status_and_bad_input(light_env: Any, cli_cmd: list[str]) -> None:
    env = light_env
    watch = subprocess.Popen(
        [
            *cli_cmd,
            "traffic",
            "watch",
            "--admin",
            env.envoy.admin_url,
            "--state-dir",
            str(env.state_dir),
            "--interval",
            "0.5",
            "--seconds",
            "2",
            "--json",
            "--prometheus-port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    load = _run(cli_cmd, "load", env.url, "--rps", "40", "--seconds", "2", "--body", json.dumps(BODY), "--json")
    w_out, w_err = watch.communicate(timeout=60)
    assert load.returncode == 0, load.stderr
    lines = [json.loads(line) for line in load.stdout.splitlines()]
    report, seconds = lines[-1], [line["second"] for line in lines[:-1]]
    # Every one of the 80 slots was sent, or skipped because a loaded machine did not schedule the generator.
    assert report["total"] + report["skipped"] == 80 and report["total"] > 0 and report["failed"] == 0
    # The last line is the summary, short; each second came on its own line before it (issue 35, finding 9).
    assert "per_second" not in report and len(load.stdout.splitlines()[-1]) < 1000
    assert report["p99_ms"] is not None and report["stall_ms"] is not None and len(seconds) >= 2
    assert sum(s["total"] for s in seconds) == report["total"]
    assert watch.returncode == 0, w_err
    rows = [json.loads(line) for line in w_out.splitlines() if line.startswith("{")]
    assert rows and rows[-1]["weights"] == {"source": 100.0, "target": 0.0}
    assert any(r["clusters"].get("source", {}).get("requests", 0) > 0 for r in rows)
    assert "prometheus metrics on" in w_err

    status = _run(cli_cmd, "status", "--state-dir", str(env.state_dir), "--json")
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout.splitlines()[-1])
    assert doc["envoys"]["test-envoy"]["applied"] == doc["desired"]["version"]

    bad = _run(cli_cmd, "set-weight", "--state-dir", str(env.state_dir), "150")
    assert bad.returncode == 2 and "0..100" in bad.stderr and "Traceback" not in bad.stderr
    missing = _run(cli_cmd, "rollback", "--state-dir", str(env.state_dir / "nope"))
    assert missing.returncode == 2 and "no traffic state" in missing.stderr  # invalid input, not a failure
    assert not (env.state_dir / "nope").exists()


def test_serve_init_set_weight_from_the_cli(tmp_path: Path, cli_cmd: list[str]) -> None:
    state = tmp_path / "xds"
    init = _run(
        cli_cmd, "init", "--state-dir", str(state), "--source", "127.0.0.1:1", "--target", "127.0.0.1:2", "--json"
    )
    assert init.returncode == 0, init.stderr
    serve = subprocess.Popen(
        [*cli_cmd, "traffic", "serve", "--state-dir", str(state), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        line = serve.stdout.readline() if serve.stdout else ""
        assert line.startswith("listening ")
        sw = _run(cli_cmd, "set-weight", "--state-dir", str(state), "25", "--json")
        assert sw.returncode == 0, sw.stderr
        assert json.loads(sw.stdout.splitlines()[-1])["weights"] == {"source": 75.0, "target": 25.0}
        listen_port = free_port()
        admin = f"unix:{access_control.admin_socket(tmp_path / 'envoy', 'cli-envoy')}"  # only this user reaches it
        envoy = subprocess.Popen(
            [
                *cli_cmd,
                "traffic",
                "envoy",
                "--state-dir",  # where its node token comes from (the plane's key): the port alone serves nothing
                str(state),
                "--xds-port",
                line.split()[1],
                "--workdir",
                str(tmp_path / "envoy"),
                "--listen-port",
                str(listen_port),
                "--node-id",
                "cli-envoy",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and "listener" not in (envoy.stderr.readline() if envoy.stderr else ""):
                pass
            assert EnvoyAdmin(admin).live_weights() == {"source": 7500, "target": 2500}
        finally:
            envoy.send_signal(signal.SIGINT)
            envoy.wait(timeout=15)
        with pytest.raises(TrafficError):  # the supervised Envoy went away with its supervisor
            EnvoyAdmin(admin, timeout_s=1).stats()
    finally:
        serve.terminate()
        serve.wait(timeout=10)
    assert serve.returncode == 0


def test_a_load_that_reaches_nothing_exits_1_saying_so(cli_cmd: list[str]) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1/generate"  # nothing listens there
    out = _run(cli_cmd, "load", dead, "--rps", "20", "--seconds", "0.5", "--json")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["total"] > 0 and report["failed"] == report["total"]
    assert "no request succeeded" in out.stdout + out.stderr

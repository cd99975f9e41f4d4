"""Real inference server processes with the embedded agent, driven by the real CLI and AgentClient.

A migration that is rolled back leaves the source serving (freeze → final → resume); a completed one
brings the target up from the image with the same answers; zeroize wipes the source afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from gpumigrate.snapshot.client import AgentClient


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *extra: str, env: dict[str, str]) -> None:
        self.agent_port = _free_port()
        cmd = [
            sys.executable,
            "-m",
            "gpumigrate.workloads.inference",
            "--port",
            "0",
            "--agent-port",
            str(self.agent_port),
            "--seed",
            "0",
            "--size",
            "tiny",
            "--device",
            "cpu",
            *extra,
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
        line = self.proc.stdout.readline()  # {"event": "listening", "port": ...}
        if not line:
            raise RuntimeError("server did not start: " + self.proc.stderr.read()[-2000:])
        self.url = f"http://127.0.0.1:{json.loads(line)['port']}"
        self.agent = f"127.0.0.1:{self.agent_port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                httpx.get(self.url + "/healthz", timeout=1)
                AgentClient(self.agent, timeout_s=5).call("ping")
                return
            except Exception:
                time.sleep(0.1)
        raise RuntimeError("server or agent did not come up")

    def generate(self, prompt: str = "hello", timeout: float = 30) -> httpx.Response:
        return httpx.post(self.url + "/v1/generate", json={"prompt": prompt, "max_new_tokens": 6}, timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        for f in (self.proc.stdout, self.proc.stderr):
            f.close()


@pytest.fixture
def servers(key_env: dict[str, str]) -> Iterator[list[Server]]:
    started: list[Server] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def start(*extra: str) -> Server:
        s = Server(*extra, env=env)
        started.append(s)
        return s

    yield start  # type: ignore[misc]
    for s in started:
        s.stop()


def _cli(cli_cmd: list[str], *args: str) -> dict:
    out = subprocess.run([*cli_cmd, "snapshot", *args, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_rolled_back_migration_keeps_source_serving(servers, key_env, store_url, cli_cmd) -> None:
    src = servers()
    before = src.generate().json()
    info = _cli(cli_cmd, "info", "--agent", src.agent)
    assert info["bytes_total"] > 0 and not info["frozen"]
    assert any(r["name"].startswith("model/") and r["dtype"] == "float32" for r in info["regions"])

    pre = _cli(
        cli_cmd,
        "precopy",
        "--agent",
        src.agent,
        "--store",
        store_url,
        "--key-env",
        key_env["env"],
        "--rounds",
        "3",
        "--max-downtime-ms",
        "1000",
    )
    assert pre["rounds"][0]["chunks_dirty"] == pre["rounds"][0]["chunks_total"]
    _cli(cli_cmd, "freeze", "--agent", src.agent)
    # A request during the freeze waits at the safe point instead of failing.
    held: dict = {}
    t = threading.Thread(target=lambda: held.setdefault("r", src.generate()))
    t.start()
    time.sleep(0.5)
    assert "r" not in held
    frozen = httpx.get(src.url + "/readyz", timeout=5)  # held, not refused: the front door keeps sending
    assert frozen.status_code == 200 and frozen.json()["status"] == "held"
    final = _cli(cli_cmd, "final", "--agent", src.agent, "--store", store_url, "--key-env", key_env["env"])
    assert final["stats"]["chunks_dirty"] == 0  # nothing changed since pre-copy: weights are read-only here
    _cli(cli_cmd, "resume", "--agent", src.agent)  # the migration is rolled back
    t.join(30)
    assert held["r"].status_code == 200 and held["r"].json()["tokens"] == before["tokens"]
    assert src.generate().json()["tokens"] == before["tokens"]
    assert httpx.get(src.url + "/readyz", timeout=5).json()["status"] == "ready"


def test_completed_migration_target_answers_like_source_then_source_is_zeroized(
    servers, key_env, store_url, cli_cmd, gm_home
) -> None:
    src = servers()
    dst = servers("--await-restore")
    expected = src.generate().json()
    assert dst.generate().status_code == 503  # no weights yet

    with AgentClient(src.agent) as s, AgentClient(dst.agent) as d:
        conv = s.precopy_until(store_url, key_env, max_rounds=3, max_downtime_ms=1000)
        d.request_restore(store_url, conv.images[-1], key_env, ready=False)  # pre-load while the source serves
        assert dst.generate().status_code == 503
        s.request_freeze()
        final = s.request_final(store_url, key_env)
        res = d.request_restore(
            store_url, final.image.id, key_env, policy={"torch": "must_match", "python": "must_match"}
        )
        # The pre-load already had every tensor chunk; only the small blobs (RNG streams, the step
        # counter), which a restore always reloads, moved again.
        blobs = [r for r in d.request_info().regions if r.kind == "blob"]
        assert res.ready and res.chunks_loaded == len(blobs)
        assert res.bytes_loaded == sum(r.nbytes for r in blobs)
    assert dst.generate().json()["tokens"] == expected["tokens"]
    src_info = httpx.get(src.url + "/v1/info", timeout=30).json()
    dst_info = httpx.get(dst.url + "/v1/info", timeout=30).json()
    assert dst_info["weights_digest"] == src_info["weights_digest"]

    from gpumigrate.state import Migration

    m = Migration.create("snapshot-test-1", "version: 1\n")
    record = _cli(cli_cmd, "zeroize", "--agent", src.agent, "--migration", m.id)
    assert record["verified"] and record["zeroized_bytes"] == sum(
        r["nbytes"] for r in _cli(cli_cmd, "info", "--agent", src.agent)["regions"] if r["kind"] != "blob"
    )  # opaque state (RNG streams, counters) lives in the workload's own objects, not tracked memory
    audited = [r for r in m.audit.records() if r.get("event") == "source.zeroized"]
    assert len(audited) == 1 and audited[0]["data"]["zeroized_bytes"] == record["zeroized_bytes"]
    m.verify_audit()


def test_cli_errors_are_one_line(cli_cmd, servers, key_env, store_url) -> None:
    out = subprocess.run(
        [*cli_cmd, "snapshot", "info", "--agent", "127.0.0.1:1"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1 and "cannot reach the snapshot agent" in out.stderr and "Traceback" not in out.stderr
    src = servers()
    out = subprocess.run(
        [*cli_cmd, "snapshot", "final", "--agent", src.agent, "--store", store_url, "--key-env", key_env["env"]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "freeze" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run(
        [
            *cli_cmd,
            "snapshot",
            "restore",
            "--agent",
            src.agent,
            "--store",
            store_url,
            "--image",
            "0" * 64,
            "--key-env",
            key_env["env"],
            "--key-file",
            "/x",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "exactly one" in out.stderr


def test_plan_writer_options_reach_the_image(servers, key_env, tmp_path) -> None:
    """The plan's transfer.compression/parallelism travel with precopy/final to the writer in the workload."""
    from gpumigrate.errors import SnapshotError

    src = servers()
    with AgentClient(src.agent) as s:
        raw = s.request_precopy(
            f"file://{tmp_path / 'raw'}", key_env, options={"compression": "none", "parallelism": 2}
        )
        auto = s.request_precopy(f"file://{tmp_path / 'auto'}", key_env, options={"compression": "auto"})
        # fp32 weights: the byte-plane codec shrinks them; "none" stores every byte of each distinct chunk
        # (identical chunks, such as LayerNorm ones, are stored once either way).
        assert raw.image.bytes_stored >= 0.95 * raw.image.bytes_image
        assert auto.image.bytes_stored < 0.95 * raw.image.bytes_stored, (auto.image, raw.image)
        with pytest.raises(SnapshotError, match="allowed are"):
            s.request_precopy(f"file://{tmp_path / 'bad'}", key_env, options={"compression": "lzma"})
    assert src.generate().status_code == 200  # the source kept serving throughout

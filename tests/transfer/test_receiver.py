"""The receiver on this machine: the detached CLI life cycle, the disk quota, plans that name receivers."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from gpumigrate.errors import InvalidInputError, TransferError
from gpumigrate.transfer import pack_paths, push, serve_stream, verify
from gpumigrate.transfer.receiver.host import read_receiver_info, stop_receiver

KEY_ENV = "GM_TEST_IMAGE_KEY"


@pytest.fixture
def env(gm_home: Path, key: bytes) -> dict[str, str]:
    return {**os.environ, "GPUMIGRATE_HOME": str(gm_home), KEY_ENV: key.hex()}


def _cli(cli_cmd: list[str], env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cli_cmd, *args], env=env, capture_output=True, text=True, timeout=120)


def test_detached_receiver_writes_its_address_and_stops_cleanly(
    cli_cmd: list[str], env: dict[str, str], tmp_path: Path, key: bytes
) -> None:
    state = tmp_path / "recv"
    started = _cli(cli_cmd, env, "image", "receive", "--detach", "--state-dir", str(state), "--key-env", KEY_ENV)
    assert started.returncode == 0, started.stderr
    first = json.loads(started.stdout.strip().splitlines()[-1])
    info = read_receiver_info(state)
    assert info.state == "running" and info.url == first["url"] and info.url.startswith("stream://127.0.0.1:")
    assert info.fingerprint.startswith("sha256:") and info.fingerprint in info.url
    assert (state / "receiver.log").exists() and info.store == f"file://{state.resolve() / 'store'}"
    files = tmp_path / "in"
    files.mkdir()
    (files / "f").write_bytes(os.urandom(3 << 20))
    local = f"file://{tmp_path / 'src'}"
    ref = pack_paths([files], local, key=key)
    pushed = _cli(cli_cmd, env, "image", "push", f"{local}#{ref.id}", info.url, "--key-env", KEY_ENV, "--json", "-q")
    assert pushed.returncode == 0, pushed.stderr
    verified = _cli(cli_cmd, env, "image", "verify", f"{info.store}#{ref.id}", "--key-env", KEY_ENV, "--json", "-q")
    assert json.loads(verified.stdout.strip().splitlines()[-1])["ok"]
    stopped = _cli(cli_cmd, env, "image", "receive-stop", "--state-dir", str(state))
    assert stopped.returncode == 0, stopped.stderr
    summary = json.loads(stopped.stdout.strip().splitlines()[-1])
    assert summary["state"] == "stopped" and summary["images"] == [ref.id]
    assert json.loads(pushed.stdout.strip().splitlines()[-1])["chunks_sent"] == summary["chunks_received"]
    assert stop_receiver(state).state == "stopped"  # stopping twice is harmless


def test_receiver_detach_needs_a_state_dir(cli_cmd: list[str], env: dict[str, str]) -> None:
    res = _cli(cli_cmd, env, "image", "receive", "--detach", "--key-env", KEY_ENV)
    assert res.returncode == 2 and "--state-dir" in res.stderr and "Traceback" not in res.stderr


def _packed(tmp_path: Path, key: bytes, mib: int) -> tuple[str, str]:
    """A packed image of ``mib`` MiB of random bytes: (store URL, image id)."""
    files = tmp_path / "in"
    files.mkdir()
    (files / "f").write_bytes(os.urandom(mib << 20))
    local = f"file://{tmp_path / 'src'}"
    return local, pack_paths([files], local, key=key).id


def test_quota_refuses_what_does_not_fit_and_stores_nothing_past_it(gm_home: Path, tmp_path: Path, key: bytes) -> None:
    local, image_id = _packed(tmp_path, key, 12)
    quota = 5 << 20
    receiver = serve_stream("127.0.0.1:0", f"file://{tmp_path / 'dst'}", key=key, quota_bytes=quota)
    try:
        with pytest.raises(TransferError, match="quota"):
            push(local, receiver.url, image_id, key=key)
        held = sum(p.stat().st_size for p in (tmp_path / "dst").rglob("*") if p.is_file())
        assert 0 < held <= quota
        assert receiver.stats()["images"] == []
    finally:
        receiver.close()


def test_a_receiver_writes_only_to_a_local_directory(gm_home: Path, key: bytes) -> None:
    with pytest.raises(InvalidInputError, match="file://"):
        serve_stream("127.0.0.1:0", "s3://bucket/prefix", key=key)


def test_resume_into_the_same_receiver_sends_nothing_twice(gm_home: Path, tmp_path: Path, key: bytes) -> None:
    local, image_id = _packed(tmp_path, key, 5)
    with serve_stream("127.0.0.1:0", f"file://{tmp_path / 'dst'}", key=key) as receiver:
        first = push(local, receiver.url, image_id, key=key)
        again = push(local, receiver.url, image_id, key=key)
    assert first.chunks_sent == first.chunks_total and again.chunks_sent == 0
    assert verify(f"file://{tmp_path / 'dst'}", image_id, key=key).chunks_total == first.chunks_total


def _validate_plan_with_store(
    cli_cmd: list[str], env: dict[str, str], repo: Path, tmp_path: Path, store: str
) -> subprocess.CompletedProcess[str]:
    """`gpumigrate plan validate` on the demo plan with ``transfer.store`` set to ``store``."""
    plan = yaml.safe_load((repo / "examples" / "local-demo.yaml").read_text())
    plan["transfer"]["store"] = store
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    (tmp_path / "golden").symlink_to(repo / "examples" / "golden")
    return _cli(cli_cmd, env, "plan", "validate", str(path))


@pytest.mark.parametrize(
    "store",
    [
        "stream://10.0.0.5:7443?fingerprint=sha256:" + "ab" * 32,
        "nixl://10.0.0.5:7443?fingerprint=sha256:" + "AB" * 32 + "&transports=tcp&connections=4&inline=0",
        "nixl://target-1:7443",
    ],
)
def test_a_plan_can_pin_the_receivers_certificate(
    cli_cmd: list[str], env: dict[str, str], repo: Path, tmp_path: Path, store: str
) -> None:
    res = _validate_plan_with_store(cli_cmd, env, repo, tmp_path, store)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize(
    "store",
    ["stream://h:1?fingerprint=sha256:12", "stream://h:1?fingerprint=sha256:" + "ab" * 32 + "&x=1", "nixl://h"],
)
def test_a_malformed_receiver_url_is_invalid_input(
    cli_cmd: list[str], env: dict[str, str], repo: Path, tmp_path: Path, store: str
) -> None:
    res = _validate_plan_with_store(cli_cmd, env, repo, tmp_path, store)
    assert res.returncode == 2 and "transfer.store" in res.stderr and "Traceback" not in res.stderr

"""The real `gpumigrate image` CLI as subprocesses: JSON summaries, exit codes, a killed push resuming, receive."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumigrate.transfer import generate_key


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    e = dict(os.environ)
    e["GM_TEST_IMAGE_KEY"] = generate_key()
    e.pop("GPUMIGRATE_IMAGE_KEY", None)
    return e


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts; killed as a group at teardown whatever happened."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)


def run(cmd: list[str], env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cmd, "image", *args], env=env, capture_output=True, text=True, timeout=120)


def last_json(proc: subprocess.CompletedProcess[str]) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pack_push_verify_unpack_json(cli_cmd: list[str], env: dict[str, str], tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    (src / "f").write_bytes(os.urandom(2 << 20))
    k = ["--key-env", "GM_TEST_IMAGE_KEY"]
    packed = last_json(run(cli_cmd, env, "pack", str(src), "--out", f"file://{tmp_path / 's1'}", *k, "--json"))
    image = packed["image"]
    assert packed["bytes_image"] == 2 << 20
    pushed = last_json(run(cli_cmd, env, "push", image, f"file://{tmp_path / 's2'}", *k, "--json", "-q"))
    assert pushed["chunks_sent"] == pushed["chunks_total"] > 0
    prefix = f"file://{tmp_path / 's2'}#{packed['image_id'][:12]}"
    assert last_json(run(cli_cmd, env, "verify", prefix, *k, "--json", "-q"))["ok"] is True
    last_json(run(cli_cmd, env, "unpack", prefix, str(tmp_path / "out"), *k, "--json", "-q"))
    assert (tmp_path / "out" / "in" / "f").read_bytes() == (src / "f").read_bytes()
    listing = last_json(run(cli_cmd, env, "ls", f"file://{tmp_path / 's2'}", "--json"))
    assert [i["image_id"] for i in listing["images"]] == [packed["image_id"]]


def test_exit_codes(cli_cmd: list[str], env: dict[str, str], tmp_path: Path) -> None:
    src = tmp_path / "f"
    src.write_bytes(os.urandom(100_000))
    store = f"file://{tmp_path / 's'}"
    k = ["--key-env", "GM_TEST_IMAGE_KEY"]
    image = last_json(run(cli_cmd, env, "pack", str(src), "--out", store, *k, "--json", "-q"))["image"]
    bad_url = run(cli_cmd, env, "push", image, "ftp://nowhere", *k)
    assert bad_url.returncode == 2 and "unsupported store URL" in bad_url.stderr
    no_key = run(cli_cmd, env, "verify", image)
    assert no_key.returncode == 2 and "no image key" in no_key.stderr
    env2 = {**env, "GM_OTHER": generate_key()}
    wrong = run(cli_cmd, env2, "unpack", image, str(tmp_path / "o"), "--key-env", "GM_OTHER")
    assert wrong.returncode == 2 and "wrong key" in wrong.stderr and env2["GM_OTHER"] not in wrong.stderr + wrong.stdout
    assert not (tmp_path / "o").exists()
    chunk = next(p for p in (tmp_path / "s" / "chunks").rglob("*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[-5] ^= 1
    chunk.write_bytes(data)
    corrupt = run(cli_cmd, env, "verify", image, *k)
    assert corrupt.returncode == 1 and "failed verification" in corrupt.stderr
    assert "Traceback" not in corrupt.stderr


def test_a_missing_store_is_named_as_missing(cli_cmd: list[str], env: dict[str, str], tmp_path: Path) -> None:
    """Not "holds 0 images ... (ids: )": the store does not exist (exit 2, like any missing store), with or
    without an image id; an existing store without images says so."""
    store = f"file://{tmp_path / 'nope'}"
    for url in (store, f"{store}#abc", f"{store}#{'a' * 64}"):
        out = run(cli_cmd, env, "verify", url, "--no-key")
        assert out.returncode == 2 and f"the store {store} does not exist" in out.stderr, out.stderr
        assert "ids:" not in out.stderr and "Traceback" not in out.stderr
    listed = run(cli_cmd, env, "ls", store)
    assert listed.returncode == 2 and f"the store {store} does not exist" in listed.stderr
    assert not (tmp_path / "nope").exists()
    (tmp_path / "empty").mkdir()
    empty = run(cli_cmd, env, "verify", f"file://{tmp_path / 'empty'}", "--no-key")
    assert empty.returncode == 2 and "holds no images" in empty.stderr and "ids:" not in empty.stderr


def test_receive_stop_help_names_the_option_it_needs(cli_cmd: list[str], env: dict[str, str]) -> None:
    out = run(cli_cmd, {**env, "COLUMNS": "200"}, "receive-stop", "--help")
    assert out.returncode == 0 and "STATE_DIR" not in out.stdout
    assert "receive --detach --state-dir DIR" in out.stdout


def test_killed_push_resumes_without_resending(
    cli_cmd: list[str], env: dict[str, str], tmp_path: Path, procs: list
) -> None:
    src = tmp_path / "state.img"
    src.write_bytes(os.urandom(16 << 20))
    k = ["--key-env", "GM_TEST_IMAGE_KEY"]
    image = last_json(run(cli_cmd, env, "pack", str(src), "--out", f"file://{tmp_path / 's1'}", *k, "--json", "-q"))[
        "image"
    ]
    dst_dir = tmp_path / "s2"
    dst = f"file://{dst_dir}"

    def arrived() -> int:
        return sum(1 for p in (dst_dir / "chunks").rglob("*") if p.is_file() and not p.name.startswith("."))

    slow = subprocess.Popen(
        [*cli_cmd, "image", "push", image, dst, *k, "--rate-limit", "3MB", "-j", "2", "-q"],
        env=env,
        text=True,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    procs.append(slow)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not (dst_dir / "chunks").exists() or arrived() < 3):
        time.sleep(0.05)
    os.killpg(slow.pid, signal.SIGKILL)
    slow.wait(timeout=10)
    assert slow.returncode == -signal.SIGKILL
    before = arrived()
    assert not (dst_dir / "manifests").exists() or not any((dst_dir / "manifests").iterdir())
    resumed = last_json(run(cli_cmd, env, "push", image, dst, *k, "--json", "-q"))
    assert 3 <= before < resumed["chunks_total"]
    assert resumed["chunks_skipped"] == before
    assert resumed["chunks_sent"] == resumed["chunks_total"] - before
    assert last_json(run(cli_cmd, env, "verify", f"{dst}#{resumed['image_id']}", *k, "--json", "-q"))["ok"]


def test_receive_and_push_over_stream(cli_cmd: list[str], env: dict[str, str], tmp_path: Path, procs: list) -> None:
    src = tmp_path / "f"
    src.write_bytes(os.urandom(3 << 20))
    k = ["--key-env", "GM_TEST_IMAGE_KEY"]
    image = last_json(run(cli_cmd, env, "pack", str(src), "--out", f"file://{tmp_path / 's1'}", *k, "--json", "-q"))[
        "image"
    ]
    recv = subprocess.Popen(
        [
            *cli_cmd,
            "image",
            "receive",
            "--listen",
            "127.0.0.1:0",
            "--store",
            f"file://{tmp_path / 'target'}",
            *k,
            "--exit-after",
            "1",
        ],
        env=env,
        text=True,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    procs.append(recv)
    assert recv.stdout is not None
    hello = json.loads(recv.stdout.readline())
    pushed = last_json(run(cli_cmd, env, "push", image, hello["url"], *k, "--json", "-q"))
    out, _ = recv.communicate(timeout=30)
    summary = json.loads(out.strip().splitlines()[-1])
    assert recv.returncode == 0
    assert summary["images"] == [pushed["image_id"]]
    assert summary["chunks_received"] == pushed["chunks_sent"] and summary["chunks_rejected"] == 0


def test_keygen_writes_a_private_file(cli_cmd: list[str], env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "image.key"
    res = last_json(run(cli_cmd, env, "keygen", "--out", str(out), "--json"))
    assert len(res["key_id"]) == 16 and oct(out.stat().st_mode & 0o777) == "0o600"
    assert out.read_text().strip() not in json.dumps(res)
    again = run(cli_cmd, env, "keygen", "--out", str(out))
    assert again.returncode == 2

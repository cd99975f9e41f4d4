"""NIXL's start-up beside a nixl:// push: the sender's agent starts in the background, and when it cannot
start the push fails with a clear error naming the package (exit 2, no image at the receiver), with
inline=0 or 1; an agent on UCX over TCP starts without UCX's memory hooks. A real NIXL
receiver on loopback and the real CLI."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumigrate import control
from gpumigrate.transfer import open_store, pack_paths, serve_stream
from gpumigrate.transfer.stores.nixl_agent import _ucx_environment, load_nixl

KEY_ENV = "GM_TEST_IMAGE_KEY"


@pytest.fixture
def nixl_receiver(gm_home: Path, tmp_path: Path) -> Iterator[tuple[str, str, bytes]]:
    """(receiver url, its store, image key): a NIXL receiver on loopback in this process."""
    load_nixl()  # the nixl extra is part of `make setup`: missing, this fails with the package's name
    control.load_key(create=True)
    key = os.urandom(32)
    recv = serve_stream("127.0.0.1:0", f"file://{tmp_path / 'recv'}", key=key, nixl=True, nixl_transports="tcp")
    try:
        yield recv.url, f"file://{tmp_path / 'recv'}", key
    finally:
        recv.close()


def _image(tmp_path: Path, key: bytes) -> str:
    files = tmp_path / "files"
    files.mkdir()
    (files / "payload.bin").write_bytes(os.urandom(1 << 20))
    store = f"file://{tmp_path / 'src'}"
    return f"{store}#{pack_paths([files], store, key=key).id}"


def _push(cli_cmd: list[str], image: str, url: str, key: bytes, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*cli_cmd, "image", "push", image, url, "--key-env", KEY_ENV, "--json", "-q"],
        env={**os.environ, KEY_ENV: key.hex(), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("inline", ["0", "1"])
def test_an_agent_that_cannot_start_is_a_clear_error_naming_the_package(
    cli_cmd: list[str], nixl_receiver: tuple[str, str, bytes], tmp_path: Path, inline: str
) -> None:
    """inline=0: every chunk waits for the agent; inline=1: chunks may go on the connection while it starts.
    Either way the push fails before its manifest, so no image lands at the receiver."""
    url, store, key = nixl_receiver
    image = _image(tmp_path, key)
    failed = _push(cli_cmd, image, f"{url}&transports=no-such-transport&inline={inline}", key)
    assert failed.returncode == 2, failed.stderr
    assert "nixl-cu13" in failed.stderr and "no-such-transport" in failed.stderr
    assert "Traceback" not in failed.stderr
    with open_store(store) as received:
        assert received.list_manifests() == []


def test_ucx_over_tcp_starts_without_memory_hooks_and_leaves_the_environment_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("UCX_MEM_EVENTS", raising=False)
    monkeypatch.delenv("UCX_TLS", raising=False)
    with _ucx_environment("tcp"):
        assert (os.environ["UCX_TLS"], os.environ["UCX_MEM_EVENTS"]) == ("tcp", "no")
    with _ucx_environment("rc,tcp"):  # a fabric's registration cache needs UCX's memory events
        assert os.environ["UCX_TLS"] == "rc,tcp" and "UCX_MEM_EVENTS" not in os.environ
    with _ucx_environment(None):
        assert "UCX_TLS" not in os.environ and "UCX_MEM_EVENTS" not in os.environ
    assert "UCX_TLS" not in os.environ and "UCX_MEM_EVENTS" not in os.environ
    monkeypatch.setenv("UCX_MEM_EVENTS", "yes")  # the operator's choice wins
    with _ucx_environment("tcp"):
        assert os.environ["UCX_MEM_EVENTS"] == "yes"
    assert os.environ["UCX_MEM_EVENTS"] == "yes"

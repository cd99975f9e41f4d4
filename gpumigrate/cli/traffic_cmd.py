"""``gpumigrate traffic``: the control plane, weights, rollback, the live view and the load generator.

Everything here works on a control plane's state directory (``--state-dir``), so it acts from any
process: a ramp running in a flow, ``serve`` in another terminal, ``rollback`` after the flow ended.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import typer

from gpumigrate.cli.output import console, emit_json, esc
from gpumigrate.errors import InvalidInputError, NotFoundError


def _existing_state(state_dir: Path) -> Path:
    """Commands that change or read live weights need state that `traffic init` wrote: exit 2 otherwise."""
    from gpumigrate.traffic.state import StateStore

    if not StateStore(state_dir).exists():
        raise NotFoundError(
            f"no traffic state in {state_dir}: run `gpumigrate traffic init` there first, "
            "or give the --state-dir of a running migration"
        )
    return state_dir


app = typer.Typer(
    help="Traffic shifting through Envoy: control plane, weights, rollback, live view, load.", no_args_is_help=True
)

STATE_DIR = typer.Option(..., "--state-dir", help="The control plane's state directory.")


def _hostport(value: str, flag: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInputError(f"{flag} must be host:port such as 127.0.0.1:8000, got {value!r}")
    return host, int(port)


@app.command("init")
def init(
    state_dir: Path = STATE_DIR,
    source: str = typer.Option(..., "--source", help="host:port of the source service."),
    target: str | None = typer.Option(None, "--target", help="host:port of the target service."),
    health_path: str = typer.Option("/readyz", "--health-path", help="Path Envoy health-checks."),
    not_idempotent: bool = typer.Option(
        False, "--not-idempotent", help="Retry only failures before the request reached the service."
    ),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Write the desired state: upstreams, 100% to the source."""
    from gpumigrate.traffic.state import DesiredState, StateStore, Upstream

    ups = {"source": Upstream("source", *_hostport(source, "--source"), health_path=health_path)}
    if target:
        ups["target"] = Upstream("target", *_hostport(target, "--target"), health_path=health_path)
    state = StateStore(state_dir).init(
        DesiredState(
            upstreams=ups, weights={n: (100.0 if n == "source" else 0.0) for n in ups}, idempotent=not not_idempotent
        )
    )
    if json_out:
        emit_json(state.to_json())
    else:
        console.print(f"traffic state version {state.version} written to {state_dir}")


@app.command("serve")
def serve(
    state_dir: Path = STATE_DIR,
    port: int | None = typer.Option(
        None,
        "--port",
        help="Also serve ADS on this TCP port (0: any free one). Default: only the private socket that "
        "`traffic envoy --state-dir` finds; every stream must carry its node's token either way.",
    ),
    host: str = typer.Option("127.0.0.1", "--host"),
) -> None:
    """Run the ADS control plane until interrupted. Envoy keeps its config while it is down."""
    import logging

    from gpumigrate.traffic import xds

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    xds.serve(state_dir, port, host)


@app.command("envoy")
def envoy(
    state_dir: Path = STATE_DIR,
    xds_port: int | None = typer.Option(
        None, "--xds-port", help="The control plane's TCP port, where it serves one (default: its private socket)."
    ),
    workdir: Path = typer.Option(Path(".gpumigrate/envoy"), "--workdir"),
    listen_port: int = typer.Option(10000, "--listen-port"),
    node_id: str = typer.Option("gpumigrate-envoy", "--node-id"),
) -> None:
    """Run one supervised Envoy bootstrapped to the control plane of --state-dir, until interrupted. Its admin
    interface is a Unix socket only this user can reach (printed), never a TCP port."""
    from gpumigrate.traffic.envoy import Envoy

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    # Stop on SIGINT or SIGTERM alike, also where SIGINT came in ignored (a job started with `&` by a
    # non-interactive shell): Envoy runs in its own session, so dying without stop() would orphan it.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    e = Envoy(workdir, state_dir=state_dir, xds_port=xds_port, node_id=node_id, listen_port=listen_port).start()
    console.print(f"envoy {node_id}: listener {e.url}, probes {e.probe_url}, admin {e.admin_url}")
    try:
        while e.proc is not None and e.proc.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        e.stop()


@app.command("set-weight")
def set_weight(
    state_dir: Path = STATE_DIR,
    weight: float = typer.Argument(..., help="Percent of client traffic to the target (0-100)."),
    wait_node: list[str] = typer.Option([], "--wait-node", help="Wait until this Envoy node ACKed (repeatable)."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Set the source/target split (one RDS update)."""
    from gpumigrate.traffic.state import StateStore, split

    store = StateStore(_existing_state(state_dir))
    state = store.set_weights(split(store.read().primary, "target", weight))
    if wait_node:
        store.wait_applied(state.version, wait_node)
    if json_out:
        emit_json({"version": state.version, "weights": state.weights})
    else:
        console.print(f"version {state.version}: {state.weights}")


@app.command("rollback")
def rollback(
    state_dir: Path = STATE_DIR,
    reason: str = typer.Option("manual rollback", "--reason"),
    wait_node: list[str] = typer.Option([], "--wait-node", help="Wait until this Envoy node ACKed (repeatable)."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """100% of traffic to the source in one update. Works from any process; a running ramp stops."""
    from gpumigrate.traffic.state import StateStore, rollback_to_source

    state = rollback_to_source(_existing_state(state_dir), reason)
    if wait_node:
        StateStore(state_dir).wait_applied(state.version, wait_node)
    if json_out:
        emit_json({"version": state.version, "weights": state.weights, "rolled_back": state.rolled_back})
    else:
        console.print(f"rolled back: version {state.version}, weights {state.weights}")


@app.command("status")
def status(state_dir: Path = STATE_DIR, json_out: bool = typer.Option(False, "--json")) -> None:
    """Desired state and what each Envoy has applied."""
    from gpumigrate.traffic.state import StateStore

    store = StateStore(_existing_state(state_dir))
    out = {"desired": store.read().to_json(), "envoys": store.statuses()}
    if json_out:
        emit_json(out)
        return
    d = out["desired"]
    console.print(f"version {d['version']} weights {d['weights']} rolled_back={bool(d['rolled_back'])}")
    for node, st in out["envoys"].items():
        console.print(f"  {node}: applied {st.get('applied')} connected={st.get('connected')} nack={st.get('nack')}")


@app.command("watch")
def watch(
    admin: str | None = typer.Option(
        None,
        "--admin",
        help="Envoy's admin: unix:PATH (a front door's, in its frontdoor.json) or the URL of an Envoy of your own. "
        "Default: the front door of --state-dir.",
    ),
    state_dir: Path | None = typer.Option(None, "--state-dir", help="Show the ramp's verdicts and probes too."),
    interval: float = typer.Option(1.0, "--interval", min=0.1, max=60),
    seconds: float | None = typer.Option(None, "--seconds", help="Stop after this long (default: until Ctrl-C)."),
    prometheus_port: int | None = typer.Option(None, "--prometheus-port", help="Also export /metrics here."),
    json_out: bool = typer.Option(False, "--json", help="One JSON line per interval instead of the table."),
) -> None:
    """Source and target side by side, live: weight, req/s, error rate, p99, health, probes, gate."""
    from rich.live import Live

    from gpumigrate.traffic.metrics import TrafficMetrics
    from gpumigrate.traffic.watch import Watcher, render

    if admin is None:
        if state_dir is None:
            raise InvalidInputError("give --state-dir (the front door's) or --admin (an Envoy's admin)")
        from gpumigrate.traffic.frontdoor import read

        admin = read(state_dir).admin_urls[0]
    watcher = Watcher(admin, state_dir=state_dir)
    metrics = TrafficMetrics() if prometheus_port is not None else None
    if metrics is not None:
        port = metrics.serve(prometheus_port or 0)
        console.print(f"prometheus metrics on http://127.0.0.1:{port}/metrics")
    end = time.monotonic() + seconds if seconds else None
    watcher.poll()
    try:
        with Live(console=console, auto_refresh=False, transient=False) if not json_out else _Null() as live:
            while end is None or time.monotonic() < end:
                time.sleep(interval)
                row = watcher.poll()
                if metrics is not None:
                    analysis = ((row.get("ramp") or {}).get("sample") or {}).get("analysis")
                    metrics.observe(row["weights"], row["clusters"], analysis)
                if json_out:
                    print(json.dumps(row), flush=True)
                else:
                    live.update(render(row), refresh=True)
    except KeyboardInterrupt:
        pass
    finally:
        if metrics is not None:
            metrics.close()


class _Null:
    """Stands in for the live table when rows go out as JSON lines."""

    def __enter__(self) -> _Null:
        return self

    def update(self, *args: object, **kwargs: object) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@app.command("load")
def load(
    url: str = typer.Argument(..., help="URL to POST to, e.g. http://127.0.0.1:10000/v1/generate"),
    rps: float = typer.Option(50.0, "--rps", min=0.1, max=100_000),
    seconds: float = typer.Option(10.0, "--seconds", min=0.1, max=86_400),
    body: str | None = typer.Option(None, "--body", help="JSON body (default: a short generate request)."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Open-loop load at a fixed rate: totals, failures, latency percentiles, the longest extra wait, the longest
    stretch with no answer. With --json: one line per second, then the summary (the last line)."""
    from gpumigrate.traffic.loadgen import LoadGenerator

    if not url.startswith(("http://", "https://")):
        raise InvalidInputError(f"URL must start with http:// or https://, got {url!r}")
    try:
        parsed = json.loads(body) if body else None
    except ValueError as exc:
        raise InvalidInputError(f"--body is not valid JSON: {exc}") from None
    report = LoadGenerator(url, rps=rps, seconds=seconds, body=parsed).run()
    if json_out:  # a line per second, then the summary: the last line is one short JSON object
        for row in report.per_second:
            print(json.dumps({"second": row}), flush=True)
        emit_json(report.summary())
    else:
        console.print(
            f"{report.total} requests, {report.failed} failed {report.errors or ''}; p50 {report.p50_ms} ms, "
            f"p99 {report.p99_ms} ms, longest extra wait {report.stall_ms} ms, no answer for {report.downtime_ms} ms "
            f"at most, {report.achieved_rps} req/s",
            soft_wrap=True,
        )
    if report.total and report.failed == report.total:  # a load that reached nothing is not a load test
        console.print(f"[red]no request succeeded[/]: is {esc(url)} the right URL, and does it answer?")
        raise typer.Exit(1)

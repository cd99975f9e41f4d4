"""Benchmark: `gpumigrate rollback ID` to 100% of traffic on the source, beside the same rollback in a Prefect flow.

Each run sets up what a cut-over leaves: a detached front door (`gpumigrate frontdoor up`, real Envoy) in front of a
source, with the target at 100% of the traffic, and a completed migration in its rollback window (its record made
through the flows' own RunContext). Then the command, as an operator types it, in a fresh process; measured from
its start to:

* ``applied_s``: every Envoy of the door ACKed the state that sends 100% to the source (what clients then meet);
* ``returned_s``: the command exited (with ``PREFECT_API_URL`` unset: no Prefect at all).

Baseline from the same run (``--baseline N``): the same rollback through the ``rollback`` Prefect flow in a fresh
process, as the CLI ran it before (the flow starts Prefect's ephemeral API first). Figures are medians over
``--runs`` (default 5), each run listed.

Usage: ``python bench/rollback.py [--runs 5] [--baseline 3] [--json]``; ``--smoke`` (CI): one run of the command,
exit 1 unless it returned 0, the door sends 100% to the source and the migration reads rolled_back (no timing is
judged).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CLI = [str(Path(sys.executable).parent / "gpumigrate")]


class _Answer(BaseHTTPRequestHandler):
    def _send(self) -> None:
        body = json.dumps({"side": self.server.side}).encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _send  # noqa: N815

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def upstream(side: str) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    server.side = side  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cut_over(home: Path, source: str, target: str, mid: str) -> str:
    """What a completed migration leaves: the door with the target at 100%, the record in its rollback window."""
    from urllib.parse import urlsplit

    from gpumigrate.flows.context import RunContext
    from gpumigrate.traffic import frontdoor
    from gpumigrate.traffic.state import StateStore, split

    plan = home / f"{mid}.yaml"
    plan.write_text(yaml.safe_dump({
        "version": 1,
        "workload": {"name": "bench-svc", "kind": "inference", "source_host": "local-a", "endpoint": source,
                     "agent": f"127.0.0.1:{_dead_port()}", "launch": {"argv": ["{python}", "service.py"]}},
        "target": {"provider": "local", "region": "local-b", "host": "bench-b"},
        "data": {"classification": "internal", "allowed_jurisdictions": ["LOCAL"]},
        "transfer": {"store": "file://store"},
    }))  # fmt: skip
    ctx = RunContext.create(plan, migration_id=mid, resume=False)
    door_dir = ctx.traffic_dir()
    door = frontdoor.read(door_dir)
    parts = urlsplit(target)
    frontdoor.add_target(door_dir, parts.hostname or "127.0.0.1", parts.port or 80, nodes=door.nodes)
    store = StateStore(door_dir)
    state = store.set_weights(split(frontdoor.SOURCE, frontdoor.TARGET, 100))
    store.wait_applied(state.version, door.nodes, timeout_s=30)
    ctx.update(target_endpoint=target, rollback_deadline=time.time() + 600)
    ctx.migration.update(status="completed")
    return str(door_dir)


def _applied_to_source(door_dir: str, nodes: list[str]) -> bool:
    from gpumigrate.traffic.state import StateStore

    store = StateStore(door_dir)
    state = store.read()
    if state.weights.get("source") != 100.0:
        return False
    statuses = store.statuses()
    return all(int((statuses.get(n) or {}).get("applied", -1)) >= state.version for n in nodes)


def one(home: Path, env: dict[str, str], source: str, target: str, mid: str, argv: list[str]) -> dict[str, Any]:
    from gpumigrate.traffic import frontdoor

    door_dir = cut_over(home, source, target, mid)
    # The names the control plane files each Envoy's ACK under (traffic/STATE_FORMAT.md).
    nodes = [
        "".join(c if c.isalnum() or c in "-_" else "_" for c in n)[:100] for n in frontdoor.read(Path(door_dir)).nodes
    ]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    applied = None
    while applied is None and time.monotonic() - t0 < 120:
        if _applied_to_source(door_dir, nodes):
            applied = time.monotonic() - t0
        else:
            time.sleep(0.005)
    out, err = proc.communicate(timeout=600)
    returned = time.monotonic() - t0
    from gpumigrate.state import Migration

    status = Migration.open(mid).read().get("status")
    return {"applied_s": None if applied is None else round(applied, 3), "returned_s": round(returned, 3),
            "exit": proc.returncode, "status": status, "stderr": err[-500:] if proc.returncode else ""}  # fmt: skip


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return round(statistics.median(values), 3) if values else None


def measure(runs: int, baseline: int, on_run: Callable[[str, dict[str, Any]], None]) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="gm-bench-rollback-"))
    home = work / "home"
    home.mkdir()
    env = {**os.environ, "GPUMIGRATE_HOME": str(home), "PREFECT_HOME": str(work / "prefect"), "GPUMIGRATE_IDENTITY":
           os.environ.get("GPUMIGRATE_IDENTITY", "aws,gcp,prefect")}  # fmt: skip
    env.pop("PREFECT_API_URL", None)
    os.environ.update({k: env[k] for k in ("GPUMIGRATE_HOME", "PREFECT_HOME")})
    out: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}}
    with upstream("source") as source, upstream("target") as target:
        up = subprocess.run([*CLI, "frontdoor", "up", "--source", source, "--listen", "127.0.0.1:0"], env=env,
                            capture_output=True, text=True, timeout=180)  # fmt: skip
        if up.returncode != 0:
            raise SystemExit(f"frontdoor up failed: {up.stderr[-2000:]}")
        try:
            cli = []
            for i in range(runs):
                cli.append(one(home, env, source, target, f"cli-{i}", [*CLI, "rollback", f"cli-{i}"]))
                on_run("cli", cli[-1])
            flow = []
            if baseline:  # Prefect's home made once, untimed: the CLI's users had theirs from the first run
                warm = "from prefect import flow; flow(name='warm-up')(lambda: None)()"
                subprocess.run([sys.executable, "-c", warm], env=env, capture_output=True, timeout=600)
            for i in range(baseline):
                code = f"from gpumigrate.flows.rollback import rollback_flow; rollback_flow(migration_id='flow-{i}')"
                flow.append(one(home, env, source, target, f"flow-{i}", [sys.executable, "-c", code]))
                on_run("flow", flow[-1])
        finally:
            subprocess.run([*CLI, "frontdoor", "down"], env=env, capture_output=True, timeout=120)
    out["cli"] = {"median_applied_s": _median(cli, "applied_s"), "median_returned_s": _median(cli, "returned_s"),
                  "runs": cli}  # fmt: skip
    if flow:
        out["baseline_prefect_flow"] = {"median_applied_s": _median(flow, "applied_s"),
                                        "median_returned_s": _median(flow, "returned_s"), "runs": flow}  # fmt: skip
    out["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--baseline", type=int, default=3, help="runs of the Prefect-flow path (0: none)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    runs, baseline = (1, 0) if args.smoke else (args.runs, args.baseline)

    def show(kind: str, run: dict[str, Any]) -> None:
        print(f"{kind}: applied {run['applied_s']} s, returned {run['returned_s']} s, exit {run['exit']}",
              file=sys.stderr, flush=True)  # fmt: skip

    result = measure(runs, baseline, show)
    print(json.dumps(result, indent=None if args.json else 2))
    if args.smoke:
        run = result["cli"]["runs"][0]
        if run["exit"] != 0 or run["status"] != "rolled_back" or run["applied_s"] is None:
            print(f"smoke: the rollback did not put 100% on the source: {run}", file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    main()

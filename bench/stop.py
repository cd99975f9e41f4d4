"""How long `gpumigrate migrate` takes to exit after SIGTERM, phase by phase (flows/stopping.py).

The scenario is the tests' (``tests/support/stop_scenario.py``): a user's own service behind a real front door,
Prefect's own ephemeral API, the real CLI in its own session; SIGTERM to its whole process group (as `timeout`,
a systemd stop or a CI cancel send it, so Prefect's API dies with it) once the phase runs. Each figure is the
wall time from the signal to the process's exit, rollback and audit record included, beside the promise
(``stopping.EXIT_WITHIN_S``, 10 s) and the exit code (3: rolled back). The source must be unharmed after each.

``--smoke`` (CI): the provision phase only; exits 1 unless it rolled back (exit 3) and the source is unharmed. It
judges no timing. Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", default="provision,snapshot,ramp", help="comma-separated: provision, snapshot, ramp")
    ap.add_argument("--smoke", action="store_true", help="CI: the provision phase only; judges no timing")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from gpumigrate.flows.stopping import EXIT_WITHIN_S
    from tests.support.stop_scenario import PHASES, plan, run_and_signal, running_source, unharmed

    phases = ["provision"] if args.smoke else [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        sys.exit(f"unknown phase(s) {unknown}: choose from {sorted(PHASES)}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gm-bench-stop-"))
    report: dict[str, Any] = {"bench": "stop", "promise_s": EXIT_WITHIN_S, "signal": "SIGTERM to the process group"}
    wrong: list[str] = []
    with running_source(work / "home") as src:
        for phase in phases:
            launch, waits_on = PHASES[phase]
            stopped = run_and_signal(
                src, plan(src, work / f"{phase}.yaml", launch=launch, hold_s=300), f"b-{phase}", phase
            )
            try:
                unharmed(src)
                harmed = ""
            except AssertionError as exc:  # the check that failed, as written, where the assertion says nothing
                where = traceback.extract_tb(exc.__traceback__)[-1].line or ""
                harmed = str(exc)[:300] or f"the source is harmed: {where}"
            report[phase] = {
                "exit_s": round(stopped.seconds, 2),
                "promise_s": EXIT_WITHIN_S,
                "exit_code": stopped.code,
                "status": stopped.result.get("status"),
                "waiting_on": waits_on,
                "source_unharmed": not harmed,
            }
            if stopped.code != 3 or stopped.result.get("status") != "rolled_back":
                wrong.append(f"{phase}: exit {stopped.code}, status {stopped.result.get('status')}")
            if harmed:
                wrong.append(f"{phase}: {harmed}")
    print(json.dumps(report))
    if wrong:
        sys.exit("stop: " + "; ".join(wrong))


if __name__ == "__main__":
    main()

"""The README's first two sections, run as a user runs them: in a clean environment (only ``PATH`` and a scratch
``HOME``), from a fresh folder holding the project's examples, each command checked for the exit code the README
documents. Nothing of the test session reaches these processes (no audit key, no Prefect server, no switch that
lets a workload be broken): what passes here passes on a user's plain shell.

* The demo (``make demo`` runs ``gpumigrate demo``): 0 to cut-over; each ``--fault`` rolls back (exit 3) with
  the fault acknowledged by the target, the source serving throughout, and failed client requests <= 0.1%.
* "What an SRE runs", in a shell where none of the plan's services run: ``plan validate`` and ``cost`` answer
  (0); ``capacity`` needs AWS credentials (1, naming the chain); ``migrate`` stops in preflight before anything
  moved (2, naming the command that starts the front door it needs); ``status``, ``rollback`` and ``audit``
  of that migration answer (0); ``--resume`` stops the same way (2). No command prints a traceback.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"```sh\n(.*?)```", re.S)
DEMO_TIMEOUT_S = 900  # one whole demo on a loaded 2-core machine, the first one migrating a fresh Prefect home
COMMAND_TIMEOUT_S = 600
# pytest-timeout's guard (600 s in pyproject) is raised above each test's own bound, so that a slow demo fails naming its
# command and bound, not with the guard's stack dump: a demo is given DEMO_TIMEOUT_S.
pytestmark = pytest.mark.timeout(DEMO_TIMEOUT_S + 300)
FAULTS = ("target-errors", "target-slow", "target-drift", "target-crash")


def _section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start : end if end > 0 else len(text)]


def sre_commands() -> list[list[str]]:
    """The `gpumigrate ...` lines of the "What an SRE runs" block, comments dropped."""
    block = _BLOCK.findall(_section("## What an SRE runs"))[0]
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def demo_commands() -> list[list[str]]:
    """What the README's opening says to run for the demo: `make demo` (it runs `gpumigrate demo`), and
    `gpumigrate demo --fault A|B|C|D` once per fault it lists."""
    intro = (REPO / "README.md").read_text().split("\n## ", 1)[0]
    assert "make demo" in intro
    make = (REPO / "Makefile").read_text()
    assert re.search(r"^demo:.*\n\t\$\(BIN\)/gpumigrate demo$", make, re.M), "make demo no longer runs gpumigrate demo"
    listed = re.search(r"gpumigrate demo --fault\s+([\w|-]+)", intro.replace("\n", " "))
    assert listed, "the README no longer names the demo's faults"
    return [["gpumigrate", "demo"], *(["gpumigrate", "demo", "--fault", f] for f in listed.group(1).split("|"))]


class UserShell:
    """A scratch folder with the project's examples, and a scratch HOME: commands run there with PATH and HOME."""

    def __init__(self, root: Path) -> None:
        self.cwd, self.home = root / "work", root / "home"
        self.home.mkdir(parents=True)
        shutil.copytree(REPO / "examples", self.cwd / "examples")
        self.env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(self.home)}

    def run(self, argv: list[str], timeout_s: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(argv, cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        assert "Traceback" not in proc.stderr + proc.stdout, f"{shlex.join(argv)}:\n{proc.stderr[-3000:]}"
        return proc


def _result(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads(lines[-1])
    return doc


def _leftovers(migration_id: str) -> list[str]:
    """Processes still running for this demo (its hosts are named demo-a-/demo-b-<suffix>)."""
    suffix = migration_id.rsplit("-", 1)[-1]
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if f"-{suffix}" in line and "ps -eo" not in line]


@pytest.fixture(scope="module")
def shell(tmp_path_factory: pytest.TempPathFactory) -> UserShell:
    """One user's shell for the module: the demos share its Prefect home (migrated once, as a user's would be)."""
    return UserShell(tmp_path_factory.mktemp("user"))


def _audit(shell: UserShell, migration_id: str) -> list[dict[str, Any]]:
    path = shell.cwd / ".gpumigrate" / "migrations" / migration_id / "audit.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_the_demo_migrates_to_cut_over(shell: UserShell) -> None:
    argv = demo_commands()[0]
    proc = shell.run([*argv, "--json", "--no-live"], timeout_s=DEMO_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = _result(proc)
    assert result["status"] == "completed" and result["error"] is None
    assert all(p["status"] == "completed" for p in result["phases"].values()) and len(result["phases"]) == 8
    rq = result["requests"]
    assert rq["total"] > 100 and rq["failed"] == 0 and rq["p50_ms"] > 0 and rq["p99_ms"] >= rq["p50_ms"]
    assert result["downtime_ms"] is not None
    assert result["bytes"]["image"] > 0 and result["bytes"]["sent"] > 0
    assert result["parity"]["passed"] is True and result["parity"]["cases"] > 0
    assert result["rollback"]["triggered"] is False
    assert Path(result["report"]).is_file() and Path(result["chart"]).read_bytes()[:4] == b"\x89PNG"
    assert result["report"] in proc.stderr and result["chart"] in proc.stderr  # says where they are
    mdir = shell.cwd / ".gpumigrate" / "migrations" / result["migration_id"]
    key = mdir / "demo.key"
    assert key.stat().st_mode & 0o777 == 0o600
    secret = key.read_text().strip()
    for path in mdir.rglob("*"):  # the key never lands in state, audit, plan or artifacts
        if path.is_file() and path != key and path.stat().st_size < 5_000_000:
            assert secret not in path.read_text(errors="ignore"), path
    assert secret not in proc.stderr
    events = [r["event"] for r in _audit(shell, result["migration_id"])]
    assert not any(e.startswith("fault.") for e in events)
    assert _leftovers(result["migration_id"]) == []


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_of_the_demo_rolls_back_while_the_source_serves(shell: UserShell, fault: str) -> None:
    argv = next(a for a in demo_commands() if a[-1] == fault)
    proc = shell.run([*argv, "--json", "--no-live"], timeout_s=DEMO_TIMEOUT_S)
    assert proc.returncode == 3, proc.stderr[-3000:]
    result = _result(proc)
    assert result["status"] == "rolled_back" and result["rollback"]["triggered"] is True
    assert result["phases"]["ramp"]["status"] == "rolled_back"
    records = _audit(shell, result["migration_id"])
    events = [r["event"] for r in records]
    # The target acknowledged the fault before the audit said it was injected; nothing failed to inject.
    injected = next(r["data"] for r in records if r["event"] == "fault.injected")
    assert injected["fault"] == fault and "fault.failed" not in events
    # The traffic is back on the source before the automatic rollback is recorded as done (each event follows its
    # action): the injection precedes both.
    assert events.index("fault.injected") < min(events.index("rollback.automatic"), events.index("traffic.rolled_back"))
    # The source served throughout: the clients of the front door saw (almost) nothing of the broken target.
    load = next(r["data"] for r in records if r["event"] == "demo.load")
    assert result["requests"]["total"] > 100, load
    assert result["requests"]["failed"] <= 0.001 * result["requests"]["total"], load
    assert (
        "source.zeroized" not in events
    )  # the source served throughout (a ramp's undo has no frozen source to resume)
    assert _leftovers(result["migration_id"]) == []


# ----------------------------------------------------------------------------- what an SRE runs
def _expect(argv: list[str]) -> tuple[int, str]:
    """The exit code the README documents for one command in a shell where none of the plan's services run,
    and a text its output must hold."""
    verb = argv[1]
    if verb == "plan":
        return 0, "valid"
    if verb == "capacity":
        return 1, "no AWS credentials"
    if verb == "cost":
        return 0, "decision"
    if verb == "migrate":
        return 2, "gpumigrate frontdoor up --source http://127.0.0.1:18080"
    if verb == "rollback":
        return 0, "denied before anything moved"
    if verb == "gc":
        return 0, "freed"
    return 0, "m1"  # status, audit


def test_what_an_sre_runs_gives_the_documented_exit_codes(shell: UserShell) -> None:
    commands = sre_commands()
    assert [c[1] for c in commands] == [
        "plan",
        "capacity",
        "cost",
        "migrate",
        "status",
        "rollback",
        "migrate",
        "audit",
        "gc",
    ]
    for argv in commands:
        code, says = _expect(argv)
        proc = shell.run(argv)
        assert proc.returncode == code, f"{shlex.join(argv)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        assert says in proc.stdout + proc.stderr, f"{shlex.join(argv)} does not say {says!r}:\n{proc.stderr[-3000:]}"
        if "--json" in argv:
            assert _result(proc)["status"] == "denied"
    events = [r["event"] for r in _audit(shell, "m1")]
    assert "phase.preflight.failed" in events and "phase.provision.started" not in events  # nothing moved

"""`gpumigrate migrate` stops when told (flows/stopping.py): SIGTERM to its whole process group — as `timeout`, a
systemd stop or a CI cancel send it, so Prefect's ephemeral API dies with it — in provision, in snapshot and in
the ramp; then a second signal. The scenario (a user's own service behind a real front door, Prefect's own
ephemeral API, the real CLI in its own session) is ``tests/support/stop_scenario.py``.

Each test asserts that the process exited, rolled back (exit 3, the result and the audit say so) and that the
source is unharmed: it serves, is not frozen, no target is left. How long the exit took is measured by
``bench/stop.py`` (JSON), not asserted here beyond a generous bound that only says "it exits".
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.stop_scenario import PHASES, SERVICE, Source, gm, plan, run_and_signal, running_source, unharmed

pytestmark = pytest.mark.slow
OUR_CODE = str(Path(__file__).resolve().parents[2])  # a frame of the repo's own code (not its .venv's packages)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Source]:
    with running_source(tmp_path_factory.mktemp("stop-home")) as src:
        yield src


@pytest.mark.parametrize("phase", list(PHASES))
def test_sigterm_rolls_back_and_exits(source: Source, tmp_path: Path, phase: str) -> None:
    launch, _ = PHASES[phase]
    plan_file = plan(source, tmp_path / f"{phase}.yaml", launch=launch, hold_s=300)
    mid = f"stop-{phase}"
    stopped = run_and_signal(source, plan_file, mid, phase)
    assert stopped.code == 3, stopped.stderr[-3000:]
    assert stopped.result["status"] == "rolled_back" and "SIGTERM" in stopped.result["error"]
    # No traceback through our code. (Prefect's own event worker may log some of its own when its API is slow on a
    # loaded machine, before any signal: not ours to silence there.)
    ours = [
        ln
        for ln in stopped.stderr.splitlines()
        if ln.strip().startswith('File "') and OUR_CODE in ln and "site-packages" not in ln
    ]
    assert not ours, stopped.stderr[-3000:]
    audit = (source.home / "migrations" / mid / "audit.jsonl").read_text()
    assert '"rollback.cancel"' in audit and '"migration.rolled_back"' in audit
    unharmed(source)


def test_a_second_signal_exits_at_once_and_leaves_the_migration_for_rollback(
    source: Source, tmp_path: Path, cli_cmd: list[str]
) -> None:
    plan_file = plan(source, tmp_path / "twice.yaml", launch=SERVICE, hold_s=300)
    stopped = run_and_signal(source, plan_file, "stop-twice", "ramp", signals=2)
    assert stopped.code == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert "second signal" in stopped.stderr and "gpumigrate rollback stop-twice" in stopped.stderr
    out = gm(cli_cmd, source.env, "rollback", "stop-twice", "--json")  # the state it left is enough to undo
    assert out.returncode in (0, 3), out.stderr[-3000:]
    unharmed(source)

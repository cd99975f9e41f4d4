"""Three cells of the fault matrix (bench/faults.py), each a real local migration with one process SIGKILLed.

The driver runs as the user would run it (a subprocess, its own Prefect server, state root and hosts);
these tests assert what its probes found. What each cell is expected to show is in bench/FAULTS.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
CELLS = ("orchestrator:freeze", "target:restore", "envoy:ramp")
# The plans' freeze lease (snapshot.freeze_lease_s; the demo plan's 60 s by default): the orchestrator cell waits it out
# once its orchestrator is killed. Shorter than the demo's, as a user's plan may set it; the flow's lease keeper renews
# it every third of it while the orchestrator lives, so the other cells never see it lapse.
FREEZE_LEASE_S = 20.0

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, Any]]:
    out = tmp_path_factory.mktemp("faults")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "GPUMIGRATE_HOME"))}
    argv = [sys.executable, str(REPO / "bench" / "faults.py"), "--only", ",".join(CELLS), "--out", str(out), "--json"]
    argv += ["--freeze-lease-s", str(FREEZE_LEASE_S)]
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=1500,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out / "faults.md").is_file() and (out / "faults.json").is_file()
    return {(c["victim"], c["phase"]): c for c in doc["cells"]}


def _unharmed(cell: dict[str, Any]) -> None:
    """Nothing lost: the source serves its own weights unfrozen, or a completed cut-over replaced it
    (the demo's plan has no rollback window: finalize then zeroizes the source, as designed)."""
    assert cell["killed"], cell
    assert cell["source_harmed"] is False and cell["bytes_lost"] is False, cell
    if cell["final_status"] == "completed":
        assert cell["target_digest_same"] and cell["door_serves"], cell
        assert (cell["door_live"] or {}).get("target") == 10000, cell
    else:
        assert cell["source_serves"] and cell["source_digest_same"], cell
        assert cell["source_frozen"] is False, cell
    assert not any("hung" in n for n in cell["notes"]), cell


def test_orchestrator_killed_after_freeze_source_serves_again_within_the_lease(
    matrix: dict[tuple[str, str], dict[str, Any]],
) -> None:
    cell = matrix[("orchestrator", "freeze")]
    assert cell["flow_exit"] == -9  # SIGKILL, at the moment the source was frozen
    assert cell["freeze_lease_s"] == FREEZE_LEASE_S  # the plan's lease, the one the source waited out
    assert cell["source_frozen_after_kill"] is True
    assert cell["source_serves_again_s"] is not None
    assert cell["source_serves_again_s"] <= FREEZE_LEASE_S + 10  # the lease, plus the probe's own period
    # `gpumigrate migrate --resume` then ends the migration one way or the other, never half-way.
    assert cell["recovery_steps"] and cell["recovery_steps"][0].startswith("resume:")
    assert cell["final_status"] in ("completed", "rolled_back")
    _unharmed(cell)


def test_target_killed_at_restore_leaves_the_source_serving(matrix: dict[tuple[str, str], dict[str, Any]]) -> None:
    cell = matrix[("target", "restore")]
    assert cell["flow_status"] in ("failed", "rolled_back")  # the flow gave up on that target by itself
    assert cell["final_status"] in ("completed", "rolled_back")  # after resume, if the flow only failed
    _unharmed(cell)
    assert cell["door_serves"]


def test_envoy_killed_during_ramp_is_started_again_and_clients_lose_only_its_restart(
    matrix: dict[tuple[str, str], dict[str, Any]],
) -> None:
    cell = matrix[("envoy", "ramp")]
    # The door's supervisor started Envoy again (with the last weights, from its control plane); the ramp saw a
    # gap in Envoy's figures and went on or rolled back, never held.
    assert cell["door_restarts"].get("envoy", 0) >= 1, cell
    assert cell["flow_status"] in ("completed", "rolled_back"), cell
    _unharmed(cell)
    assert cell["door_serves"] is True and cell["door_live"] is not None, cell
    # What clients lost is the restart: a few seconds of the load, not the rest of the cell.
    assert cell["client_failed"] <= 0.25 * cell["client_requests"], cell

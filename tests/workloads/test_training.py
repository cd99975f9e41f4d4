"""Training state capture/restore: the next step after a restore gives the identical loss."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpumigrate.errors import SnapshotError
from gpumigrate.workloads.training import TrainingConfig, TrainingState, run_steps, train

CHILD = """
import json, sys, torch
from gpumigrate.workloads.training import *
torch.set_num_threads(1)
mode, path = sys.argv[1], sys.argv[2]
state = TrainingState.create(TrainingConfig(seed=5))
if mode == "source":
    run_steps(state, 3)
    save_capture(state.capture(), path)
    print(json.dumps(run_steps(state, 2)))
else:
    state.restore(load_capture(path))
    print(json.dumps(run_steps(state, 2)))
"""


def _child(mode: str, path: Path) -> list[float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(path)], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_capture_restore_across_processes(tmp_path: Path) -> None:
    snap = tmp_path / "step3.pt"
    continued = _child("source", snap)
    restored = _child("target", snap)
    assert restored == continued  # bit-identical losses for steps 4 and 5


def test_restore_twice_from_one_capture_in_process() -> None:
    cfg = TrainingConfig(seed=1)
    src = TrainingState.create(cfg)
    run_steps(src, 2)
    snap = src.capture()
    expected = run_steps(src, 2)
    for _ in range(2):  # a capture must survive being restored from (no shared optimizer tensors)
        dst = TrainingState.create(cfg)
        dst.restore(snap)
        assert run_steps(dst, 2) == expected


def test_forgetting_rng_changes_the_loss() -> None:
    """Dropout draws from the torch RNG: the restore must carry it (this guards the test above)."""
    cfg = TrainingConfig(seed=2)
    src = TrainingState.create(cfg)
    run_steps(src, 2)
    snap = src.capture()
    expected = run_steps(src, 1)
    dst = TrainingState.create(cfg)
    dst.restore(snap)
    torch.manual_seed(999)
    assert run_steps(dst, 1) != expected


def test_lightning_trainer_matches_plain_loop() -> None:
    cfg = TrainingConfig(seed=3)
    plain = TrainingState.create(cfg)
    expected = run_steps(plain, 3)
    lit = TrainingState.create(cfg)
    assert train(lit, 3) == expected
    assert lit.step == 3 and lit.weights_digest() == plain.weights_digest()


def test_restore_rejects_other_config() -> None:
    snap = TrainingState.create(TrainingConfig(seed=1)).capture()
    with pytest.raises(SnapshotError, match="config"):
        TrainingState.create(TrainingConfig(seed=2)).restore(snap)


def test_training_cli_runs_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpumigrate.workloads.training",
            "--steps",
            "3",
            "--seed",
            "4",
            "--out",
            str(out),
            "--threads",
            str(torch.get_num_threads()),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 3]
    result = json.loads(out.read_text())
    state = TrainingState.create(TrainingConfig(seed=4))
    assert result["losses"] == run_steps(state, 3)
    assert result["weights_digest"] == state.weights_digest()

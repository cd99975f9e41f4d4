"""The SDK's warm-up at attach: a capture of a probe through the real writer, leaving nothing behind; captures
and restores wait for it instead of compiling the same kernels beside it."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch


def test_the_warm_capture_runs_the_real_writer_and_leaves_no_store_behind(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from gpumigrate.agent import warmup

    monkeypatch.setenv("GPUMIGRATE_SNAPSHOT_CHUNK_MB", "1")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    warmup._warm_capture(torch.device("cpu"))
    assert list(scratch.iterdir()) == []  # the probe's store is gone


def test_the_warm_capture_draws_none_of_the_workloads_random_numbers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """It runs on a thread beside the job's first steps: a draw from the default generator would shift the job's
    dropout masks and samples (a 2-rank DDP job on GPUs took other losses after its move than its control run)."""
    from gpumigrate.agent import warmup

    monkeypatch.setenv("GPUMIGRATE_SNAPSHOT_CHUNK_MB", "1")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    torch.manual_seed(1234)
    before = torch.get_rng_state().clone()
    warmup._warm_capture(torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before)


def test_captures_wait_for_the_warm_up_and_say_how_long(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpumigrate.agent import warmup

    started = threading.Event()
    thread = threading.Thread(target=lambda: (started.set(), time.sleep(0.3)), daemon=True)
    monkeypatch.setattr(warmup, "_warming", [thread])
    thread.start()
    started.wait()
    waited = warmup.wait_for_kernels()
    assert not thread.is_alive() and waited >= 0.1
    assert warmup.wait_for_kernels() < 0.05  # once done, nothing to wait for


def test_the_chunk_size_follows_where_the_state_lives_unless_the_environment_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """32 MiB chunks for state on a GPU (set when the attach warms a device's kernels), the image format's default
    for host memory, and GPUMIGRATE_SNAPSHOT_CHUNK_MB over both."""
    from gpumigrate.agent import warmup

    monkeypatch.delenv("GPUMIGRATE_SNAPSHOT_CHUNK_MB", raising=False)
    monkeypatch.setattr(warmup, "_state_on_gpu", threading.Event())
    assert warmup.warm_device_kernels([]) is None and warmup.chunk_size() is None  # host memory: 4 MiB
    warmup._state_on_gpu.set()  # what warm_device_kernels([0]) records first, on a GPU host
    assert warmup.chunk_size() == warmup.GPU_CHUNK_SIZE == 32 << 20
    monkeypatch.setenv("GPUMIGRATE_SNAPSHOT_CHUNK_MB", "8")
    assert warmup.chunk_size() == 8 << 20


def test_a_workload_that_reports_its_writes_gets_small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``attach(written=...)`` (a KV cache): every round ships each chunk a reported range touches, a chunk per
    running request at least in the final one, so the SDK cuts 1 MiB chunks there, on a GPU too; an attach without
    reports after it gets the sizes above again; GPUMIGRATE_SNAPSHOT_CHUNK_MB still decides over both."""
    import torch

    import gpumigrate.agent as gm
    from gpumigrate.agent import warmup

    monkeypatch.delenv("GPUMIGRATE_SNAPSHOT_CHUNK_MB", raising=False)
    monkeypatch.setattr(warmup, "_state_on_gpu", threading.Event())
    monkeypatch.setattr(warmup, "_reports_writes", threading.Event())
    kv = torch.zeros(4096)
    handle = gm.attach({"w": torch.ones(8)}, state={"kv": kv}, written={"kv": lambda: []})
    try:
        assert warmup.chunk_size() == warmup.WRITTEN_CHUNK_SIZE == 1 << 20
        warmup._state_on_gpu.set()
        assert warmup.chunk_size() == 1 << 20  # on a GPU as well
        monkeypatch.setenv("GPUMIGRATE_SNAPSHOT_CHUNK_MB", "8")
        assert warmup.chunk_size() == 8 << 20
    finally:
        handle.close()
    monkeypatch.delenv("GPUMIGRATE_SNAPSHOT_CHUNK_MB")
    handle = gm.attach({"w": torch.ones(8)})
    try:
        assert warmup.chunk_size() == warmup.GPU_CHUNK_SIZE
    finally:
        handle.close()


def test_the_timeline_says_when_this_process_started_and_attached(monkeypatch: pytest.MonkeyPatch) -> None:
    """``info``'s ``timeline``: the process's start as the kernel recorded it (it began before this test did and
    not long before the interpreter's own clock started), and the attach's moment once the SDK warmed up."""
    import os
    import subprocess
    import sys

    from gpumigrate.agent import warmup

    monkeypatch.setattr(warmup, "_marks", {})
    monkeypatch.setattr(warmup, "_steps", {})
    before = time.time()
    assert "attach" not in warmup.timeline()
    warmup.warm_device_kernels([])  # host memory: nothing to compile, but the attach is marked
    line = warmup.timeline()
    started = line["process_start"]
    assert isinstance(started, float) and started <= before
    assert isinstance(line["attach"], float) and before - 1 <= line["attach"] <= time.time() + 1
    assert line["warm_steps"] == {}
    # a fresh process's own record of its start lies within a few seconds of when it was launched
    launched = time.time()
    code = "from gpumigrate.agent.warmup import process_started; print(process_started())"
    child = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=os.environ)
    assert launched - 2 <= float(child.stdout.strip()) <= time.time() + 1

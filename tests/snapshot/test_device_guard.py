"""Every kernel launch on the engine's threads runs under its tensors' own device.

Triton launches on the calling thread's *current* CUDA device, whatever device its pointer arguments live on.
The engine's request thread has device 0 current, so a rank whose tensors live on ``cuda:1`` had its fingerprint
kernels launched on the wrong device ("Pointer argument (at 0) cannot be accessed from Triton", issue 32).

On this CPU-only machine the CUDA side is stood in for: ``fp_kernels``'s view of torch gets a device guard and a
current device that follow a thread (as CUDA's do), and the kernels record which device was current when they were
launched. The launchers themselves, their buffers and their guard, run as they are. A launch site that does not set
its anchor's device fails here; so does a new launch site this test does not know about.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gpumigrate.snapshot import fp_kernels
from tests.support.device_guard import HostBuffer, Recorder, ThreadDevices, launch_sites

SNAPSHOT = Path(__file__).resolve().parents[2] / "snapshot"


def _torch_with(cuda: ThreadDevices) -> SimpleNamespace:
    """The names of torch the launchers use, with ``cuda`` for CUDA's per-thread device; buffers live on the host."""

    def tensor(data: Any, dtype: torch.dtype, pin_memory: bool = False) -> HostBuffer:
        return HostBuffer(torch.tensor(data, dtype=dtype))

    def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    return SimpleNamespace(tensor=tensor, empty=empty, int64=torch.int64, cuda=cuda)


# Each launch site of the snapshot package: the kernel it launches, and how to launch it on an anchor.
LAUNCHES: dict[str, Callable[[Any], Any]] = {
    "_kernel": lambda anchor: fp_kernels.weighted_sums(anchor, [0, 256], 256, torch.zeros(256, dtype=torch.int64)),
    "_tail_kernel": lambda anchor: fp_kernels.tail_sums(anchor, [0, 40], [40, 17], torch.zeros(40, dtype=torch.int64)),
}


@pytest.mark.parametrize("kernel", sorted(LAUNCHES))
def test_a_launch_runs_under_its_anchors_device_whatever_the_thread_has_current(
    monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    cuda = ThreadDevices()
    recorder = Recorder(cuda)
    monkeypatch.setattr(fp_kernels, "torch", _torch_with(cuda))
    monkeypatch.setattr(fp_kernels, kernel, lambda: recorder)
    anchor = SimpleNamespace(device=torch.device("cuda", 1))  # rank 1's tensors
    seen: list[int] = []
    failures: list[BaseException] = []

    def request_thread() -> None:  # as the engine's: device 0 current
        try:
            seen.append(cuda.current_device())
            LAUNCHES[kernel](anchor)
        except BaseException as exc:
            failures.append(exc)

    worker = threading.Thread(target=request_thread)
    worker.start()
    worker.join(30)
    assert not worker.is_alive() and not failures, failures
    assert seen == [0]
    assert recorder.launched_on == [1], f"{kernel} launched on device {recorder.launched_on}, its tensors on cuda:1"


def test_every_launch_site_of_the_snapshot_package_is_checked_above() -> None:
    """``NAME()[grid](...)`` is how the package launches a Triton kernel; each NAME must be in LAUNCHES."""
    found = launch_sites(SNAPSHOT)
    assert found == set(LAUNCHES), f"launch sites {sorted(found - set(LAUNCHES))} are not checked for their device"


@pytest.mark.gpu
def test_fingerprints_of_a_second_gpus_tensors_from_a_thread_on_the_first() -> None:
    """On two GPUs: rank 1's tensors fingerprinted from a thread whose current device is 0 give the host's numbers."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from gpumigrate.snapshot.chunks import Fingerprints, byte_view

    chunk = 64 << 10
    views = {
        "w": byte_view(torch.randn(5 * chunk // 4 + 123, device="cuda:1")),
        "b": byte_view(torch.randn(77, device="cuda:1")),
    }
    expected = Fingerprints({k: v.cpu() for k, v in views.items()}, chunk).to_host()
    got: list[dict[str, list[int]]] = []

    def request_thread() -> None:
        torch.cuda.set_device(0)
        got.append(Fingerprints(views, chunk).to_host())

    worker = threading.Thread(target=request_thread)
    worker.start()
    worker.join(120)
    assert got == [expected]

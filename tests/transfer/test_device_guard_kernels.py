"""Every Triton launch of the transfer engine runs under its tensors' own device (the class of issue 32's crash).

Triton launches on the calling thread's *current* CUDA device, and the engine's worker threads (a restore's
readers, a landing's hashing, a capture's sealing) have device 0 current: rank 1's chunks hashed or split from
there were launched on the wrong GPU. On this CPU-only machine CUDA's per-thread current device is stood in for
(``tests/support/device_guard.py``): ``torch.cuda.device`` is that device's guard, buffers live on the host, and
each kernel records the device current at its launch. The launchers (``devhash``, ``plane_kernels``) run as they
are. A launch that does not set its tensors' device fails here; so does a launch site this test does not know.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gpumigrate.transfer.device import devhash, plane_kernels
from tests.support.device_guard import HostBuffer, Recorder, ThreadDevices, launch_sites, on_a_thread_with_device_0

DEVICE = Path(__file__).resolve().parents[2] / "transfer" / "device"
RANK1 = torch.device("cuda", 1)


class DeviceBytes:
    """Rank 1's device memory as the launchers see it: a device, an address, a length; views of itself."""

    def __init__(self, nbytes: int) -> None:
        self.device = RANK1
        self.is_cuda = True
        self.dtype = torch.uint8
        self._n = nbytes

    def data_ptr(self) -> int:
        return 1 << 20  # 16-byte aligned

    def numel(self) -> int:
        return self._n

    def view(self, dtype: torch.dtype) -> DeviceBytes:
        return self


LEAF = devhash.LEAF
# Each launch site of transfer/device: the kernel's name, and a call of its launcher that reaches it.
LAUNCHES: dict[str, Callable[[], Any]] = {
    "leaf_kernel": lambda: devhash.blake3_at(DeviceBytes(4 * LEAF), [0, 2 * LEAF], LEAF),
    "parent_kernel": lambda: devhash.blake3_at(DeviceBytes(4 * LEAF), [0, 2 * LEAF], 2 * LEAF),  # 2 leaves: 1 level
    "parent2_kernel": lambda: devhash.blake3_at(DeviceBytes(32 * LEAF), [0, 16 * LEAF], 16 * LEAF),
    "leaf_copy_gather_kernel": lambda: devhash.blake3_copy_gather(
        DeviceBytes(16 * LEAF), [0, 8 * LEAF], DeviceBytes(16 * LEAF), [8 * LEAF, 0], 8 * LEAF
    ),
    "_kernel": lambda: plane_kernels.split([DeviceBytes(4096), DeviceBytes(2048)], SimpleNamespace(device=RANK1)),
    "_merge_kernel": lambda: plane_kernels.merge(1 << 20, (1 << 20) + 2048, DeviceBytes(4096)),
}


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> ThreadDevices:
    """torch's CUDA guard and buffers as the launchers use them, stood in for (see the module)."""
    devices = ThreadDevices()
    real_tensor, real_zeros = torch.tensor, torch.zeros

    def tensor(data: Any, dtype: torch.dtype, pin_memory: bool = False) -> HostBuffer:
        return HostBuffer(real_tensor(data, dtype=dtype))

    def empty(*shape: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return real_zeros(*shape, dtype=dtype)

    monkeypatch.setattr(torch.cuda, "device", devices.device)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: nullcontext())
    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(torch, "empty", empty)
    return devices


@pytest.mark.parametrize("kernel", sorted(LAUNCHES))
def test_a_transfer_kernel_launches_under_its_tensors_device_whatever_the_thread_has_current(
    cuda: ThreadDevices, monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    log: list[tuple[str, int]] = []
    names = ("leaf_kernel", "parent_kernel", "parent2_kernel", "leaf_copy_gather_kernel")
    kernels = SimpleNamespace(**{n: Recorder(cuda, n, log) for n in names})
    monkeypatch.setattr(devhash, "_kernels", lambda: kernels)
    split, merge = Recorder(cuda, "_kernel", log), Recorder(cuda, "_merge_kernel", log)
    monkeypatch.setattr(plane_kernels, "_kernel", lambda: split)
    monkeypatch.setattr(plane_kernels, "_merge_kernel", lambda: merge)

    started_on = on_a_thread_with_device_0(cuda, LAUNCHES[kernel])

    assert started_on == 0
    assert kernel in {name for name, _ in log}, f"{kernel} was not launched: {log}"
    wrong = [(name, device) for name, device in log if device != 1]
    assert not wrong, f"launched on the thread's device, not on cuda:1 where the tensors live: {wrong}"


def test_every_launch_site_of_transfer_device_is_checked_above() -> None:
    found = launch_sites(DEVICE)
    assert found == set(LAUNCHES), f"launch sites {sorted(found - set(LAUNCHES))} are not checked for their device"

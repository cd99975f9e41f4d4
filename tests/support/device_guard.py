"""CUDA's per-thread current device, stood in for on a CPU-only machine: what the device-guard tests of the kernel
launch sites share (tests/snapshot/test_device_guard.py, tests/transfer/test_device_guard_kernels.py).

Triton launches a kernel on the calling thread's *current* device, whatever device its pointer arguments live on.
:class:`ThreadDevices` keeps a current device per thread (0 until a guard says otherwise) and is the guard
(``torch.cuda.device``); :class:`Recorder` is a kernel that records which device was current at each launch.
"""

from __future__ import annotations

import ast
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


class ThreadDevices:
    """CUDA's current device, per thread (0 until a guard says otherwise), and its device guard."""

    def __init__(self) -> None:
        self._local = threading.local()

    def current_device(self) -> int:
        return int(getattr(self._local, "index", 0))

    @contextmanager
    def device(self, where: torch.device | int) -> Iterator[None]:
        before = self.current_device()
        self._local.index = where if isinstance(where, int) else where.index
        try:
            yield
        finally:
            self._local.index = before


class HostBuffer:
    """A pinned host tensor as the launchers use it: its ``.to(device)`` is the copy to the device."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def to(self, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
        return self.data


class Recorder:
    """A kernel: ``kernel[grid](*args)`` records the device that was current at the launch."""

    def __init__(self, cuda: ThreadDevices, name: str = "", log: list[tuple[str, int]] | None = None) -> None:
        self.cuda = cuda
        self.name = name
        self.launched_on: list[int] = []
        self.log = log  # launches of several kernels, in order: (name, device)

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **meta: Any) -> None:
            self.launched_on.append(self.cuda.current_device())
            if self.log is not None:
                self.log.append((self.name, self.cuda.current_device()))

        return launch


def on_a_thread_with_device_0(cuda: ThreadDevices, work: Callable[[], Any]) -> int:
    """Run ``work`` on a new thread whose current device is 0 (as the engine's worker threads'); re-raise its
    failure; return the device that was current when it started."""
    seen: list[int] = []
    failures: list[BaseException] = []

    def thread() -> None:
        try:
            seen.append(cuda.current_device())
            work()
        except BaseException as exc:
            failures.append(exc)

    worker = threading.Thread(target=thread)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "the launching thread did not finish within 30 s"
    if failures:
        raise failures[0]
    return seen[0]


def launch_sites(folder: Path) -> set[str]:
    """The kernels launched in ``folder``'s modules, as ``NAME()[grid](...)`` or ``module.NAME[grid](...)`` (a
    subscript with a string, such as a table of functions, is not a launch)."""
    found: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
                continue
            sub = node.func
            if isinstance(sub.slice, ast.Constant) and isinstance(sub.slice.value, str):
                continue
            if isinstance(sub.value, ast.Call) and isinstance(sub.value.func, ast.Name):
                found.add(sub.value.func.id)
            elif isinstance(sub.value, ast.Attribute):
                found.add(sub.value.attr)
    return found

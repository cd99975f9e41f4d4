"""Asynchronous CUDA copies and events that keep the GIL: the per-chunk calls of a capture and a restore.

Every PyTorch call lets go of the GIL while it runs and must take it back afterwards. The direct writer
and reader run one thread per core, and a thread that makes torch calls beside them spends most of its
time queued behind the others for the GIL when each call returns (measured: bench/HISTORY.md, "The GIL,
not the cores"). A ``cudaMemcpyAsync``, ``cudaEventRecord`` or
``cudaStreamWaitEvent`` only queues work and returns in microseconds, so holding the GIL through it costs
the other threads nothing, and the caller never queues to get it back. They are called here through
``ctypes.PyDLL`` (which keeps the GIL) on the CUDA runtime PyTorch already loaded; waiting for an event,
which blocks, goes through ``ctypes.CDLL`` (which lets the GIL go).

Written on ``ctypes`` rather than a binding package (``cuda-python``): five runtime calls, present in
every CUDA runtime, and no new dependency for a GPU host. :func:`runtime` is None where the runtime cannot
be found; callers then use the torch calls, which are correct, only slower under contention.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator
from typing import Any

_COPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the (unified) addresses
_EVENT_DISABLE_TIMING = 2
_HOST_REGISTER_PORTABLE = 1
_RUNTIMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")


class _Runtime:
    def __init__(self, holding: ctypes.PyDLL, releasing: ctypes.CDLL) -> None:
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        self.copy = holding.cudaMemcpyAsync
        self.copy.argtypes = [vp, vp, sz, ctypes.c_int, vp]
        self.record = holding.cudaEventRecord
        self.record.argtypes = [vp, vp]
        self.wait = holding.cudaStreamWaitEvent
        self.wait.argtypes = [vp, vp, ctypes.c_uint]
        self.set_device = holding.cudaSetDevice
        self.set_device.argtypes = [ctypes.c_int]
        self.get_device = holding.cudaGetDevice
        self.get_device.argtypes = [ctypes.POINTER(ctypes.c_int)]
        self.create = holding.cudaEventCreateWithFlags
        self.create.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        self.destroy = holding.cudaEventDestroy
        self.destroy.argtypes = [vp]
        self.synchronize = releasing.cudaEventSynchronize  # blocks: lets the GIL go
        self.synchronize.argtypes = [vp]
        self.host_register = releasing.cudaHostRegister  # pins every page: lets the GIL go
        self.host_register.argtypes = [vp, sz, ctypes.c_uint]
        calls = (self.copy, self.record, self.wait, self.set_device, self.get_device, self.create, self.destroy)
        for call in (*calls, self.synchronize, self.host_register):
            call.restype = ctypes.c_int


@functools.cache
def runtime() -> _Runtime | None:
    """The CUDA runtime's calls, or None (no runtime library loadable here, or torch has no CUDA)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        torch.cuda.init()  # the runtime PyTorch uses is loaded (and its context made) before we look it up
    except Exception:
        return None
    for name in _RUNTIMES:
        try:
            return _Runtime(ctypes.PyDLL(name), ctypes.CDLL(name))
        except (OSError, AttributeError):
            continue
    return None


def _check(code: int, what: str) -> None:
    if code != 0:
        from gpumigrate.errors import TransferError

        raise TransferError(f"CUDA {what} failed (cudaError {code})")


@contextlib.contextmanager
def _on(rt: _Runtime, device: int) -> Iterator[None]:
    """Run the enclosed calls with ``device`` current, and leave the thread's current device as it was (a torch
    call later in the same thread may rely on it)."""
    was = ctypes.c_int(-1)
    _check(rt.get_device(ctypes.byref(was)), "get device")
    if was.value != device:
        _check(rt.set_device(device), "set device")
    try:
        yield
    finally:
        if was.value != device:
            rt.set_device(was.value)


def copy(rt: _Runtime, device: int, dst: int, src: int, nbytes: int, stream: int) -> None:
    """Queue a copy of ``nbytes`` from address ``src`` to ``dst`` (device or page-locked host) on ``stream``."""
    if nbytes:
        with _on(rt, device):
            _check(rt.copy(dst, src, nbytes, _COPY_DEFAULT, stream), "copy")


def register_host(rt: _Runtime, address: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` of ordinary host memory at ``address`` for every device (``cudaHostRegisterPortable``):
    copies to and from it run at the link's rate, and its pages stay ordinary pages, which direct I/O (``O_DIRECT``)
    can read and write, where the driver's own page-locked allocations may refuse it."""
    _check(rt.host_register(address, nbytes, _HOST_REGISTER_PORTABLE), "host register")


class Event:
    """A CUDA event without timing, recorded on a raw stream; ``synchronize`` waits without the GIL."""

    def __init__(self, rt: _Runtime, device: int) -> None:
        self._rt = rt
        self._device = device
        self.handle = ctypes.c_void_p()
        with _on(rt, device):
            _check(rt.create(ctypes.byref(self.handle), _EVENT_DISABLE_TIMING), "event create")

    def record(self, stream: int) -> Event:
        with _on(self._rt, self._device):
            _check(self._rt.record(self.handle, stream), "event record")
        return self

    def wait_on(self, stream: int) -> None:
        """Work queued on ``stream`` from now on runs after this event's work."""
        with _on(self._rt, self._device):
            _check(self._rt.wait(stream, self.handle, 0), "stream wait")

    def synchronize(self) -> None:
        _check(self._rt.synchronize(self.handle), "event synchronize")

    def __del__(self) -> None:
        handle = getattr(self, "handle", None)
        if handle is not None and handle.value:
            self._rt.destroy(handle)


def recorded(device: Any, stream: Any) -> Any:
    """An event recorded now on a torch ``stream`` of ``device``: raw where the runtime is here, else torch's."""
    rt = runtime()
    if rt is None:
        import torch

        event = torch.cuda.Event()
        event.record(stream)
        return event
    return Event(rt, device.index or 0).record(stream.cuda_stream)

"""CUDA IPC by allocation: the source shares each device allocation once, the target maps each once.

A model's state is hundreds of tensors, but the caching allocator carves them out of far fewer device
allocations (on an H100, 521 tensors of a 16 GiB model sat in 93). PyTorch's own sharing
(``UntypedStorage._share_cuda_``) works per tensor, with a reference-count file and an event per tensor;
on the receiving side rebuilding and releasing 521 of them took 12-18 ms and 11 ms, against 6 ms and 4 ms
to map and unmap the 93 allocations through the driver. So the landing's lend uses this module where it
can, and falls back to PyTorch's sharing where it cannot (no ``libcuda``; an allocation the driver cannot
export, e.g. PyTorch's expandable segments, which are not ordinary ``cuMemAlloc`` memory).

Written on ``ctypes`` over the driver library rather than a binding package: the four calls it needs are
in every driver, and a GPU host needs no extra package for them.

Lifetime: the source keeps its tensors alive and unchanged until the landing replies (``lend_all`` waits for
that reply), and the target unmaps (:meth:`Mapped.close`) when its landing closes.

Wire form (inside the landing's signed ``lend`` message, ``transfer/nixl_device.py``):
``{"allocations": [{"handle": base64 of the 64-byte cudaIpcMemHandle, "bytes": n}, ...],
"regions": {name: {"allocation": k, "offset": byte offset into allocation k, "nbytes": n}}}``.
"""

from __future__ import annotations

import base64
import ctypes
import functools
import threading
import time
from collections.abc import Mapping
from typing import Any

_LAZY_ENABLE_PEER_ACCESS = 1
_HANDLE_BYTES = 64


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * _HANDLE_BYTES)]  # opaque bytes (NULs included)

    @classmethod
    def of(cls, raw: bytes) -> _Handle:
        handle = cls()
        ctypes.memmove(ctypes.addressof(handle), raw, _HANDLE_BYTES)
        return handle

    def raw(self) -> bytes:
        return ctypes.string_at(ctypes.addressof(self), _HANDLE_BYTES)


@functools.cache
def _driver() -> Any:
    """The driver library's four IPC calls, typed; None where there is no driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    try:
        calls = {
            "range": lib.cuMemGetAddressRange_v2,
            "get": lib.cuIpcGetMemHandle,
            "open": lib.cuIpcOpenMemHandle_v2,
            "close": lib.cuIpcCloseMemHandle,
        }
    except AttributeError:
        return None
    ptr = ctypes.c_uint64
    calls["range"].argtypes = [ctypes.POINTER(ptr), ctypes.POINTER(ctypes.c_size_t), ptr]
    calls["get"].argtypes = [ctypes.POINTER(_Handle), ptr]
    calls["open"].argtypes = [ctypes.POINTER(ptr), _Handle, ctypes.c_uint]
    calls["close"].argtypes = [ptr]
    for call in calls.values():
        call.restype = ctypes.c_int
    return calls


class _Device:
    """A raw device range as an object PyTorch can view without a copy (the CUDA array interface)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 2}


def share(tensors: Mapping[str, Any]) -> dict[str, Any] | None:
    """The wire form above for ``tensors`` (flat uint8 device tensors), or None where the driver cannot export
    one of their allocations (the caller then shares them PyTorch's way)."""
    calls = _driver()
    if calls is None or not tensors:
        return None
    import torch

    device = next(iter(tensors.values())).device
    torch.cuda.set_device(device)  # the driver calls run in this thread's context: the device's primary one
    allocations: list[dict[str, Any]] = []
    at: dict[int, int] = {}
    regions: dict[str, dict[str, int]] = {}
    for name, tensor in tensors.items():
        if tensor.device != device:
            return None
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        if calls["range"](ctypes.byref(base), ctypes.byref(size), tensor.data_ptr()) != 0:
            return None
        k = at.get(base.value)
        if k is None:
            handle = _Handle()
            if calls["get"](ctypes.byref(handle), base.value) != 0:
                return None
            k = at[base.value] = len(allocations)
            allocations.append({"handle": base64.b64encode(handle.raw()).decode(), "bytes": size.value})
        regions[name] = {"allocation": k, "offset": tensor.data_ptr() - base.value, "nbytes": tensor.numel()}
    return {"allocations": allocations, "regions": regions}


class Mapped:
    """The source's allocations named in a ``share`` message, mapped into this process on first use."""

    def __init__(self, message: Mapping[str, Any], device: Any) -> None:
        calls = _driver()
        if calls is None:
            raise RuntimeError("the CUDA driver library (libcuda.so.1) is not loadable here")
        self._calls = calls
        self.device = device
        self.allocations = [(base64.b64decode(str(a["handle"])), int(a["bytes"])) for a in list(message["allocations"])]
        self.regions = {
            str(name): (int(r["allocation"]), int(r["offset"]), int(r["nbytes"]))
            for name, r in dict(message["regions"]).items()
        }
        for name, (k, offset, nbytes) in self.regions.items():
            if not 0 <= k < len(self.allocations) or offset < 0 or offset + nbytes > self.allocations[k][1]:
                raise ValueError(f"region {name}: outside the allocation it names")
            if len(self.allocations[k][0]) != _HANDLE_BYTES:
                raise ValueError(f"region {name}: a handle of {len(self.allocations[k][0])} bytes")
        self._mapped: dict[int, int] = {}  # allocation -> its address here
        self._views: dict[int, Any] = {}  # allocation -> a uint8 tensor over it
        self._lock = threading.Lock()
        self.seconds_opening = 0.0

    def address(self, name: str) -> int:
        """Where region ``name`` of the source's memory lies in this process (mapping its allocation now if it is
        the first region there)."""
        k, offset, _ = self.regions[name]
        return self._base(k) + offset

    def tensor(self, name: str) -> Any:
        """Region ``name`` of the source's memory as a flat uint8 tensor of this process (a view of its
        allocation's, which is made once)."""
        k, offset, nbytes = self.regions[name]
        self._base(k)
        return self._views[k][offset : offset + nbytes]

    def _base(self, k: int) -> int:
        base = self._mapped.get(k)
        if base is not None:
            return base
        import torch

        t0 = time.perf_counter()
        torch.cuda.set_device(self.device)
        handle = _Handle.of(self.allocations[k][0])
        address = ctypes.c_uint64()
        code = self._calls["open"](ctypes.byref(address), handle, _LAZY_ENABLE_PEER_ACCESS)
        if code != 0:
            raise RuntimeError(f"cuIpcOpenMemHandle failed (CUresult {code}) for allocation {k}")
        with self._lock:
            self._mapped[k] = address.value
            self._views[k] = torch.as_tensor(_Device(address.value, self.allocations[k][1]), device=self.device)
        self.seconds_opening += time.perf_counter() - t0
        return address.value

    def close(self) -> None:
        """Unmap every allocation mapped here; nothing of the source's may be used afterwards."""
        import torch

        with self._lock:
            mapped, self._mapped = self._mapped, {}
            self._views = {}  # no view may outlive its mapping
        if mapped:
            torch.cuda.set_device(self.device)
        for address in mapped.values():
            self._calls["close"](address)

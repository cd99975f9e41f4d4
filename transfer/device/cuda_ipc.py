"""CUDA IPC by allocation: the source shares each device allocation once, the target maps each once.

A model's state is hundreds of tensors, but the caching allocator carves them out of far fewer device
allocations. PyTorch's own sharing (``UntypedStorage._share_cuda_``) works per tensor, with a reference-count
file and an event per tensor; on the receiving side rebuilding and releasing each of them costs about twice what
mapping and unmapping the allocations through the driver does (bench/README.md). So the landing's lend uses this
module where it
can, and falls back to PyTorch's sharing where it cannot (no ``libcuda``; an allocation the driver cannot
export, e.g. PyTorch's expandable segments, which are not ordinary ``cuMemAlloc`` memory).

Written on ``ctypes`` over the driver library rather than a binding package: the four calls it needs are
in every driver, and a GPU host needs no extra package for them.

Lifetime: the source keeps its tensors alive and unchanged until the landing replies (``lend_all`` waits for
that reply), and the target unmaps (:meth:`Mapped.close`) when its landing closes.

:func:`share_all` and :func:`open_lent` are the two ends: by allocation where the driver can, else PyTorch's
per-tensor sharing (:class:`TorchLent`); either way the target reads the lent memory through :class:`LentMemory`.

Wire form (inside the landing's signed ``lend`` message, ``landing.py``), packed so that signing
and checking the message (canonical JSON, HMAC) stays cheap at hundreds of regions:
``{"handles": base64 of the allocations' 64-byte cudaIpcMemHandles back to back, "sizes": [bytes of allocation
k, ...], "names": [region, ...], "places": base64 of little-endian int64 triples (allocation k, byte offset into
it, nbytes), one per name}``.
"""

from __future__ import annotations

import base64
import ctypes
import functools
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

_Calls = dict[str, "ctypes._NamedFuncPointer"]  # the driver's IPC calls by short name

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
def _driver() -> _Calls | None:
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


def share(tensors: Mapping[str, torch.Tensor]) -> dict[str, Any] | None:
    """The wire form above for ``tensors`` (flat uint8 device tensors), or None where the driver cannot export
    one of their allocations (the caller then shares them PyTorch's way)."""
    calls = _driver()
    if calls is None or not tensors:
        return None
    import torch

    device = next(iter(tensors.values())).device
    torch.cuda.set_device(device)  # the driver calls run in this thread's context: the device's primary one
    handles: list[bytes] = []
    sizes: list[int] = []
    bases: list[int] = []  # allocation k starts at bases[k]
    at: dict[int, int] = {}  # an allocation's start -> k
    places: list[int] = []  # (allocation, offset, nbytes) per tensor, flat
    base, size, handle = ctypes.c_uint64(), ctypes.c_size_t(), _Handle()
    k = -1
    for tensor in tensors.values():
        if tensor.device != device:
            return None
        address, nbytes = tensor.data_ptr(), tensor.numel()
        # A tensor inside the allocation of the one before it needs no driver call: live allocations never
        # overlap, and that one cannot go away while its tensors are alive (most of a model's 521 tensors).
        if not (k >= 0 and bases[k] <= address and address + nbytes <= bases[k] + sizes[k]):
            if calls["range"](ctypes.byref(base), ctypes.byref(size), address) != 0:
                return None
            k = at.get(base.value, -1)
            if k < 0:
                if calls["get"](ctypes.byref(handle), base.value) != 0:
                    return None
                k = at[base.value] = len(bases)
                bases.append(base.value)
                sizes.append(size.value)
                handles.append(handle.raw())
        places += (k, address - bases[k], nbytes)
    return {
        "handles": base64.b64encode(b"".join(handles)).decode(),
        "sizes": sizes,
        "names": list(tensors),
        "places": base64.b64encode(struct.pack(f"<{len(places)}q", *places)).decode(),
    }


class Mapped:
    """The source's allocations named in a ``share`` message, mapped into this process on first use."""

    def __init__(self, message: Mapping[str, Any], device: torch.device) -> None:
        calls = _driver()
        if calls is None:
            raise RuntimeError("the CUDA driver library (libcuda.so.1) is not loadable here")
        self._calls = calls
        self.device = device
        raw = base64.b64decode(str(message["handles"]), validate=True)
        sizes = [int(n) for n in message["sizes"]]
        if len(raw) != _HANDLE_BYTES * len(sizes):
            raise ValueError(f"{len(raw)} bytes of handles for {len(sizes)} allocations")
        self.allocations = [(raw[i * _HANDLE_BYTES : (i + 1) * _HANDLE_BYTES], n) for i, n in enumerate(sizes)]
        names = [str(name) for name in message["names"]]
        packed = base64.b64decode(str(message["places"]), validate=True)
        if len(packed) != 24 * len(names):
            raise ValueError(f"{len(packed)} bytes of places for {len(names)} regions")
        places = struct.unpack(f"<{3 * len(names)}q", packed)
        self.regions: dict[str, tuple[int, int, int]] = {
            name: (places[3 * i], places[3 * i + 1], places[3 * i + 2]) for i, name in enumerate(names)
        }
        for name, (k, offset, nbytes) in self.regions.items():
            if not 0 <= k < len(self.allocations) or offset < 0 or nbytes < 0 or offset + nbytes > sizes[k]:
                raise ValueError(f"region {name}: outside the allocation it names")
        self._mapped: dict[int, int] = {}  # allocation -> its address here
        self._views: dict[int, torch.Tensor] = {}  # allocation -> a uint8 tensor over it, made when first asked for
        self._lock = threading.Lock()
        self._ready: dict[int, threading.Event] = {}  # allocations given to a mapping thread
        self._failed: dict[int, str] = {}
        self._threads: list[threading.Thread] = []
        self.seconds_opening = 0.0  # time the caller waited for mappings (its own, or the threads' not yet done)
        self.seconds_mapping = 0.0  # time spent in the driver's mapping call, summed over threads

    def map_ahead(self, names: Sequence[str]) -> None:
        """Map the allocations of regions ``names``, in that order, on a thread of its own, so the caller's work on
        the first regions (launching their copies) runs while the later ones are mapped. :meth:`address` and
        :meth:`tensor` wait for an allocation still being mapped. One thread: more made each driver call slower
        (the driver serializes them) and slowed the copies running meanwhile."""
        order: list[int] = []
        for name in names:
            k = self.regions[name][0]
            if k not in self._mapped and k not in self._ready:
                self._ready[k] = threading.Event()
                order.append(k)

        def work() -> None:
            try:
                import torch

                torch.cuda.set_device(self.device)  # the driver's calls run in this thread's current context
                trouble = ""
            except Exception as exc:  # noqa: BLE001 - reported for each allocation this thread was to map
                trouble = f"{type(exc).__name__}: {exc}"
            for k in order:
                try:
                    if trouble:
                        raise RuntimeError(trouble)
                    self._map(k)
                except Exception as exc:  # noqa: BLE001 - raised in the caller's thread, at its address()
                    self._failed[k] = str(exc) if isinstance(exc, RuntimeError) else f"{type(exc).__name__}: {exc}"
                finally:
                    self._ready[k].set()

        if order:
            thread = threading.Thread(target=work, name="gm-ipc-map", daemon=True)
            thread.start()
            self._threads.append(thread)

    def address(self, name: str) -> int:
        """Where region ``name`` of the source's memory lies in this process (mapping its allocation now if it is
        the first region there and no mapping thread has it)."""
        k, offset, _ = self.regions[name]
        return self._base(k) + offset

    def tensor(self, name: str) -> torch.Tensor:
        """Region ``name`` of the source's memory as a flat uint8 tensor of this process (a view of its
        allocation's, which is made once)."""
        k, offset, nbytes = self.regions[name]
        base = self._base(k)
        with self._lock:
            view = self._views.get(k)
            if view is None:
                import torch

                view = self._views[k] = torch.as_tensor(_Device(base, self.allocations[k][1]), device=self.device)
        return view[offset : offset + nbytes]

    def _base(self, k: int) -> int:
        base = self._mapped.get(k)
        if base is not None:
            return base
        t0 = time.perf_counter()
        ready = self._ready.get(k)
        if ready is not None:
            ready.wait()
            if k in self._failed:
                raise RuntimeError(self._failed[k])
            base = self._mapped[k]
        else:
            import torch

            torch.cuda.set_device(self.device)
            base = self._map(k)
        self.seconds_opening += time.perf_counter() - t0
        return base

    def _map(self, k: int) -> int:
        t0 = time.perf_counter()
        handle = _Handle.of(self.allocations[k][0])
        address = ctypes.c_uint64()
        code = self._calls["open"](ctypes.byref(address), handle, _LAZY_ENABLE_PEER_ACCESS)
        if code != 0:
            raise RuntimeError(f"cuIpcOpenMemHandle failed (CUresult {code}) for allocation {k}")
        with self._lock:
            self._mapped[k] = address.value
            self.seconds_mapping += time.perf_counter() - t0
        return address.value

    def close(self) -> None:
        """Unmap every allocation mapped here; nothing of the source's may be used afterwards."""
        import torch

        for thread in self._threads:  # a mapping still being made is unmapped below, not leaked
            thread.join()
        self._threads = []
        with self._lock:
            mapped, self._mapped = self._mapped, {}
            self._views = {}  # no view may outlive its mapping
        if mapped:
            torch.cuda.set_device(self.device)
        for address in mapped.values():
            self._calls["close"](address)


# ----------------------------------------------------------------------------- PyTorch's sharing, per tensor
def _lend_spec(flat: torch.Tensor) -> dict[str, Any]:
    """A device tensor's CUDA IPC handle and place, as plain fields (PyTorch's own sharing of CUDA tensors)."""
    device, handle, storage_bytes, storage_offset, ref, ref_offset, event, event_sync = (
        flat.untyped_storage()._share_cuda_()
    )

    def b64(raw: bytes) -> str:
        return base64.b64encode(bytes(raw)).decode()

    return {
        "device": int(device),
        "handle": b64(handle),
        "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset),
        "ref": b64(ref),
        "ref_offset": int(ref_offset),
        "event": b64(event),
        "event_sync": bool(event_sync),
        "offset": int(flat.storage_offset()),
        "nbytes": int(flat.numel()),
    }


def _open_spec(spec: Mapping[str, Any]) -> torch.Tensor:
    """The source's tensor from :func:`_lend_spec`, mapped into this process (as PyTorch rebuilds a shared one)."""
    import torch

    def raw(key: str) -> bytes:
        return base64.b64decode(str(spec[key]))

    storage = torch.UntypedStorage._new_shared_cuda(
        int(spec["device"]),
        raw("handle"),
        int(spec["storage_bytes"]),
        int(spec["storage_offset"]),
        raw("ref"),
        int(spec["ref_offset"]),
        raw("event"),
        bool(spec["event_sync"]),
    )
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.uint8, _internal=True)
    rebuilt: torch.Tensor = torch._utils._rebuild_tensor(typed, int(spec["offset"]), (int(spec["nbytes"]),), (1,))
    return rebuilt


class LentMemory(Protocol):
    """The source's memory as the landing reads it: region ``name``'s address and tensor in this process."""

    regions: dict[str, tuple[int, int, int]]  # name -> (allocation, byte offset into it, nbytes)
    seconds_opening: float  # time the caller waited for mappings
    seconds_mapping: float  # time spent in the driver's mapping calls

    def map_ahead(self, names: Sequence[str]) -> None: ...

    def address(self, name: str) -> int: ...

    def tensor(self, name: str) -> torch.Tensor: ...

    def close(self) -> None: ...


class TorchLent:
    """The source's tensors shared PyTorch's way (one handle per tensor), all mapped now; the same reading interface
    as :class:`Mapped`. Released right after the pass: PyTorch's sharing counts references, and the source's
    allocator may reuse a block only once the target let it go."""

    def __init__(self, specs: Mapping[str, Mapping[str, Any]]) -> None:
        t0 = time.perf_counter()
        self._lent = {str(name): _open_spec(spec) for name, spec in specs.items()}
        self.seconds_opening = time.perf_counter() - t0
        self.seconds_mapping = 0.0  # PyTorch maps them: no driver call of ours
        self.regions = {name: (0, 0, t.numel()) for name, t in self._lent.items()}

    def tensor(self, name: str) -> torch.Tensor:
        return self._lent[name]

    def map_ahead(self, names: Sequence[str]) -> None:
        """Nothing: every tensor was mapped when this was made."""

    def address(self, name: str) -> int:
        return int(self._lent[name].data_ptr())

    def close(self) -> None:
        import torch

        self._lent.clear()  # the opened tensors go before ipc_collect, which then releases them
        torch.cuda.ipc_collect()  # the source may free or change its memory once it has the reply


def share_all(tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """What a ``lend`` message carries for ``tensors`` (flat uint8 device tensors): :func:`share`'s wire form, or
    PyTorch's per-tensor handles (``{"regions": {name: spec}}``) where the driver cannot export an allocation."""
    return share(tensors) or {"regions": {name: _lend_spec(t) for name, t in tensors.items()}}


def open_lent(message: Mapping[str, Any], device: torch.device) -> LentMemory:
    """The source's memory a ``lend`` message names (:func:`share_all`), opened in this process."""
    if "handles" in message:
        return Mapped(message, device)
    return TorchLent(dict(message["regions"]))

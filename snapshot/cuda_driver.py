"""CUDA driver checkpoint backend: suspend an unmodified CUDA process to free its GPU, and resume it.

Uses ``cuda.bindings.driver.cuCheckpointProcess*`` (driver 555+; restore onto other GPUs through
``gpuPairs`` needs driver 580+ and cuda-bindings 13.0.2/13.3.1+). The state machine the driver
enforces is RUNNING → lock → LOCKED → checkpoint → CHECKPOINTED → restore → LOCKED → unlock →
RUNNING; this module checks the state first so a wrong transition is a clear error, not a bare
CUDA error code. A lock that times out leaves the process RUNNING, and the error says so.

Imported lazily: on machines without cuda-bindings or a driver, :class:`CudaCheckpointUnavailable`
says so.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpumigrate.errors import SnapshotError

STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}
_NEEDED = (
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
    "CUcheckpointLockArgs",
)


class CudaCheckpointUnavailable(SnapshotError):
    """cuda-bindings, the driver or its checkpoint API is not available on this host."""


class LockTimeout(SnapshotError):
    """The process did not reach a lockable point in time; it was left running."""


_driver: Any = None


def driver() -> Any:
    """The cuda.bindings driver module, initialised once; a clear error where it cannot be."""
    global _driver
    if _driver is not None:
        return _driver
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        raise CudaCheckpointUnavailable(
            "the CUDA driver checkpoint is not available here: cuda-bindings is not installed",
            hint="use snapshot backend 'agent' on hosts without NVIDIA's driver, or install cuda-bindings>=13.0.2",
        ) from None
    missing = [n for n in _NEEDED if not hasattr(cu, n)]
    if missing:
        raise CudaCheckpointUnavailable(
            f"this cuda-bindings lacks {', '.join(missing)}: need 13.0.2+ (13.3.1+ on the 13.3 line)"
        )
    try:
        (err,) = cu.cuInit(0)
    except Exception as exc:  # libcuda.so missing: the bindings raise at call time
        raise CudaCheckpointUnavailable(f"the CUDA driver is not available here: {exc}") from None
    if int(err) != 0:
        raise CudaCheckpointUnavailable(f"cuInit failed ({_name(cu, err)}): no usable NVIDIA driver or GPU here")
    _driver = cu
    return cu


def _name(cu: Any, err: Any) -> str:
    try:
        return str(cu.CUresult(err).name)
    except Exception:
        return str(int(err))


def driver_version() -> tuple[int, int]:
    cu = driver()
    err, v = cu.cuDriverGetVersion()
    _check(cu, err, "cuDriverGetVersion")
    return v // 1000, (v % 1000) // 10


def _check(cu: Any, err: Any, what: str, pid: int | None = None) -> None:
    if int(err) != 0:
        who = f" for pid {pid}" if pid is not None else ""
        raise SnapshotError(f"{what}{who} failed: {_name(cu, err)}")


@dataclass
class Timing:
    lock_s: float = 0.0
    checkpoint_s: float = 0.0
    restore_s: float = 0.0
    unlock_s: float = 0.0


class CudaProcess:
    """One CUDA process controlled through the driver checkpoint API (same host)."""

    def __init__(self, pid: int) -> None:
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise SnapshotError(f"pid must be a positive integer, got {pid!r}")
        self.pid = pid
        self.timing = Timing()

    def state(self) -> str:
        cu = driver()
        err, st = cu.cuCheckpointProcessGetState(self.pid)
        if int(err) != 0:
            raise SnapshotError(
                f"cannot read the CUDA checkpoint state of pid {self.pid} ({_name(cu, err)}): "
                "is it a CUDA process that has initialised the driver?"
            )
        return STATES.get(int(st), f"unknown({int(st)})")

    def _expect(self, want: str, action: str) -> None:
        st = self.state()
        if st != want:
            raise SnapshotError(
                f"cannot {action} pid {self.pid}: its CUDA state is {st}, {action} needs {want}",
                hint="order is lock → checkpoint → restore → unlock",
            )

    def lock(self, timeout_ms: int = 10_000) -> None:
        cu = driver()
        self._expect("running", "lock")
        args = cu.CUcheckpointLockArgs()
        args.timeoutMs = int(timeout_ms)
        t0 = time.perf_counter()
        (err,) = cu.cuCheckpointProcessLock(self.pid, args)
        self.timing.lock_s = time.perf_counter() - t0
        timeouts = {
            int(getattr(cu.CUresult, n))
            for n in ("CUDA_ERROR_NOT_READY", "CUDA_ERROR_TIMEOUT")
            if hasattr(cu.CUresult, n)
        }
        if int(err) in timeouts:
            raise LockTimeout(
                f"pid {self.pid} did not reach a lockable point within {timeout_ms} ms; "
                f"it was left running (state: {self.state()})"
            )
        _check(cu, err, "cuCheckpointProcessLock", self.pid)

    def checkpoint(self) -> None:
        """Copy the process's GPU memory to host memory and release the GPU (needs LOCKED)."""
        cu = driver()
        self._expect("locked", "checkpoint")
        t0 = time.perf_counter()
        (err,) = cu.cuCheckpointProcessCheckpoint(self.pid, None)
        self.timing.checkpoint_s = time.perf_counter() - t0
        _check(cu, err, "cuCheckpointProcessCheckpoint", self.pid)

    def restore_memory(self, gpu_pairs: Mapping[str, str] | None = None) -> None:
        """Bring GPU memory back (needs CHECKPOINTED); ``gpu_pairs`` maps old→new GPU UUIDs, every GPU the driver sees."""
        cu = driver()
        self._expect("checkpointed", "restore")
        keep: list[Any] = []
        args = _restore_args(cu, gpu_pairs, keep) if gpu_pairs else None
        t0 = time.perf_counter()
        (err,) = cu.cuCheckpointProcessRestore(self.pid, args)
        self.timing.restore_s = time.perf_counter() - t0
        _check(cu, err, "cuCheckpointProcessRestore", self.pid)

    def unlock(self) -> None:
        cu = driver()
        self._expect("locked", "unlock")
        t0 = time.perf_counter()
        (err,) = cu.cuCheckpointProcessUnlock(self.pid, None)
        self.timing.unlock_s = time.perf_counter() - t0
        _check(cu, err, "cuCheckpointProcessUnlock", self.pid)

    def suspend(self, timeout_ms: int = 10_000) -> None:
        """Lock then checkpoint: the process keeps its host state, its GPU is free. Unlocks again if checkpoint fails."""
        self.lock(timeout_ms)
        try:
            self.checkpoint()
        except SnapshotError:
            if self.state() == "locked":
                self.unlock()
            raise

    def unsuspend(self, gpu_pairs: Mapping[str, str] | None = None) -> None:
        """Restore then unlock: the undo of :meth:`suspend`, onto other GPUs with ``gpu_pairs``."""
        self.restore_memory(gpu_pairs)
        self.unlock()

    def ensure_running(self) -> str:
        """The undo: whatever step a checkpoint stopped at, bring the process back to RUNNING on its own GPUs.

        checkpointed → restore → unlock; locked → unlock; running → nothing. Returns the state it found.
        """
        found = self.state()
        if found == "checkpointed":
            self.restore_memory()
            self.unlock()
        elif found == "locked":
            self.unlock()
        elif found != "running":
            raise SnapshotError(f"pid {self.pid} is in CUDA checkpoint state {found}: it cannot be resumed")
        return found


def _restore_args(cu: Any, pairs: Mapping[str, str], keep: list[Any]) -> Any:
    if not hasattr(cu, "CUcheckpointGpuPair") or not hasattr(cu, "CUcheckpointRestoreArgs"):
        raise CudaCheckpointUnavailable(
            "this cuda-bindings cannot remap GPUs on restore: need 13.0.2+ / 13.3.1+ and driver 580+"
        )
    out = []
    for old, new in pairs.items():
        pair = cu.CUcheckpointGpuPair()
        pair.oldUuid = _uuid(cu, old, keep)
        pair.newUuid = _uuid(cu, new, keep)
        out.append(pair)
    args = cu.CUcheckpointRestoreArgs()
    args.gpuPairs = out
    args.gpuPairsCount = len(out)
    return args


def _uuid(cu: Any, text: str, keep: list[Any]) -> Any:
    raw = bytes.fromhex(text.removeprefix("GPU-").replace("-", ""))
    if len(raw) != 16:
        raise SnapshotError(f"GPU UUID {text!r} is not 32 hex digits")
    buf = ctypes.create_string_buffer(raw, 16)
    keep.append(buf)
    return cu.CUuuid(ctypes.addressof(buf))


def gpu_uuids() -> list[str]:
    """UUIDs of every GPU the driver sees (a gpuPairs map must list them all)."""
    cu = driver()
    err, count = cu.cuDeviceGetCount()
    _check(cu, err, "cuDeviceGetCount")
    out = []
    for i in range(count):
        err, dev = cu.cuDeviceGet(i)
        _check(cu, err, "cuDeviceGet")
        err, uuid = cu.cuDeviceGetUuid(dev)
        _check(cu, err, "cuDeviceGetUuid")
        h = bytes(uuid.bytes).hex()
        out.append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
    return out

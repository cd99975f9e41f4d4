"""The SDK's warm-up: device kernels compiled, and the transfer engine's libraries loaded, before the first move.

Triton compiles a kernel on its first call (and caches it on disk); the first capture or restore on a fresh
host would compile inside its timed work, and a target's first restore would load the image reader, the
writer and the GPU codec's library inside it. A source serves for a while before it moves, and a target
starts while the source pre-copies, so :func:`warm_device_kernels` does all of it then, on a background
thread, and captures and restores wait for that thread (:func:`wait_for_kernels`) rather than compile
beside it. What the warm-up saves is measured by bench/e2e.py and bench/live_round.py (bench/README.md).
A failure here only means the first capture compiles the kernels after all.

It also decides the chunk size (:func:`chunk_size`). Where the tracked state lives on a GPU, each chunk costs
the capture's one queueing thread a fixed round of launches and the sealing threads a round of system
calls, so larger chunks keep those threads from setting the pace (bench/README.md has the figures). Where the
workload reports what it writes (``attach(written=...)``: a KV cache, one row per running request a step), a round
ships every chunk a reported range touches, so the final round costs a chunk per request at least: there small
chunks keep the downtime short (32 MiB chunks made a 64-stream server's final round 2 GB, 1 MiB ones 64 MB).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import time
from typing import TYPE_CHECKING

from gpumigrate.interfaces import ImageWriter
from gpumigrate.snapshot.engine import SnapshotEngine

if TYPE_CHECKING:
    import torch

GPU_CHUNK_SIZE = 32 << 20  # for state on a GPU; the image format's 4 MiB default stays for state in host memory
WRITTEN_CHUNK_SIZE = 1 << 20  # for a workload that reports its writes (a KV cache): the final round's unit
_state_on_gpu = threading.Event()  # set by warm_device_kernels: the attach found tracked state on a GPU
_reports_writes = threading.Event()  # set by reports_writes: the attach was given written-range reports
_warming: list[threading.Thread] = []
# When this process reached each point of its start (epoch seconds), and what each warm-up step took (seconds):
# the agent's ``info`` reports them (``timeline``), so a benchmark can say where a target's start-up goes.
_marks: dict[str, float] = {}
_steps: dict[str, float] = {}


def _step(name: str, t0: float) -> float:
    now = time.perf_counter()
    _steps[name] = round(_steps.get(name, 0.0) + now - t0, 4)
    return now


def process_started() -> float | None:
    """When this process started (epoch seconds), from the kernel's records; None where they cannot be read.

    Its age (the uptime now less the uptime at its start, both in clock ticks) taken from the wall clock now: the
    boot time ``/proc/stat`` gives is whole seconds, which would put the start up to a second early."""
    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as fh:
            uptime = float(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def timeline() -> dict[str, object]:
    """Where this process's start went: ``process_start``, ``attach`` (the warm-up began), ``warm_done`` (epoch
    seconds, those reached so far) and ``warm_steps`` (seconds each warm-up step took)."""
    started = process_started()
    return {**({"process_start": round(started, 3)} if started else {}), **_marks, "warm_steps": dict(_steps)}


def chunk_size() -> int | None:
    """``GPUMIGRATE_SNAPSHOT_CHUNK_MB`` where set; else :data:`WRITTEN_CHUNK_SIZE` where the workload reports its
    writes; else :data:`GPU_CHUNK_SIZE` where the tracked state lives on a GPU; else None (the transfer engine's
    default, 4 MiB). One process always picks the same (the attach decides before any round): every round of a
    migration cuts its tensors at the same offsets, which is what lets a round reuse the chunks of the one before."""
    mb = int(os.environ.get("GPUMIGRATE_SNAPSHOT_CHUNK_MB", "0") or 0)
    if mb:
        return mb << 20
    if _reports_writes.is_set():
        return WRITTEN_CHUNK_SIZE
    return GPU_CHUNK_SIZE if _state_on_gpu.is_set() else None


def reports_writes(given: bool) -> None:
    """Whether the attach (one a process at a time) was given written-range reports (``attach(written=...)``)."""
    if given:
        _reports_writes.set()
    else:
        _reports_writes.clear()


def warm_device_kernels(devices: list[int] | None, *, capture: bool = True) -> threading.Thread | None:
    """Compile the device kernels now, in the background, rather than inside the first capture or restore.

    The same thread loads the image reader and writer, the GPU codec's library and the fill's landing, page-locks
    the direct path's host slots, and (unless ``capture`` is false) runs one capture of a two-chunk probe into a
    temporary store (:func:`_warm_capture`), which compiles the fingerprint kernels. A target awaiting its restore
    warms only what a restore runs: warming a capture then would hold the GIL and the GPU beside that restore."""
    _marks["attach"] = round(time.time(), 3)
    if not devices:
        return None
    _state_on_gpu.set()  # before the warm-up below, which page-locks slots and captures a probe at the chunk size
    from gpumigrate.transfer.device import devhash

    def compile_all() -> None:
        import torch

        t = time.perf_counter()
        with contextlib.suppress(Exception):
            importlib.import_module("gpumigrate.transfer.api")
            importlib.import_module("gpumigrate.transfer.device.gpucodec").available()
        t = _step("transfer_and_codec_libraries", t)
        with contextlib.suppress(Exception):
            # a fill from the source (either side of it): the landing and its sender, and the driver's IPC calls,
            # loaded here rather than inside the first lend
            importlib.import_module("gpumigrate.transfer.device.landing")
            importlib.import_module("gpumigrate.transfer.device.cuda_ipc")._driver()
        t = _step("fill_libraries", t)
        with contextlib.suppress(Exception):
            from gpumigrate.transfer.writer import DEFAULT_CHUNK_SIZE

            importlib.import_module("gpumigrate.transfer.direct").warm_slots(chunk_size() or DEFAULT_CHUNK_SIZE)
        t = _step("page_locked_slots", t)
        for index in devices:
            device = torch.device("cuda", index)
            if devhash.available(device):
                with contextlib.suppress(Exception):
                    devhash.warm(device)
                t = _step("hash_kernels", t)
                with contextlib.suppress(Exception):  # the byte-plane split and merge (capture and restore)
                    importlib.import_module("gpumigrate.transfer.device.plane_kernels").warm(device)
                t = _step("plane_kernels", t)
            if capture:
                with contextlib.suppress(Exception):
                    _warm_capture(device)
                t = _step("capture_probe", t)
        _marks["warm_done"] = round(time.time(), 3)

    thread = threading.Thread(target=compile_all, name="gm-warm-kernels", daemon=True)
    thread.start()
    _warming.append(thread)
    return thread


def _warm_capture(device: torch.device) -> None:
    """One live round of a two-chunk bf16 probe (and a short one) on ``device`` through the real writer into a
    temporary store.

    It compiles the chunk fingerprints' kernels (seconds, once per process) and sets up the writer's device paths
    (device ids, pinned slots, the codec); then the probe and the store are gone."""
    import tempfile

    import torch

    from gpumigrate import transfer
    from gpumigrate.transfer.writer import DEFAULT_CHUNK_SIZE

    chunk = chunk_size() or DEFAULT_CHUNK_SIZE
    # A generator of its own: drawing from the device's default one would move the workload's random stream
    # (its dropout masks, its sampling) by however far this thread ran, at whatever step it ran beside, so the
    # job would no longer take the steps an unmigrated run takes.
    own = torch.Generator(device=device).manual_seed(0)
    probe = torch.randn(chunk, device=device, generator=own).to(torch.bfloat16)  # two chunks of bf16
    tail = torch.randn(777, device=device, generator=own).to(torch.bfloat16)  # a short chunk: its own kernel
    with tempfile.TemporaryDirectory(prefix="gm-warm-") as where:
        engine = SnapshotEngine()
        try:
            engine.track_tensor("probe", probe)
            engine.track_tensor("probe_tail", tail)
            writer: ImageWriter = transfer.open_writer(
                f"file://{where}", key=None, parent=None, source="agent", chunk_size=chunk
            )
            engine.capture_round(writer)
        finally:
            engine.close()


def kernels_warming() -> bool:
    """Whether the background warm-up of :func:`warm_device_kernels` still runs (the agent's ``info``)."""
    return any(thread.is_alive() for thread in _warming)


def wait_for_kernels(timeout_s: float = 120.0) -> float:
    """Wait for the background compile of :func:`warm_device_kernels`; return the seconds waited.

    A restore that starts while it runs would compile the same kernels a second time in its own thread,
    both holding the GIL in turns; waiting costs less, and the restore's phases show the wait."""
    t0 = time.perf_counter()
    for thread in list(_warming):
        if thread is threading.current_thread():
            continue
        thread.join(max(0.0, timeout_s - (time.perf_counter() - t0)))
    return time.perf_counter() - t0


__all__ = [
    "GPU_CHUNK_SIZE",
    "WRITTEN_CHUNK_SIZE",
    "chunk_size",
    "kernels_warming",
    "reports_writes",
    "process_started",
    "timeline",
    "wait_for_kernels",
    "warm_device_kernels",
]

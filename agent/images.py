"""Where the agent's images go: gpumigrate.transfer's writer and reader, opened inside the workload.

``gpumigrate.snapshot`` must not import ``gpumigrate.transfer`` (siblings meet through Protocols),
so the SDK, which sits above both, hands the agent these two factories. The agent passes a store
URL and a key *reference*; the key is resolved here, in the workload's own process, and never
crosses the control channel.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from gpumigrate.interfaces import ImageReader, ImageWriter
from gpumigrate.snapshot.agent import Agent


def _key(key_ref: Mapping[str, str]) -> bytes | None:
    """The image key from its reference; none for an empty reference (a store without encryption)."""
    if not key_ref:
        return None
    from gpumigrate import transfer
    from gpumigrate.errors import InvalidInputError

    try:
        key: bytes | None = transfer.resolve_key(env=key_ref.get("env"), file=key_ref.get("file"))
    except InvalidInputError as exc:
        # Raised in the workload's process, reported by `migrate`, whose own shell may well have the key.
        raise InvalidInputError(
            f"the workload's agent (pid {os.getpid()}) cannot read the image key: {exc.message}",
            hint="the workload seals and opens its image itself: start it with the image key's variable set "
            "(or its key file readable), as for `gpumigrate migrate` (agent/README.md, 'The environment contract')",
        ) from None
    return key


def open_writer(
    store: str,
    key_ref: Mapping[str, str],
    parent: str | None,
    *,
    compression: str = "auto",
    parallelism: int | None = None,
) -> ImageWriter:
    from gpumigrate import transfer

    wait_for_kernels()  # the attach's warm-up first: a round must not compile the same kernels beside it
    workers = parallelism or int(os.environ.get("GPUMIGRATE_SNAPSHOT_PARALLELISM", "4"))
    writer: ImageWriter = transfer.open_writer(
        store,
        key=_key(key_ref),
        parent=parent,
        parallelism=workers,
        source="agent",
        compression=compression,
        chunk_size=_chunk_size(),
    )
    return writer


# Where the tracked state lives on a GPU. Each chunk costs the capture's one queueing thread a fixed round of
# launches, and the sealing threads a round of system calls; those thread switches, not the bytes, set the pace:
# on the lent H100 (16 GiB bf16 in 521 tensors) 32 MiB chunks captured at 11.0-16.3 GB/s in one process against
# 6.2-11.2 at 16 MiB, and the migration's capture and restore ran at 13.0 / 17.8 GB/s against 8.5 / 11.7
# (snapshot/BENCHMARKS.md, tenth session). The image format's 4 MiB stays for state in host memory.
GPU_CHUNK_SIZE = 32 << 20
_state_on_gpu = threading.Event()  # set by warm_device_kernels: the attach found tracked state on a GPU


def _chunk_size() -> int | None:
    """``GPUMIGRATE_SNAPSHOT_CHUNK_MB`` where set; else :data:`GPU_CHUNK_SIZE` where the tracked state lives on a GPU;
    else None (the transfer engine's default, 4 MiB). One process always picks the same: every round of a migration
    cuts its tensors at the same offsets, which is what lets a round reuse the chunks of the one before."""
    mb = int(os.environ.get("GPUMIGRATE_SNAPSHOT_CHUNK_MB", "0") or 0)
    if mb:
        return mb << 20
    return GPU_CHUNK_SIZE if _state_on_gpu.is_set() else None


def open_reader(store: str, image_id: str, key_ref: Mapping[str, str]) -> ImageReader:
    from gpumigrate import transfer

    wait_for_kernels()
    reader: ImageReader = transfer.open_reader(store, image_id, key=_key(key_ref))
    return reader


def make_agent(**kwargs: Any) -> Agent:
    """A snapshot Agent whose images go through gpumigrate.transfer (for a program that tracks its
    state by hand with ``track_module``/``track_tensor``/...; ``attach()`` builds one for you)."""
    from gpumigrate.agent.fill import SourceFill

    return Agent(
        writer_factory=open_writer, reader_factory=open_reader, filler=SourceFill(), warming=kernels_warming, **kwargs
    )


def warm_device_kernels(devices: list[int] | None, *, capture: bool = True) -> threading.Thread | None:
    """Compile the device kernels now, in the background, rather than inside the first capture or restore.

    Triton compiles a kernel on its first call and caches it on disk; on a fresh host the first
    migration compiled them inside its timed work (bench/e2e.py, H100, 16 GiB: capture 23.6 s
    against 11.2 s with a warm cache, restore 16.0 s against 4.7 s). A source serves for a while
    before it moves and a target starts while the source pre-copies, so both compile off the clock.
    A failure here only means the first capture compiles them after all. The same thread loads the image
    reader and writer and the GPU codec's library, which a fresh target's first restore loaded inside its
    timed work (about 90 ms), page-locks the direct path's host slots (0.6 s inside that restore), and
    runs one capture of a two-chunk probe into a temporary store (:func:`_warm_capture`, unless
    ``capture`` is false), which compiles the fingerprint kernel: on the lent H100 the first live round
    of a 16 GiB model took 9.8 s (1.8 GB/s) without it and 2.6 s (6.6 GB/s) with it. Captures and
    restores wait for this thread (:func:`wait_for_kernels`) rather than compile beside it.
    """
    if not devices:
        return None
    _state_on_gpu.set()  # before the warm-up below, which page-locks slots and captures a probe at the chunk size
    from gpumigrate.transfer.device import devhash

    def compile_all() -> None:
        import torch

        with contextlib.suppress(Exception):
            importlib.import_module("gpumigrate.transfer.api")
            importlib.import_module("gpumigrate.transfer.device.gpucodec").available()
        with contextlib.suppress(Exception):
            # a fill from the source (either side of it): the landing and its sender, and the driver's IPC calls,
            # loaded here rather than inside the first lend (which spent ~35 ms outside its connect and its pass)
            importlib.import_module("gpumigrate.transfer.device.landing")
            importlib.import_module("gpumigrate.transfer.device.cuda_ipc")._driver()
        with contextlib.suppress(Exception):
            from gpumigrate.transfer.writer import DEFAULT_CHUNK_SIZE

            importlib.import_module("gpumigrate.transfer.direct").warm_slots(_chunk_size() or DEFAULT_CHUNK_SIZE)
        for index in devices:
            device = torch.device("cuda", index)
            if devhash.available(device):
                with contextlib.suppress(Exception):
                    devhash.warm(device)
                with contextlib.suppress(Exception):  # the byte-plane split and merge (capture and restore)
                    importlib.import_module("gpumigrate.transfer.device.plane_kernels").warm(device)
            if capture:
                with contextlib.suppress(Exception):
                    _warm_capture(device)

    thread = threading.Thread(target=compile_all, name="gm-warm-kernels", daemon=True)
    thread.start()
    _warming.append(thread)
    return thread


_warming: list[threading.Thread] = []


def _warm_capture(device: Any) -> None:
    """One live round of a two-chunk bf16 probe (and a short one) on ``device`` through the real writer into a
    temporary store.

    It compiles the chunk fingerprints' kernel (``torch.compile``, seconds, once per process) and sets up the
    writer's device paths (device ids, pinned slots, the codec); then the probe and the store are gone."""
    import tempfile

    import torch

    from gpumigrate import transfer
    from gpumigrate.transfer.writer import DEFAULT_CHUNK_SIZE

    chunk = _chunk_size() or DEFAULT_CHUNK_SIZE
    probe = torch.randn(chunk, device=device).to(torch.bfloat16)  # two chunks of bf16
    tail = torch.randn(777, device=device).to(torch.bfloat16)  # one short chunk: the short-chunk fingerprint kernel
    with tempfile.TemporaryDirectory(prefix="gm-warm-") as where:

        def writer(store: str, key_ref: Mapping[str, str], parent: str | None, **options: Any) -> ImageWriter:
            opened: ImageWriter = transfer.open_writer(
                store, key=None, parent=parent, source="agent", chunk_size=chunk, **options
            )
            return opened

        agent = Agent(writer_factory=writer)
        try:
            agent.track_tensor("probe", probe)
            agent.track_tensor("probe_tail", tail)
            agent.precopy_to(f"file://{where}", {})
        finally:
            agent.close()


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

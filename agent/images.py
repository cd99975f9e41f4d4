"""Where the engine's images go: gpumigrate.transfer's writer and reader, opened inside the workload.

``gpumigrate.snapshot`` must not import ``gpumigrate.transfer`` (siblings meet through Protocols),
so the SDK, which sits above both, hands the engine these two factories and the fill's two ends
(``fill.py``). The engine passes a store URL and a key *reference*; the key is resolved here, in the
workload's own process, and never crosses the control channel.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping

from gpumigrate.interfaces import ImageReader, ImageWriter, LatencySignal
from gpumigrate.snapshot.engine import SnapshotEngine
from gpumigrate.snapshot.ranks import RankGroup
from gpumigrate.snapshot.stepgate import SafePointGate

from .fill import SourceFill
from .warmup import chunk_size, kernels_warming, timeline, wait_for_kernels


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


def check_key(key_ref: Mapping[str, str]) -> str | None:
    """The id of the image key ``key_ref`` names, read in this process (None: no key); the agent's ``key``
    command, which preflight sends before anything moves."""
    from gpumigrate import transfer

    key = _key(key_ref)
    return None if key is None else transfer.derive_keys(key).key_id


def open_writer(
    store: str,
    key_ref: Mapping[str, str],
    parent: str | None,
    *,
    compression: str = "auto",
    parallelism: int | None = None,
    rate_limit: int | None = None,
    pacing: str = "off",
    latency: LatencySignal | None = None,
) -> ImageWriter:
    """A writer for one round, bounded as the round's options say (gpumigrate/bounds.py: threads, bytes/s, and
    with ``pacing="adaptive"`` a pace that yields to ``latency``, the workload's own request latency)."""
    from gpumigrate import transfer

    wait_for_kernels()  # the attach's warm-up first: a round must not compile the same kernels beside it
    workers = parallelism or int(os.environ.get("GPUMIGRATE_SNAPSHOT_PARALLELISM", "0") or 0) or None
    writer: ImageWriter = transfer.open_writer(
        store,
        key=_key(key_ref),
        parent=parent,
        parallelism=workers,
        source="agent",
        compression=compression,
        chunk_size=chunk_size(),
        rate_limit=rate_limit,
        latency=latency if pacing == "adaptive" else None,
    )
    return writer


def open_reader(store: str, image_id: str, key_ref: Mapping[str, str]) -> ImageReader:
    from gpumigrate import transfer

    wait_for_kernels()
    reader: ImageReader = transfer.open_reader(store, image_id, key=_key(key_ref))
    return reader


def make_engine(
    *,
    freezer: SafePointGate | None = None,
    set_ready: Callable[[bool], None] | None = None,
    group: RankGroup | None = None,
    workers: int = 4,
    streams: int = 2,
) -> SnapshotEngine:
    """A snapshot engine whose images go through gpumigrate.transfer (for a program that tracks its state by
    hand with ``track_module``/``track_tensor``/...; ``attach()`` builds one for you)."""
    return SnapshotEngine(
        # a round's pacing yields to the requests that pass the workload's safe point
        writer_factory=functools.partial(open_writer, latency=freezer) if freezer is not None else open_writer,
        reader_factory=open_reader,
        filler=SourceFill(),
        warming=kernels_warming,
        timeline=timeline,
        key_check=check_key,
        freezer=freezer,
        set_ready=set_ready,
        group=group,
        workers=workers,
        streams=streams,
    )

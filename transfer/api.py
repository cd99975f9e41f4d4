"""open_writer / open_reader: the entry points the snapshot agent and the flows use."""

from __future__ import annotations

from gpumigrate.interfaces import LatencySignal
from gpumigrate.transfer.direct_reader import DirectStoreImageReader
from gpumigrate.transfer.direct_writer import DirectStoreImageWriter
from gpumigrate.transfer.format.chunkobj import Sealer
from gpumigrate.transfer.latest import resolve_image_id
from gpumigrate.transfer.progress import ProgressCallback
from gpumigrate.transfer.reader import StoreImageReader
from gpumigrate.transfer.stores import Store, open_store
from gpumigrate.transfer.writer import UPLOADS, committed_body


def _store(store_url: str | Store, endpoint_url: str | None, parallelism: int = 4) -> Store:
    if isinstance(store_url, Store):
        return store_url
    return open_store(store_url, endpoint_url=endpoint_url, parallelism=parallelism)


def open_writer(
    store_url: str | Store,
    *,
    key: bytes | None,
    parent: str | None = None,
    compression: str = "auto",
    parallelism: int | None = None,
    chunk_size: int | None = None,
    source: str | None = None,
    delta: bool = False,
    parent_store: str | None = None,
    endpoint_url: str | None = None,
    progress: ProgressCallback | None = None,
    rate_limit: float | None = None,
    latency: LatencySignal | None = None,
) -> DirectStoreImageWriter:
    """An ImageWriter (a DirectImageWriter: it also takes chunks as tensors) into ``store_url``. With ``parent``, chunks the parent holds cost no bytes.

    ``parent`` is read (and verified) from ``parent_store`` or, by default, the same store; a
    ``stream://`` destination needs ``parent_store`` to name a readable copy of the parent.
    ``delta=True`` stores changed chunks as XOR deltas against the parent's chunk at the same index.
    What the writer may take from its host (gpumigrate/bounds.py): ``parallelism`` threads seal and store (None:
    one per core; a remote store then gets 4 connections), ``rate_limit`` caps its bytes per second, and with a
    ``latency`` signal (the source's requests) its pace yields to the source (pacing.py).
    """
    store = _store(store_url, endpoint_url, parallelism or UPLOADS)
    sealer = Sealer(key)
    parent_body = None
    parent_reader = None
    if parent:
        pstore = store if parent_store is None else _store(parent_store, endpoint_url)
        parent_id = resolve_image_id(pstore, parent, sealer)
        # A parent this process committed itself needs no read back (delta chunks read its objects, though).
        parent_body = None if delta else committed_body(pstore.url, parent_id, sealer.key_id)
        if parent_body is None:
            parent_reader = StoreImageReader(pstore, parent_id, sealer)
            parent_body = parent_reader.body
        parent = parent_id
    return DirectStoreImageWriter(
        store,
        sealer,
        parent=parent_body,
        parent_id=parent,
        parent_reader=parent_reader,
        compression=compression,
        parallelism=parallelism,
        chunk_size=chunk_size,
        source=source,
        delta=delta,
        progress=progress,
        rate_limit=rate_limit,
        latency=latency,
    )


def open_reader(
    store_url: str | Store, image_id: str, *, key: bytes | None, endpoint_url: str | None = None
) -> DirectStoreImageReader:
    """A verified ImageReader (a DirectImageReader: it also fills tensors): the manifest's id, key id and signature are checked here."""
    store = _store(store_url, endpoint_url)
    sealer = Sealer(key)
    return DirectStoreImageReader(store, resolve_image_id(store, image_id, sealer), sealer)

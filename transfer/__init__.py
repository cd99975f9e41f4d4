"""gpumigrate.transfer: checkpoint images (FORMAT.md) and the engine that moves them (TRANSPORTS.md).

Importing this package is cheap: the public names load their modules on first use.

- ``open_writer(store_url, *, key, parent=None, compression="auto", parallelism=None, chunk_size=None, source=None,
  rate_limit=None, latency=None)``: ``parallelism`` sealing threads (None: one per core), ``rate_limit`` bytes/s,
  ``latency`` the source's request latency its pace yields to (pacing.py)
- ``open_reader(store_url, image_id, *, key)``
- ``resolve_key(env=None, file=None) -> bytes``, ``generate_key() -> str``, ``derive_keys(key).key_id``
- ``pack_paths(paths, store_url, *, key, parent=None, ...) -> ImageRef``, ``unpack(store_url, image_id, out_dir, *, key)``
- ``push(src_url, dst_url, image_id, *, key, parallelism=4, progress=None) -> TransferStats``: any store or
  receiver (stream://, nixl://) as destination; the CLI and the flows both call it
- ``verify(store_url, image_id, *, key) -> TransferStats``
- ``serve_stream(listen, store_url, *, key=None, quota_bytes=None, nixl=False) -> Receiver`` (``.url``, ``.close()``)
- a receiver on a host: ``receiver_argv(state_dir, ReceiverOptions(...), key_ref=)`` (the command to run there), ``start_receiver``
  (detached here), ``read_receiver_info(state_dir) -> ReceiverInfo`` (``.url`` pinned, ``.store``),
  ``stop_receiver(state_dir)``
- ``check_landed(store_url, image_id, *, key) -> TransferStats``: an image where a writer put it, checked
  from its signed manifest and the store's listing, no payload read back
- ``store_region(store_url) -> str | None``, ``ensure_bucket(store_url, location) -> str | None``
- ``ProgressCallback = Callable[[bytes_done, bytes_total], None]``
"""

from __future__ import annotations

from gpumigrate.lazy import lazy_exports

_EXPORTS = {
    "open_writer": "api",
    "open_reader": "api",
    "resolve_key": "format.keys",
    "generate_key": "format.keys",
    "derive_keys": "format.keys",
    "pack_paths": "pack",
    "unpack": "unpack",
    "push": "push",
    "verify": "push",
    "store_region": "push",
    "ensure_bucket": "push",
    "check_landed": "push",
    "serve_stream": "receiver.server",
    "Receiver": "receiver.server",
    "receiver_argv": "receiver.host",
    "start_receiver": "receiver.host",
    "read_receiver_info": "receiver.host",
    "stop_receiver": "receiver.host",
    "ReceiverInfo": "receiver.host",
    "ReceiverOptions": "receiver.host",
    "ReceiverLimits": "receiver.admission",
    "resolve_image": "latest",
    "check_image_id": "stores",
    "ProgressCallback": "progress",
    "TransferStats": "progress",
    "open_store": "stores",
    "parse_image_url": "stores",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)

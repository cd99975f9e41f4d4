"""Chunk stores behind one interface, and the one factory that opens them: ``open_store(url)``.

One module per store, picked by the URL's scheme and imported on first use (the file store needs no cloud SDK, a
receiver's sender no boto3): ``file.py`` (``file://``), ``s3.py`` (``s3://``), ``gcs.py`` (``gs://``),
``stream.py`` (``stream://``, write-only towards a receiver) and ``nixl.py`` (``nixl://``, the same with chunk
bytes WRITTEN by NIXL). ``base.py`` holds the :class:`Store` interface and what the stores share; ``wire.py`` the
stream protocol's frames, ``connections.py`` a sender's connections, ``nixl_agent.py`` a NIXL agent.
"""

from __future__ import annotations

from importlib import import_module

from gpumigrate.transfer.stores.base import (
    ID_PATTERN,
    ID_RULE,
    SCHEMES,
    BucketStore,
    InvalidIdError,
    Store,
    StoreOptions,
    check_chunk_id,
    check_image_id,
    chunk_key,
    manifest_key,
    parse_image_url,
    query_param,
    split_url,
)

# scheme -> "module:Class", imported on first use
STORES: dict[str, str] = {
    "file": "gpumigrate.transfer.stores.file:FileStore",
    "s3": "gpumigrate.transfer.stores.s3:S3Store",
    "gs": "gpumigrate.transfer.stores.gcs:GcsStore",
    "stream": "gpumigrate.transfer.stores.stream:StreamStore",
    "nixl": "gpumigrate.transfer.stores.nixl:NixlStore",
}


def store_class(scheme: str) -> type[Store]:
    """The :class:`Store` implementation of a URL scheme (one of ``SCHEMES``)."""
    module_name, _, class_name = STORES[scheme].partition(":")
    found: type[Store] = getattr(import_module(module_name), class_name)
    return found


def open_store(url: str, *, endpoint_url: str | None = None, parallelism: int = 4, sync: str | None = None) -> Store:
    """Open the store a URL names (see :class:`StoreOptions` for the options). Creates nothing until the first write."""
    scheme = split_url(url)[0]  # a clear error for a URL that names no store
    return store_class(scheme).from_url(
        url, StoreOptions(endpoint_url=endpoint_url, parallelism=parallelism, sync=sync)
    )


__all__ = [
    "ID_PATTERN",
    "ID_RULE",
    "SCHEMES",
    "STORES",
    "BucketStore",
    "InvalidIdError",
    "Store",
    "StoreOptions",
    "check_chunk_id",
    "check_image_id",
    "chunk_key",
    "manifest_key",
    "open_store",
    "parse_image_url",
    "query_param",
    "split_url",
    "store_class",
]

"""The store interface and what every store shares: object keys, URL helpers, the object-store layout.

A store holds the objects of an image (FORMAT.md) as bytes, by key, and knows nothing of what they mean. Every put
is atomic: an object is either absent or complete. This module imports no implementation; ``open_store`` in
``stores/__init__.py`` picks one by the URL's scheme (TRANSPORTS.md: the Store interface).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Self
from urllib.parse import parse_qs, urlsplit

from gpumigrate.errors import InvalidInputError, NotFoundError, TransferError

SCHEMES = ("file", "s3", "gs", "stream", "nixl")
STORE_MARKER = "gpumigrate-store.json"
STORE_MARKER_BODY = b'{"format": "gpumigrate-store", "version": 1}\n'


@dataclass(frozen=True)
class StoreOptions:
    """How ``open_store`` opens a store; each store reads what applies to it.

    ``endpoint_url`` (s3://, gs://: the API endpoint), ``parallelism`` (concurrent requests or connections),
    ``sync`` (file:// only: when chunk data reaches the disk, see ``file.py``).
    """

    endpoint_url: str | None = None
    parallelism: int = 4
    sync: str | None = None


# An id names an object in every store (a file name, an object key), so it is checked before it touches one: a
# string that is anything else (``../../outside``, a prefix, upper case) never becomes a path. One rule, one place.
ID_RULE = "64 lowercase hex digits (^[0-9a-f]{64}$)"
ID_PATTERN = re.compile(r"[0-9a-f]{64}")


class InvalidIdError(InvalidInputError):
    """A string given as an image or chunk id is not one: refused before it touches a path or a key (exit 2)."""


def _bad_id(value: object, what: str) -> InvalidIdError:
    if isinstance(value, str):
        shown = f"{value[:16]!r}{'…' if len(value) > 16 else ''} ({len(value)} characters)"
    else:
        shown = type(value).__name__
    return InvalidIdError(
        f"{shown} is not {what}: an id is {ID_RULE}",
        hint="an image URL is STORE_URL#ID with the id `gpumigrate image pack` or `image ls` printed, a unique "
        "hex prefix of it, or no id for the newest image",
    )


def check_image_id(value: object) -> str:
    """``value`` when it is an image id (:data:`ID_RULE`); else :class:`InvalidIdError`, naming the rule and no
    content of anything. Every entry point (CLI, stores, receiver, reader) goes through this one check."""
    if type(value) is str and ID_PATTERN.fullmatch(value):
        return value
    raise _bad_id(value, "an image id")


def check_chunk_id(value: object) -> str:
    """``value`` when it is a chunk id (the same rule as an image id); else :class:`InvalidIdError`."""
    if type(value) is str and ID_PATTERN.fullmatch(value):
        return value
    raise _bad_id(value, "a chunk id")


def chunk_key(chunk_id: str) -> str:
    check_chunk_id(chunk_id)
    return f"chunks/{chunk_id[:2]}/{chunk_id}"


def manifest_key(image_id: str) -> str:
    check_image_id(image_id)
    return f"manifests/{image_id}"


class Store:
    """The operations the writer, reader and push need; each implementation is one module of this package."""

    url: str
    readable = True
    # True when the far side authenticates and BLAKE3-checks every chunk before storing it and lists
    # only chunks it verified (a stream:// or nixl:// receiver): push then trusts its listing instead
    # of reading existing chunks back to verify them.
    verifies_on_arrival = False
    # True when one listing is cheaper than a size query per chunk (remote stores): the writer then
    # lists once instead of asking about every chunk it has not seen.
    prefers_listing = False
    # True when put_chunk is a cheap local write that never waits on a network: the writer then
    # stores each object on the thread that sealed it (its bytes still hot in that core's cache)
    # instead of handing it to an upload thread.
    writes_inline = False

    @classmethod
    def from_url(cls, url: str, options: StoreOptions) -> Self:
        """The store ``url`` names (its scheme is this class's), opened with ``options``. Creates nothing yet."""
        raise NotImplementedError

    def put_chunk(self, chunk_id: str, blob: bytes | bytearray | memoryview) -> None:
        raise NotImplementedError

    def get_chunk(self, chunk_id: str) -> bytes:
        raise NotImplementedError

    def missing(self) -> NotFoundError | None:
        """The error for a store that does not exist, where the store can tell (a directory); None otherwise."""
        return None

    def get_chunk_into(self, chunk_id: str, out: memoryview) -> int:
        """Read a chunk object into ``out`` (e.g. a pinned buffer); return its length."""
        data = self.get_chunk(chunk_id)
        if len(data) > len(out):
            raise TransferError(f"chunk {chunk_id[:16]} is {len(data)} bytes, more than the {len(out)} expected")
        out[: len(data)] = data
        return len(data)

    def chunk_size(self, chunk_id: str) -> int | None:
        """Stored size of a chunk object, or None when the store does not hold it."""
        raise NotImplementedError

    def chunk_header(self, chunk_id: str, nbytes: int) -> bytes:
        """The first ``nbytes`` bytes of a chunk object (its header: codec, base) without reading the rest."""
        return self.get_chunk(chunk_id)[:nbytes]

    def list_chunks(self) -> dict[str, int]:
        """Every chunk id the store holds, with its stored size (one listing, not one call per chunk)."""
        raise NotImplementedError

    def put_manifest(self, image_id: str, data: bytes) -> None:
        raise NotImplementedError

    def get_manifest(self, image_id: str) -> bytes:
        raise NotImplementedError

    def list_manifests(self) -> list[str]:
        raise NotImplementedError

    def flush(self) -> None:
        """Make every put so far durable (before a manifest that names the chunks is written)."""

    def take_rejected(self) -> list[str]:
        """Chunks the far side refused after checking them (a receiver), to send again; none for a store."""
        return []

    def location(self) -> str:
        """The store without its options (a file store: its real directory): what a reader's record of the newest
        image it took from the store is kept under (``transfer/latest.py``)."""
        return self.url.split("?", 1)[0]

    def region(self) -> str | None:
        """Where the store's data lives (cloud region), for residency checks; None when not a cloud."""
        return None

    def close(self) -> None:
        pass

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BucketStore(Store):
    """Object stores (S3, GCS): the layout of TRANSPORTS.md on top of three primitives.

    Subclasses provide ``_put(rel, data, what)``, ``_get(rel, what)`` (raising NotFoundError when the
    object is absent) and ``_list(rel_prefix) -> {name: size}``; keys are relative to the store's prefix.
    """

    prefers_listing = True
    _marker_done = False

    def _put(self, rel: str, data: bytes | bytearray | memoryview, what: str) -> None:
        raise NotImplementedError

    def _get(self, rel: str, what: str) -> bytes:
        raise NotImplementedError

    def _list(self, rel_prefix: str) -> dict[str, int]:
        raise NotImplementedError

    def ensure_bucket(self, location: str) -> str:
        """The bucket's region, creating the bucket (private) in ``location`` when it does not exist."""
        raise NotImplementedError

    def put_chunk(self, chunk_id: str, blob: bytes | bytearray | memoryview) -> None:
        self._put(chunk_key(chunk_id), blob, f"chunk {chunk_id[:16]}")

    def get_chunk(self, chunk_id: str) -> bytes:
        return self._get(chunk_key(chunk_id), f"chunk {chunk_id[:16]}")

    def list_chunks(self) -> dict[str, int]:
        return self._list("chunks/")

    def put_manifest(self, image_id: str, data: bytes) -> None:
        if not self._marker_done:
            self._put(STORE_MARKER, STORE_MARKER_BODY, "store marker")
            self._marker_done = True
        self._put(manifest_key(image_id), data, f"manifest {image_id[:16]}")

    def get_manifest(self, image_id: str) -> bytes:
        try:
            return self._get(manifest_key(image_id), f"image {image_id}")
        except NotFoundError:
            raise NotFoundError(f"no image {image_id} in {self.url}") from None

    def list_manifests(self) -> list[str]:
        return sorted(name for name in self._list("manifests/") if ID_PATTERN.fullmatch(name))


def split_url(url: str) -> tuple[str, str, str, dict[str, list[str]]]:
    """(scheme, netloc, path, query) of a store URL, with a clear error for anything else."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES or "://" not in url:
        raise InvalidInputError(
            f"unsupported store URL {url!r}",
            hint="allowed: file:///abs/dir, file://relative/dir, s3://bucket/prefix, gs://bucket/prefix, "
            "stream://host:port, nixl://host:port",
        )
    return parts.scheme, parts.netloc, parts.path, parse_qs(parts.query)


def query_param(query: dict[str, list[str]], name: str) -> str | None:
    """The first value of ``name`` in a parsed URL query (:func:`split_url`), or None."""
    values = query.get(name)
    return values[0] if values else None


def parse_image_url(text: str) -> tuple[str, str | None]:
    """``STORE_URL#IMAGE_ID`` → (store URL, image id or None)."""
    store, sep, image = text.partition("#")
    return store, (image or None) if sep else None

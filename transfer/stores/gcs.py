"""``gs://bucket/prefix`` through google-cloud-storage.

The API endpoint comes from ``endpoint_url`` or ``GPUMIGRATE_GCS_ENDPOINT`` (tests serve a small
fake of the JSON and upload APIs on loopback); with an endpoint set, anonymous credentials are used.
"""

from __future__ import annotations

import os
from typing import Self

from gpumigrate.errors import InvalidInputError, NotFoundError, TransferError
from gpumigrate.transfer.stores.base import BucketStore, StoreOptions, chunk_key, query_param, split_url


class GcsStore(BucketStore):
    """Objects under ``gs://bucket/prefix``, through google-cloud-storage (``?endpoint=``)."""

    def __init__(self, url: str, *, endpoint_url: str | None = None) -> None:
        from google.cloud import storage

        _, bucket, path, query = split_url(url)
        if not bucket:
            raise InvalidInputError(f"GCS URL {url!r} names no bucket (gs://bucket/prefix)")
        self.url = url
        self.prefix = path.strip("/")
        endpoint = endpoint_url or query_param(query, "endpoint") or os.environ.get("GPUMIGRATE_GCS_ENDPOINT")
        try:
            if endpoint:
                from google.auth.credentials import AnonymousCredentials

                self._client = storage.Client(
                    project="gpumigrate", credentials=AnonymousCredentials(), client_options={"api_endpoint": endpoint}
                )
            else:
                self._client = storage.Client()
        except Exception as exc:  # google.auth.exceptions.DefaultCredentialsError and friends
            raise InvalidInputError(f"cannot open {url}: {exc}") from None
        self._bucket = self._client.bucket(bucket)

    @classmethod
    def from_url(cls, url: str, options: StoreOptions) -> Self:
        return cls(url, endpoint_url=options.endpoint_url)

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _err(self, exc: Exception, what: str) -> Exception:
        from google.api_core import exceptions as gexc

        if isinstance(exc, gexc.NotFound):
            return NotFoundError(f"{what} not found in {self.url}")
        return TransferError(f"GCS {what} failed in {self.url}: {exc}")

    def _put(self, rel: str, data: bytes | bytearray | memoryview, what: str) -> None:
        try:
            # A single-request upload: the object appears whole or not at all.
            self._bucket.blob(self._key(rel)).upload_from_string(bytes(data), content_type="application/octet-stream")
        except Exception as exc:
            raise self._err(exc, what) from None

    def _get(self, rel: str, what: str, head: int | None = None) -> bytes:
        """The object at ``rel``, or its first ``head`` bytes (a ranged read, no checksum: the checksum covers the whole)."""
        blob = self._bucket.blob(self._key(rel))
        try:
            data: bytes = (
                blob.download_as_bytes()
                if head is None
                else blob.download_as_bytes(start=0, end=head - 1, checksum=None)
            )
            return data
        except Exception as exc:
            err = self._err(exc, what)
            if isinstance(err, NotFoundError) and what.startswith("chunk"):
                raise TransferError(err.message) from None
            raise err from None

    def chunk_header(self, chunk_id: str, nbytes: int) -> bytes:
        return self._get(chunk_key(chunk_id), f"chunk {chunk_id[:16]}", head=nbytes)

    def chunk_size(self, chunk_id: str) -> int | None:
        try:
            blob = self._bucket.get_blob(self._key(chunk_key(chunk_id)))
        except Exception as exc:
            raise self._err(exc, f"chunk {chunk_id[:16]}") from None
        return None if blob is None else int(blob.size or 0)

    def _list(self, rel_prefix: str) -> dict[str, int]:
        try:
            return {
                b.name.rsplit("/", 1)[-1]: int(b.size or 0)
                for b in self._client.list_blobs(self._bucket, prefix=self._key(rel_prefix))
            }
        except Exception as exc:
            raise self._err(exc, "listing") from None

    def ensure_bucket(self, location: str) -> str:
        """The bucket's location, creating the bucket in ``location`` when it does not exist (uniform
        bucket-level access, public access prevented). An existing bucket is left as it is, wherever it
        is: the caller checks that location before any byte moves."""
        try:
            found = self._client.lookup_bucket(self._bucket.name)
            if found is not None:
                return (found.location or "").lower()
            bucket = self._client.bucket(self._bucket.name)
            bucket.iam_configuration.uniform_bucket_level_access_enabled = True
            bucket.iam_configuration.public_access_prevention = "enforced"
            created = self._client.create_bucket(bucket, location=location)
        except Exception as exc:
            raise self._err(exc, f"bucket creation in {location}") from None
        return (created.location or location).lower()

    def region(self) -> str | None:
        try:
            bucket = self._client.get_bucket(self._bucket.name)
        except Exception as exc:
            raise self._err(exc, "bucket location") from None
        return (bucket.location or "").lower() or None

    def close(self) -> None:
        self._client.close()

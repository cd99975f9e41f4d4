"""``s3://bucket/prefix`` through boto3: parallel requests, multipart uploads for large objects.

The endpoint comes from the ``endpoint_url`` argument or ``AWS_ENDPOINT_URL`` (tests point it at
moto's ThreadedMotoServer on loopback); credentials come from boto3's usual chain.
"""

from __future__ import annotations

import io
import os
from typing import Any, Self

from gpumigrate.errors import InvalidInputError, NotFoundError, TransferError
from gpumigrate.transfer.stores.base import BucketStore, StoreOptions, chunk_key, query_param, split_url

MIN_PART = 5 << 20  # S3's smallest multipart part (except the last)
DEFAULT_MULTIPART_THRESHOLD = 16 << 20
S3Client = Any  # a boto3 S3 client: boto3 ships no type information


def _regional_client(client: S3Client, region: str) -> S3Client:
    """An S3 client with ``client``'s endpoint and settings, in ``region`` (buckets are created regionally)."""
    import boto3

    return boto3.session.Session().client(
        "s3", region_name=region, endpoint_url=client.meta.endpoint_url, config=client.meta.config
    )


class S3Store(BucketStore):
    """Objects under ``s3://bucket/prefix``, through boto3 (``?endpoint=``, ``?multipart_threshold=``)."""

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        parallelism: int = 4,
        multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
    ) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        _, bucket, path, query = split_url(url)
        if not bucket:
            raise InvalidInputError(f"S3 URL {url!r} names no bucket (s3://bucket/prefix)")
        self.url = url
        self.bucket = bucket
        self.prefix = path.strip("/")
        endpoint = endpoint_url or query_param(query, "endpoint") or os.environ.get("AWS_ENDPOINT_URL")
        threshold = int(query_param(query, "multipart_threshold") or multipart_threshold)
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint,
            config=Config(
                max_pool_connections=max(10, parallelism * 2), retries={"max_attempts": 5, "mode": "standard"}
            ),
        )
        self._transfer = TransferConfig(
            multipart_threshold=max(threshold, MIN_PART),
            multipart_chunksize=max(MIN_PART, threshold // 2),
            max_concurrency=max(1, parallelism),
            use_threads=True,
        )

    @classmethod
    def from_url(cls, url: str, options: StoreOptions) -> Self:
        return cls(url, endpoint_url=options.endpoint_url, parallelism=options.parallelism)

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _err(self, exc: Exception, what: str) -> Exception:
        from botocore.exceptions import ClientError, NoCredentialsError

        if isinstance(exc, NoCredentialsError):
            return InvalidInputError(
                f"no AWS credentials for {self.url}", hint="set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile"
            )
        if isinstance(exc, ClientError):
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404", "NotFound"):
                return NotFoundError(f"{what} not found in {self.url}")
            if code == "NoSuchBucket":
                return InvalidInputError(f"bucket {self.bucket} does not exist ({self.url})")
            return TransferError(
                f"S3 {what} failed in {self.url}: {code} {exc.response.get('Error', {}).get('Message', '')}"
            )
        return TransferError(f"S3 {what} failed in {self.url}: {exc}")

    def _put(self, rel: str, data: bytes | bytearray | memoryview, what: str) -> None:
        try:
            if len(data) >= self._transfer.multipart_threshold:
                # upload_fileobj splits into parts; the object appears only when the upload completes.
                self._client.upload_fileobj(io.BytesIO(data), self.bucket, self._key(rel), Config=self._transfer)
            else:
                self._client.put_object(Bucket=self.bucket, Key=self._key(rel), Body=bytes(data))
        except Exception as exc:
            raise self._err(exc, what) from None

    def _get(self, rel: str, what: str, rng: str | None = None) -> bytes:
        try:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self._key(rel)}
            if rng:
                kwargs["Range"] = rng
            data: bytes = self._client.get_object(**kwargs)["Body"].read()
            return data
        except Exception as exc:
            err = self._err(exc, what)
            if isinstance(err, NotFoundError) and what.startswith("chunk"):
                raise TransferError(err.message) from None
            raise err from None

    def chunk_header(self, chunk_id: str, nbytes: int) -> bytes:
        return self._get(chunk_key(chunk_id), f"chunk {chunk_id[:16]}", rng=f"bytes=0-{nbytes - 1}")

    def chunk_size(self, chunk_id: str) -> int | None:
        try:
            return int(
                self._client.head_object(Bucket=self.bucket, Key=self._key(chunk_key(chunk_id)))["ContentLength"]
            )
        except Exception as exc:
            err = self._err(exc, f"chunk {chunk_id[:16]}")
            if isinstance(err, NotFoundError):
                return None
            raise err from None

    def _list(self, rel_prefix: str) -> dict[str, int]:
        found: dict[str, int] = {}
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(rel_prefix)
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    found[obj["Key"].rsplit("/", 1)[-1]] = int(obj["Size"])
        except Exception as exc:
            raise self._err(exc, "listing") from None
        return found

    def ensure_bucket(self, location: str) -> str:
        """The bucket's region, creating the bucket in ``location`` when it does not exist (private:
        public access blocked, objects encrypted at rest). An existing bucket is left as it is, wherever
        it is: the caller checks that location before any byte moves."""
        from botocore.exceptions import ClientError

        try:
            self._client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code not in ("404", "NoSuchBucket", "NotFound"):
                raise self._err(exc, "bucket check") from None
        else:
            return str(self.region())
        regional = _regional_client(self._client, location)
        try:
            args: dict[str, Any] = {"Bucket": self.bucket}
            if location != "us-east-1":  # S3 names us-east-1 by leaving the constraint out
                args["CreateBucketConfiguration"] = {"LocationConstraint": location}
            regional.create_bucket(**args)
            regional.put_public_access_block(
                Bucket=self.bucket,
                PublicAccessBlockConfiguration={
                    "BlockPublicAcls": True,
                    "IgnorePublicAcls": True,
                    "BlockPublicPolicy": True,
                    "RestrictPublicBuckets": True,
                },
            )
            regional.put_bucket_encryption(
                Bucket=self.bucket,
                ServerSideEncryptionConfiguration={
                    "Rules": [{"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}]
                },
            )
        except Exception as exc:
            raise self._err(exc, f"bucket creation in {location}") from None
        finally:
            regional.close()
        return location

    def region(self) -> str | None:
        try:
            loc = self._client.get_bucket_location(Bucket=self.bucket).get("LocationConstraint")
        except Exception as exc:
            raise self._err(exc, "bucket location") from None
        return loc or "us-east-1"  # S3 reports us-east-1 as an empty constraint

    def close(self) -> None:
        self._client.close()

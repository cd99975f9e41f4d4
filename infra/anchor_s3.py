"""An audit anchor in S3 under object lock: ``s3://bucket/prefix[?mode=COMPLIANCE|GOVERNANCE&days=N]``.

Each published head is a new version of ``<prefix>/<log slug>/<chain>.json``, written with an object-lock
retention (default COMPLIANCE, 365 days): until it expires no one — the bucket's owner included, in
COMPLIANCE mode — can delete or overwrite that version, so the history of heads survives whoever can
rewrite the state directory, and a key holder too. The bucket must have been created with object lock
enabled (which also turns versioning on); a bucket without it is refused before anything is written.
Credentials come from boto3's standard chain; ``AWS_ENDPOINT_URL`` points it at another endpoint (moto's
server in tests). Spec of the head: ``gpumigrate/AUDIT.md``.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs, urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from gpumigrate.audit_anchor import check_chain, log_slug, ordered_heads
from gpumigrate.errors import GpumigrateError, InvalidInputError

MODES = ("COMPLIANCE", "GOVERNANCE")


class S3ObjectLockAnchor:
    def __init__(self, bucket: str, prefix: str = "gpumigrate-audit", *, mode: str = "COMPLIANCE",
                 days: int = 365, client: Any = None) -> None:  # fmt: skip
        if mode not in MODES:
            raise InvalidInputError(f"S3 audit anchor: mode {mode!r} is not one of {', '.join(MODES)}")
        if not 1 <= days <= 36_500:
            raise InvalidInputError(f"S3 audit anchor: days must be 1-36500, got {days}")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.mode, self.days = mode, days
        self._client = client
        self._checked = False
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str) -> S3ObjectLockAnchor:
        parts = urlsplit(url)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = set(query) - {"mode", "days"}
        if parts.scheme != "s3" or not parts.netloc or unknown:
            raise InvalidInputError(
                f"audit anchor {url!r}: write s3://bucket/prefix[?mode=COMPLIANCE|GOVERNANCE&days=N]"
            )
        try:
            days = int(query.get("days", "365"))
        except ValueError:
            raise InvalidInputError(f"audit anchor {url!r}: days must be a whole number") from None
        return cls(parts.netloc, parts.path or "gpumigrate-audit", mode=query.get("mode", "COMPLIANCE").upper(),
                   days=days)  # fmt: skip

    def describe(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def _s3(self) -> Any:
        with self._lock:
            if self._client is None:
                config = Config(connect_timeout=5, read_timeout=10, retries={"mode": "standard"})
                self._client = boto3.session.Session().client("s3", config=config)
            if not self._checked:
                try:
                    self._check_lock(self._client)
                except NoCredentialsError:
                    raise InvalidInputError(
                        f"audit anchor {self.describe()}: no AWS credentials in boto3's chain (environment, profile, "
                        "instance role)"
                    ) from None
                except BotoCoreError as exc:
                    raise GpumigrateError(f"audit anchor {self.describe()}: {type(exc).__name__}: {exc}") from None
                self._checked = True
            return self._client

    def _check_lock(self, s3: Any) -> None:
        try:
            conf = s3.get_object_lock_configuration(Bucket=self.bucket)["ObjectLockConfiguration"]
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            raise InvalidInputError(
                f"audit anchor {self.describe()}: the bucket has no object lock ({code}); create it with object "
                "lock enabled (aws s3api create-bucket --object-lock-enabled-for-bucket)"
            ) from None
        if conf.get("ObjectLockEnabled") != "Enabled":
            raise InvalidInputError(f"audit anchor {self.describe()}: object lock is not enabled on the bucket")

    def _key(self, log: str, chain: str) -> str:
        return f"{self.prefix}/{log_slug(log)}/{check_chain(chain)}.json"

    def publish(self, log: str, chain: str, head: Mapping[str, Any]) -> None:
        until = dt.datetime.now(dt.UTC) + dt.timedelta(days=self.days)
        self._s3().put_object(
            Bucket=self.bucket, Key=self._key(log, chain), Body=json.dumps(dict(head), sort_keys=True).encode(),
            ContentType="application/json", ObjectLockMode=self.mode, ObjectLockRetainUntilDate=until,
            ChecksumAlgorithm="SHA256",  # object-lock writes must carry an integrity checksum
        )  # fmt: skip

    def _read(self, key: str, version: str | None = None) -> dict[str, Any]:
        kwargs = {"Bucket": self.bucket, "Key": key, **({"VersionId": version} if version else {})}
        body = self._s3().get_object(**kwargs)["Body"].read()
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        return doc if isinstance(doc, dict) else {"damaged": f"{key} version {version} is not a JSON object"}

    def heads(self, log: str, chain: str) -> list[dict[str, Any]]:
        key = self._key(log, chain)
        versions: list[str] = []
        for page in self._s3().get_paginator("list_object_versions").paginate(Bucket=self.bucket, Prefix=key):
            versions += [v["VersionId"] for v in page.get("Versions", []) if v["Key"] == key]
        docs = [self._read(key, v) for v in versions]
        return ordered_heads(docs)

    def latest(self, log: str, chain: str) -> dict[str, Any] | None:
        try:
            return self._read(self._key(log, chain))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise

    def chains(self, log: str) -> list[str]:
        folder = f"{self.prefix}/{log_slug(log)}/"
        found: list[str] = []
        for page in self._s3().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=folder):
            found += [o["Key"][len(folder) : -len(".json")] for o in page.get("Contents", [])]
        return sorted(c for c in found if len(c) == 32)

"""The plan's ``snapshot`` and ``transfer`` sections: how the source's state is captured (backend, pre-copy
rounds, the freeze lease) and where and how its image travels (store or receiver URL, codec, key, bounds)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator

from gpumigrate.bounds import TransferBounds, parse_rate
from gpumigrate.plan.base import KeyRef, PlanModel


class Snapshot(PlanModel):
    backend: Literal["agent", "cuda-driver", "criu"] = "agent"
    precopy_rounds: Annotated[int, Field(ge=0, le=50)] = 3
    max_downtime_ms: Annotated[int, Field(gt=0, le=600_000)] = 500
    freeze_lease_s: Annotated[float, Field(gt=0, le=86_400)] = Field(
        default=60,
        description="The freeze is a lease: a frozen source resumes by itself unless the orchestrator renews it "
        "within this many seconds (the flow renews it while it works on the frozen source).",
    )
    keep_parked_source: bool = Field(
        default=False,
        description="Training: after the cut-over the source stays parked at its safe point, its state zeroized, for "
        "one freeze lease (freeze_lease_s), then its process ends (exit 0). true: it stays parked until you stop it.",
    )


# Receivers (stream://, nixl://) take options after "?": the certificate pinned as
# fingerprint=sha256:<64 hex> (receiver.json gives it), connections=N, and for nixl:// the UCX
# transports (transports=tcp), landing slots per connection (slots=N) and inline=0 (every chunk by NIXL).
_RECEIVER_OPTION = (
    r"(fingerprint=sha256:[0-9a-fA-F]{64}|connections=\d{1,2}|transports=[a-z0-9_]+(,[a-z0-9_]+)*|slots=\d{1,2}"
    r"|inline=[01])"
)
_STORE_RE = re.compile(
    r"^(file://.+|s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?|gs://[a-z0-9][a-z0-9._\-]{1,61}[a-z0-9](/.*)?"
    rf"|(stream|nixl)://[A-Za-z0-9_.\-\[\]:]+:\d{{1,5}}(\?{_RECEIVER_OPTION}(&{_RECEIVER_OPTION})*)?)$"
)

# A receiver the flow starts on the target itself (flows/target_store.py): stream://target or nixl://target,
# with the sender's options but no fingerprint (the receiver makes a fresh certificate, which the flow pins).
_ON_TARGET_OPTION = r"(connections=\d{1,2}|transports=[a-z0-9_]+(,[a-z0-9_]+)*|slots=\d{1,2}|inline=[01])"
TARGET_RECEIVER_RE = re.compile(rf"^(stream|nixl)://target(\?{_ON_TARGET_OPTION}(&{_ON_TARGET_OPTION})*)?$")


class Transfer(PlanModel):
    store: str = Field(
        description="file:///path, s3://bucket/prefix, gs://bucket/prefix, or a receiver: "
        "stream://host:port or nixl://host:port, optionally ?fingerprint=sha256:<hex>; "
        "stream://target or nixl://target: a receiver the flow starts on the target"
    )
    compression: Literal["auto", "none", "zstd", "byteplane"] = Field(
        default="auto",
        description="auto picks per chunk (byte-plane for float tensors, zstd, or none when a sample gains < 5%).",
    )
    encryption_key: KeyRef | None = None
    parallelism: Annotated[int, Field(ge=1, le=64)] = Field(
        default=4,
        description="Host threads a pre-copy round of the live source seals and stores its chunks with (and the "
        "connections or requests a store uses). The frozen final round takes every core: the source serves nobody "
        "then (gpumigrate/bounds.py).",
    )
    rate_limit: int | None = Field(
        default=None,
        description="Bytes per second a pre-copy round of the live source may move, device copies included: a whole "
        "number or a size per second such as 500MB/s or 2GiB/s (at least 1 MiB/s). Unset: no cap.",
    )
    pacing: Literal["adaptive", "off"] = Field(
        default="adaptive",
        description="adaptive: a pre-copy round slows down while the source's own requests (as its SDK's safe point "
        "times them) take longer than before the round, and speeds up again when they do not or the source is idle "
        "(transfer/pacing.py). off: it moves as fast as parallelism and rate_limit allow.",
    )
    store_region: str | None = Field(default=None, description="Region of the store (bucket) for residency checks.")
    restore_from: Literal["store", "source"] = Field(
        default="store",
        description="store: the target loads the image from the store. source (agent backend, a local target on the "
        "source's host): the target copies the source's tensors straight out of its memory (CUDA IPC on a GPU, "
        "NIXL for host memory), each chunk checked against the image's signed manifest (a workload of several ranks: "
        "target rank r copies source rank r's); the image is still written.",
    )

    @field_validator("rate_limit", mode="before")
    @classmethod
    def _rate(cls, v: object) -> int | None:
        return None if v is None else parse_rate(v)

    @field_validator("store")
    @classmethod
    def _store(cls, v: str) -> str:
        if not (_STORE_RE.match(v) or TARGET_RECEIVER_RE.match(v)):
            raise ValueError(
                "must be file:///path, s3://bucket/prefix, gs://bucket/prefix, stream://host:port or "
                "nixl://host:port (a receiver's URL may add ?fingerprint=sha256:HEX with 64 hex digits), or "
                "stream://target / nixl://target (a receiver the flow starts on the target)"
            )
        return v

    def bounds(self) -> TransferBounds:
        """What a live capture round may take from its host (gpumigrate/bounds.py)."""
        return TransferBounds(self.parallelism, self.rate_limit, self.pacing)

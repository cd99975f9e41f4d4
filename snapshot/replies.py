"""The typed replies of an agent's commands, as PROTOCOL.md gives them: what :class:`~.client.AgentClient`'s
``request_<command>`` wrappers return, and what the backends build from several ranks' replies."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpumigrate.interfaces import ImageRef, RegionInfo, Round, RoundStats, StepLosses


def decode_round(reply: Mapping[str, Any]) -> Round:
    """``{"stats": RoundStats, "image": ImageRef}`` as PROTOCOL.md gives them."""
    return Round(stats=RoundStats(**reply["stats"]), image=ImageRef(**reply["image"]))


@dataclass(frozen=True)
class AgentInfo:
    """The agent's ``info``: what it tracks and where it stands."""

    regions: tuple[RegionInfo, ...]
    bytes_total: int
    environment: Mapping[str, Any]
    frozen: bool
    ready: bool | None
    rounds: int
    last_image: str | None
    lease: Mapping[str, float] | None = None  # {"lease_s", "expires_in_s"} while frozen under a lease
    lease_expiries: int = 0  # freezes that ended because nobody renewed them
    fingerprint_collisions: int = 0  # chunks the final round's full hash caught
    steps: int = 0  # safe points passed (training steps, or requests)
    warming: bool = False  # the SDK's background warm-up (kernel compiles) still runs
    auth: Mapping[str, Any] = field(default_factory=dict)  # {"key_id", "refused", "last_refused"}

    @classmethod
    def decode(cls, reply: Mapping[str, Any]) -> AgentInfo:
        regions = tuple(
            RegionInfo(**{**r, "shape": tuple(r["shape"]) if r.get("shape") is not None else None})
            for r in reply["regions"]
        )
        return cls(
            regions=regions,
            bytes_total=int(reply["bytes_total"]),
            environment=dict(reply.get("environment") or {}),
            frozen=bool(reply["frozen"]),
            ready=reply.get("ready"),
            rounds=int(reply["rounds"]),
            last_image=reply.get("last_image"),
            warming=bool(reply.get("warming", False)),
            lease=reply.get("lease"),
            lease_expiries=int(reply.get("lease_expiries") or 0),
            fingerprint_collisions=int(reply.get("fingerprint_collisions") or 0),
            steps=int(reply.get("steps") or 0),
            auth=dict(reply.get("auth") or {}),
        )


def decode_steps(reply: Mapping[str, Any]) -> StepLosses:
    """An ``advance`` or ``metrics`` reply: the steps taken and the losses reported for them."""
    return StepLosses(
        steps=int(reply["steps"]),
        losses=tuple((int(s), float(loss)) for s, loss in reply.get("losses") or ()),
        frozen=reply.get("frozen"),
        ready=reply.get("ready"),
    )


@dataclass(frozen=True)
class Zeroized:
    """The audit record of a zeroize: tracked memory overwritten with zeros and read back."""

    regions: int
    bytes: int
    verified: bool
    devices: tuple[str, ...]
    seconds: float

    def record(self) -> dict[str, Any]:
        """The fields the audit log keeps (``source.zeroized``), under the names PROTOCOL.md uses."""
        return {
            "zeroized_regions": self.regions,
            "zeroized_bytes": self.bytes,
            "verified": self.verified,
            "devices": ",".join(self.devices),
            "seconds": round(self.seconds, 3),
        }

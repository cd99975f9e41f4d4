"""The frozen round's confirmation of the chunks it reuses, and its verdict when the round returned first.

A frozen round trusts no fingerprint alone (``capture.py``): every chunk it references unchanged is hashed
(BLAKE3) and compared with the id it reuses. The chunks of regions that changed in the last round (*hot*: a KV
cache, the mutable state) are confirmed before the round commits, beside the shipping; so are all of them in a
plain ``final``. A ``final`` with ``confirm: "later"`` commits as soon as the rest is shipped and returns, while
the hashes of the *cold* regions (a model's weights, which never change) go on: its image references their
chunks pending that confirmation, and :class:`PendingConfirmation` holds what the verdict needs.

The verdict (:class:`Verdict`) is taken once, by whichever comes first: the orchestrator's ``confirmed``, or
anything that would change the tracked state or start another round (``resume``, a lease running out,
``advance``, ``zeroize``, a load, the next round: all settle first, while the workload is still parked). Every
chunk confirmed: the round's image stands. A chunk caught changed: a follow-up image, a child of the round's,
ships those chunks (the rest referenced) and is what a target must restore; the orchestrator makes no target
ready before the verdict (PROTOCOL.md, "The final round's confirmation").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from gpumigrate.errors import GpumigrateError, SnapshotError
from gpumigrate.interfaces import ChunkRun, ImageRef, ImageWriter, RegionInfo, RoundStats

if TYPE_CHECKING:
    from gpumigrate.snapshot.engine.planning import RoundPlan
    from gpumigrate.snapshot.pipeline import Job

# (the parent image id) -> a writer into the round's store with its key and options: the follow-up's
Reopen = Callable[[str], ImageWriter]


@dataclass
class PendingConfirmation:
    """A committed frozen round whose cold chunks are still being hashed (see the module)."""

    image: ImageRef  # the round's image, committed with those chunks referenced
    runs: Sequence[ChunkRun]  # the cold chunks and the ids the image gave them
    wait: Callable[[], list[list[bool]]]  # the hashes' verdicts, per run and chunk, once done
    reopen: Reopen  # how the follow-up image is opened, if a chunk was caught
    plan: RoundPlan  # the round as it committed: the follow-up's starting point
    by_hash: set[str]  # the regions the round left to the hash alone (no fingerprint pass)
    infos: Mapping[str, RegionInfo]  # the round's regions
    chunk_size: int
    unrecorded: Sequence[Job] = ()  # chunks the hash alone shipped: their fingerprints, recorded at the verdict


@dataclass
class Verdict:
    """A frozen round's confirmation, once every chunk it reused was hashed: the image a target restores."""

    of_image: ImageRef  # the round's own image
    image: ImageRef  # the image to restore: ``of_image``, or the follow-up that ships what the hashes caught
    chunks_confirmed: int  # chunks hashed after the round returned (0 for a round that confirmed all before commit)
    caught: int = 0  # chunks among them whose bytes no longer had their id: shipped in the follow-up
    deferred: bool = False  # whether the round returned before these hashes ended
    seconds: float = 0.0  # the verdict's own time: the wait for the hashes, and the follow-up where one was made
    phases: dict[str, float] = field(default_factory=dict)
    stats: RoundStats | None = None  # the follow-up's round, where one was made
    error: GpumigrateError | None = None  # the confirmation (or its follow-up) failed: no image may be restored

    def reply(self) -> dict[str, Any]:
        """``confirmed``'s reply (PROTOCOL.md); an error is raised instead (a target must not become ready)."""
        if self.error is not None:
            raise self.error
        return {
            "of_image": self.of_image.id,
            "image": asdict(self.image),
            "follow_up": self.image.id != self.of_image.id,
            "chunks_confirmed": self.chunks_confirmed,
            "caught": self.caught,
            "deferred": self.deferred,
            "seconds": self.seconds,
            "phases": dict(self.phases),
            "stats": asdict(self.stats) if self.stats is not None else None,
        }

    def state(self) -> dict[str, Any]:
        """What ``info`` says of it."""
        return {
            "of_image": self.of_image.id,
            "image": self.image.id,
            "pending": False,
            "caught": self.caught,
            "failed": self.error is not None,
        }


def no_verdict(image_id: str, last: Verdict | None, pending: PendingConfirmation | None) -> SnapshotError:
    """The refusal of ``confirmed`` for an image whose confirmation this agent does not hold."""
    if pending is not None:
        held = pending.image.id
    elif last is not None:
        held = last.of_image.id
    else:
        return SnapshotError(
            f"no final round's confirmation is held here (asked for image {image_id[:16]}): the agent committed no "
            "final round since it started or since its last round"
        )
    return SnapshotError(f"image {image_id[:16]} is not this agent's last final round ({held[:16]} is)")

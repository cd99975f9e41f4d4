"""The engine as one rank of a process group (``ranks.py``): its place, and the group's teardown and rebuild.

NCCL communicators cannot be captured by a whole-process checkpoint (the CUDA driver's, CRIU's), so the
orchestrator tears the group down around one and builds it again afterwards, or on a rollback: every
rank at once, for a rebuild is a rendezvous. A torn-down group is rebuilt before the workload's next step.
"""

from __future__ import annotations

from typing import Any

from gpumigrate.errors import SnapshotError
from gpumigrate.snapshot.engine.state import EngineState
from gpumigrate.snapshot.ranks import RankGroup


class GroupControl:
    """This process's rank of its group, if it is one (``group`` None: a process that is no rank)."""

    def __init__(self, group: RankGroup | None, state: EngineState) -> None:
        self.group = group
        self.state = state

    def rank_id(self) -> dict[str, int] | None:
        """``{"rank", "world_size"}`` as images record it; None for a process that is no rank."""
        if self.group is None:
            return None
        return {"rank": self.group.rank, "world_size": self.group.world_size}

    def describe(self, devices: list[str]) -> dict[str, Any] | None:
        """What ``info`` says of this rank (``RankGroup.describe``); None for a process that is no rank."""
        return self.group.describe(devices) if self.group is not None else None

    @property
    def torn_down(self) -> bool:
        return self.group is not None and self.group.torn_down

    def require_alone_or_at_step(self, at_step: int | None) -> None:
        """A rank of a group larger than one freezes only at the group's step (a freeze of it alone could leave a
        peer inside a collective for ever)."""
        if at_step is None and self.group is not None and self.group.world_size > 1:
            raise SnapshotError(
                f"this process is rank {self.group.rank} of a group of {self.group.world_size}: "
                "freeze the whole group at one step, never one rank alone",
                hint="hold every rank, then freeze each at_step = the highest step any started "
                "(gpumigrate.snapshot.world.World.freeze_ranks; snapshot/PROTOCOL.md)",
            )

    def teardown(self) -> dict[str, Any]:
        """Destroy the group's communicators (before an in-place capture of the whole process). Frozen only."""
        if self.group is None:
            raise SnapshotError("teardown: this process is not a rank of a process group")
        if not self.state.frozen:
            raise SnapshotError("teardown needs the group frozen first (hold, then freeze at_step)")
        if not self.group.torn_down:
            self.group.teardown()
            self.group.torn_down = True
        return {"group": "torn down"}

    def rebuild(self) -> dict[str, Any]:
        """Build the group's communicators again. Idempotent."""
        if self.group is None:
            raise SnapshotError("rebuild: this process is not a rank of a process group")
        if self.group.torn_down:
            self.group.rebuild()
            self.group.torn_down = False
        return {"group": "up"}

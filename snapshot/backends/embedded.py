"""The agent backend (``snapshot.backend: agent``): the agents embedded in the workload, driven over their
control addresses (PROTOCOL.md).

The workload's agents are a :class:`~gpumigrate.snapshot.world.World` of ``workload.ranks`` agents, rank
r's at the plan's agent address with its port + r; a world of one is a plain process (its own image, a
plain freeze). Source side: pre-copy rounds into the plan's store while the workload serves, a freeze at
its safe point under a lease that the flow renews, the final dirty set, and for a training job the steps
that prove parity (``advance``); resume. Target side: a workload the flow started (``workload.launch``,
awaiting restore) loads each image through its own agents, the pre-copy ones unready, then trains or
serves on. Each call opens its own connections: the flow may call from any process (a resumed
migration, the rollback flow).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from gpumigrate.errors import InvalidInputError, SnapshotError
from gpumigrate.interfaces import ImageRef, Restored, Round, Side, StepLosses
from gpumigrate.snapshot.backends import Setup
from gpumigrate.snapshot.client import agent_environment
from gpumigrate.snapshot.errors import AgentUnreachableError, TrainingLoopError
from gpumigrate.snapshot.replies import Zeroized, decode_steps
from gpumigrate.snapshot.world import World

COMMAND_TIMEOUT_S = 600.0  # one command (a round, a restore); a stalled agent fails it rather than hanging
STEPS_POLL_S = 0.01
UNREPORTED_STEPS = 3  # steps past those asked for, with no loss reported: the loop never calls step.report


class EmbeddedAgentBackend:
    name = "agent"
    needs_launch = True
    live_rounds = True
    preloads = True  # the target's agents load each pre-copy image unready, then only what changed
    leases = True  # a freeze parks the source under a lease: an orchestrator that dies costs one lease

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self._parent = setup.parent  # each round's image is the next round's parent

    def _address(self, side: Side) -> str:
        address = self.setup.source_agent if side == "source" else self.setup.target_agent
        if not address:
            where = "workload.agent in the plan" if side == "source" else "the target's agent, known once provisioned"
            raise InvalidInputError(f"the {side} has no snapshot agent address ({where})")
        return address

    def _world(self, side: Side, *, timeout_s: float = COMMAND_TIMEOUT_S) -> World:
        # Who may answer there: at the source never a target (it cannot answer for it), at the target only the
        # agent the flow started there.
        address, ranks = self._address(side), self.setup.ranks
        if side == "source":
            return World.consecutive(address, ranks, timeout_s=timeout_s, source=True)
        return World.consecutive(address, ranks, timeout_s=timeout_s, agent=self.setup.target_agent_id)

    def check(self) -> dict[str, Any]:
        """The source's agents answer on their control addresses, and each reads the image key (the workload
        seals its image itself: a key its environment lacks would stop the snapshot after a target started)."""
        with self._world("source") as world:
            world.ping_ranks()
            if self.setup.key_ref:
                world.check_key_ranks(self.setup.key_ref)
        return {"agent": self.setup.source_agent}

    def facts(self, side: Side) -> dict[str, Any]:
        """The environment rank 0's agent reports (every rank runs on the same software)."""
        if side == "source":
            return agent_environment(self.setup.source_agent, source=True)
        return agent_environment(self.setup.target_agent, agent=self.setup.target_agent_id)

    # -- source side
    def precopy(self) -> Round:
        with self._world("source") as world:
            done = world.precopy_ranks(
                self.setup.store, self.setup.key_ref, parent=self._parent, options=self.setup.writer_options
            )
        self._parent = done["image"]["id"]
        return Round(stats=done["stats"], image=ImageRef(**done["image"]))

    def freeze(self, lease_s: float | None = None) -> int:
        with self._world("source") as world:  # unless renewed within lease_s, it resumes by itself
            return int(world.freeze_ranks(lease_s=lease_s)["step"])

    def renew(self, lease_s: float) -> bool:
        """Whether every rank is still frozen, or still holds sealed work in flight for a hand-over."""
        with self._world("source", timeout_s=max(5.0, lease_s / 3)) as world:
            return all(bool(r.get("frozen") or r.get("holding")) for r in world.renew_ranks(lease_s))

    def final(self) -> ImageRef:
        # confirm: wait (every reused chunk hashed before the commit). The flow's inference source resumes right
        # after this, and a resume waits for a pending confirmation anyway; a training target restores in the next
        # phase, maybe from another process, and must not depend on this source living on to give a verdict.
        # ``cutover.py`` is the path that takes the confirmation off the downtime, for an orchestrator that drives
        # the target's restore right after the final round.
        with self._world("source") as world:
            done = world.final_ranks(
                self.setup.store, self.setup.key_ref, parent=self._parent, options=self.setup.writer_options
            )
        image = ImageRef(**done["image"])
        if not image.id:
            raise SnapshotError("the source agent committed no image")
        self._parent = image.id
        return image

    def advance(self, steps: int, *, timeout_s: float) -> StepLosses:
        """The steps every rank took (they step together): rank 0's losses, and every rank's (``ranks``)."""
        with self._world("source", timeout_s=timeout_s + 30) as world:
            return world_steps(world.advance_ranks(steps, timeout_s=timeout_s))

    def resume(self) -> None:
        with self._world("source") as world:
            world.resume_ranks()

    def hand_over(self, target: str) -> dict[str, Any]:
        """Rank 0's account of the work in flight its ranks hand over to ``target`` ({} where the workload has no
        in-flight hooks: ``attach(in_flight=...)``)."""
        with self._world("source") as world:
            replies = world.hand_over_ranks(target)
        return {} if not any(r.get("handed_over") for r in replies) else dict(replies[0])

    def take_back(self) -> dict[str, Any]:
        with self._world("source") as world:
            replies = world.take_back_ranks()
        return {} if not any(r.get("taken_back") for r in replies) else dict(replies[0])

    def work(self, side: Side) -> dict[str, Any]:
        """Rank 0's figures of its work in flight on ``side`` (its agent's ``metrics``)."""
        with self._world(side, timeout_s=10) as world:
            return dict(world.metrics_ranks()[0].get("work") or {})

    def retire(self) -> dict[str, Any]:
        with self._world("source") as world:
            record = zeroized_of(world.zeroize_ranks(end_parked=self.setup.end_parked_source))
        if not record.verified:
            raise SnapshotError(f"the zeroize of the source could not be verified: {record}")
        return record.record()

    # -- target side
    def _load(self, image: ImageRef, *, ready: bool) -> Restored:
        with self._world("target") as world:
            done = world.restore_ranks(
                self.setup.target_store or self.setup.store,
                image.id,
                self.setup.key_ref,
                policy=self.setup.policy,
                ready=ready,
                source=self.setup.source_agent if self.setup.fill_from_source else None,
            )
        return restored_of(done)

    def preload(self, image: ImageRef) -> Restored:
        return self._load(image, ready=False)

    def restore(self, image: ImageRef | None) -> Restored:
        """Load ``image`` into the target's agents and make them ready; a target that holds it already and is ready
        (a migration resumed after its orchestrator died past this load) is left as it is: it may be running, and a
        second load would rewrite its state under it."""
        if image is None:
            raise SnapshotError("the agent backend restores from an image, and the snapshot committed none")
        with self._world("target") as world:
            held = world.info_ranks()
        if all(i.ready and i.last_image == image.id for i in held):
            return Restored(image_id=image.id, seconds=0.0, ready=True)
        return self._load(image, ready=True)

    def wait_for_steps(self, side: Side, *, since: int, count: int, timeout_s: float) -> StepLosses:
        """Poll the agents on ``side`` until every rank reported ``count`` losses after step ``since``.

        A loop that takes steps without reporting a loss fails as soon as it took :data:`UNREPORTED_STEPS` more
        than asked (it would train to its end unseen), and one whose agent is gone fails naming that, never
        after ``timeout_s``: both are :class:`TrainingLoopError`, which no retry can fix."""
        deadline = time.monotonic() + timeout_s
        address = self._address(side)
        with self._world(side, timeout_s=30) as world:
            while True:
                try:
                    seen = world_steps(world.metrics_ranks(since))
                except AgentUnreachableError as exc:
                    raise TrainingLoopError(
                        f"the {side}'s training process ended, or closed its agent at {address}, before it reported "
                        f"{count} step(s) after step {since} ({exc})",
                        hint="it may have trained to its end: give it steps to outlast the migration; its log says more",
                    ) from None
                fewest = min(len(r) for r in seen.ranks) if seen.ranks else len(seen.losses)
                if fewest >= count:
                    return seen
                if not seen.losses and seen.steps - since >= count + UNREPORTED_STEPS:
                    raise TrainingLoopError(
                        f"the {side} took {seen.steps - since} steps after step {since} and reported no loss",
                        hint="the training loop must call step.report(loss=loss.item()) inside `with "
                        "handle.safe_point() as step:` (README, 'Migrate a training job'): migration proves "
                        "the move by those losses",
                    )
                if time.monotonic() > deadline:
                    raise SnapshotError(
                        f"the {side}'s agent(s) from {address} reported {fewest} of {count} steps "
                        f"after step {since} within {timeout_s:g} s: is the training loop running (safe_point, "
                        "step.report)?"
                    )
                time.sleep(STEPS_POLL_S)

    def discard(self) -> None:
        """The target workload is a process of the target host: terminating the host stops it."""


def world_steps(replies: Sequence[Mapping[str, Any]]) -> StepLosses:
    """The ranks' ``advance`` or ``metrics`` replies as one: rank 0's, with every rank's losses for a world."""
    first = decode_steps(replies[0])
    if len(replies) == 1:
        return first
    return replace(first, ranks=tuple(decode_steps(r).losses for r in replies))


def _from_source(ranks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The ranks' fills from the source's memory as one record: chunks summed, seconds of the slowest."""
    fills = [dict(r["from_source"]) for r in ranks if r.get("from_source")]
    if len(fills) <= 1:
        return fills[0] if fills else {}
    return {
        "way": fills[0].get("way"),
        "chunks": sum(int(f.get("chunks") or 0) for f in fills),
        "chunks_from_image": sum(int(f.get("chunks_from_image") or 0) for f in fills),
        "seconds": max(float(f.get("seconds") or 0) for f in fills),
        "ranks": fills,
    }


def restored_of(done: Mapping[str, Any]) -> Restored:
    """A ``restore_ranks`` reply as the seam's :class:`~gpumigrate.interfaces.Restored`: the ranks' loads summed
    (seconds of the slowest, as they run side by side), ready once every rank is; rank 0's environment check; for a
    world, each rank's GPUs there and here (``device_map``) beside its own load."""
    ranks: Sequence[Mapping[str, Any]] = done["ranks"]
    first = ranks[0]
    where = {int(m["rank"]): m for m in done.get("device_map") or ()}
    per_rank = tuple(
        {
            **{k: v for k, v in where.get(r, {}).items()},
            "rank": r,
            "bytes_loaded": int(x["bytes_loaded"]),
            "seconds": round(float(x["seconds"]), 4),
            **({"phases": x["phases"]} if x.get("phases") else {}),
            **({"placement": x["placement"]} if x.get("placement") else {}),
        }
        for r, x in enumerate(ranks)
    )
    return Restored(
        image_id=str(first["image"]),
        seconds=max(float(r["seconds"]) for r in ranks),
        bytes_loaded=sum(int(r["bytes_loaded"]) for r in ranks),
        chunks_loaded=sum(int(r["chunks_loaded"]) for r in ranks),
        chunks_skipped=sum(int(r["chunks_skipped"]) for r in ranks),
        ready=all(bool(r["ready"]) for r in ranks),
        environment=dict(first.get("environment") or {}),
        from_source=_from_source(ranks),
        ranks=per_rank if len(ranks) > 1 else (),
    )


def zeroized_of(replies: Sequence[Mapping[str, Any]]) -> Zeroized:
    """The ranks' ``zeroize`` replies as one audit record: regions and bytes summed, verified where every rank
    verified, every device, seconds of the slowest."""
    return Zeroized(
        regions=sum(int(r["zeroized_regions"]) for r in replies),
        bytes=sum(int(r["zeroized_bytes"]) for r in replies),
        verified=all(bool(r["verified"]) for r in replies),
        devices=tuple(d for r in replies for d in r.get("devices") or ()),
        seconds=max(float(r["seconds"]) for r in replies),
    )

"""The agent backend: the agent embedded in the workload, driven over its control address (PROTOCOL.md).

Source side: pre-copy rounds into the plan's store while the workload serves, freeze at its safe
point, the final dirty set, resume. Target side: a workload the flow started (``workload.launch``,
awaiting restore) loads the image through its own agent and then reports ready.
"""

from __future__ import annotations

from typing import Any

from gpumigrate.errors import InvalidInputError, SnapshotError
from gpumigrate.interfaces import ImageRef, Restored, Round
from gpumigrate.snapshot.backends import Setup
from gpumigrate.snapshot.client import AgentClient


class AgentBackend:
    name = "agent"
    needs_launch = True
    live_rounds = True
    preloads = True  # the target's agent loads each pre-copy image unready, then only what changed

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self._parent = setup.parent  # each round's image is the next round's parent

    def _client(self, side: str) -> AgentClient:
        address = self.setup.source_agent if side == "source" else self.setup.target_agent
        if not address:
            where = "workload.agent in the plan" if side == "source" else "the target's agent, known once provisioned"
            raise InvalidInputError(f"the {side} has no snapshot agent address ({where})")
        return AgentClient(address)

    def check(self) -> dict[str, Any]:
        """The source's agent answers on its control address."""
        with self._client("source") as client:
            client.call("ping")
        return {"agent": self.setup.source_agent}

    # -- source side
    def precopy(self) -> Round:
        with self._client("source") as client:
            done = client.precopy(self.setup.store, self.setup.key_ref, self._parent, options=self.setup.writer_options)
        self._parent = done.image.id
        return done

    def freeze(self, lease_s: float | None = None) -> None:
        with self._client("source") as client:  # unless renewed within lease_s, it resumes by itself
            client.freeze(lease_s)

    def final(self) -> ImageRef:
        with self._client("source") as client:
            done = client.final(self.setup.store, self.setup.key_ref, self._parent, options=self.setup.writer_options)
        if not done.image.id:
            raise SnapshotError("the source agent committed no image")
        self._parent = done.image.id
        return done.image

    def resume(self) -> None:
        with self._client("source") as client:
            client.resume()

    def retire(self) -> dict[str, Any]:
        with self._client("source") as client:
            record = client.zeroize()
        if not record.verified:
            raise SnapshotError(f"the zeroize of the source could not be verified: {record}")
        return record.record()

    # -- target side
    def _load(self, image: ImageRef, *, ready: bool) -> Restored:
        with self._client("target") as client:
            return client.restore(
                self.setup.target_store or self.setup.store,
                image.id,
                self.setup.key_ref,
                policy=self.setup.policy,
                ready=ready,
                source=self.setup.source_agent if self.setup.fill_from_source else None,
            )

    def preload(self, image: ImageRef) -> Restored:
        return self._load(image, ready=False)

    def restore(self, image: ImageRef | None) -> Restored:
        if image is None:
            raise SnapshotError("the agent backend restores from an image, and the snapshot committed none")
        return self._load(image, ready=True)

    def discard(self) -> None:
        """The target workload is a process of the target host: terminating the host stops it."""

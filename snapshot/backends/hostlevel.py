"""What the two host-level backends share: reaching the host that holds the process, and the verbs they do alike.

Both act on an unmodified process by pid, through one host action at a time on the host that holds it
(``Setup.host_actions``). Neither has a safe point, a lease or live rounds: everything moves while the
process is stopped. Where they differ is said by two flags: a freeze ``suspends`` the process in place (the
CUDA driver's checkpoint), and the final round ``dumps`` it into an image (CRIU); ``checkpoint`` is the host
action either way, which each backend's ``on_host`` carries out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpumigrate.errors import InvalidInputError, SnapshotError
from gpumigrate.interfaces import HostActions, ImageRef, Restored, Round, Side, StepLosses
from gpumigrate.snapshot.backends import Setup
from gpumigrate.snapshot.client import agent_environment


class HostLevel:
    """Base of the CUDA driver and CRIU backends: each step is one host action on the process's own host."""

    name = ""
    live_rounds = False
    preloads = False
    leases = False
    suspends = False  # a freeze suspends the process in place (its state stays in it)
    dumps = False  # the final round dumps the process into an image in the plan's store

    def __init__(self, setup: Setup) -> None:
        self.setup = setup

    def _act(self, side: str, action: str, **params: Any) -> dict[str, Any]:
        host = self.setup.source_host if side == "source" else self.setup.target_host
        if self.setup.host_actions is None:
            raise SnapshotError(f"the {self.name} backend acts through host actions, and none were given")
        if not host:
            raise SnapshotError(f"the {self.name} backend needs the {side} host, which is not known yet")
        run: HostActions = self.setup.host_actions
        return run(host, action, {"backend": self.name, **params})

    def _source_process(self) -> Mapping[str, int | None]:
        """The source's pid (from its /v1/info at preflight) and start time: the process every step acts on."""
        if not self.setup.source_pid:
            raise InvalidInputError(
                f"the {self.name} backend acts on the source process by pid, and the source's /v1/info reports none"
            )
        return {"pid": self.setup.source_pid, "start": self.setup.checked.get("start")}

    def facts(self, side: Side) -> dict[str, Any]:
        """The environment an agent embedded in the workload reports, where the plan names one (a host-level
        backend needs none)."""
        return agent_environment(self.setup.source_agent if side == "source" else self.setup.target_agent)

    # -- source side
    def precopy(self) -> Round:
        raise SnapshotError(f"the {self.name} backend has no live pre-copy rounds: everything moves while frozen")

    def freeze(self, lease_s: float | None = None) -> None:
        """Suspend the process in place, or nothing to hold: a dump stops the tree for its own duration and leaves
        it running. No lease: the process has no safe point that could resume it by itself."""
        if self.suspends:
            self._act("source", "checkpoint", **self._source_process())

    def final(self) -> ImageRef | None:
        """The dump packed into the plan's store (the process serves on), or None: the state stays in the
        suspended process's host memory, with no image to move."""
        if not self.dumps:
            return None
        out = self._act(
            "source",
            "checkpoint",
            **self._source_process(),
            images_dir=self.setup.source_dir,
            store=self.setup.store,
            key_ref=dict(self.setup.key_ref),
        )
        return ImageRef(**out["image"])

    def resume(self) -> None:
        """The undo on the source: the process runs again from whatever step it stopped at (a dump's directory
        tells CRIU which tree an interrupted dump left stopped)."""
        dump = {"images_dir": self.setup.source_dir} if self.dumps else {}
        self._act("source", "resume", **self._source_process(), **dump)

    def retire(self) -> dict[str, Any]:
        """After the cut-over held: the source process stops, or nothing to retire where it was suspended in place
        (the process itself is the workload)."""
        if self.suspends:
            return {"retired": False, "why": "in place: the source process is the workload"}
        return self._act("source", "retire", **self._source_process())

    def renew(self, lease_s: float) -> bool:
        raise SnapshotError(f"the {self.name} backend freezes without a lease: there is nothing to renew")

    def hand_over(self, target: str) -> dict[str, Any]:
        """Nothing to hand over: the whole process moves, with its work, or stays."""
        return {}

    def take_back(self) -> dict[str, Any]:
        return {}

    def work(self, side: Side) -> dict[str, Any]:
        return {}

    def advance(self, steps: int, *, timeout_s: float) -> StepLosses:
        raise SnapshotError(
            f"the {self.name} backend has no safe point to take {steps} step(s) through: a training job moves "
            "with the agent backend"
        )

    # -- target side
    def preload(self, image: ImageRef) -> Restored:
        """Nothing to pre-load (``preloads`` is False): the state arrives whole, at the restore."""
        raise SnapshotError(f"the {self.name} backend does not pre-load: its state arrives whole, at the restore")

    def wait_for_steps(self, side: Side, *, since: int, count: int, timeout_s: float) -> StepLosses:
        raise SnapshotError(
            f"the {self.name} backend has no safe point that counts steps: a training job moves with the agent backend"
        )

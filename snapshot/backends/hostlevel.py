"""What the two host-level backends share: reaching the host that holds the process, with its pid."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpumigrate.errors import InvalidInputError, SnapshotError
from gpumigrate.interfaces import HostActions, Round
from gpumigrate.snapshot.backends import Setup


class HostLevel:
    """Base of the CUDA driver and CRIU backends: each step is one host action on the process's own host."""

    name = ""

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

    def precopy(self) -> Round:
        raise SnapshotError(f"the {self.name} backend has no live pre-copy rounds: everything moves while frozen")

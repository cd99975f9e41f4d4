"""The CRIU backend: dump the unmodified source process on its host, restore the tree on the target's.

Every step is a host action (``snapshot/criu.py`` does the work where the process lives):
``checkpoint`` dumps with ``--leave-running`` and packs the dump into the plan's store, so the
source serves on until the cut-over; ``restore`` unpacks on the target and restores the tree, whose
pid (and start time) the flow keeps for ``discard``; ``resume`` (the undo on the source) continues a
tree an interrupted dump left stopped; ``retire`` stops the source once the cut-over held.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from gpumigrate.errors import SnapshotError
from gpumigrate.interfaces import ImageRef, Restored
from gpumigrate.snapshot import criu, process
from gpumigrate.snapshot.backends import ImageFiles
from gpumigrate.snapshot.backends.hostlevel import HostLevel


class CriuBackend(HostLevel):
    name = "criu"
    needs_launch = False  # the restored tree is the workload, listening sockets included
    dumps = True  # the final round: ``checkpoint`` dumps with --leave-running and packs the dump into the store

    def check(self) -> dict[str, Any]:
        """CRIU 4+ with its CUDA plugin works on the source host; the source's start time, for later steps."""
        return self._act("source", "check", pid=self._source_process()["pid"])

    def restore(self, image: ImageRef | None) -> Restored:
        if image is None:
            raise SnapshotError("the criu backend restores from an image, and the snapshot committed none")
        out = self._act(
            "target",
            "restore",
            store=self.setup.target_store or self.setup.store,
            image_id=image.id,
            images_dir=self.setup.target_dir,
            key_ref=dict(self.setup.key_ref),
        )
        return Restored(image_id=image.id, seconds=float(out["seconds"]), pid=out["pid"], pid_start=out["start"])

    def discard(self) -> None:
        if self.setup.target_pid is not None:
            self._act("target", "discard", pid=self.setup.target_pid, start=self.setup.target_pid_start)


# ----------------------------------------------------------------------------- on the host that holds the process


def on_host(action: str, params: Mapping[str, Any], files: ImageFiles) -> dict[str, Any]:
    """One CRIU host action, here (the flows' host-action deployment, or in-process on this machine)."""
    key_ref: Mapping[str, str] = params.get("key_ref") or {}
    t0 = time.monotonic()
    if action == "check":
        info = criu.detect()
        criu.check_kernel(info.binary)
        pid = params.get("pid")
        return {"binary": info.binary, "plugin": info.plugin, "start": process.start_ticks(int(pid)) if pid else None}
    if action == "restore":
        images_dir = str(params["images_dir"])
        files.unpack(str(params["store"]), str(params["image_id"]), images_dir, key_ref)
        pid = criu.restore(images_dir)
        return {"pid": pid, "start": process.start_ticks(pid), "seconds": time.monotonic() - t0}
    pid = int(params["pid"])
    process.require_same(pid, params.get("start"))
    if action == "checkpoint":
        store = str(params["store"])
        ref = criu.dump_and_pack(pid, str(params["images_dir"]), lambda paths: files.pack(paths, store, key_ref))
        return {"image": asdict(ref), "seconds": time.monotonic() - t0}
    if action == "resume":
        return {"source": process.ensure_running(pid, dump_dir=params.get("images_dir"))}
    return {"stopped": process.stop_tree(pid, params.get("start"))}  # discard (target) or retire (source)
